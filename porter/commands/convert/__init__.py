"""`porter convert`: a checkpoint -> MXFP8 porter artifact, tensor at a time.

Order of work: resolve the source and its config, plan every output tensor (names, dtypes, shapes,
shards) from the safetensors headers alone, then run the plan through porter.engine: every core (or
the GPU) reads, quantizes, hashes and writes units of work (one expert, one tensor, one byte range) in a
memory budget, straight into the shards' known byte ranges. Shards are `.partial` until complete; a
journal lets `--resume` skip finished shards after a crash; `config.json`, `porter.json` and finally
`model.safetensors.index.json` are written (each atomically) only when every shard is done.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

import converters
from porter import engine
from porter.commands.convert.options import ConvertOptions, parse_size
from porter.commands.convert.output import (
    Run,
    planned_bytes,
    prepare_output,
    read_journal,
    write_journal,
)
from porter.commands.convert.plan import COPY_FILES, Plan, entries_for, fingerprint, make_plan
from porter.cores import available_cores
from porter.devices import resolve_device
from porter.engine import fault_point, output_guard
from porter.errors import ConvertError
from porter.format import journal as porter_journal
from porter.format import manifest, model_card
from porter.format.journal import JOURNAL
from porter.format.safe_files import copy_into, present
from porter.format.safetensors_io import atomic_write_text
from porter.source import INDEX_NAME, open_source

log = logging.getLogger("porter")


def convert(source, output, options: Optional[ConvertOptions] = None, **given) -> dict:
    """Convert; returns a summary dict. Mirrors `porter convert` (see `porter convert --help`): `options` is
    a ConvertOptions, and any of its fields may be given as keywords instead (porter.convert(src, out,
    force=True)). quantize=None: the layout's default scope (the converter's DEFAULT_SCOPE); workers=None:
    the available cores + 1; max_memory=None: this process's memory + half the available RAM; device: auto
    (the GPU when there is one), cpu, cuda or cuda:N; digest: the chunk hash of the shard digests, xxh3-128 or sha256
    (docs/artifact-format.md). token / cache_dir: Hugging Face token and cache folder for a repo id
    (None: HF_TOKEN / HF_HUB_CACHE)."""
    t0 = time.time()
    opts = _options(options, given)
    out = output_guard.check_output_option(output)  # "" would be the current directory
    engine.arm_faults()
    workers = opts.worker_count() or engine.default_workers()
    max_memory = (
        engine.default_max_memory()
        if opts.max_memory is None
        else parse_size(opts.max_memory, "--max-memory")
    )
    dev = resolve_device(opts.device)  # an unknown device, or cuda without a GPU: DeviceError (exit 2)
    if opts.device == "auto" and dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        log.info("device auto: quantizing on the GPU (%s); --device cpu to use the CPU", name)
    src = open_source(
        source, opts.revision, headers_only=opts.dry_run, token=opts.token, cache_dir=opts.cache_dir
    )
    for name in COPY_FILES:  # copied at the end: a directory or FIFO there is refused before any work
        present(src.path / name, ConvertError, "file to copy")
    plan = make_plan(src, opts, converters.for_config(src.raw_config, str(src.path / "config.json")))
    output_guard.check_apart_from_source(out, src.path)
    workers, estimate = _workers_within(plan, workers, dev, max_memory)
    if opts.dry_run:
        return describe_plan(plan, out, estimate)
    run = Run.start(plan, opts, source, out)
    # one writer per output folder; a full disk is a one-line error that leaves the output resumable
    with output_guard.OutputLock(out), output_guard.disk_full_is_bad_input(out):
        reusable = output_guard.porter_written(out, COPY_FILES) if (opts.force or opts.resume) else ()
        output_guard.check_free_space(out, planned_bytes(plan), reusable)
        done = prepare_output(out, plan, run, workers)
        if done is None:
            return {
                "output": str(out),
                "already_complete": True,
                "shards": len(plan.shards),
                "seconds": time.time() - t0,
            }
        stats = _produce(plan, out, done, opts.progress, workers, max_memory, dev)
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


def _options(options: Optional[ConvertOptions], given: dict) -> ConvertOptions:
    """`options` with the keyword fields applied, checked; an unknown keyword is a ConvertError."""
    base = options if options is not None else ConvertOptions()
    unknown = sorted(set(given) - {f.name for f in fields(ConvertOptions)})
    if unknown:
        raise ConvertError(f"convert: unknown option {unknown[0]!r}; the options are ConvertOptions' fields")
    return replace(base, **given).check()


def interrupted_hint(output) -> Optional[str]:
    """What an interrupted run left in `output`, as one line ('OUT: interrupted conversion (N of M shards
    done): resume with ...'); None when it left nothing to resume."""
    try:
        state = porter_journal.interrupted(Path(output))
    except (OSError, TypeError, ValueError):
        return None
    return None if state is None else str(state)


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
        plan.options.scale_rounding,
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


def _produce(plan: Plan, out: Path, done: dict, progress: bool, workers: int, max_memory: int, dev) -> dict:
    """Make, hash and write every tensor (porter.engine); returns per-tensor manifest records."""
    stats = {n: r for rec in done.values() for n, r in rec["tensors"].items()}
    journal = read_journal(out)

    def shard_done(f: str, record: dict) -> None:  # called one at a time (the pipeline's journal lock)
        journal["shards"][f] = record
        write_journal(out, journal)

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
            copy_into(src.path / name, out / name, ConvertError)  # never through a link planted in `out`
    model_card.write(src.path, out, plan.options, src.repo_id, src.commit)
    if plan.options.layout == "hf":  # vendor config, top-level quantization_config the engines read
        hf = plan.converter.hf_layout
        qc = hf.hf_quantization_config(plan.tensors, plan.options.quantize, plan.options.scale_rounding)
        cfg = hf.hf_config_json(src.raw_config, qc)
    else:
        cfg = dict(src.raw_config)
        cfg["quantization_config"] = manifest.quantization_config(plan)
    secs = engine.sync_files([out / f for f, _ in plan.shards], available_cores())
    log.debug("fsync of %d shard(s): %.2f s", len(plan.shards), secs)
    changed = plan.source_change()  # last: nothing complete-looking is written from a source that moved
    if changed:
        raise ConvertError(
            f"{changed} while porter converted it; the output is left unfinished (no index): convert again "
            "from a source that nothing else writes, with --force"
        )
    _write_final(out / "config.json", json.dumps(cfg, indent=2))
    shard_digests = {
        f: {k: rec[k] for k in ("header_sha256", "digest")} for f, rec in read_journal(out)["shards"].items()
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
