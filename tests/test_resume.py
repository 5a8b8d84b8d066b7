"""`porter convert --resume` guards: what a resume may skip, what it must redo, and what it must refuse.

An interrupted conversion is made for real: the quantizer (`porter.format.mxfp8.quantize_with_error`, which
every conversion path calls through the module) raises on its last call, so every shard not waiting on that
call can finish and be recorded in the journal. Work is counted in quantized elements, which does not
depend on how the conversion cuts tensors into calls.
"""
import hashlib
import json
import math
import shutil
import threading

import pytest
from click.testing import CliRunner

import porter
from porter.cli import main as cli
from porter.format import mxfp8
from tensor_checks import shard_digests

SHARD_CAP = "300KB"  # the tiny checkpoint makes several shards at this cap
JOURNAL = ".porter-journal.json"
INDEX = "model.safetensors.index.json"


class QuantizeCounter:
    """Wraps mxfp8.quantize_with_error: counts quantized elements; optionally raises on call `crash_at`."""

    def __init__(self, crash_at=None):
        self.real, self.crash_at = mxfp8.quantize_with_error, crash_at
        self.calls, self.elements, self.lock = 0, 0, threading.Lock()

    def __call__(self, w, *args, **kwargs):
        with self.lock:
            self.calls += 1
            self.elements += w.numel()
            crash = self.calls == self.crash_at
        if crash:
            raise RuntimeError("simulated crash")
        return self.real(w, *args, **kwargs)


def convert_counting(src, out, crash_at=None, **options) -> QuantizeCounter:
    counter = QuantizeCounter(crash_at)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mxfp8, "quantize_with_error", counter)
        porter.convert(src, out, max_shard_size=SHARD_CAP, progress=False, **options)
    return counter


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(tiny_vendor, tmp_path_factory):
    """A complete conversion, and how many quantize calls / elements it took."""
    out = tmp_path_factory.mktemp("resume") / "reference"
    counter = convert_counting(tiny_vendor, out)
    man = json.loads((out / "porter.json").read_text())
    assert len(man["shards"]) >= 3 and counter.calls >= 2
    return out, man, counter


@pytest.fixture(scope="module")
def crashed(tiny_vendor, reference, tmp_path_factory):
    """An interrupted conversion: the last quantize call raised."""
    _, man, full = reference
    out = tmp_path_factory.mktemp("resume") / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_counting(tiny_vendor, out, crash_at=full.calls)
    journal = json.loads((out / JOURNAL).read_text())
    assert not (out / INDEX).exists() and not (out / "porter.json").exists()
    assert 1 <= len(journal["shards"]) < len(man["shards"]), journal["shards"].keys()
    return out


