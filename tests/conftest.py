"""Shared fixtures: tiny random MiniMax-M3 checkpoints built in code (examples/tiny_checkpoint.py), and
seeded random number generators for every test.

`tiny_checkpoint` is imported under that one name (examples/ is on sys.path), never as
`examples.tiny_checkpoint`: two names would make two module objects with separate state.
"""

import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from tiny_checkpoint import build_tiny_checkpoint  # noqa: E402

TEST_SEED = 0


@pytest.fixture(autouse=True)
def _seeded_rngs():
    """Every test starts from the same global RNG state (torch CPU and CUDA, Python's random), so a draw
    without an explicit generator is still the same on every run: no test passes or fails by luck."""
    random.seed(TEST_SEED)
    torch.manual_seed(TEST_SEED)  # seeds every CUDA device too
    yield


@pytest.fixture(autouse=True)
def _pinned_memory_budget(monkeypatch):
    """Conversions run in a fixed default --max-memory (4 GiB) rather than half of what the machine has
    available when the test runs: no test passes or fails by what else the machine is doing. Tests of the
    default itself call porter.engine.budget.default_max_memory."""
    import porter.engine

    monkeypatch.setattr(porter.engine, "default_max_memory", lambda: 4 << 30)
    yield


@pytest.fixture(autouse=True)
def _pinned_verify_memory(monkeypatch):
    """porter verify plans resident or layer-streamed runs on the CPU against 16 GiB, not what the machine
    has available when the test runs: a test's runtime hooks (tests/verify_tamper.py) patch the resident
    model, and a busy machine must not switch a run to streaming under them. CUDA keeps its real free
    memory; tests of the plan itself patch memory_available."""
    from porter.commands.verify import generation

    real = generation.memory_available
    monkeypatch.setattr(
        generation, "memory_available", lambda device: 16 << 30 if device.type == "cpu" else real(device)
    )
    yield


@pytest.fixture(autouse=True, scope="session")
def _own_porter_cache(tmp_path_factory):
    """porter's record of checked shards (porter/format/checked.py) goes to a folder of this session, not
    the user's ~/.cache: no test sees another run's records."""
    import os

    os.environ["PORTER_CACHE_DIR"] = str(tmp_path_factory.mktemp("porter-cache"))
    yield


@pytest.fixture(scope="session")
def tiny_vendor(tmp_path_factory) -> Path:
    """Vendor layout (legacy config keys, per-expert w1/w2/w3, vision tensors), seed 0."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_vendor"), layout="vendor", seed=0)


@pytest.fixture(scope="session")
def tiny_transformers(tmp_path_factory) -> Path:
    """transformers 5.23 fused layout of the same weights (seed 0)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_hf"), layout="transformers", seed=0)


@pytest.fixture(scope="module")
def one_thread():
    """One torch CPU thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): on tiny
    tensors op overheads dominate, and two OpenMP threads made index_add_ ~1000x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


from hub_server import hub, hub_server  # noqa: E402,F401  (a real hub on localhost: tests/hub_server.py)
