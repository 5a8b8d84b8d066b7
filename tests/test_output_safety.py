"""Safety of `porter convert`'s output folder (docs/convert.md): the source is never written or removed,
--force removes only what porter wrote, free space is checked up front, a full disk leaves the output
resumable, and one run at a time writes an output folder (a flock held by real processes here).
"""

import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import porter
from porter.cli import main as cli
from porter.engine import output_guard
from porter.format import manifest

ROOT = Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"
JOURNAL = ".porter-journal.json"
SHARD_CAP = "300KB"  # several shards from the tiny checkpoint


def convert_cli(src, out, *extra):
    return CliRunner().invoke(
        cli,
        [
            "convert",
            str(src),
            "--output",
            str(out),
            "-q",
            "--device",
            "cpu",
            "--max-shard-size",
            SHARD_CAP,
            "--workers",
            "2",
            *map(str, extra),
        ],
    )


def one_error_line(res, *names) -> str:
    """exit 2, one `porter: error:` line naming every given string, no traceback."""
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("porter: error: "), res.output
    for n in names:
        assert str(n) in lines[0], (n, lines[0])
    return lines[0]


def hashes(d: Path) -> dict:
    """sha256 of every file under d (relative path -> digest)."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def artifact_bytes(d: Path) -> dict:
    """Every file's bytes; porter.json without its creation time."""
    out = {}
    for p in sorted(d.iterdir()):
        data = p.read_bytes()
        if p.name == "porter.json":
            doc = json.loads(data)
            doc.pop("created")
            data = json.dumps(doc, sort_keys=True).encode()
        out[p.name] = data
    return out


@pytest.fixture
def src(tiny_vendor, tmp_path) -> Path:
    """A private copy of the tiny checkpoint (the tests below point --force at it)."""
    return Path(shutil.copytree(tiny_vendor, tmp_path / "src"))


