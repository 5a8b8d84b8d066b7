"""porter: MiniMax-M3 Hugging Face checkpoints -> MXFP8 artifacts, with a runtime and a verifier."""
__version__ = "0.1.0"


def convert(*args, **kwargs):
    """Python API mirroring `porter convert` (see porter.convert.convert)."""
    from porter.conversion import convert as _convert
    return _convert(*args, **kwargs)


def verify(*args, **kwargs):
    """Python API mirroring `porter verify` (see porter.verify.verify)."""
    from porter.verification import verify as _verify
    return _verify(*args, **kwargs)