def interrupted_copy(crashed, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(crashed, out)
    return out, json.loads((out / JOURNAL).read_text())


def elements_to_redo(man: dict, done: set) -> int:
    """Elements a resume must quantize: every quantized tensor whose weight or scale lies in a shard that
    is not done (a scale needs the whole tensor quantized again)."""
    tensors = man["tensors"]
    return sum(math.prod(rec["shape"]) for name, rec in tensors.items()
               if rec.get("scale") and (rec["shard"] not in done or tensors[rec["scale"]]["shard"] not in done))


def assert_same_artifact(out, ref_out, ref_man):
    man = json.loads((out / "porter.json").read_text())
    assert man["shards"] == ref_man["shards"] and man["tensors"] == ref_man["tensors"]
    for f, rec in ref_man["shards"].items():
        assert shard_digests(out / f)[2] == rec["digest"] and sha256(out / f) == sha256(ref_out / f), f
    assert (out / INDEX).exists() and not (out / JOURNAL).exists()


def test_resume_does_not_requantize_finished_tensors(tiny_vendor, reference, crashed, tmp_path):
    ref_out, ref_man, full = reference
    out, journal = interrupted_copy(crashed, tmp_path)
    done = set(journal["shards"])
    before = {f: (out / f).stat().st_mtime_ns for f in done}
    want = elements_to_redo(ref_man, done)
    assert 0 < want < full.elements  # the crash left quantized work both done and to do

    again = convert_counting(tiny_vendor, out, resume=True)
    assert again.elements == want, (again.elements, want, full.elements)
    assert all((out / f).stat().st_mtime_ns == m for f, m in before.items())  # finished shards untouched
    assert_same_artifact(out, ref_out, ref_man)


def test_finished_shard_with_wrong_digest_is_rewritten(tiny_vendor, reference, crashed, tmp_path):
    ref_out, ref_man, full = reference
    out, journal = interrupted_copy(crashed, tmp_path)
    done = set(journal["shards"])
    # damage the finished shard holding the most quantized tensors (same size, one byte flipped mid-data)
    holds = {f: sum(1 for r in ref_man["tensors"].values() if r["shard"] == f and r.get("scale")) for f in done}
    victim = max(sorted(done), key=holds.get)
    raw = bytearray((out / victim).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (out / victim).write_bytes(bytes(raw))
    assert shard_digests(out / victim)[2] != journal["shards"][victim]["digest"]

    again = convert_counting(tiny_vendor, out, resume=True)
    assert again.elements == elements_to_redo(ref_man, done - {victim})
    if holds[victim]:
        assert again.elements > elements_to_redo(ref_man, done)  # the victim's tensors were quantized again
    assert shard_digests(out / victim)[2] == ref_man["shards"][victim]["digest"]
    assert_same_artifact(out, ref_out, ref_man)


def test_finished_shard_truncated_or_missing_is_rewritten(tiny_vendor, reference, crashed, tmp_path):
    """A journaled shard cut short (its header no longer fits the file) or deleted is rewritten, not trusted."""
    ref_out, ref_man, _ = reference
    out, journal = interrupted_copy(crashed, tmp_path)
    done = sorted(journal["shards"])
    cut = out / done[0]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    if len(done) > 1:
        (out / done[1]).unlink()
    convert_counting(tiny_vendor, out, resume=True)
    assert_same_artifact(out, ref_out, ref_man)


@pytest.mark.parametrize("option", [["--scale-rounding", "floor"], ["--quantize", "all"], ["--gate-up", "interleaved"],
                                    ["--max-shard-size", "200KB"]])
def test_resume_with_other_options_is_refused(tiny_vendor, crashed, tmp_path, option):
    out, journal = interrupted_copy(crashed, tmp_path)
    before = {p.name: sha256(p) for p in out.iterdir() if p.is_file()}
    args = ["convert", str(tiny_vendor), "--output", str(out), "--resume", "--max-shard-size", SHARD_CAP, *option]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert "--resume" in res.output and "different" in res.output and "--force" in res.output
    assert {p.name: sha256(p) for p in out.iterdir() if p.is_file()} == before  # nothing touched
    assert not (out / INDEX).exists()


@pytest.mark.parametrize("garbage", [b"\xff\xfe\x00binary", b'{"fingerprint": "x", "sha'])
def test_unreadable_journal_is_refused_in_one_line(tiny_vendor, crashed, tmp_path, garbage):
    """A journal that is not UTF-8 or not JSON reads as no journal: --resume is refused with porter's one-line
    message and exit code 2 (not a UnicodeDecodeError traceback), and nothing is touched."""
    out, _ = interrupted_copy(crashed, tmp_path)
    (out / JOURNAL).write_bytes(garbage)
    before = {p.name: sha256(p) for p in out.iterdir() if p.is_file()}
    args = ["convert", str(tiny_vendor), "--output", str(out), "--resume", "--max-shard-size", SHARD_CAP]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert "--resume" in res.output and "--force" in res.output and "Traceback" not in res.output
    assert {p.name: sha256(p) for p in out.iterdir() if p.is_file()} == before