@pytest.fixture(scope="module")
def clean(tiny_vendor, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("safety") / "clean"
    res = convert_cli(tiny_vendor, out)
    assert res.exit_code == 0, res.output
    return out


# ---------------------------------------------------------------------------------------------------
# the output is never the source


@pytest.mark.parametrize("where", ["same", "inside", "contains", "symlink"])
@pytest.mark.parametrize("flags", [("--force",), ("--resume",), ("--force", "--resume"), ()])
def test_output_overlapping_the_source_is_refused(src, tmp_path, where, flags):
    before = hashes(tmp_path)
    if where == "symlink":
        (tmp_path / "link").symlink_to(src)
        before = hashes(tmp_path)
    out = {"same": src, "inside": src / "converted", "contains": tmp_path, "symlink": tmp_path / "link"}[
        where
    ]
    line = one_error_line(convert_cli(src, out, *flags), out, "give an output folder apart from the source")
    assert {
        "same": "is the source",
        "inside": "is inside",
        "contains": "contains",
        "symlink": "is the source",
    }[where] in line
    assert hashes(tmp_path) == before  # every shard, config, index and tokenizer file byte-identical
    assert not (src / "converted").exists() and not (src / output_guard.LOCK_NAME).exists()


def test_force_refuses_a_checkpoint_folder_as_output(src, tmp_path):
    """Another HF checkpoint (not the source) given as --output with --force: nothing in it is porter's."""
    other = Path(shutil.copytree(src, tmp_path / "other_checkpoint"))
    before = hashes(tmp_path)
    res = convert_cli(src, other, "--force")
    line = one_error_line(res, "not written by porter", "--force only replaces")
    assert str(other / "config.json") in line  # the first foreign file, by name
    assert hashes(tmp_path) == before


def test_force_refuses_foreign_files_beside_a_porter_output(src, clean, tmp_path):
    out = Path(shutil.copytree(clean, tmp_path / "out"))
    (out / "notes.md").write_text("mine")
    (out / "extra").mkdir()
    before = hashes(out)
    one_error_line(convert_cli(src, out, "--force"), out / "extra", "2 such entries")
    assert hashes(out) == before
    shutil.rmtree(out / "extra")
    one_error_line(convert_cli(src, out, "--force"), out / "notes.md", "1 such entry")
    assert hashes(out) == before


def test_force_replaces_an_earlier_porter_output(tiny_vendor, clean, tmp_path):
    out = Path(shutil.copytree(clean, tmp_path / "out"))
    res = convert_cli(tiny_vendor, out, "--force", "--max-shard-size", "200KB")  # another plan, other names
    assert res.exit_code == 0, res.output
    assert not (out / output_guard.LOCK_NAME).exists()
    shards = json.loads((out / INDEX).read_text())["weight_map"].values()
    assert sorted(p.name for p in out.glob("model-*")) == sorted(set(shards))  # the old shards are gone


@pytest.mark.parametrize("output", ["", " ", "\t"])
def test_empty_output_is_a_usage_error(tiny_vendor, tmp_path, monkeypatch, output):
    monkeypatch.chdir(tmp_path)
    one_error_line(convert_cli(tiny_vendor, output, "--force"), "--output is empty")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(output_guard.OutputFolderError, match="--output is empty"):
        porter.convert(tiny_vendor, output, progress=False)


def test_output_that_is_a_file_or_unwritable_is_one_line(tiny_vendor, tmp_path):
    (tmp_path / "file").write_text("x")
    assert convert_cli(tiny_vendor, tmp_path / "file").exit_code == 2  # click's own check
    with pytest.raises(output_guard.OutputFolderError, match="is a file, not a folder"):
        porter.convert(tiny_vendor, tmp_path / "file", progress=False)
    assert (tmp_path / "file").read_text() == "x"
    out = tmp_path / "out"
    out.mkdir()
    (out / output_guard.LOCK_NAME).symlink_to(tmp_path / "file")  # never followed, never written through
    one_error_line(
        convert_cli(tiny_vendor, out), out / output_guard.LOCK_NAME, "a symlink at the name of porter's lock"
    )
    assert (tmp_path / "file").read_text() == "x"
    (out / output_guard.LOCK_NAME).unlink()
    os.mkfifo(out / output_guard.LOCK_NAME)  # a FIFO: never waited on, never taken for the lock
    one_error_line(convert_cli(tiny_vendor, out), out / output_guard.LOCK_NAME, "not a regular file (a FIFO")
    assert stat.S_ISFIFO(os.lstat(out / output_guard.LOCK_NAME).st_mode) and not (out / INDEX).exists()


# ---------------------------------------------------------------------------------------------------
# disk space


Usage = namedtuple("Usage", "total used free")


def test_free_space_is_checked_before_writing(tiny_vendor, tmp_path, monkeypatch):
    plan = porter.convert(tiny_vendor, tmp_path / "x", dry_run=True, max_shard_size=SHARD_CAP, progress=False)
    free = plan["output_bytes"] // 2
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 * free, 9 * free, free))
    out = tmp_path / "new" / "out"
    res = convert_cli(tiny_vendor, out)
    line = one_error_line(res, out, f"only {free / 1e9:.3f} GB ({free} bytes) is free")
    needed = int(line.split("needs ")[1].split("(")[1].split(" bytes")[0])
    assert plan["output_bytes"] < needed < plan["output_bytes"] + (2 << 20)  # shards + headers + JSON room
    assert list(tmp_path.iterdir()) == []  # refused before any write; the folders it made are gone too
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 * needed, 9 * needed, needed))
    assert convert_cli(tiny_vendor, out).exit_code == 0  # exactly enough is enough


class FullDisk:
    """os.pwrite that fails with ENOSPC on its n-th write into a `.partial` shard."""

    def __init__(self, n: int):
        self.real, self.n, self.calls = os.pwrite, n, 0

    def __call__(self, fd, data, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".partial"):
            self.calls += 1
            if self.calls == self.n:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.real(fd, data, offset)


