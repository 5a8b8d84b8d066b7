"""`porter convert --resume` guards: what a resume may skip, what it must redo, and what it must refuse.

An interrupted conversion is made for real: the quantizer (`porter.format.mxfp8.quantize_with_error`, which
every conversion path calls through the module) raises on its last call, so every shard not waiting on that
call can finish and be recorded in the journal. Work is counted in quantized elements, which does not
depend on how the conversion cuts tensors into calls.
"""

import hashlib
import json
import math
import os
import shutil
import threading

import pytest
from click.testing import CliRunner
from tensor_checks import shard_digests

import porter
from porter.cli import main as cli
from porter.format import mxfp8

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
    return sum(
        math.prod(rec["shape"])
        for name, rec in tensors.items()
        if rec.get("scale") and (rec["shard"] not in done or tensors[rec["scale"]]["shard"] not in done)
    )


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
    holds = {
        f: sum(1 for r in ref_man["tensors"].values() if r["shard"] == f and r.get("scale")) for f in done
    }
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


@pytest.mark.parametrize(
    "option, then",
    [
        (["--scale-rounding", "floor"], "--scale-rounding rceil"),
        (["--quantize", "all"], "--quantize experts"),
        (["--gate-up", "interleaved"], "--gate-up auto"),
        (["--max-shard-size", "200KB"], f"--max-shard-size {SHARD_CAP}"),
        (["--digest", "sha256"], "--digest xxh3-128"),
        (["--layout", "hf"], "--layout porter"),  # named, not the --quantize default it implies
    ],
)
def test_resume_with_other_options_is_refused_naming_the_option(tiny_vendor, crashed, tmp_path, option, then):
    """The option that differs is named with both values, and the exact command that resumes is given;
    running that command then finishes the conversion."""
    out, journal = interrupted_copy(crashed, tmp_path)
    before = {p.name: sha256(p) for p in out.iterdir() if p.is_file()}
    args = [
        "convert",
        str(tiny_vendor),
        "--output",
        str(out),
        "--resume",
        "--max-shard-size",
        SHARD_CAP,
        *option,
    ]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    now = " ".join(option)
    assert f"--resume with {now}, but this conversion was started with {then}" in line, line
    command = f"porter convert {tiny_vendor} --output {out} --max-shard-size {SHARD_CAP} --resume"
    assert f"resume with {command} (or --force to start over)" in line
    assert {p.name: sha256(p) for p in out.iterdir() if p.is_file()} == before  # nothing touched
    assert not (out / INDEX).exists()


def test_the_printed_resume_command_resumes(tiny_vendor, reference, crashed, tmp_path):
    """The command an interrupted output prints (inspect, a plain rerun, the journal) is the one that
    resumes it: run word for word (shell-split), it ends in the reference's bytes."""
    import shlex

    ref_out, ref_man, _ = reference
    out, _ = interrupted_copy(crashed, tmp_path)
    plain = CliRunner().invoke(cli, ["convert", str(tiny_vendor), "--output", str(out)])
    assert plain.exit_code == 2 and "interrupted conversion (" in plain.output, plain.output
    command = (
        plain.output.strip()
        .split("resume with ", 1)[1]
        .removesuffix("; or add --force to start over with these options")
    )
    argv = shlex.split(command)
    assert argv[:2] == ["porter", "convert"] and argv[-1] == "--resume"
    assert argv[argv.index("--output") + 1] == str(out)  # the folder where it is now, not where it was made
    res = CliRunner().invoke(cli, [*argv[1:], "-q"])
    assert res.exit_code == 0, res.output
    assert_same_artifact(out, ref_out, ref_man)


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


# ---- the source is proven, not assumed: headers + sampled data + config.json -------------------------------


