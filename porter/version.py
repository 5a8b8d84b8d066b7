"""porter's version (format layer: recorded in porter.json and in the conversion fingerprint)."""

__version__ = "0.1.0"