def test_full_disk_mid_run_is_resumable(tiny_vendor, clean, tmp_path, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as mp:
        mp.setattr(os, "pwrite", FullDisk(12))
        line = one_error_line(convert_cli(tiny_vendor, out), out, "no space left", "--resume")
    assert not (out / INDEX).exists() and not (out / output_guard.LOCK_NAME).exists()
    journal = json.loads((out / JOURNAL).read_text())
    assert journal["fingerprint"] and list(out.glob("*.partial")), line
    assert convert_cli(tiny_vendor, out, "--resume").exit_code == 0
    assert artifact_bytes(out) == artifact_bytes(clean)


def test_force_removes_an_interrupted_porter_run(tiny_vendor, clean, tmp_path, monkeypatch):
    """The journal names the files the interrupted run planned (.partial shards too): --force removes them."""
    out = tmp_path / "out"
    with monkeypatch.context() as mp:
        mp.setattr(os, "pwrite", FullDisk(5))
        one_error_line(convert_cli(tiny_vendor, out), "no space left")
    assert list(out.glob("*.partial"))
    assert convert_cli(tiny_vendor, out, "--force").exit_code == 0
    assert artifact_bytes(out) == artifact_bytes(clean)


# ---------------------------------------------------------------------------------------------------
# one writer per output folder, with real processes

HOLD_LOCK = """
import sys, time
sys.path.insert(0, {root!r})
from porter.engine.output_guard import OutputLock
OutputLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""

# a real conversion held inside its first shard: its first data write into a .partial blocks
HOLD_IN_SHARD = """
import os, sys, time
sys.path.insert(0, {root!r})
import porter
real = os.pwrite
def pwrite(fd, data, offset):
    if offset > 0 and os.readlink(f"/proc/self/fd/{{fd}}").endswith(".partial"):
        print("inside", flush=True)
        time.sleep(120)
    return real(fd, data, offset)
os.pwrite = pwrite
porter.convert(sys.argv[2], sys.argv[1], max_shard_size="300KB", progress=False, workers=1, device="cpu")
"""


def start(script: str, *args) -> subprocess.Popen:
    code = textwrap.dedent(script).format(root=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().strip()  # blocks until the child holds the lock (or dies)
    assert line in ("locked", "inside"), proc.stderr.read()
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)


def test_second_run_is_refused_while_a_conversion_is_inside_a_shard(tiny_vendor, tmp_path):
    out = tmp_path / "out"
    proc = start(HOLD_IN_SHARD, out, tiny_vendor)
    try:
        partial = sorted(out.glob("*.partial"))
        assert partial
        sizes = {p.name: p.stat().st_size for p in partial}
        for flags in ((), ("--resume",), ("--force",), ("--force", "--resume")):
            t0 = time.monotonic()
            res = convert_cli(tiny_vendor, out, *flags)
            line = one_error_line(res, out, f"pid {proc.pid} on ", "another porter run")
            assert time.monotonic() - t0 < 20, line  # refused at once, not after waiting
        assert {p.name: p.stat().st_size for p in sorted(out.glob("*.partial"))} == sizes  # not truncated
        assert not (out / INDEX).exists()
        holder = (out / output_guard.LOCK_NAME).read_text().split()
        assert holder[0] == str(proc.pid)
    finally:
        stop(proc)


def test_lock_holder_is_named_and_a_killed_holder_is_recovered(tiny_vendor, clean, tmp_path):
    out = tmp_path / "out"
    proc = start(HOLD_LOCK, out)
    try:
        one_error_line(convert_cli(tiny_vendor, out), f"pid {proc.pid} on ")
        one_error_line(convert_cli(tiny_vendor, out, "--resume", "--force"), f"pid {proc.pid} on ")
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # kill -9: the lock file stays, the kernel drops the flock
        proc.wait(timeout=30)
    assert (out / output_guard.LOCK_NAME).read_text().split()[0] == str(proc.pid)
    res = convert_cli(tiny_vendor, out, "--resume")  # -q: warnings are still shown
    assert res.exit_code == 0, res.output
    assert "taking over the lock" in res.output and f"(pid {proc.pid} on " in res.output, res.output
    assert artifact_bytes(out) == artifact_bytes(clean)  # no lock file left; the same artifact


def test_lock_file_is_no_shard_and_verify_inspect_accept_it(clean, tmp_path):
    """A stale lock (its run was killed after the index) changes neither inspect nor the integrity check."""
    from porter.commands.verify.integrity import check_integrity

    out = Path(shutil.copytree(clean, tmp_path / "out"))
    (out / output_guard.LOCK_NAME).write_text("12345 somehost\n")
    res = CliRunner().invoke(cli, ["inspect", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert output_guard.LOCK_NAME not in res.output
    report = check_integrity(out, manifest.read(out))
    assert report.passed and report.issues == [], report
    assert report.shards == len(list(out.glob("model-*.safetensors")))


# ---------------------------------------------------------------------------------------------------
# nothing planted at porter's own names is followed, written through or replaced


class Crash(BaseException):
    """Ends a conversion in this process as a kill would (no `except Exception` handler catches it)."""


@pytest.fixture(scope="module")
def interrupted(tiny_vendor, tmp_path_factory) -> Path:
    """An interrupted conversion: the last shard's last quantize call never returns."""
    from porter.format import mxfp8

    out = tmp_path_factory.mktemp("planted") / "out"
    real, calls = mxfp8.quantize_with_error, []

    def quantize(w, *a, **k):
        calls.append(1)
        if len(calls) == 72:  # the tiny checkpoint's last quantize call (72 at 2 workers)
            raise RuntimeError("simulated crash")
        return real(w, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mxfp8, "quantize_with_error", quantize)
        res = convert_cli(tiny_vendor, out)
    assert res.exit_code == 3 and not (out / INDEX).exists(), res.output
    journal = json.loads((out / JOURNAL).read_text())
    assert 1 <= len(journal["shards"]) < journal["shard_count"]
    return out


def _not_done(out: Path) -> str:
    journal = json.loads((out / JOURNAL).read_text())
    return next(f for f in journal["files"] if f.startswith("model-") and f not in journal["shards"])


def _plant(at: Path, kind: str, victim: Path) -> None:
    if at.is_dir() and not at.is_symlink():
        shutil.rmtree(at)
    elif os.path.lexists(at):
        at.unlink()
    if kind == "link to a file":
        at.symlink_to(victim)
    elif kind == "link to a folder":
        at.symlink_to(victim.parent)
    elif kind == "dangling link":
        at.symlink_to(victim.parent / "nowhere")
    elif kind == "fifo":
        os.mkfifo(at)
    else:
        at.mkdir()


PLANTED_NAMES = [
    "{shard}.partial",  # a shard still to do: written from scratch
    "{shard}",
    "{done}",  # a finished shard: re-hashed by --resume
    ".porter-journal.json",
    ".porter-journal.json.tmp",
    "model.safetensors.index.json.tmp",
    "porter.json.tmp",
    "config.json.tmp",
    "README.md.tmp",
    "tokenizer.json",  # copied from the source at the end
    "tokenizer.json.tmp",
]
PLANTED_KINDS = ["link to a file", "link to a folder", "dangling link", "fifo", "folder"]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(PLANTED_NAMES), kind=st.sampled_from(PLANTED_KINDS))
def test_resume_never_follows_what_is_planted_at_porters_names(
    tiny_vendor, interrupted, tmp_path_factory, name, kind
):
    """A symlink, FIFO or folder at any name --resume writes or reads back: exit 2 naming it, before any
    file is touched; the link's target is unchanged and nothing looks complete."""
    base = tmp_path_factory.mktemp("plant")
    victim = base / "victim.txt"
    victim.write_text("not porter's")
    out = Path(shutil.copytree(interrupted, base / "out", symlinks=True))
    journal = json.loads((out / JOURNAL).read_text())
    planted = out / name.format(shard=_not_done(out), done=sorted(journal["shards"])[0])
    _plant(planted, kind, victim)
    before = {p.name: os.lstat(p).st_mtime_ns for p in out.iterdir()}
    res = convert_cli(tiny_vendor, out, "--resume")
    one_error_line(res, planted)
    assert victim.read_text() == "not porter's" and not (out / INDEX).exists()
    assert {p.name: os.lstat(p).st_mtime_ns for p in out.iterdir()} == before


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(PLANTED_KINDS), how=st.sampled_from(["create_new", "atomic_write", "copy_into"]))
def test_writes_never_go_through_a_planted_entry(tmp_path_factory, kind, how):
    """The primitives every porter write goes through: a planted entry at the file's or its temporary's name
    is an error naming it; the entry and its target are as they were."""
    from porter.errors import OutputFolderError
    from porter.format import safe_files

    d = tmp_path_factory.mktemp("prim")
    victim, src = d / "victim", d / "src.txt"
    victim.write_text("keep")
    src.write_text("new")
    target = d / "out.json"
    for planted in (target, d / "out.json.tmp") if how != "create_new" else (target,):
        _plant(planted, kind, victim)
        with pytest.raises(OutputFolderError, match="porter did not make it"):
            if how == "create_new":
                safe_files.create_new(target, OutputFolderError)
            elif how == "atomic_write":
                safe_files.atomic_write(target, b"new", OutputFolderError)
            else:
                safe_files.copy_into(src, target, OutputFolderError)
        assert victim.read_text() == "keep" and os.path.lexists(planted)
        assert not os.path.isdir(planted) or kind in ("folder", "link to a folder")
        _plant(planted, "folder", victim)
        shutil.rmtree(planted)
    safe_files.atomic_write(target, b"new", OutputFolderError)  # nothing planted: written
    assert target.read_bytes() == b"new" and victim.read_text() == "keep"


