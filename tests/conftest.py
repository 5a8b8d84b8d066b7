"""Shared fixtures: tiny random MiniMax-M3 checkpoints built in code (examples/tiny_checkpoint.py)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from tiny_checkpoint import build_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_vendor(tmp_path_factory) -> Path:
    """Vendor layout (legacy config keys, per-expert w1/w2/w3, vision tensors), seed 0."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_vendor"), layout="vendor", seed=0)


@pytest.fixture(scope="session")
def tiny_transformers(tmp_path_factory) -> Path:
    """transformers 5.23 fused layout of the same weights (seed 0)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_hf"), layout="transformers", seed=0)
