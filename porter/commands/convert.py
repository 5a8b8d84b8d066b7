"""`porter convert`: a MiniMax-M3 checkpoint -> MXFP8 porter artifact, tensor at a time.

Order of work: resolve the source and its config, plan every output tensor (names, dtypes, shapes,
shards) from the safetensors headers alone, then run the plan through porter.engine: every core (or
the GPU) reads, quantizes, hashes and writes units of work (one expert, one tensor, one byte range) in a
memory budget, straight into the shards' known byte ranges. Shards are `.partial` until complete; a
journal lets `--resume` skip finished shards after a crash; `config.json`, `porter.json` and finally
`model.safetensors.index.json` are written (each atomically) only when every shard is done.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

import converters
from converters.base import ResolvedConfig
from porter import engine
from porter.cores import available_cores
from porter.engine import fault_point, output_guard
from porter.errors import ConvertError, MalformedSafetensors, PorterError
from porter.format import manifest, model_card, mxfp8
from porter.format.digest import CHUNK_HASHES, DEFAULT_DIGEST
from porter.format.layout import OutTensor, scale_name
from porter.format.safe_files import present, read_json_object
from porter.format.safetensors_io import (
    DTYPE_NAMES,
    SHARD_METADATA,
    Entry,
    atomic_write_text,
    digest_rule,
    file_digests,
    header_bytes,
    source_sample_digest,
)
from porter.source import INDEX_NAME, Source, open_source
from porter.version import __version__

log = logging.getLogger("porter")

COPY_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
    "processor_config.json",
)
JOURNAL = ".porter-journal.json"


def parse_size(text, option: str = "--max-shard-size") -> int:
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(text).upper())
    if not m or float(m.group(1)) <= 0:
        raise ConvertError(f"{option} {text!r}: use a size like 5GB, 500MB or a byte count")
    unit = m.group(2) or "B"
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    size = int(float(m.group(1)) * scale)
    if size < 1:
        raise ConvertError(
            f"{option} {text!r} is less than one byte: use a size like 5GB, 500MB or a byte count"
        )
    return size


@dataclass
class Plan:
    source: Source
    config: ResolvedConfig  # resolved from source.raw_config by the converter
    architecture_facts: dict  # the converter's records for porter.json (its manifest_facts)
    tensors: list  # OutTensor in write order
    shards: list  # [(file name, [Entry, ...])]
    options: dict
    shard_of: dict = field(default_factory=dict)  # entry name -> file name
    digest: str = DEFAULT_DIGEST  # the chunk hash of the digest rule (porter.format.digest.CHUNK_HASHES)
    _source_digests: Optional[dict] = None

    @property
    def source_digests(self) -> dict:
        """{file name: sample digest} of every source shard and config.json (computed once)."""
        if self._source_digests is None:
            src = self.source
            files = [*src.shard_files, src.path / "config.json"]
            self._source_digests = {f.name: source_sample_digest(f) if f.is_file() else None for f in files}
        return self._source_digests

    @property
    def output_bytes(self) -> int:
        return sum(e.nbytes for _, es in self.shards for e in es)


def entries_for(t: OutTensor) -> list[Entry]:
    if not t.quantize:
        return [Entry(t.name, t.dtype, tuple(t.shape))]
    scale_shape = tuple(t.shape[:-1]) + (t.shape[-1] // mxfp8.BLOCK,)
    return [
        Entry(t.name, torch.float8_e4m3fn, tuple(t.shape)),
        Entry(scale_name(t.name), torch.uint8, scale_shape),
    ]


def make_plan(
    source: Source,
    quantize="experts",
    gate_up="auto",
    scale_rounding="rceil",
    max_shard_size="5GB",
    layout="porter",
    digest=DEFAULT_DIGEST,
) -> Plan:
    if scale_rounding not in mxfp8.ROUNDING_MODES:
        raise ConvertError(f"--scale-rounding must be one of {mxfp8.ROUNDING_MODES}")
    if digest not in CHUNK_HASHES:
        raise ConvertError(f"--digest {digest!r}: give one of {', '.join(CHUNK_HASHES)}")
    converter = converters.for_config(source.raw_config, str(source.path / "config.json"))
    config = converter.resolve_config(source.raw_config)
    if layout == "hf":
        converter.check_hf_source(source.raw_config, str(source.path / "config.json"))
    tensors = converter.plan_tensors(config, source.meta, quantize, gate_up, layout)
    for t in tensors:  # e.g. F8_E8M0 scale bytes in a source whose config declares no quantization
        if not t.quantize and t.dtype not in DTYPE_NAMES:
            name = t.sources[0] if t.sources else t.name
            raise ConvertError(
                f"{source.files.get(name) or source.path}: tensor {name!r} is {t.dtype}, "
                "which porter does not write; is config.json's quantization_config missing?"
            )
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
    options = {
        "quantize": quantize,
        "gate_up": gate_up,
        "scale_rounding": scale_rounding,
        "max_shard_size": cap,
        "layout": layout,
    }
    if source.prequantized is not None:  # how its values were read and re-quantized: verify's rule too
        options["source_quantization"] = source.prequantized.record()
    plan = Plan(source, config, converter.manifest_facts(config), tensors, shards, options, digest=digest)
    plan.shard_of = {e.name: f for f, es in shards for e in es}
    return plan


def fingerprint(plan: Plan) -> str:
    """Identifies a conversion: porter version, options, the source's bytes (every shard's header and sampled
    data, config.json: Plan.source_digests) and the full output plan."""
    src = plan.source
    ident = {
        "porter": __version__,
        "format_version": manifest.FORMAT_VERSION,
        "digest": digest_rule(plan.digest),
        "options": plan.options,
        "commit": src.commit,
        "source_files": plan.source_digests,
        "shards": [(f, [(e.name, str(e.dtype), e.shape) for e in es]) for f, es in plan.shards],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------


def convert(
    source,
    output,
    *,
    revision: Optional[str] = None,
    quantize: Optional[str] = None,
    gate_up: str = "auto",
    scale_rounding: str = "rceil",
    max_shard_size="5GB",
    force: bool = False,
    resume: bool = False,
    dry_run: bool = False,
    progress: bool = True,
    layout: str = "porter",
    workers: Optional[int] = None,
    max_memory=None,
    device: str = "auto",
    digest: str = DEFAULT_DIGEST,
    token: Optional[str] = None,
    cache_dir=None,
) -> dict:
    """Convert; returns a summary dict. Mirrors `porter convert` (see `porter convert --help`).
    quantize=None: the layout's default scope (the converter's DEFAULT_SCOPE). workers=None: the available
    cores + 1; max_memory=None: half the available RAM; device: auto (the GPU when there is one), cpu or
    cuda; digest: the chunk hash of the shard digests, xxh3-128 or sha256 (docs/artifact-format.md).
    token / cache_dir: Hugging Face token and cache folder for a repo id (None: HF_TOKEN / HF_HOME)."""
    t0 = time.time()
    out = output_guard.check_output_option(output)  # "" would be the current directory
    engine.arm_faults()
    workers = _check_workers(workers)
    max_memory = engine.default_max_memory() if max_memory is None else parse_size(max_memory, "--max-memory")
    src = open_source(source, revision, headers_only=dry_run, token=token, cache_dir=cache_dir)
    for name in COPY_FILES:  # copied at the end: a directory or FIFO there is refused before any work
        present(src.path / name, ConvertError, "file to copy")
    converter = converters.for_config(src.raw_config, str(src.path / "config.json"))
    quantize = quantize or converter.DEFAULT_SCOPE.get(layout, "experts")
    plan = make_plan(src, quantize, gate_up, scale_rounding, max_shard_size, layout, digest)
    dev = engine.resolve_device(device)  # an unknown device, or cuda without a GPU: PorterError (exit 2)
    output_guard.check_apart_from_source(out, src.path)
    workers, estimate = _workers_within(plan, workers, dev, max_memory)
    if dry_run:
        return describe_plan(plan, out, estimate)
    # one writer per output folder; a full disk is a one-line error that leaves the output resumable
    with output_guard.OutputLock(out), output_guard.disk_full_is_bad_input(out):
        reusable = output_guard.porter_written(out, JOURNAL, COPY_FILES) if (force or resume) else ()
        output_guard.check_free_space(out, _planned_bytes(plan), reusable)
        done = _prepare_output(out, plan, force, resume, workers)
        if done is None:
            return {
                "output": str(out),
                "already_complete": True,
                "shards": len(plan.shards),
                "seconds": time.time() - t0,
            }
        stats = _produce(plan, out, done, progress, workers, max_memory, dev)
        fsync_secs = _finish(plan, out, stats)
    secs = time.time() - t0
    summary = {
        "output": str(out),
        "shards": len(plan.shards),
        "tensors": len(stats),
        "fsync_seconds": fsync_secs,
        "quantized": sum(1 for t in plan.tensors if t.quantize),
        "output_bytes": plan.output_bytes,
        "source_bytes": src.total_bytes,
        "seconds": secs,
        "workers": workers,
        "device": dev.type,
        "memory_estimate": estimate["total"],
    }
    log.info(
        "converted %s -> %s: %d tensors (%d quantized) in %d shard(s), %.2f GB written, %.1f s "
        "(%d workers, %s)",
        source,
        out,
        summary["tensors"],
        summary["quantized"],
        summary["shards"],
        plan.output_bytes / 1e9,
        secs,
        workers,
        dev.type,
    )
    return summary


def _check_workers(workers) -> int:
    if workers is None:
        return engine.default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConvertError(f"--workers {workers!r}: give a positive number of worker threads")
    return workers


def _workers_within(plan: Plan, workers: int, dev, max_memory: int) -> tuple[int, dict]:
    """The most workers, up to `workers`, whose own buffers (read slabs, hash read-back) fit --max-memory
    beside this process, one unit in flight and the scale arrays, and their memory estimate. Fewer workers
    than asked is logged; not even one fitting is a ConvertError."""

    def estimate(w: int) -> dict:
        return engine.memory_estimate(plan.tensors, plan.source.stored_meta, w, dev, max_memory)

    def need(e: dict) -> int:
        return e["base"] + e["readback"] + e["unit"] + e["scales"]

    best = estimate(workers)
    if need(best) <= max_memory:
        return workers, best
    lo, hi = 0, workers  # need(estimate(w)) grows with w: find the largest w that fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(estimate(mid)) <= max_memory else (lo, mid)
    if lo == 0:
        one = estimate(1)
        raise ConvertError(
            f"--max-memory {max_memory / 1e9:.2f} GB is below what one unit of work needs "
            f"({need(one) / 1e9:.2f} GB: this process, one worker's buffers, one expert in flight and "
            "the scale arrays); raise --max-memory"
        )
    log.warning(
        "--max-memory %.2f GB holds the buffers of %d of %d workers; converting with %d",
        max_memory / 1e9,
        lo,
        workers,
        lo,
    )
    return lo, estimate(lo)


def describe_plan(plan: Plan, out: Path, estimate: dict) -> dict:
    src = plan.source
    q = [t for t in plan.tensors if t.quantize]
    log.info("dry run: nothing will be written to %s", out)
    log.info("read %d file(s) from %s (%.3f GB)", len(src.shard_files), src.path, src.total_bytes / 1e9)
    for f in src.shard_files:
        log.info("  read  %s", f.name)
    log.info(
        "quantize to MXFP8 (%s scales): %d tensor(s), e.g. %s",
        plan.options["scale_rounding"],
        len(q),
        ", ".join(t.name for t in q[:3]) or "none",
    )
    carried = [t for t in plan.tensors if not t.quantize]
    log.info("carry unchanged: %d tensor(s)", len(carried))
    for f, es in plan.shards:
        log.info("  write %s  %.3f GB  %d tensors", f, sum(e.nbytes for e in es) / 1e9, len(es))
    log.info(
        "expected peak memory: %.2f GB = %.2f this process + %.2f in flight (%d workers, units of up to "
        "%.3f GB, capped by --max-memory %.2f GB) + %.3f scale arrays + %.3f hash read-back buffers + %.3f margin",
        estimate["total"] / 1e9,
        estimate["base"] / 1e9,
        estimate["inflight"] / 1e9,
        estimate["workers"],
        estimate["unit"] / 1e9,
        estimate["max_memory"] / 1e9,
        estimate["scales"] / 1e9,
        estimate["readback"] / 1e9,
        estimate["margin"] / 1e9,
    )
    return {
        "dry_run": True,
        "shards": [(f, sum(e.nbytes for e in es)) for f, es in plan.shards],
        "quantized": [t.name for t in q],
        "output_bytes": plan.output_bytes,
        "peak_bytes_estimate": estimate["total"],
        "memory_estimate": estimate,
        "reads": [str(f) for f in src.shard_files],
    }


def _prepare_output(out: Path, plan: Plan, force: bool, resume: bool, workers: int = 1) -> Optional[dict]:
    """Returns the shards already complete (for --resume) as {file: journal record}; None when --resume
    finds this very conversion already complete (nothing to do)."""
    fp = fingerprint(plan)
    journal = _read_journal(out)
    if output_guard.has_content(out):
        if resume and _complete_fingerprint(out) == fp:
            done = _intact_finished_shards(out, plan, workers)
            if len(done) == len(plan.shards):
                (out / JOURNAL).unlink(missing_ok=True)  # a crash after the index, before this cleanup
                log.info(
                    "resume: %s is already complete (same source, options and porter version; every "
                    "shard matches porter.json's digest); nothing to do",
                    out,
                )
                return None
            # journal first, then drop the index: the output reads as interrupted, never as complete
            _write_journal(out, {**_new_journal(plan, fp), "shards": done})
            (out / INDEX_NAME).unlink()
            return done
        if resume and journal.get("fingerprint") == fp:
            return _verified_done(out, journal, workers, plan.digest)
        if (
            resume
            and not journal
            and all(
                p.is_file() and p.name == JOURNAL + ".tmp"
                for p in out.iterdir()
                if p.name != output_guard.LOCK_NAME
            )
        ):
            # killed before the first journal write: nothing finished, start over in place
            log.info("resume: %s holds no finished shard yet; starting from the beginning", out)
            (out / (JOURNAL + ".tmp")).unlink(missing_ok=True)
            out.mkdir(parents=True, exist_ok=True)
            _write_journal(out, _new_journal(plan, fp))
            return {}
        if resume:
            raise ConvertError(_resume_mismatch(out, plan, journal))
        if not force:
            hint = (
                f" (an interrupted conversion of this source is there: {len(journal.get('shards', {}))} of "
                f"{len(plan.shards)} shards done; add --resume)"
                if journal.get("fingerprint") == fp
                else ""
            )
            foreign = output_guard.foreign_files(out, JOURNAL, _carried_names(out))
            if foreign:  # --force would refuse too: say so now
                raise ConvertError(
                    f"{out}: output folder is not empty ({out / foreign[0]} was not written "
                    "by porter); choose an empty or new --output folder"
                )
            raise ConvertError(f"{out}: output folder is not empty{hint}; use --force to overwrite")
        output_guard.clear_for_force(
            out, JOURNAL, _carried_names(out)
        )  # only what porter wrote, else refused
    out.mkdir(parents=True, exist_ok=True)
    _write_journal(out, _new_journal(plan, fp))
    return {}


def _new_journal(plan: Plan, fp: str) -> dict:
    """A journal with no finished shard; `source` keeps the per-file digests so a refusal can name a file."""
    src = plan.source
    return {
        "fingerprint": fp,
        "source": plan.source_digests,
        "source_path": src.repo_id or str(src.path),
        "shards": {},
        "files": _planned_files(plan),
    }


def _resume_mismatch(out: Path, plan: Plan, journal: dict) -> str:
    """Why --resume refuses: the first source file whose digest differs from the one the output recorded
    (journal, or a complete artifact's index), else other options or porter version."""
    recorded = journal.get("source")
    if not isinstance(recorded, dict):
        try:
            recorded = json.loads((out / INDEX_NAME).read_text())["metadata"]["porter_source"]
        except (OSError, ValueError, KeyError, TypeError):
            recorded = None
    if isinstance(recorded, dict):
        now = plan.source_digests
        for name in sorted(set(recorded) | set(now)):
            if recorded.get(name) != now.get(name):
                what = (
                    "is new"
                    if name not in recorded
                    else "is gone"
                    if now.get(name) is None
                    else "changed (its header or sampled bytes differ)"
                )
                return (
                    f"{plan.source.path / name}: --resume into {out}, but this source file {what} since "
                    "that output was started; use --force to start over"
                )
    what = "options or porter version" if isinstance(recorded, dict) else "source, options or porter version"
    return f"{out}: --resume, but what is there was made with different {what}; use --force to start over"


def _intact_finished_shards(out: Path, plan: Plan, workers: int) -> dict:
    """A complete artifact's shards whose size and digest still match porter.json, as journal records
    ({file: {"header_sha256", "digest", "tensors"}}); each missing or altered shard is logged by name."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        man = manifest.read(out)
        recorded, tensors = man["shards"], man["tensors"]
    except (PorterError, KeyError, TypeError):
        recorded, tensors = {}, {}
    done = {}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for f, _ in plan.shards:
            rec, path = recorded.get(f) if isinstance(recorded, dict) else None, out / f
            why = (
                "missing"
                if not path.is_file()
                else "not in porter.json"
                if not isinstance(rec, dict)
                else None
            )
            if why is None and path.stat().st_size != rec.get("bytes"):
                why = f"{path.stat().st_size} bytes, porter.json says {rec.get('bytes')}"
            if why is None:
                try:
                    ok = file_digests(path, pool, chunk_hash=plan.digest).digest == rec.get("digest")
                except (OSError, MalformedSafetensors):
                    ok = False
                why = None if ok else "its digest differs from porter.json's"
            if why:
                log.warning(
                    "resume: %s is %s; it will be rewritten",
                    path,
                    why if why == "missing" else f"altered ({why})",
                )
                continue
            done[f] = {
                "header_sha256": rec["header_sha256"],
                "digest": rec["digest"],
                "tensors": {n: r for n, r in tensors.items() if isinstance(r, dict) and r.get("shard") == f},
            }
    return done


def _planned_files(plan: Plan) -> list:
    """Every file this conversion may write (the journal keeps the list: what --force may remove later)."""
    copied = [n for n in COPY_FILES if (plan.source.path / n).exists()]
    card = [model_card.CARD] + [p.name for p in model_card.license_files(plan.source.path)]
    return [f for f, _ in plan.shards] + copied + card + ["config.json", manifest.MANIFEST, INDEX_NAME]


def _carried_names(out: Path) -> tuple:
    """Names a complete porter output may hold beside its shards: the copied files, model card and licenses."""
    return (*COPY_FILES, *(p.name for p in out.iterdir() if model_card.is_card_file(p.name)))


def _planned_bytes(plan: Plan) -> int:
    """Disk space the output needs: every shard with its header, the copied files, and room for the JSON
    files (porter.json holds a record of ~300 bytes per tensor)."""
    shards = sum(len(header_bytes(es, SHARD_METADATA)) + sum(e.nbytes for e in es) for _, es in plan.shards)
    copied = sum(
        (plan.source.path / n).stat().st_size for n in COPY_FILES if (plan.source.path / n).is_file()
    )
    return shards + copied + (1 << 20) + 1024 * len(plan.tensors)


def _complete_fingerprint(out: Path) -> Optional[str]:
    """The fingerprint recorded in a complete artifact's index (written last); its shards are checked
    apart (_intact_finished_shards)."""
    try:
        return read_json_object(out / INDEX_NAME, ConvertError, "index")["metadata"]["porter_fingerprint"]
    except (PorterError, KeyError, TypeError):  # unreadable, not a regular file, not an artifact's index
        return None


def _read_journal(out: Path) -> dict:
    try:
        return read_json_object(out / JOURNAL, ConvertError, "journal")
    except PorterError:  # unreadable, not a regular file or not an object: as if absent
        return {}


def _write_journal(out: Path, journal: dict) -> None:
    atomic_write_text(out / JOURNAL, json.dumps(journal), before_rename=lambda: fault_point("journal-tmp"))
    fault_point("journal")


def _verified_done(out: Path, journal: dict, workers: int, chunk_hash: str) -> dict:
    """The journaled shards whose bytes still hash to the digest the journal says (chunks re-hashed on every
    worker: a shard torn by a power loss, or edited, is rewritten)."""
    from concurrent.futures import ThreadPoolExecutor

    shards, done = journal.get("shards", {}), {}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for f, rec in shards.items():
            try:
                intact = file_digests(out / f, pool, chunk_hash=chunk_hash).digest == rec.get("digest")
            except (OSError, MalformedSafetensors):
                intact = False
            if intact:
                done[f] = rec
            else:
                log.warning("resume: %s is missing or changed; it will be rewritten", f)
    log.info("resume: %d shard(s) already complete and verified", len(done))
    return done


def _produce(plan: Plan, out: Path, done: dict, progress: bool, workers: int, max_memory: int, dev) -> dict:
    """Make, hash and write every tensor (porter.engine); returns per-tensor manifest records."""
    stats = {n: r for rec in done.values() for n, r in rec["tensors"].items()}
    journal = _read_journal(out)

    def shard_done(f: str, record: dict) -> None:  # called one at a time (the pipeline's journal lock)
        journal["shards"][f] = record
        _write_journal(out, journal)

    skip = lambda t: all(plan.shard_of[e.name] in done for e in entries_for(t))  # noqa: E731
    units = engine.make_units(plan.tensors, plan.source.stored_meta, skip, dev, workers)
    bar = tqdm(
        total=sum(u.src_bytes for u in units), unit="B", unit_scale=True, desc="convert", disable=not progress
    )
    _reuse_freed_memory()
    pipeline = engine.Pipeline(
        plan,
        out,
        done,
        stats,
        workers=workers,
        max_memory=max_memory,
        device=dev,
        on_shard_done=shard_done,
        progress=bar,
    )
    try:
        pipeline.run(units)
    finally:
        bar.close()
    return stats


def _reuse_freed_memory() -> None:
    """glibc hands every multi-MB temporary its own mmap and unmaps it on free, so each quantized part
    page-faults its memory in again, spending the conversion's CPU time in the kernel.
    Raising the mmap/trim thresholds keeps freed blocks in the heap for reuse; the working set (one
    expert's temporaries per worker) is what stays resident. No-op where glibc's mallopt is unavailable."""
    import ctypes

    mallopt = engine.libc_function("mallopt", ctypes.c_int, ctypes.c_int)
    if mallopt is None:
        return
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: chunk temporaries (< 32 MiB) from the heap; whole
    # expert reads (38 MB and up) mapped and unmapped, so they cannot fragment the heap
    mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD: keep up to 128 MiB of freed heap per arena for reuse
    mallopt(-8, 2)  # M_ARENA_MAX: workers share 2 arenas (one arena each would keep its own freed memory,
    # GBs of RSS with many workers)


def _finish(plan: Plan, out: Path, stats: dict) -> float:
    """Copies the tokenizer files, the model card (with porter's section) and license, syncs the shards,
    writes config.json, porter.json and the index (last).
    Returns the seconds the shards' fsync took (what durability adds once the last byte is written)."""
    src = plan.source
    for name in COPY_FILES:
        if (src.path / name).exists():
            shutil.copyfile(src.path / name, out / name)
    model_card.write(src.path, out, plan.options, src.repo_id, src.commit)
    if plan.options["layout"] == "hf":  # vendor config, top-level quantization_config the engines read
        converter = converters.for_config(src.raw_config)
        cfg = converter.hf_config_json(
            src.raw_config,
            converter.hf_quantization_config(
                plan.tensors, plan.options["quantize"], plan.options["scale_rounding"]
            ),
        )
    else:
        cfg = dict(src.raw_config)
        cfg["quantization_config"] = manifest.quantization_config(plan)
    secs = engine.sync_files([out / f for f, _ in plan.shards], available_cores())
    log.debug("fsync of %d shard(s): %.2f s", len(plan.shards), secs)
    _write_final(out / "config.json", json.dumps(cfg, indent=2))
    shard_digests = {
        f: {k: rec[k] for k in ("header_sha256", "digest")} for f, rec in _read_journal(out)["shards"].items()
    }
    manifest.write(
        out, plan, stats, shard_digests, before_rename=lambda: fault_point(f"tmp:{manifest.MANIFEST}")
    )
    fault_point(f"wrote:{manifest.MANIFEST}")
    weight_map = {e.name: stats[e.name]["shard"] for _, es in plan.shards for e in es}
    index = {
        "metadata": {
            "total_size": plan.output_bytes,
            "format": "porter",
            "porter_fingerprint": fingerprint(plan),
            "porter_source": plan.source_digests,
        },
        "weight_map": weight_map,
    }
    _write_final(out / INDEX_NAME, json.dumps(index, indent=2))  # last: its presence means complete
    (out / JOURNAL).unlink(missing_ok=True)
    return secs


def _write_final(path: Path, text: str) -> None:
    """config.json, porter.json and the index: temp file + rename, so none is ever half-written."""
    atomic_write_text(path, text, before_rename=lambda: fault_point(f"tmp:{path.name}"))
    fault_point(f"wrote:{path.name}")
