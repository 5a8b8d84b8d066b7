"""`porter convert`: a MiniMax-M3 checkpoint -> MXFP8 porter artifact, tensor at a time.

Order of work: resolve the source and its config, plan every output tensor (names, dtypes, shapes,
shards) from the safetensors headers alone, then produce one group at a time (a plain tensor, or one
layer's stacked experts), write it into the open shard and let it go. Shards are `.partial` until
complete; a journal lets `--resume` skip finished shards after a crash; `porter.json`, `config.json`
and finally `model.safetensors.index.json` are written only when every shard is done.
"""
from __future__ import annotations

import hashlib
import os
import json
import logging
import queue
import re
import threading
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch
from tqdm import tqdm

from converters import minimax_m3 as arch
from porter import manifest, mxfp8
from porter.safetensors_io import Entry, ShardWriter, dtype_name, file_sha256, nbytes
from porter.layout import OutTensor, scale_name
from porter.source import INDEX_NAME, Source, open_source
from porter.errors import PorterError
from porter.version import __version__

log = logging.getLogger("porter")

COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
              "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
              "preprocessor_config.json", "processor_config.json")
JOURNAL = ".porter-journal.json"


class ConvertError(PorterError):
    """Bad options or output folder for a conversion (the message says what to do)."""


def parse_size(text) -> int:
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(text).upper())
    if not m:
        raise ConvertError(f"--max-shard-size {text!r}: use a size like 5GB, 500MB or a byte count")
    unit = m.group(2) or "B"
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


@dataclass
class Plan:
    source: Source
    config: arch.TextConfig  # resolved from source.raw_config by the converter
    architecture_facts: dict  # the converter's records for porter.json (arch.manifest_facts)
    tensors: list  # OutTensor in write order
    shards: list  # [(file name, [Entry, ...])]
    options: dict
    shard_of: dict = field(default_factory=dict)  # entry name -> file name

    @property
    def output_bytes(self) -> int:
        return sum(e.nbytes for _, es in self.shards for e in es)

    def peak_bytes_estimate(self) -> int:
        """Largest group held at once: source values (fp32 working copy of one expert) plus the group's
        output tensors (one layer's quantized experts)."""
        peak = 0
        for t in self.tensors:
            out = sum(e.nbytes for e in entries_for(t))
            one = nbytes(torch.float32, t.shape[1:] if t.per_expert else t.shape) * 3
            peak = max(peak, out + one)
        return peak