# ---------------------------------------------------------------------------------------------------
# --force: crash-safe removal of an earlier output


def _removals_then_crash(at: int):
    """output_guard.fault_point that ends the run at its `at`-th removal, as a SIGKILL would."""
    count = []

    def point(event):
        if event == "remove":
            count.append(1)
            if len(count) == at:
                raise Crash()

    return point


def _convert_api(src, out, **kw):
    return porter.convert(src, out, max_shard_size=SHARD_CAP, workers=2, device="cpu", progress=False, **kw)


@pytest.mark.parametrize("at", [1, 2, 3, 6, 10])
def test_force_killed_while_removing_never_looks_complete(tiny_vendor, clean, tmp_path, monkeypatch, at):
    """--force into a complete output (another plan), killed after `at` removals: the index goes first, so
    the folder is an interrupted conversion that verify and runtime.load refuse, naming how to resume; a
    second --force (or --resume) finishes the removal and the conversion."""
    import runtime
    from porter.errors import PorterError

    out = Path(shutil.copytree(clean, tmp_path / "out"))
    with monkeypatch.context() as mp:
        mp.setattr(output_guard, "fault_point", _removals_then_crash(at))
        with pytest.raises(Crash):
            porter.convert(tiny_vendor, out, max_shard_size="200KB", force=True, progress=False)
    assert not (out / INDEX).exists()
    assert (at > 1) <= (not (out / "porter.json").exists())  # porter.json goes second
    journal = json.loads((out / JOURNAL).read_text())
    assert journal["removing"] and not journal["shards"]
    for call in (lambda: runtime.load(out), lambda: porter.verify(out)):
        with pytest.raises(
            PorterError, match=r"interrupted conversion \(0 of \d+ shards done\): resume with"
        ):
            call()
    flag = "--force" if at % 2 else "--resume"
    res = convert_cli(tiny_vendor, out, flag, "--max-shard-size", "200KB")
    assert res.exit_code == 0, res.output
    fresh = tmp_path / "fresh"
    assert convert_cli(tiny_vendor, fresh, "--max-shard-size", "200KB").exit_code == 0
    assert artifact_bytes(out) == artifact_bytes(fresh)


