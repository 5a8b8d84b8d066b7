"""Bad input and faults: every malformed shard named, crash-anywhere resume, hub errors, fuzzed headers.

Each class of fault ends in one line naming the file, tensor or field, exit code 2, and nothing that looks
complete (no model.safetensors.index.json) in the output folder.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import porter
from porter.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"


def convert_cli(src, out, *extra):
    return CliRunner().invoke(cli, ["convert", str(src), "--output", str(out), "-q", *map(str, extra)])


def assert_bad_input(res, out: Path, *names):
    """exit 2, exactly one line, no traceback, names every given string, nothing complete-looking left."""
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("porter: error: "), res.output
    assert "Traceback" not in res.output
    for n in names:
        assert n in lines[0], (n, lines[0])
    assert not (out / INDEX).exists()


def first_shard(d: Path) -> Path:
    return sorted(d.glob("model-*.safetensors"))[0]


def header_len(f: Path) -> int:
    return int.from_bytes(f.read_bytes()[:8], "little")


# ---------------------------------------------------------------------------------------------------
# malformed safetensors: each names the shard file


def _truncate_data(f: Path):
    os.truncate(f, f.stat().st_size - 100)


def _truncate_header(f: Path):
    os.truncate(f, 8 + header_len(f) // 2)


def _break_json(f: Path):
    data = bytearray(f.read_bytes())
    data[8] = ord("[")  # the header's first byte: '{' -> '['  (JSON, but not an object) ...
    data[9:12] = b"}}}"  # ... and not JSON either
    f.write_bytes(bytes(data))


def _edit_header(f: Path, fn):
    """Rewrite the header JSON (same data) after fn(header dict)."""
    data = f.read_bytes()
    n = header_len(f)
    header = json.loads(data[8 : 8 + n])
    fn(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])


def _first_tensor(header):
    return next(k for k in header if k != "__metadata__")


def _offsets_beyond_file(f: Path):
    def fn(h):
        k = sorted((v["data_offsets"][1], k) for k, v in h.items() if k != "__metadata__")[-1][1]
        begin, end = h[k]["data_offsets"]
        h[k]["data_offsets"][1] += (end - begin) // h[k]["shape"][0]  # one more row than the file holds
        h[k]["shape"][0] += 1

    _edit_header(f, fn)


def _length_disagrees_with_shape(f: Path):
    _edit_header(f, lambda h: h[_first_tensor(h)].update(shape=[3, 5, 7]))


def _unknown_dtype(f: Path):
    _edit_header(f, lambda h: h[_first_tensor(h)].update(dtype="F4_E2M1"))


def _trailing_bytes(f: Path):
    with open(f, "ab") as fh:
        fh.write(b"\0" * 24)


MALFORMED = {
    "truncated data": (_truncate_data, "truncated"),
    "truncated header": (_truncate_header, "truncated"),
    "broken header JSON": (_break_json, "invalid JSON"),
    "offsets beyond the file": (_offsets_beyond_file, "truncated"),
    "length disagrees with shape": (_length_disagrees_with_shape, "needs"),
    "unknown dtype": (_unknown_dtype, "unsupported dtype"),
    "bytes after the data": (_trailing_bytes, "padded"),
}


@pytest.mark.parametrize("fault", sorted(MALFORMED))
def test_malformed_shard_is_named(tiny_vendor, tmp_path, fault):
    src = tmp_path / "src"
    shutil.copytree(tiny_vendor, src)
    shard = first_shard(src)
    mutate, words = MALFORMED[fault]
    mutate(shard)
    res = convert_cli(src, tmp_path / "out")
    assert_bad_input(res, tmp_path / "out", str(shard), words)
    # --dry-run reads headers only and fails the same way
    assert_bad_input(convert_cli(src, tmp_path / "dry", "--dry-run"), tmp_path / "dry", str(shard))


def test_truncated_while_converting_is_named(tiny_vendor, tmp_path, monkeypatch):
    """A shard that shrinks after the plan was made (a copy still in progress) is named by the reader."""
    import porter.engine.run as pp

    src = tmp_path / "src"
    shutil.copytree(tiny_vendor, src)
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    real = pp.Pipeline.run

    def shrink_then_run(self, units):
        os.truncate(shard, 8 + header_len(shard) + 16)
        return real(self, units)

    monkeypatch.setattr(pp.Pipeline, "run", shrink_then_run)
    res = convert_cli(src, tmp_path / "out", "--workers", 2)
    assert_bad_input(res, tmp_path / "out", str(shard), "truncated")


# ---------------------------------------------------------------------------------------------------
# resume


def test_resume_on_complete_output_is_a_noop(tiny_vendor, tmp_path, caplog):
    out = tmp_path / "out"
    porter.convert(tiny_vendor, out, max_shard_size="300KB", progress=False)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}
    res = CliRunner().invoke(
        cli, ["convert", str(tiny_vendor), "--output", str(out), "--max-shard-size", "300KB", "--resume"]
    )
    assert res.exit_code == 0, res.output
    assert "already complete" in res.output and "nothing to do" in res.output
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()} == before
    # other options -> a different conversion: refused, not silently mixed
    res = CliRunner().invoke(cli, ["convert", str(tiny_vendor), "--output", str(out), "--resume"])
    assert res.exit_code == 2, res.output
    assert (
        "--resume with --max-shard-size 5GB, but this output was made with --max-shard-size 300000"
        in res.output
    )


KILL_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import porter
porter.convert(sys.argv[1], sys.argv[2], max_shard_size="300KB", progress=False, workers=int(sys.argv[3]),
               device="cpu", resume=sys.argv[4] == "1")
"""