def entries_for(t: OutTensor) -> list[Entry]:
    if not t.quantize:
        return [Entry(t.name, t.dtype, tuple(t.shape))]
    scale_shape = tuple(t.shape[:-1]) + (t.shape[-1] // mxfp8.BLOCK,)
    return [Entry(t.name, torch.float8_e4m3fn, tuple(t.shape)),
            Entry(scale_name(t.name), torch.uint8, scale_shape)]


def make_plan(source: Source, quantize="experts", gate_up="auto", scale_rounding="rceil",
              max_shard_size="5GB", layout="porter") -> Plan:
    if scale_rounding not in mxfp8.ROUNDING_MODES:
        raise ConvertError(f"--scale-rounding must be one of {mxfp8.ROUNDING_MODES}")
    config = arch.resolve_config(source.raw_config)
    if layout == "hf":
        arch.check_hf_source(source.raw_config, str(source.path / "config.json"))
    tensors = arch.plan_tensors(config, source.meta, quantize, gate_up, layout)
    cap = parse_size(max_shard_size)
    groups, current, size = [], [], 0
    for e in (e for t in tensors for e in entries_for(t)):
        if current and size + e.nbytes > cap:
            groups.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current:
        groups.append(current)
    n = len(groups)
    shards = [(f"model-{i:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups, 1)]
    options = {"quantize": quantize, "gate_up": gate_up, "scale_rounding": scale_rounding, "max_shard_size": cap,
               "layout": layout}
    plan = Plan(source, config, arch.manifest_facts(config), tensors, shards, options)
    plan.shard_of = {e.name: f for f, es in shards for e in es}
    return plan


def fingerprint(plan: Plan) -> str:
    """Identifies a conversion: porter version, options, source identity and the full output plan."""
    src = plan.source
    ident = {"porter": __version__, "options": plan.options, "commit": src.commit,
             "source_files": [(f.name, f.stat().st_size if f.exists() else None) for f in src.shard_files],
             "shards": [(f, [(e.name, str(e.dtype), e.shape) for e in es]) for f, es in plan.shards]}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------


def convert(source, output, *, revision: Optional[str] = None, quantize: Optional[str] = None, gate_up: str = "auto",
            scale_rounding: str = "rceil", max_shard_size="5GB", force: bool = False, resume: bool = False,
            dry_run: bool = False, progress: bool = True, layout: str = "porter") -> dict:
    """Convert; returns a summary dict. Mirrors `porter convert` (see `porter convert --help`).
    quantize=None: the layout's default scope (arch.DEFAULT_SCOPE)."""
    t0 = time.time()
    quantize = quantize or arch.DEFAULT_SCOPE.get(layout, "experts")
    src = open_source(source, revision, headers_only=dry_run)
    plan = make_plan(src, quantize, gate_up, scale_rounding, max_shard_size, layout)
    out = Path(output)
    if dry_run:
        return describe_plan(plan, out)
    done = _prepare_output(out, plan, force, resume)
    stats = _produce(plan, out, done, progress)
    _finish(plan, out, stats)
    secs = time.time() - t0
    summary = {"output": str(out), "shards": len(plan.shards), "tensors": len(stats),
               "quantized": sum(1 for t in plan.tensors if t.quantize), "output_bytes": plan.output_bytes,
               "source_bytes": src.total_bytes, "seconds": secs}
    log.info("converted %s -> %s: %d tensors (%d quantized) in %d shard(s), %.2f GB written, %.1f s",
             source, out, summary["tensors"], summary["quantized"], summary["shards"],
             plan.output_bytes / 1e9, secs)
    return summary


def describe_plan(plan: Plan, out: Path) -> dict:
    src = plan.source
    q = [t for t in plan.tensors if t.quantize]
    log.info("dry run: nothing will be written to %s", out)
    log.info("read %d file(s) from %s (%.3f GB)", len(src.shard_files), src.path, src.total_bytes / 1e9)
    for f in src.shard_files:
        log.info("  read  %s", f.name)
    log.info("quantize to MXFP8 (%s scales): %d tensor(s), e.g. %s", plan.options["scale_rounding"], len(q),
             ", ".join(t.name for t in q[:3]) or "none")
    carried = [t for t in plan.tensors if not t.quantize]
    log.info("carry unchanged: %d tensor(s)", len(carried))
    for f, es in plan.shards:
        log.info("  write %s  %.3f GB  %d tensors", f, sum(e.nbytes for e in es) / 1e9, len(es))
    log.info("expected peak memory: %.3f GB (largest group in flight)", plan.peak_bytes_estimate() / 1e9)
    return {"dry_run": True, "shards": [(f, sum(e.nbytes for e in es)) for f, es in plan.shards],
            "quantized": [t.name for t in q], "output_bytes": plan.output_bytes,
            "peak_bytes_estimate": plan.peak_bytes_estimate(), "reads": [str(f) for f in src.shard_files]}


def _prepare_output(out: Path, plan: Plan, force: bool, resume: bool) -> dict:
    """Returns the shards already complete (for --resume) as {file: journal record}."""
    fp = fingerprint(plan)
    journal = _read_journal(out)
    if out.exists() and any(out.iterdir()):
        if resume and journal.get("fingerprint") == fp:
            return _verified_done(out, journal)
        if resume:
            raise ConvertError(f"{out}: --resume, but what is there comes from a different source or options; "
                               "use --force to start over")
        if not force:
            hint = (f" (an interrupted conversion of this source is there: {len(journal.get('shards', {}))} of "
                    f"{len(plan.shards)} shards done; add --resume)" if journal.get("fingerprint") == fp else "")
            raise ConvertError(f"{out}: output folder is not empty{hint}; use --force to overwrite")
        _clear_output(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_journal(out, {"fingerprint": fp, "shards": {}})
    return {}


def _clear_output(out: Path) -> None:
    """--force: remove what a previous conversion left (only porter's own file kinds)."""
    for p in out.iterdir():
        if p.is_file() and (p.name.startswith("model-") or p.name in (INDEX_NAME, "porter.json", "config.json",
                                                                       JOURNAL) or p.name in COPY_FILES):
            p.unlink()


def _read_journal(out: Path) -> dict:
    try:
        return json.loads((out / JOURNAL).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_journal(out: Path, journal: dict) -> None:
    tmp = out / (JOURNAL + ".tmp")
    tmp.write_text(json.dumps(journal))
    tmp.replace(out / JOURNAL)


def _verified_done(out: Path, journal: dict) -> dict:
    done = {}
    for f, rec in journal.get("shards", {}).items():
        path = out / f
        if path.exists() and file_sha256(path) == rec["sha256"]:
            done[f] = rec
        else:
            log.warning("resume: %s is missing or changed; it will be rewritten", f)
    log.info("resume: %d shard(s) already complete and verified", len(done))
    return done


class _WriterThread:
    """Writes shards in a background thread so hashing and disk I/O overlap with quantization.

    Items arrive in plan order through a small bounded queue (memory stays bounded); the thread owns
    the ShardWriters, the per-tensor sha256, shard closing and the journal."""

    def __init__(self, plan: Plan, out: Path, done: dict, stats: dict):
        self.plan, self.out, self.done, self.stats = plan, out, done, stats
        self.entries_of = dict(plan.shards)
        self.pending = {f: len(es) for f, es in plan.shards}
        self.journal = _read_journal(out)
        self.writers: dict = {}
        self.error: Optional[BaseException] = None
        self.queue: queue.Queue = queue.Queue(maxsize=3)
        self.thread = threading.Thread(target=self._loop, name="porter-writer", daemon=True)
        self.thread.start()

    def put(self, name: str, tensor: Optional[torch.Tensor], record: Optional[dict] = None) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put((name, tensor, record))

    def _loop(self) -> None:
        try:
            while (item := self.queue.get()) is not None:
                self._write(*item)
        except BaseException as e:  # surfaced in the main thread by put()/finish()
            self.error = e
            while self.queue.get() is not None:  # drain so the producer never blocks
                pass

    def _write(self, name, tensor, record) -> None:
        f = self.plan.shard_of[name]
        if record is not None:
            self.stats.setdefault(name, {}).update(record)
        if tensor is None or f in self.done:
            return
        if f not in self.writers:
            self.writers[f] = ShardWriter(self.out / f, self.entries_of[f], metadata={"format": "pt"})
        e = self.writers[f].write(name, tensor)
        if e is None:  # a leading chunk; the tensor is not complete yet
            return
        self.stats.setdefault(name, {}).update(
            shard=f, dtype=dtype_name(e.dtype), shape=list(e.shape), sha256=self.writers[f].tensor_sha256[name])
        self.pending[f] -= 1
        if self.pending[f] == 0:
            sha = self.writers.pop(f).close()
            self.journal["shards"][f] = {"sha256": sha, "tensors": {x.name: self.stats[x.name]
                                                                   for x in self.entries_of[f]}}
            _write_journal(self.out, self.journal)

    def finish(self, ok: bool) -> None:
        self.queue.put(None)
        self.thread.join()
        if not ok or self.error is not None:
            for w in self.writers.values():
                w.abort()
        if ok and self.error is not None:
            raise self.error


def _produce(plan: Plan, out: Path, done: dict, progress: bool) -> dict:
    """Make and write every tensor; returns per-tensor manifest records."""
    stats = {n: r for rec in done.values() for n, r in rec["tensors"].items()}
    src_bytes = lambda t: sum(plan.source.nbytes(s) for s in dict.fromkeys(t.sources))
    bar = tqdm(total=sum(src_bytes(t) for t in plan.tensors), unit="B", unit_scale=True, desc="convert",
               disable=not progress)
    _reuse_freed_memory()
    writer = _WriterThread(plan, out, done, stats)
    ok = False
    try:
        for t in plan.tensors:
            shown = 0  # source bytes already shown for t (experts advance the bar part by part)
            if not all(plan.shard_of[e.name] in done for e in entries_for(t)):
                for name, chunk, record in produce(t, plan.source.read, plan.options["scale_rounding"]):
                    writer.put(name, chunk, record)
                    if t.per_expert and name == t.name and chunk is not None:
                        step = chunk.numel() * t.dtype.itemsize
                        bar.update(step)
                        shown += step
                plan.source.close()  # unmap source shards: RSS must not grow with the model
            bar.update(max(0, src_bytes(t) - shown))
        ok = True
    finally:
        writer.finish(ok)
        bar.close()
    return stats


def _reuse_freed_memory() -> None:
    """glibc hands every multi-MB temporary its own mmap and unmaps it on free, so each quantized part
    page-faults its memory in again (measured: a third of the conversion's CPU time was kernel time).
    Raising the mmap/trim thresholds keeps freed blocks in the heap for reuse; the working set (one
    expert's temporaries) is what stays resident. No-op where glibc's mallopt is unavailable."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: serve allocations below 1 GiB from the heap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of freed heap for reuse
    except (OSError, AttributeError):
        pass


def produce(t: OutTensor, read, rounding: str) -> Iterator[tuple]:
    """Yields (output tensor name, tensor or leading chunk of it, error record or None) in write order."""
    if t.per_expert:
        yield from _produce_experts(t, read, rounding)
        return
    value = t.build(read)
    if not t.quantize:
        yield t.name, value.contiguous(), None
        return
    q, s, err = mxfp8.quantize_with_error(value, rounding, name=_src_label(t))
    yield t.name, q, _error_record(t, value.dtype, err)
    yield scale_name(t.name), s, None


def _error_record(t, src_dtype, err) -> dict:
    rel = (err["err_sq"] / err["ref_sq"]) ** 0.5 if err["ref_sq"] else 0.0
    return {"source_dtype": dtype_name(src_dtype), "scale": scale_name(t.name),
            "rel_fro_error": rel, "max_abs_error": err["max_abs_error"]}


def _src_label(t) -> str:
    return t.sources[0] if len(t.sources) == 1 else f"{t.name} (from {t.sources[0]}, ...)"


def _expert_label(t, e, read) -> str:
    """Names the source tensor(s) of expert e, the non-finite one first when there is one."""
    n = len(t.sources) // t.shape[0] if len(t.sources) % t.shape[0] == 0 else 0
    srcs = t.sources[e * n:(e + 1) * n] if n else t.sources
    bad = [s for s in srcs if n and not bool(torch.isfinite(read(s)).all())]
    return f"{bad[0] if bad else ', '.join(srcs)} (expert {e} of {t.name})"


def _produce_experts(t, read, rounding):
    """One layer's experts, one expert row part at a time. Values stream out expert by expert ([E, N, K]
    in order); the small scales [E, N, K/32] follow once all experts are done. Quantization is per row, so
    quantizing w1 and w3 separately equals quantizing [w1; w3]. Parts are quantized by a small thread pool
    (torch releases the GIL) while this thread reads the next ones; results are yielded in order."""
    e_count = t.shape[0]
    if not t.quantize:
        for e in range(e_count):
            yield t.name, t.build_expert(read, e), None
        return
    s = torch.empty(tuple(t.shape[:-1]) + (t.shape[-1] // mxfp8.BLOCK,), dtype=torch.uint8)  # [E, N, K/32]
    total = {"err_sq": 0.0, "ref_sq": 0.0, "max_abs_error": 0.0}
    in_flight: deque = deque()

    def collect():
        e, row, fut = in_flight.popleft()
        try:
            q, scale, err = fut.result()
        except mxfp8.MXFP8Error as exc:  # name the offending source tensor, not the stacked output
            raise mxfp8.MXFP8Error(str(exc).replace(t.name, _expert_label(t, e, read), 1)) from None
        s[e, row:row + q.shape[0]] = scale
        total["err_sq"] += err["err_sq"]
        total["ref_sq"] += err["ref_sq"]
        total["max_abs_error"] = max(total["max_abs_error"], err["max_abs_error"])
        return q

    with _quantize_pool() as pool:
        for e in range(e_count):
            row = 0
            for part in t.expert_rows(read, e):  # [rows, K]
                in_flight.append((e, row, pool.submit(mxfp8.quantize_with_error, part, rounding, t.name)))
                row += part.shape[0]
                while len(in_flight) > QUANTIZE_WORKERS:
                    yield t.name, collect(), None
            if row != t.shape[1]:
                raise arch.LayoutError(f"{t.name}: expert {e} has {row} rows, expected {t.shape[1]}")
        while in_flight:
            yield t.name, collect(), None
    yield t.name, None, _error_record(t, t.dtype, total)
    yield scale_name(t.name), s, None


# one more worker than cores: the main thread (reads) and the writer thread (hash, disk) leave gaps
QUANTIZE_WORKERS = max(1, min(8, (os.cpu_count() or 1) + 1))


@contextmanager
def _quantize_pool():
    """Worker threads for quantization, each running single-threaded torch ops (no oversubscription)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(QUANTIZE_WORKERS, thread_name_prefix="porter-quantize")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(threads)


def _finish(plan: Plan, out: Path, stats: dict) -> None:
    src = plan.source
    for name in COPY_FILES:
        if (src.path / name).exists():
            shutil.copyfile(src.path / name, out / name)
    if plan.options["layout"] == "hf":  # vendor config, top-level quantization_config the engines read
        cfg = arch.hf_config_json(src.raw_config, arch.hf_quantization_config(
            plan.tensors, plan.options["quantize"], plan.options["scale_rounding"]))
    else:
        cfg = dict(src.raw_config)
        cfg["quantization_config"] = manifest.quantization_config(plan)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    shard_sha = {f: rec["sha256"] for f, rec in _read_journal(out)["shards"].items()}
    manifest.write(out, plan, stats, shard_sha)
    weight_map = {name: rec["shard"] for name, rec in stats.items()}
    index = {"metadata": {"total_size": plan.output_bytes, "format": "porter"}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2))  # last: its presence means complete
    (out / JOURNAL).unlink(missing_ok=True)