def _flip_byte(path, offset) -> None:
    """Change one byte in place (size unchanged)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _source_copy(tiny_vendor, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_vendor, src)
    return src


@pytest.mark.parametrize("where", ["first data byte", "last byte", "config.json"])
def test_resume_after_source_changed_at_same_size_is_refused_naming_the_file(tiny_vendor, tmp_path, where):
    from porter.format.safetensors_io import parse_header

    src = _source_copy(tiny_vendor, tmp_path)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_counting(src, out, crash_at=2)
    shard = sorted(src.glob("*.safetensors"))[0]
    sizes = {p.name: p.stat().st_size for p in src.iterdir()}
    if where == "config.json":
        changed = src / "config.json"
        text = changed.read_text()
        changed.write_text(text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 2e-06', 1))
        assert text != changed.read_text()
    else:
        changed = shard
        _flip_byte(shard, parse_header(shard)[0] if where == "first data byte" else shard.stat().st_size - 1)
    assert {p.name: p.stat().st_size for p in src.iterdir()} == sizes  # same names, same sizes
    before = {p.name: sha256(p) for p in out.iterdir() if p.is_file()}
    res = CliRunner().invoke(
        cli, ["convert", str(src), "--output", str(out), "--resume", "--max-shard-size", SHARD_CAP]
    )
    assert res.exit_code == 2, res.output
    assert str(changed) in res.output and "changed" in res.output and "--force" in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert {p.name: sha256(p) for p in out.iterdir() if p.is_file()} == before  # nothing touched


def test_resume_of_complete_output_after_source_changed_is_refused(tiny_vendor, tmp_path):
    src = _source_copy(tiny_vendor, tmp_path)
    out = tmp_path / "out"
    convert_counting(src, out)
    shard = sorted(src.glob("*.safetensors"))[-1]
    _flip_byte(shard, shard.stat().st_size - 1)
    res = CliRunner().invoke(
        cli, ["convert", str(src), "--output", str(out), "--resume", "--max-shard-size", SHARD_CAP]
    )
    assert res.exit_code == 2 and str(shard) in res.output and "changed" in res.output, res.output


def test_source_sample_reads_header_and_bounded_bytes(tmp_path):
    """The sample is the whole header + 2 x 64 KiB + 8 x 4 KiB of data, however big the file."""
    from porter.format.safetensors_io import sample_spans

    header_end, size = 8 + 200_000, 13_500_000_000
    spans = sample_spans(size, header_end)
    assert sum(n for _, n in spans) == header_end + 2 * 65536 + 8 * 4096
    assert all(0 <= b and b + n <= size for b, n in spans)
    assert (size - 65536, 65536) in spans and (header_end, 65536) in spans


@pytest.mark.parametrize("damage", ["delete", "alter"])
def test_complete_output_with_missing_or_altered_shard_redoes_only_that_shard(
    tiny_vendor, reference, tmp_path, damage
):
    ref_out, ref_man, full = reference
    out = tmp_path / "out"
    shutil.copytree(ref_out, out)
    shards = sorted(ref_man["shards"])
    victim = out / shards[1]
    if damage == "delete":
        victim.unlink()
    else:
        _flip_byte(victim, victim.stat().st_size - 1)
    kept = {f: ((out / f).stat().st_ino, (out / f).stat().st_mtime_ns) for f in shards if f != victim.name}
    counter = QuantizeCounter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mxfp8, "quantize_with_error", counter)
        res = CliRunner().invoke(
            cli,
            [
                "convert",
                str(tiny_vendor),
                "--output",
                str(out),
                "--resume",
                "--max-shard-size",
                SHARD_CAP,
                "--workers",
                "2",
            ],
        )
    assert res.exit_code == 0, res.output
    assert victim.name in res.output and ("missing" if damage == "delete" else "altered") in res.output
    assert counter.elements == elements_to_redo(ref_man, set(shards) - {victim.name}) < full.elements
    assert {f: ((out / f).stat().st_ino, (out / f).stat().st_mtime_ns) for f in kept} == kept
    assert_same_artifact(out, ref_out, ref_man)


def test_resume_of_intact_complete_output_does_nothing(tiny_vendor, reference, tmp_path):
    ref_out, ref_man, _ = reference
    out = tmp_path / "out"
    shutil.copytree(ref_out, out)
    counter = convert_counting(tiny_vendor, out, resume=True)
    assert counter.calls == 0
    assert_same_artifact(out, ref_out, ref_man)


def test_inspect_says_an_interrupted_output_is_incomplete(tiny_vendor, reference, crashed, tmp_path):
    out, journal = interrupted_copy(crashed, tmp_path)
    total, done = len(reference[1]["shards"]), len(journal["shards"])
    res = CliRunner().invoke(cli, ["inspect", str(out)])
    want = (
        f"{out}: interrupted conversion ({done} of {total} shards done): resume with porter convert "
        f"{tiny_vendor} --output {out} --max-shard-size {SHARD_CAP} --resume"
    )
    assert res.exit_code == 2 and want in res.output and len(res.output.strip().splitlines()) == 1, res.output
    # killed after config.json and porter.json, before the index: still incomplete, not "porter artifact"
    ref_out = reference[0]
    out2 = tmp_path / "late"
    shutil.copytree(ref_out, out2)
    (out2 / INDEX).unlink()
    (out2 / JOURNAL).write_text(json.dumps({**journal, "shards": {f: {} for f in reference[1]["shards"]}}))
    res = CliRunner().invoke(cli, ["inspect", str(out2)])
    assert res.exit_code == 0, res.output
    assert (
        f"porter output, interrupted conversion ({total} of {total} shards done): resume with" in res.output
    )
    assert "porter artifact" not in res.output


# ---- every command recognises an interrupted output ------------------------------------------------------


def test_every_command_names_an_interrupted_output_and_its_resume_command(tiny_vendor, crashed, tmp_path):
    """generate, verify, inspect, runtime.load and a plain rerun of convert: one line (exit 2 / a porter
    error) saying how many shards are done and the exact command that resumes."""
    import runtime
    from porter.errors import PorterError

    out, journal = interrupted_copy(crashed, tmp_path)
    state = (
        f"{out}: interrupted conversion ({len(journal['shards'])} of {journal['shard_count']} shards done)"
    )
    command = f"resume with porter convert {tiny_vendor} --output {out} --max-shard-size {SHARD_CAP} --resume"
    for args in (
        ["generate", str(out), "--prompt", "hi"],
        ["verify", str(out)],
        ["inspect", str(out)],
        ["convert", str(tiny_vendor), "--output", str(out), "--max-shard-size", SHARD_CAP],
    ):
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2, (args, res.output)
        line = res.output.strip()
        assert len(line.splitlines()) == 1 and f"{state}: {command}" in line, (args, line)
    with pytest.raises(PorterError) as e:
        runtime.load(out)
    assert str(e.value) == f"{state}: {command}"


def test_journal_keeps_the_options_but_never_the_token(tiny_vendor, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_counting(
            tiny_vendor, out, crash_at=2, token="hf_not_to_be_kept", workers=1, scale_rounding="floor"
        )
    text = (out / JOURNAL).read_text()
    journal = json.loads(text)
    assert "hf_not_to_be_kept" not in text
    assert (
        journal["options"]["scale_rounding"] == "floor" and journal["options"]["max_shard_size"] == SHARD_CAP
    )
    assert journal["command"] == [
        "porter",
        "convert",
        str(tiny_vendor),
        "--output",
        str(out),
        "--scale-rounding",
        "floor",
        "--max-shard-size",
        SHARD_CAP,
        "--workers",
        "1",
        "--resume",
    ]


# ---- a source that changes while it is converted ----------------------------------------------------------


def _rewrite_in_place(shard):
    """One data byte flipped, size and mtime as they were (ctime moves: the kernel sets it)."""
    st = shard.stat()
    _flip_byte(shard, shard.stat().st_size - 1)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def _replace(shard):
    """Another file with the same bytes renamed over it (a re-download)."""
    tmp = shard.with_name("incoming")
    shutil.copy2(shard, tmp)
    os.replace(tmp, shard)


CHANGES = {"rewritten": _rewrite_in_place, "replaced by another file": _replace, "deleted": os.unlink}


@pytest.mark.parametrize("when", ["before its reads", "after its reads"])
@pytest.mark.parametrize("how", sorted(CHANGES))
def test_source_changed_during_the_run_is_one_line_and_nothing_complete(tiny_vendor, tmp_path, how, when):
    """A source shard rewritten in place (even with its mtime put back), replaced or deleted while porter
    converts: exit 2 naming it, and no config.json, porter.json or index (the output stays unfinished)."""
    import porter.engine.run as pipeline_module
    from porter import engine

    src = _source_copy(tiny_vendor, tmp_path)
    shard = sorted(src.glob("model-*.safetensors"))[0]
    out = tmp_path / "out"
    where = (pipeline_module.Pipeline, "run") if when == "before its reads" else (engine, "sync_files")
    real = getattr(*where)

    def change_then(*args, **kwargs):
        CHANGES[how](shard)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(*where, change_then)
        res = CliRunner().invoke(
            cli, ["convert", str(src), "--output", str(out), "--max-shard-size", SHARD_CAP, "-q"]
        )
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert len(line.splitlines()) == 1 and str(shard) in line and "Traceback" not in line, line
    if when == "after its reads":
        assert f"{shard} was {how} while porter converted it" in line
    assert not any((out / f).exists() for f in (INDEX, "porter.json", "config.json"))
