"""porter: Hugging Face MoE checkpoints -> MXFP8 artifacts, with a runtime and a verifier.

The Python API mirrors the command line: `porter.convert(...)` is `porter convert`, `porter.verify(...)` is
`porter verify` (docs/architecture.md). The runtime is the separate `runtime` package (`runtime.load`).
"""

from porter.version import __version__

__all__ = ["__version__", "convert", "verify"]


def convert(*args, **kwargs):
    """`porter convert` as a function; see porter.commands.convert.convert for the arguments."""
    from porter.commands.convert import convert as _convert

    return _convert(*args, **kwargs)


def verify(*args, **kwargs):
    """`porter verify` as a function; see porter.commands.verify.verify for the arguments."""
    from porter.commands.verify import verify as _verify

    return _verify(*args, **kwargs)