def test_force_that_cannot_remove_a_file_is_one_line_and_finishes_later(
    tiny_vendor, clean, tmp_path, monkeypatch
):
    out = Path(shutil.copytree(clean, tmp_path / "out"))
    stuck = sorted(out.glob("model-*.safetensors"))[1]
    real = Path.unlink

    def unlink(self, missing_ok=False):
        if self.name == stuck.name:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        return real(self, missing_ok=missing_ok)

    with monkeypatch.context() as mp:
        mp.setattr(Path, "unlink", unlink)
        line = one_error_line(convert_cli(tiny_vendor, out, "--force"), stuck, "cannot remove it", "--force")
    assert "Operation not permitted" in line
    assert not (out / INDEX).exists() and not (out / "porter.json").exists() and stuck.exists()
    assert json.loads((out / JOURNAL).read_text())["removing"]  # what is left is still porter's to remove
    assert convert_cli(tiny_vendor, out, "--force").exit_code == 0
    assert artifact_bytes(out) == artifact_bytes(clean)


def test_force_checks_that_it_can_remove_before_removing_anything(tiny_vendor, clean, tmp_path, monkeypatch):
    out = Path(shutil.copytree(clean, tmp_path / "out"))
    before = hashes(out)
    real = os.access
    read_only = lambda path, mode, **kw: (mode & os.W_OK == 0 or Path(path) != out) and real(path, mode, **kw)  # noqa: E731
    monkeypatch.setattr(os, "access", read_only)  # a read-only folder (root is let through by the kernel)
    one_error_line(convert_cli(tiny_vendor, out, "--force"), out, "cannot remove files from this folder")
    assert hashes(out) == before
