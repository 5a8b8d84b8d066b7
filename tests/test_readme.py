"""The README as a user reads it: every ```python block runs as written, every link and named path resolves.

The blocks run in a subprocess each, in a tmp dir that holds what quick-start command 1 makes: the tiny
checkpoint at out/tiny-m3 (examples/tiny_checkpoint.py) and its conversion at out/tiny-m3-mxfp8 (the CLI).
A block whose first line is `# GPU` (device="cuda", device_map) runs only under `pytest -m gpu`.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```python\n(.*?)^```", TEXT, flags=re.S | re.M)
MAX_LINES = 200
TOP = ("porter/", "converters/", "runtime/", "examples/", "tests/", "benchmarks/", "docs/", ".ci/")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(args: list, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    """A folder as README command 1 leaves it: out/tiny-m3 and out/tiny-m3-mxfp8."""
    work = tmp_path_factory.mktemp("readme")
    built = _run([str(ROOT / "examples" / "tiny_checkpoint.py"), "out/tiny-m3"], work)
    assert built.returncode == 0, built.stderr
    conv = _run(["-m", "porter.cli", "convert", "out/tiny-m3", "--output", "out/tiny-m3-mxfp8"], work)
    assert conv.returncode == 0, conv.stderr
    assert (work / "out/tiny-m3-mxfp8/model.safetensors.index.json").is_file()
    return work


def _is_gpu(block: str) -> bool:
    return block.lstrip().startswith("# GPU")


def test_readme_has_python_blocks_and_fits():
    assert len(BLOCKS) >= 2
    n = len(TEXT.splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines, at most {MAX_LINES}"


def test_gpu_blocks_are_marked():
    """Unmarked blocks must run on the CPU: no cuda device or device_map outside a comment."""
    for block in BLOCKS:
        code = "\n".join(line.split("#", 1)[0] for line in block.splitlines())
        if not _is_gpu(block):
            assert "cuda" not in code and "device_map" not in code, block


@pytest.mark.parametrize("index", [i for i, b in enumerate(BLOCKS) if not _is_gpu(b)])
def test_python_block_runs(quickstart, index):
    done = _run(["-c", BLOCKS[index]], quickstart)
    assert done.returncode == 0, (
        f"README python block {index} failed:\n{BLOCKS[index]}\n{done.stderr[-3000:]}"
    )


@pytest.mark.gpu
def test_gpu_python_blocks_run(quickstart):
    """Every `# GPU` block (none today: the README's examples run on the CPU)."""
    for index in [i for i, b in enumerate(BLOCKS) if _is_gpu(b)]:
        done = _run(["-c", BLOCKS[index]], quickstart)
        assert done.returncode == 0, (
            f"README GPU block {index} failed:\n{BLOCKS[index]}\n{done.stderr[-3000:]}"
        )


def test_generate_command_prints_text_then_rate(quickstart):
    done = _run(
        [
            "-m",
            "porter.cli",
            "generate",
            "out/tiny-m3-mxfp8",
            "--prompt",
            "The capital of France is",
            "--max-new-tokens",
            "20",
        ],
        quickstart,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n") and len(done.stdout) > 1
    assert re.search(r"^20 tokens in [0-9.]+ s: [0-9.]+ tokens/s", done.stderr, flags=re.M), done.stderr


def _anchors(md: str) -> set:
    """GitHub's heading slugs: lower case, punctuation dropped except '-', spaces to '-'."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", md, flags=re.S | re.M), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_links_and_anchors_resolve():
    for target in re.findall(r"\]\(([^)\s]+)\)", TEXT):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else README
        assert file.exists(), f"README links to {target}: {file} does not exist"
        if anchor:
            assert anchor in _anchors(file.read_text(encoding="utf-8")), (
                f"README links to {target}: no heading"
            )


def test_named_repo_paths_exist():
    named = {m for m in re.findall(r"`([^`\s]+)`", TEXT) if m.startswith(TOP)}
    assert named, "the README names no repo path"
    missing = sorted(m for m in named if not (ROOT / m).exists())
    assert not missing, f"README names paths that do not exist: {missing}"