def run_convert(src, out, workers=2, resume=False, env=None):
    return subprocess.run(
        [
            sys.executable,
            "-c",
            KILL_SCRIPT.format(root=str(ROOT)),
            str(src),
            str(out),
            str(workers),
            "1" if resume else "0",
        ],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


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


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_is_byte_identical(tiny_vendor, tmp_path):
    """SIGKILL at points spread over the whole run (units, shard renames, journal writes, each final file
    between its temp write and its rename, and after), then --resume: the same bytes as a clean run."""
    clean, log = tmp_path / "clean", tmp_path / "events.log"
    res = run_convert(tiny_vendor, clean, env={"PORTER_FAULT": f"log={log}"})
    assert res.returncode == 0, res.stderr
    events = log.read_text().split()
    final = [e for e in events if e.startswith(("tmp:", "wrote:"))]
    assert {
        "tmp:config.json:1",
        "tmp:porter.json:1",
        "wrote:porter.json:1",
        "tmp:model.safetensors.index.json:1",
        "wrote:model.safetensors.index.json:1",
    } <= set(final)
    units = [e for e in events if e.startswith("unit:")]
    others = [e for e in events if e.startswith(("shard-renamed:", "journal:", "journal-tmp:"))]
    points = units[1 :: max(1, len(units) // 3)] + others[:: max(1, len(others) // 3)] + final
    assert len(points) >= 12, points
    want = artifact_bytes(clean)
    for i, point in enumerate(points):
        out = tmp_path / f"k{i}"
        res = run_convert(tiny_vendor, out, env={"PORTER_FAULT": f"kill={point}"})
        assert res.returncode == -9, (point, res.returncode, res.stderr[-500:])
        complete = (out / INDEX).exists()
        assert complete == (point == "wrote:model.safetensors.index.json:1"), point  # the index is last
        assert not list(out.glob("*.tmp")) or not complete
        porter.convert(
            tiny_vendor, out, max_shard_size="300KB", progress=False, workers=2, device="cpu", resume=True
        )  # in this process: one torch import per kill point, not two
        got = artifact_bytes(out)
        assert got.keys() == want.keys() and all(got[k] == want[k] for k in want), point


def test_quick_ctrl_c_presses_end_in_exit_130_and_the_resume_command(tiny_vendor, tmp_path):
    """Three SIGINTs 50 ms apart while the conversion is inside its work (a worker held at a unit by the
    test-only stall): exit 130, one line with the command that resumes, no traceback; that command then
    finishes the conversion."""
    import signal
    import time

    out, log = tmp_path / "out", tmp_path / "events.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PORTER_FAULT": f"stall=unit:3,log={log}"}
    argv = [sys.executable, "-m", "porter.cli", "convert", str(tiny_vendor), "--output", str(out), "-q"]
    proc = subprocess.Popen(
        [*argv, "--max-shard-size", "300KB", "--device", "cpu"], env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not (log.exists() and "unit:3" in log.read_text().split()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    for _ in range(3):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    command = f"porter convert {tiny_vendor} --output {out} --max-shard-size 300KB --device cpu --resume"
    assert lines[0].startswith(f"porter: interrupted: {out}: interrupted conversion (") and lines[0].endswith(
        f"shards done): resume with {command}"
    ), lines[0]
    assert not (out / INDEX).exists() and not (out / ".porter.lock").exists()
    res = convert_cli(tiny_vendor, out, *command.split()[5:])
    assert res.exit_code == 0 and (out / INDEX).exists(), res.output


# ---------------------------------------------------------------------------------------------------
# hub: one line per failure, and porter never defeats huggingface_hub's resume of partial downloads


def _http_response(status: int):
    import importlib

    from huggingface_hub.errors import HfHubHTTPError

    http = importlib.import_module(HfHubHTTPError.__mro__[1].__module__.split(".")[0])  # httpx (or its fork)
    return http.Response(status, request=http.Request("GET", "https://huggingface.co/api/models/o/r"))


def _hub_errors():
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    return {
        "gated": (lambda: GatedRepoError("403 gated\nmore", response=_http_response(403)), "gated repo"),
        "not found": (
            lambda: RepositoryNotFoundError("404 nope\nmore", response=_http_response(404)),
            "no such repo",
        ),
        "revision": (
            lambda: RevisionNotFoundError("404 rev\nmore", response=_http_response(404)),
            "revision",
        ),
        "401": (
            lambda: HfHubHTTPError("401 Unauthorized\nInvalid credentials", response=_http_response(401)),
            "HTTP 401",
        ),
        "500": (lambda: HfHubHTTPError("500 Server Error\nboom", response=_http_response(500)), "HTTP 500"),
        "network": (lambda: ConnectionResetError("connection reset by peer"), "finished files stay"),
    }


@pytest.mark.parametrize("kind", ["gated", "not found", "revision", "401", "500", "network"])
def test_hub_errors_are_one_line(tmp_path, monkeypatch, kind):
    import huggingface_hub

    make, words = _hub_errors()[kind]
    calls = []

    def fake_snapshot(repo_id, **kw):
        calls.append(kw)
        raise make()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    res = convert_cli("MiniMaxAI/Some-Repo", tmp_path / "o", "--revision", "v1")
    assert_bad_input(res, tmp_path / "o", "MiniMaxAI/Some-Repo", words)
    assert calls and not any(kw.get("force_download") for kw in calls)


def test_hub_interrupted_download_is_left_to_resume(tmp_path, monkeypatch):
    """An interrupted download leaves huggingface_hub's .incomplete blob; porter neither deletes it nor asks
    for force_download, so the next run resumes it."""
    import huggingface_hub
    import huggingface_hub.constants as c

    cache = tmp_path / "hub"
    blob = cache / "models--MiniMaxAI--Big" / "blobs" / ("ab" * 32 + ".incomplete")
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"\0" * 4096)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    seen = []

    def interrupted(repo_id, **kw):
        seen.append(kw)
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", interrupted)
    res = convert_cli("MiniMaxAI/Big", tmp_path / "o")
    assert_bad_input(res, tmp_path / "o", "retry")
    assert blob.exists() and blob.stat().st_size == 4096
    assert all("force_download" not in kw for kw in seen)


# ---------------------------------------------------------------------------------------------------
# property tests: fuzzed headers and index JSON never give a traceback or a complete-looking output

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _check_outcome(res, out: Path):
    assert res.exit_code in (0, 2), res.output  # never an internal error (3) or a crash
    assert "Traceback" not in res.output
    if res.exit_code == 2:
        assert len(res.output.strip().splitlines()) == 1, res.output
        assert not (out / INDEX).exists()
    else:
        assert (out / INDEX).exists()


@FUZZ
@given(data=st.data())
def test_fuzzed_safetensors_header(tiny_vendor, data):
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(tiny_vendor, src)
        shard = first_shard(src)
        raw = bytearray(shard.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        how = data.draw(st.sampled_from(["flip", "splice", "length", "json"]))
        if how == "flip":  # overwrite a few header bytes
            for _ in range(data.draw(st.integers(1, 4))):
                raw[data.draw(st.integers(8, 8 + n - 1))] = data.draw(st.integers(0, 255))
        elif how == "splice":  # drop a run of header bytes
            a = data.draw(st.integers(8, 8 + n - 1))
            del raw[a : a + data.draw(st.integers(1, 40))]
        elif how == "length":  # a wrong header length
            raw[:8] = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
        else:  # a structurally edited header: wrong types and values in one entry
            header = json.loads(raw[8 : 8 + n])
            name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
            field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            header[name][field] = data.draw(
                st.one_of(
                    st.none(),
                    st.integers(-5, 10**12),
                    st.text(max_size=6),
                    st.lists(st.integers(-3, 10**9), max_size=4),
                    st.sampled_from(["BF16", "F32", "U8", "F8_E4M3", "I64"]),
                )
            )
            body = json.dumps(header).encode()
            raw = bytearray(len(body).to_bytes(8, "little") + body + raw[8 + n :])
        shard.write_bytes(bytes(raw))
        out = Path(tmp) / "out"
        _check_outcome(convert_cli(src, out, "--workers", 2), out)


@FUZZ
@given(
    value=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=12),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
        max_leaves=8,
    ),
    where=st.sampled_from(["whole", "weight_map", "one entry", "metadata"]),
)
def test_fuzzed_index_json(tiny_vendor, value, where):
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(tiny_vendor, src)
        index = json.loads((src / INDEX).read_text())
        if where == "whole":
            index = value
        elif where == "weight_map":
            index["weight_map"] = value
        elif where == "one entry":
            index["weight_map"][sorted(index["weight_map"])[0]] = value
        else:
            index["metadata"] = value
        (src / INDEX).write_text(json.dumps(index))
        out = Path(tmp) / "out"
        _check_outcome(convert_cli(src, out, "--workers", 2), out)


def test_resume_rewrites_a_torn_finished_shard(tiny_vendor, tmp_path):
    """A shard the journal lists as finished but whose bytes changed (a power loss before the final fsync,
    an edit) is re-hashed on --resume, found out and rewritten."""
    clean = tmp_path / "clean"
    assert run_convert(tiny_vendor, clean).returncode == 0
    out = tmp_path / "out"
    res = run_convert(tiny_vendor, out, env={"PORTER_FAULT": "kill=journal:3"})  # 2 shards journaled
    assert res.returncode == -9
    journal = json.loads((out / ".porter-journal.json").read_text())
    assert len(journal["shards"]) == 2
    torn = out / sorted(journal["shards"])[0]
    data = bytearray(torn.read_bytes())
    data[-1] ^= 0xFF
    torn.write_bytes(bytes(data))
    porter.convert(
        tiny_vendor, out, max_shard_size="300KB", progress=False, workers=2, device="cpu", resume=True
    )
    assert artifact_bytes(out) == artifact_bytes(clean)
