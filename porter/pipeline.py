"""The conversion engine: read -> quantize -> hash -> write on every core (or the GPU), in a memory budget.

Work is cut into units in plan order: one expert of a stacked expert tensor, a byte range of a tensor
carried verbatim, or one whole plain tensor; they run interleaved over a few output shards at a time
(SHARDS_IN_FLIGHT), each shard's own units in plan order. The plan fixes every shard's header, so every output byte
has a known place: a worker writes its results with pwrite as soon as they exist, in any order. Digests
are chunked (porter.safetensors_io.digest_rule): each 16 MiB chunk of a tensor's data is hashed by the
worker whose write completes it, from the bytes it holds when its write covers the chunk, else read back
from the page cache; a tensor's digest and a shard's follow from those without another pass (the chunk
hashes, pread/pwrite and torch ops all release the GIL, so threads scale). A unit takes its working set plus its
output bytes from the budget before it starts; output bytes go back once written, so memory stays flat
with model size. Bytes, digests and error statistics do not depend on the worker count or on timing:
units are fixed by the plan and statistics are summed in plan order.

Generic over `porter.layout.OutTensor` lists: nothing here knows an architecture.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from porter import mxfp8, mxfp8_native, safetensors_io
from porter.digest import CHUNK_HASHES, DEFAULT_DIGEST
from porter.errors import PorterError, ProduceError
from porter.layout import OutTensor, scale_name
from porter.safetensors_io import (Entry, TensorReader, chunk_spans, dtype_name, header_bytes, pwrite_all,
                                   read_chunk_digest, shard_digest, tensor_bytes, tensor_digest)

log = logging.getLogger("porter")

SHARD_METADATA = {"format": "pt"}
COPY_CHUNK_BYTES = 64 << 20  # verbatim tensors are copied in ranges of this size
QUANT_CHUNK_ELEMS = 1 << 20  # CPU quantizes this many elements per call up to 2 workers (it bounds each
# call's arrays; porter.mxfp8 tiles them for the cache itself)
MANY_WORKERS_QUANT_ELEMS = 1 << 22  # ... and this many, in one tile, past 2 workers (quant_sizes)
# Working memory of one CPU quantize call per element, besides its results (q and scale bytes, counted as the
# unit's output). mxfp8's torch path: 16 bounds its reference path (fp32 copy, decoded copy, int32 codes,
# |error|), which its tiled path falls back to for rare inputs; the tiled path itself needs ~1 byte/element of
# per-block arrays plus 10 of reused tile buffers (fp32 copy, fp32 squares, int16 decode). The C quantizer:
# its [blocks, 3] fp32 statistics (0.375) and the float64 / int64 per-block arrays that sum them into the
# error totals (~2), plus what the allocator keeps of those in the worker's arena after they are freed.
# Measured with glibc's mallinfo2 on the 2-core box, 8.1 GB real-dims checkpoint, 4M-element calls: 4.2
# bytes/element with results at 17 workers (threads share arenas), 7.1 at 3 workers (one arena each, as on a
# 16-core machine); 9 + 1.03 of results covers both with room for the run-to-run spread.
TORCH_WORK_BYTES_PER_ELEM = 16
NATIVE_WORK_BYTES_PER_ELEM = 9
# --dry-run's estimate adds this to its parts: with every part counted at its size, a 1-worker conversion's
# measured peak (VmHWM) came within 1% of their sum, and the same conversion's peak moves by ~20 MB between
# runs (2-core box, real-dims checkpoints).
ESTIMATE_MARGIN_BYTES = 32 << 20
SLAB_MAX_BYTES = 256 << 20  # CPU reads up to this size go into the worker's reused buffer
# Output shards written at once. ext4 (and most Linux filesystems) serialize buffered writes into one file on
# its inode lock, so workers that all pwrite into one shard copy into the page cache one at a time (2-core
# box: two threads into one file were no faster than one, into two files twice as fast). A few shards at
# once spread the writes; few enough that a killed run loses at most this many partial shards to --resume.
# On the H200 machine's 16 cores the count made no measured difference: 8.1 GB in 13 shards, --device cuda,
# 1 / 4 / 8 / 16 in flight: 2.78 / 2.92 / 2.87 / 3.21 s, and 2.83 s at 16 in another run
# (benchmarks/results/convert_round6.md).
SHARDS_IN_FLIGHT = 4  # PORTER_SHARDS_IN_FLIGHT overrides it (benchmarks' A/B): shards_in_flight()
# When the kernel is asked to start writing the shards to disk: "thread" (one background thread, Writeback),
# "inline" (each worker right after its write) or "off" (only the final fsync). sync_file_range blocks while
# the disk's request queue is full: inline, --device cuda workers spent 14% of their time there (H200 machine,
# 3.2 GB real-dims checkpoint, 16 workers: cuda 2.49 s inline, 1.72 s thread, 2.47 s off, whose final fsync
# then writes everything; CPU 1.71 / 1.66 / 2.39 s; 8.1 GB, cuda: 3.18 -> 3.13 s). A threaded copy of the same
# bytes with fsync: 5.19 GB/s thread, 3.74 inline (benchmarks/convert_floor.py). PORTER_WRITEBACK overrides it.
WRITEBACK = "thread"
# Host memory the GPU path adds: the CUDA context, its libraries and the kernels a conversion loads. Measured on
# the H200 machine (torch 2.11.0+cu130): VmHWM +401 MB after the context and porter.mxfp8's GPU quantizer on 4
# streams (benchmarks/cuda_context_rss.py, benchmarks/results/convert_round16_call4_cuda_context_rss.log). With
# 600 MiB, --dry-run's estimate was 1.31-1.56x the measured peak over the 63 GPU conversions recorded in rounds
# 15-16 (benchmarks/results/convert_round1[56]_*.json); 200 MiB less puts those runs at 1.14-1.49x.
CUDA_CONTEXT_BYTES = 400 << 20


# ---------------------------------------------------------------------------------------------------
# fault injection for the crash/resume tests: PORTER_FAULT_KILL="event:n" SIGKILLs the process at the
# n-th occurrence of `event`; PORTER_FAULT_LOG=FILE appends every event name (to pick kill points).

_FAULT = {"kill": os.environ.get("PORTER_FAULT_KILL"), "log": os.environ.get("PORTER_FAULT_LOG"), "counts": {}}
_FAULT_LOCK = threading.Lock()


def fault_point(event: str) -> None:
    if not (_FAULT["kill"] or _FAULT["log"]):
        return
    with _FAULT_LOCK:
        n = _FAULT["counts"][event] = _FAULT["counts"].get(event, 0) + 1
        if _FAULT["log"]:
            with open(_FAULT["log"], "a") as f:
                f.write(f"{event}:{n}\n")
        if _FAULT["kill"] == f"{event}:{n}":
            os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------------
# sizing


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_workers() -> int:
    """`--workers` when not given: one more than the cores this process may run on, so that a worker blocked
    (in the shard journal's fsync, waiting for the memory budget, on a page the kernel is reading) leaves no
    core idle. On the H200 machine's Xeon limited to 2 cores (1.92 GB, CPU path, two runs of three repeats):
    3 workers 1.40-1.44 and 1.18-1.49 s, 2 workers 1.49-1.59 and 1.24-1.53 s (medians 1.42 vs 1.51 s), 4
    workers 1.39-1.67 s; on 16 cores 17 and 16 workers were within the run-to-run spread (2 GB 0.90 vs 0.96 s,
    8 GB 3.12 vs 2.70 s; benchmarks/results/convert_round15.md)."""
    return available_cores() + 1


def memory_status() -> dict:
    """This process's RssAnon / RssFile / VmHWM and the machine's MemAvailable, in bytes (Linux)."""
    out = {}
    for path, keys in (("/proc/self/status", ("RssAnon", "RssFile", "VmHWM", "VmRSS")),
                       ("/proc/meminfo", ("MemAvailable", "MemTotal"))):
        try:
            for line in open(path):
                k, _, v = line.partition(":")
                if k in keys:
                    out[k] = int(v.split()[0]) * 1024
        except OSError:
            pass
    return out


def default_max_memory() -> int:
    """Half of the memory available now (the page cache and the rest of the machine keep the other half)."""
    return int(memory_status().get("MemAvailable", 8 << 30) * 0.5)


def resolve_device(device: str) -> torch.device:
    if device not in ("auto", "cpu", "cuda"):
        raise PorterError(f"--device must be auto, cpu or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise PorterError("--device cuda: no CUDA GPU is visible to torch here; use --device cpu (or auto)")
    if device == "auto":
        if torch.cuda.is_available():
            log.info("device auto: quantizing on the GPU (%s); --device cpu to use the CPU",
                     torch.cuda.get_device_name(0))
            return torch.device("cuda")
        log.debug("device auto: no CUDA GPU, quantizing on the CPU")
        return torch.device("cpu")
    return torch.device(device)


# ---------------------------------------------------------------------------------------------------
# units of work


@dataclass
class Place:
    shard: str
    offset: int  # absolute byte offset of the entry's data in its shard
    nbytes: int


def places_of(shards: list) -> dict:
    """entry name -> Place, from the plan's shards [(file, [Entry, ...])] (the header is fixed up front)."""
    places = {}
    for f, entries in shards:
        offset = len(header_bytes(entries, SHARD_METADATA))
        for e in entries:
            places[e.name] = Place(f, offset, e.nbytes)
            offset += e.nbytes
    return places


def verbatim_source(t: OutTensor, meta: dict) -> Optional[str]:
    """The source tensor that `t` is a byte-for-byte copy of, or None: one source of t's dtype and shape whose
    builder hands the read on unchanged (builder_copies). Such tensors (embeddings, lm_head: 2.5 GB each at
    MiniMax-M3 size) are copied in ranges, never held whole."""
    if t.per_expert or t.quantize or len(t.sources) != 1:
        return None
    src = t.sources[0]
    if meta.get(src) is None or (meta[src][0], tuple(meta[src][1])) != (t.dtype, tuple(t.shape)):
        return None
    return None if builder_copies(t, meta) else src


@dataclass
class Unit:
    index: int  # position in plan order
    t: OutTensor
    kind: str  # "expert" | "copy" | "whole"
    expert: int = 0
    begin: int = 0  # copy: byte range of the tensor
    length: int = 0
    src_bytes: int = 0  # source bytes consumed (progress)
    cost: int = 0  # working set + output bytes (budget)


def quant_sizes(workers: int) -> tuple[int, Optional[int]]:
    """(elements per CPU quantize call, blocks per tile or None for mxfp8's default). Every torch op takes the
    GIL back when it returns, so the small cache-resident tiles that are fastest on one core (~200 ops per
    million elements) make the GIL the limit once many workers quantize at once. Past 2 workers a call is one
    tile of 4M elements: ~25x fewer ops per byte for ~15% more CPU time per byte (single-threaded); with the
    reused read slabs (measured together) an 8 GB conversion at 16 workers on the H200 machine went from 19.2
    to 4.5 s. Same bytes and statistics."""
    if workers <= 2:
        return QUANT_CHUNK_ELEMS, None
    return MANY_WORKERS_QUANT_ELEMS, MANY_WORKERS_QUANT_ELEMS // mxfp8.BLOCK


def unit_costs(t: OutTensor, device: torch.device, workers: int, meta: dict) -> tuple[int, int]:
    """(working set, output bytes) of one unit of t (one expert, or the whole tensor), in bytes. meta: the
    source's stored_meta (a source it lacks counts as a builder copy and the torch quantizer)."""
    src = _src_bytes(t)
    read = src if device.type == "cpu" and src > SLAB_MAX_BYTES else 0  # reads live in the worker's slab
    # (memory_estimate counts the slabs), except CPU reads too large for one
    if not t.quantize:
        return read, src  # the value: the read itself, or a copy a builder makes of it
    copied = src if builder_copies(t, meta) else 0  # e.g. uninterleaving a fused gate_up
    chunk = min(src // t.dtype.itemsize, quant_sizes(workers)[0])
    native = native_quantizes(t, meta)
    work = (NATIVE_WORK_BYTES_PER_ELEM if native else TORCH_WORK_BYTES_PER_ELEM) * chunk  # CPU quantize call
    out = chunk + chunk // mxfp8.BLOCK  # its q and scale bytes
    if device.type == "cpu":
        return read + copied + work, out
    # GPU: reads and results live in the worker's pinned slabs (memory_estimate counts them); a part quantized
    # on the CPU while the CUDA context starts (Pipeline._quantize) takes the CPU call's memory
    return copied + work + out, 0


def builder_copies(t: OutTensor, meta: dict) -> bool:
    """Whether building one unit of t (expert 0, or the whole tensor) makes a new tensor from what it reads
    (uninterleaving a fused gate_up, dequantizing, concatenating) rather than handing the reads on as they
    are. Proven by calling the converter's builder with a reader that returns shape-only (meta) tensors: only
    parts that are those tensors themselves (a whole tensor: at t's shape) copy nothing. Any failure counts as
    a copy."""
    probes = []

    def read(name, index=None):
        dtype, shape = meta[name]
        probes.append(torch.empty(tuple(shape) if index is None else tuple(shape)[1:], dtype=dtype, device="meta"))
        return probes[-1]
    try:
        parts = t.expert_rows(read, 0) if t.per_expert else [t.build(read)]
    except Exception:  # noqa: BLE001 — a builder that cannot run on shapes alone: assume it copies
        return True
    if not t.per_expert and tuple(parts[0].shape) != tuple(t.shape):
        return True
    return not all(any(p is q for q in probes) for p in parts)


def native_quantizes(t: OutTensor, meta: dict) -> bool:
    """Whether the CPU path quantizes t with the compiled C quantizer (porter.mxfp8_native.takes): t's dtype
    and shape are ones it takes and every source is stored as it is read (stored_meta leaves out pre-quantized
    weights, whose kept scale bytes only the torch path takes)."""
    return all(s in meta for s in t.sources) and mxfp8_native.takes(t.dtype, t.shape[-1])


def make_units(tensors: list, meta: dict, skip: Callable[[OutTensor], bool], device: torch.device,
               workers: int = 1) -> list:
    units = []
    for t in tensors:
        if skip(t):
            continue
        work, out = unit_costs(t, device, workers, meta)
        src = verbatim_source(t, meta)
        if t.per_expert:
            for e in range(t.shape[0]):
                units.append(Unit(len(units), t, "expert", expert=e, src_bytes=_src_bytes(t), cost=work + out))
        elif src is not None:
            total = _src_bytes(t)
            for begin in range(0, max(total, 1), COPY_CHUNK_BYTES):  # a 0-byte tensor still gets its unit
                n = min(COPY_CHUNK_BYTES, total - begin)
                units.append(Unit(len(units), t, "copy", begin=begin, length=n, src_bytes=n, cost=0))  # its
                # bytes live in the worker's read slab (memory_estimate counts the slabs)
        else:
            units.append(Unit(len(units), t, "whole", src_bytes=_src_bytes(t), cost=work + out))
    return units


def _env_switch(name: str, default: str, valid: Callable[[str], bool]) -> str:
    """The benchmarks' A/B switches (PORTER_*): the variable's value where `valid` accepts it, else `default`
    (anything else is ignored)."""
    value = os.environ.get(name, "")
    return value if valid(value) else default


def fused_quantizer(device: torch.device, rounding: str):
    """The GPU path's quantizer with PORTER_CUDA_QUANTIZE=fused: porter.mxfp8_triton (two launches per part
    instead of ~75 torch ops), its kernel loaded by one small launch; else None, for mxfp8's torch ops (also on
    the CPU, and where Triton cannot be imported or cannot build the kernel for this GPU: its e4m3 cast needs
    compute capability 8.9). Both write the same bytes. Not the default: on 8 GB conversions it was no faster
    end to end (parts wait in its launches as they did in the torch ops'), and its one-time load (0.6-0.8 s)
    made short conversions slower (benchmarks/results/convert_round7.md)."""
    if device.type != "cuda" or _env_switch("PORTER_CUDA_QUANTIZE", "torch", "fused".__eq__) != "fused":
        return None
    try:
        from porter import mxfp8_triton
        mxfp8_triton.warm_up(device, rounding)
    except Exception as exc:  # noqa: BLE001 — any failure here only means the slower torch ops
        log.info("quantizing with torch ops on the GPU (the Triton quantizer is unavailable: %s)",
                 str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    return mxfp8_triton


def shards_in_flight(workers: int) -> int:
    """Output shards written at once: SHARDS_IN_FLIGHT (or PORTER_SHARDS_IN_FLIGHT, a positive integer),
    and never more than one per worker."""
    n = int(_env_switch("PORTER_SHARDS_IN_FLIGHT", str(SHARDS_IN_FLIGHT), lambda v: v.isdigit() and int(v) > 0))
    return max(1, min(n, workers))


def writeback_mode() -> str:
    """WRITEBACK, or PORTER_WRITEBACK when it is one of its values."""
    return _env_switch("PORTER_WRITEBACK", WRITEBACK, ("thread", "inline", "off").__contains__)


def slab_prefault() -> bool:
    """Whether the GPU path prefaults its slabs and makes the CUDA context early (Pipeline._new_slab);
    PORTER_SLAB_PREFAULT=0 turns both off."""
    return _env_switch("PORTER_SLAB_PREFAULT", "1", lambda v: v == "0") != "0"


def cpu_while_cuda_starts() -> bool:
    """Whether --device cuda quantizes the parts that are ready before its CUDA context on the CPU (the C
    quantizer: the same bytes) instead of waiting for the context; PORTER_CUDA_CPU_START=0 makes them wait
    (the GPU tests, so that every part goes through the GPU, and benchmarks' A/B)."""
    return _env_switch("PORTER_CUDA_CPU_START", "1", lambda v: v == "0") != "0"


def interleave_shards(units: list, shard_of: Callable[[Unit], str], width: int) -> list:
    """Units reordered round-robin over `width` output shards at a time (each shard's own units keep plan
    order; the next shard joins when one runs out), so writes go to several files at once."""
    queues: dict = {}
    for u in units:
        queues.setdefault(shard_of(u), []).append(u)
    waiting = [q[::-1] for q in queues.values()]  # reversed: pop() takes the next unit in plan order
    waiting.reverse()
    active, out = [], []
    while active or waiting:
        while waiting and len(active) < max(1, width):
            active.append(waiting.pop())
        for q in active:
            out.append(q.pop())
        active = [q for q in active if q]
    return out


def _src_bytes(t: OutTensor) -> int:
    shape = tuple(t.shape[1:]) if t.per_expert else tuple(t.shape)
    n = t.dtype.itemsize
    for d in shape:
        n *= d
    return n


def memory_estimate(tensors: list, meta: dict, workers: int, device: torch.device, max_memory: int) -> dict:
    """Expected peak RSS of a conversion (what --dry-run prints) and the budget the pipeline runs in:
    this process as it is now (torch loaded; + the CUDA context on a GPU), plus the bytes in flight
    (each worker's unit: reads, temporaries and results, capped by --max-memory), plus the scale arrays of
    the stacked expert tensors being filled (one per shard in flight, plus one where a shard moves from one
    tensor to the next: an array's pages become resident as its experts land, so the 2 per shard that can be
    open at once are not all full; sparse full-structure run, 2 workers: estimate / VmHWM 1.67 when counting
    2 per shard), plus the hash read-back buffers, plus ESTIMATE_MARGIN_BYTES."""
    mem = memory_status()
    base = mem.get("RssAnon", 0) + mem.get("RssFile", 0) + (CUDA_CONTEXT_BYTES if device.type == "cuda" else 0)
    copied = [verbatim_source(t, meta) is not None for t in tensors]
    costs = [(0, 0) if c else unit_costs(t, device, workers, meta)
             for t, c in zip(tensors, copied)]  # a copied range is read into the slab and written from it
    unit = max((w + o for w, o in costs), default=0)
    scales = sum(sorted(scale_array_bytes(t) for t in tensors)[-(shards_in_flight(workers) + 1):])
    readback = workers * safetensors_io.DIGEST_CHUNK_BYTES  # each worker may read a chunk back to hash it
    reads = [min(COPY_CHUNK_BYTES, _src_bytes(t)) if c else _src_bytes(t)
             for t, c in zip(tensors, copied)]  # one unit's reads
    if device.type == "cuda":  # every worker keeps its pinned slabs (registered at their size) for the whole run
        base += workers * sum(pinned_slab_bytes(reads, [t for t in tensors if t.quantize]).values())
    else:  # CPU: every worker keeps a read slab as large as its largest read that goes into one
        base += workers * max((r for r in reads if r <= SLAB_MAX_BYTES), default=0)
    inflight = max(unit, min(workers * unit, budget_for(max_memory, base, scales + readback)))
    return {"base": base, "unit": unit, "workers": workers, "inflight": inflight, "scales": scales,
            "readback": readback, "margin": ESTIMATE_MARGIN_BYTES,
            "total": base + inflight + scales + readback + ESTIMATE_MARGIN_BYTES, "max_memory": max_memory}


def scale_array_bytes(t: OutTensor) -> int:
    """The [E, N, K/32] scale array a stacked expert tensor keeps in memory until its last expert is in."""
    if not (t.per_expert and t.quantize):
        return 0
    n = t.shape[-1] // mxfp8.BLOCK
    for d in t.shape[:-1]:
        n *= d
    return n


def pinned_slab_bytes(reads: list, quantized: list) -> dict:
    """Sizes of one worker's pinned buffers on the GPU path, for units reading up to max(reads) bytes each
    and quantizing these tensors: src holds a unit's reads (each 64-byte aligned), out one part's results
    (values + scales)."""
    out = max((_out_bytes(t) for t in quantized), default=0)
    return {"src": max(reads, default=0) + 4096, "out": out + 4096}


def _out_bytes(t: OutTensor) -> int:
    """Values + scales of one unit of a quantized tensor (one expert, or the whole tensor)."""
    elems = _src_bytes(t) // t.dtype.itemsize
    return elems + elems // mxfp8.BLOCK


def budget_for(max_memory: int, base: int, reserved: int) -> int:
    return max_memory - base - reserved


# ---------------------------------------------------------------------------------------------------
# digests and shard files


class Budget:
    """Bytes in flight. acquire() blocks until they fit (a unit larger than the whole budget runs alone)."""

    def __init__(self, total: int):
        self.total, self.used, self.peak = max(1, total), 0, 0
        self.cond = threading.Condition()
        self.aborted = False

    def acquire(self, n: int) -> bool:
        with self.cond:
            while not self.aborted and self.used and self.used + n > self.total:
                self.cond.wait()
            if self.aborted:
                return False
            self.used += n
            self.peak = max(self.peak, self.used)
            return True

    def release(self, n: int) -> None:
        if n:
            with self.cond:
                self.used -= n
                self.cond.notify_all()

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()


class TensorDigest:
    """The chunked digest of one tensor's data (bytes [start, start + length) of a shard file written out
    of order). Writers report each range they wrote. A chunk is hashed as its bytes arrive when they arrive
    in order (each writer feeds the chunk's running hash the part of its range that continues the bytes
    hashed so far; one writer at a time per chunk), and once all its bytes are in, its digest is finished by
    whichever writer is last: from the running hash, plus the bytes that came out of order read back from
    the page cache. Chunks of one tensor are hashed on many threads at once. Streaming spares the
    read-back of chunks one worker writes in order (a CPU worker writes an expert in 1 MiB pieces; each
    16 MiB chunk then took a 16 MiB pread back)."""

    def __init__(self, fd: int, path: Path, start: int, length: int, chunk_bytes: int,
                 on_done: Callable[[str], None], chunk_hash: str = DEFAULT_DIGEST):
        self.fd, self.path, self.start, self.chunk, self.on_done = fd, path, start, chunk_bytes, on_done
        self.new_hash = CHUNK_HASHES[chunk_hash]
        self.spans = chunk_spans(length, chunk_bytes)
        self.left = [n for _, n in self.spans]  # bytes of each chunk not written yet
        self.fed = [0] * len(self.spans)  # bytes from each chunk's start in its running hash
        self.hashers: list = [None] * len(self.spans)  # running hash per chunk (None: nothing fed yet)
        self.busy = [False] * len(self.spans)  # a writer is feeding the chunk's hash right now
        self.claimed = [False] * len(self.spans)  # a writer is finishing (or has finished) the chunk
        self.digests: list = [None] * len(self.spans)
        self.todo = len(self.spans)
        self.lock = threading.Lock()
        if not self.spans:
            on_done(tensor_digest([]))

    def add(self, offset: int, data: memoryview) -> None:
        """`data` was written at `offset` (relative to the tensor's start)."""
        if not len(data):  # nothing written; a 0-byte range completes nothing
            return
        end, feeds, finish = offset + len(data), [], []
        with self.lock:
            for i in range(offset // self.chunk, (end - 1) // self.chunk + 1):
                b, n = self.spans[i]
                lo, hi = max(b, offset), min(b + n, end)  # this write's part of chunk i
                self.left[i] -= hi - lo
                if not self.busy[i] and lo - b == self.fed[i]:  # continues the bytes hashed so far
                    self.busy[i] = True
                    feeds.append((i, lo, hi))
                elif self.left[i] == 0 and not self.busy[i] and not self.claimed[i]:
                    self.claimed[i] = True
                    finish.append(i)
        for i, lo, hi in feeds:
            if self.hashers[i] is None:
                self.hashers[i] = self.new_hash()
            self.hashers[i].update(data[lo - offset:hi - offset])  # releases the GIL
            with self.lock:
                self.busy[i] = False
                self.fed[i] += hi - lo
                if self.left[i] == 0 and not self.claimed[i]:
                    self.claimed[i] = True
                    finish.append(i)
        for i in finish:
            b, n = self.spans[i]
            fed, h = self.fed[i], self.hashers[i]
            h = self.new_hash() if h is None else h
            if fed == n:
                digest = h.digest()
            else:  # the bytes after the in-order prefix arrived out of order: read them back
                digest = read_chunk_digest(self.fd, self.start + b + fed, n - fed, self.path, h)
            self.hashers[i] = None
            with self.lock:
                self.digests[i] = digest
                self.todo -= 1
                last = self.todo == 0
            if last:
                self.on_done(tensor_digest(self.digests))


class Writeback:
    """One background thread that asks the kernel to start writing ranges to disk (start_writeback), so a
    worker never waits in sync_file_range for a full disk queue. It owns a dup of each shard's descriptor
    and closes it after the shard's last range (FIFO), so a range is never flushed through a reused fd."""

    def __init__(self):
        import queue
        self.queue = queue.SimpleQueue()
        self.fds: set = set()  # dups not closed yet (stop closes what a failed run left)
        self.thread = threading.Thread(target=self._loop, name="porter-writeback", daemon=True)
        self.thread.start()

    MAX_FDS = 64  # dups held at once; a shard opened past this (the thread lagging far) writes back inline

    def open(self, fd: int) -> Optional[int]:
        """A dup of fd for this thread, or None (the caller starts its writeback inline) when MAX_FDS are open:
        with many small shards and a slow disk the thread can lag many shards behind, and each would hold one."""
        if len(self.fds) >= self.MAX_FDS:
            return None
        dup = os.dup(fd)
        self.fds.add(dup)
        return dup

    def submit(self, fd: int, offset: int, length: int) -> None:
        self.queue.put((fd, offset, length))

    def close(self, fd: int) -> None:
        self.queue.put((fd, None, None))

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join()
        for fd in list(self.fds):
            self._close(fd)

    def _loop(self) -> None:
        while (item := self.queue.get()) is not None:
            fd, offset, length = item
            if offset is None:
                self._close(fd)
            else:
                try:
                    start_writeback(fd, offset, length)  # a hint; the final fsync reports write errors
                except Exception:  # noqa: BLE001 — the thread must keep closing the dups it owns
                    pass

    def _close(self, fd: int) -> None:
        self.fds.discard(fd)
        try:
            os.close(fd)
        except OSError:
            pass


class ShardOut:
    """One output shard: `.partial` written with pwrite, renamed once every tensor's digest and every error
    record is in (`todo` counts those events). writeback: see WRITEBACK; flusher: the thread mode's (else None)."""

    def __init__(self, path: Path, entries: list, todo: int, on_closed: Callable, writeback: str,
                 flusher: Optional[Writeback]):
        self.path, self.entries, self.on_closed = path, entries, on_closed
        self.partial = path.with_name(path.name + ".partial")
        header = header_bytes(entries, SHARD_METADATA)
        size = len(header) + sum(e.nbytes for e in entries)
        self.fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, size)
        self.flusher = flusher
        self.wb_fd = flusher.open(self.fd) if flusher is not None else None
        # inline: asked for, or thread mode without a flusher or with one that holds MAX_FDS shards already
        self.inline_writeback = self.wb_fd is None and writeback != "off"
        self.lock = threading.Lock()
        self.todo = todo
        self.header_sha256 = hashlib.sha256(header).hexdigest()
        pwrite_all(self.fd, memoryview(header), 0)

    def write(self, data: memoryview, offset: int) -> None:
        """data at `offset` of the shard; then start its writeback as the writeback mode says."""
        pwrite_all(self.fd, data, offset)
        if self.wb_fd is not None:
            self.flusher.submit(self.wb_fd, offset, len(data))
        elif self.inline_writeback:
            start_writeback(self.fd, offset, len(data))

    def event(self) -> None:
        with self.lock:
            self.todo -= 1
            last = self.todo == 0
        if last:  # no fsync here: durability is checked at the end (sync_files) before the index is written,
            os.close(self.fd)  # and --resume re-hashes every journaled shard, so a torn one is rewritten
            self.fd = None
            self._close_writeback()
            os.replace(self.partial, self.path)
            fault_point("shard-renamed")
            self.on_closed(self)

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._close_writeback()

    def _close_writeback(self) -> None:
        if self.wb_fd is not None:
            self.flusher.close(self.wb_fd)
            self.wb_fd = None


# ---------------------------------------------------------------------------------------------------
# the pipeline


@dataclass
class _Job:
    """A stacked expert tensor in flight: its scale array and per-expert error sums, until all are in."""
    left: int
    scale: Optional[torch.Tensor]
    errs: list
    lock: threading.Lock = field(default_factory=threading.Lock)


class Pipeline:
    def __init__(self, plan, out: Path, done: dict, stats: dict, *, workers: int, max_memory: int,
                 device: torch.device, on_shard_done: Callable[[str, dict], None], progress=None):
        self.plan, self.out, self.done, self.stats = plan, out, done, stats
        self.workers, self.device, self.on_shard_done, self.progress = workers, device, on_shard_done, progress
        self.places = places_of(plan.shards)
        self.entries_of = dict(plan.shards)
        self.quantized_values = {t.name for t in plan.tensors if t.quantize}
        self.rounding = plan.options["scale_rounding"]
        self.reader = TensorReader(plan.source.spans)
        self.pin = device.type == "cuda"
        self.lock = threading.RLock()  # re-entered when a zero-byte tensor's hash completes at creation
        self.journal_lock = threading.Lock()  # on_shard_done calls, one at a time (see _closed)
        self.shards: dict = {}
        self.tensor_digest: dict = {}
        self.chunk_bytes = safetensors_io.DIGEST_CHUNK_BYTES
        self.quant_sizes = quant_sizes(workers)
        self.jobs: dict = {}
        self.error: Optional[tuple] = None
        self.estimate = memory_estimate(plan.tensors, plan.source.stored_meta, workers, device, max_memory)
        self.budget = Budget(self.estimate["inflight"])
        self.local = threading.local()
        self.registered: list = []  # page-locked slabs (GPU path)
        self.writeback = writeback_mode()
        self.prefault_slabs = slab_prefault()
        self.flusher: Optional[Writeback] = None
        self.cuda_init: Optional[threading.Thread] = None  # see _init_cuda_async
        self.cuda_ready = threading.Event()  # set once the CUDA init thread is done (or when there is none)
        self.cpu_start = device.type == "cuda" and cpu_while_cuda_starts()
        self.parts_on_cpu = 0  # --device cuda parts quantized on the CPU while the context started
        self.fused_lock = threading.Lock()  # see _fused
        self.fused_quantizer, self.fused_resolved = None, False

    # -- reads
    def read(self, name: str, index: Optional[int] = None) -> torch.Tensor:
        pre = self.plan.source.prequantized  # a quantized source weight: dequantized (porter.prequantized)
        if pre is not None and name in pre.scales:
            return pre.dequantize(self.reader.read(name, index), self.reader.read(pre.scales[name], index))
        n = self.reader.nbytes(name, index)
        if self.pin or n <= SLAB_MAX_BYTES:  # into this worker's slab: pinned on the GPU path (the async
            # host->device copy needs page-locked memory); on the CPU a reused buffer instead of a fresh
            # allocation per read (large ones are mmapped and page-faulted in every time: kernel time)
            return self.reader.read(name, index, into=self._slab("src", n))
        return self.reader.read(name, index)

    def read_scale(self, name: str, index: Optional[int] = None) -> torch.Tensor:
        """uint8 [..., K/32] scale bytes that re-quantizing source tensor `name` (or its row `index` along
        dim 0) keeps: an MXFP8 source weight's own, any other tensor's by the rounding rule. A builder
        given this reader instead of `read` yields its value's scale rows (builders only pick rows:
        porter.layout.OutTensor), so a kept scale is found by construction, for slices too."""
        pre = self.plan.source.prequantized
        if name in pre.scales:
            return pre.kept_scale(self.reader.read(pre.scales[name], index))
        return mxfp8.quantize(self.reader.read(name, index), self.rounding, name)[1]

    def _keeps_scales(self, t: OutTensor) -> bool:
        """t is re-quantized with kept source scale bytes: an MXFP8 source weight is among its sources."""
        pre = self.plan.source.prequantized
        return t.quantize and pre is not None and pre.keeps_scales and any(s in pre.scales for s in t.sources)

    def _slab(self, which: str, n: int) -> torch.Tensor:
        """n bytes of this worker thread's buffer `which` (src: the unit's reads, pinned on the GPU path; out:
        one part's results on the GPU path). Allocated once per worker and reused for every unit (reset when
        a unit starts; results are written out before the next part), so slab memory stays workers x (unit
        + part) bytes and no read page-faults fresh memory in."""
        at = getattr(self.local, which + "_at", 0)
        slab = getattr(self.local, which, None)
        if slab is None or at + n > slab.numel():  # sized once from the plan (slab_bytes); grows only past it
            slab = self._new_slab(max(self.slab_bytes.get(which, 0), at + n))
            setattr(self.local, which, slab)
            at = 0  # views already handed out keep the old slab alive until the unit ends
        setattr(self.local, which + "_at", at + (n + 63) // 64 * 64)
        return slab[at:at + n]

    def _new_slab(self, n: int) -> torch.Tensor:
        """n bytes. On the GPU path the slab is page-locked by registering it with CUDA at exactly n bytes
        (torch's pinned allocator rounds up to a power of two: up to 2x the memory to lock, which costs kernel
        time and counts in the peak). Its pages are faulted in here (prefault), in parallel and outside the
        driver, and it is registered at the worker's first GPU call (_register_pending), by when the CUDA
        context, made on a background thread as the run starts, is ready and the first read has landed.
        PORTER_SLAB_PREFAULT=0 registers fresh pages at once instead, and leaves the CUDA context to the first
        worker's CUDA call (the previous GPU start; benchmarks' A/B)."""
        slab = torch.empty(n, dtype=torch.uint8)
        if self.device.type != "cuda" or not n:
            return slab
        if not self.prefault_slabs:
            self._register(slab)
            return slab
        prefault(slab)
        pending = getattr(self.local, "pending", None)
        if pending is None:
            pending = self.local.pending = []
        pending.append(slab)
        return slab

    def _register_pending(self) -> None:
        """Page-lock this worker's slabs made since its last GPU call (async copies need page-locked memory)."""
        pending = getattr(self.local, "pending", None)
        while pending:
            self._register(pending.pop())

    def _register(self, slab: torch.Tensor) -> None:
        """cudaHostRegister the slab (unregistered when the run ends: _release_slabs). If that fails, the slab
        stays pageable: CUDA then copies through its own staging buffers, synchronously for the host (slower,
        the same bytes, and the slab may be reused as soon as the copy call returns)."""
        code = int(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), slab.numel(), 0))
        if code == 0:
            with self.lock:
                self.registered.append(slab)
            return
        # a failed call also leaves CUDA's per-thread last error set, which torch's next kernel-launch check
        # would raise as an unrelated error: clear it
        torch.cuda.cudart().cudaGetLastError()
        log.debug("cudaHostRegister of %d bytes failed (error %d); copying from pageable memory", slab.numel(), code)

    def _init_cuda_async(self) -> None:
        """Make the CUDA context on a background thread while the workers start reading (~0.3 s on the H200
        machine); their first CUDA call waits for it. An error here is left to that call to raise."""
        def init():
            try:
                torch.empty(1, device=self.device)
                self._fused()
            except Exception:  # noqa: BLE001 — the workers' own CUDA calls raise it where it is handled
                pass
            finally:
                self.cuda_ready.set()
        self.cuda_init = threading.Thread(target=init, name="porter-cuda-init", daemon=True)
        self.cuda_init.start()

    def _fused(self, wait: bool = False):
        """fused_quantizer, resolved once per run by the CUDA init thread (else by the first part). Parts that
        start while it is being resolved use the torch ops (the same bytes) instead of waiting (wait=False):
        importing Triton and loading the kernel took 0.6-0.8 s on the H200 machine, and waiting for it was 40%
        of the workers' stack samples in a 3 GB conversion (benchmarks/results/convert_round7.md)."""
        if self.fused_resolved:
            return self.fused_quantizer
        if not self.fused_lock.acquire(blocking=wait):
            return None
        try:
            if not self.fused_resolved:
                self.fused_quantizer = fused_quantizer(self.device, self.rounding)
                self.fused_resolved = True
        finally:
            self.fused_lock.release()
        return self.fused_quantizer

    def _release_slabs(self) -> None:
        """After the workers are done: unlock the registered slabs (once no copy can still be reading them)."""
        try:
            if self.registered:
                torch.cuda.synchronize(self.device)  # raises after a sticky CUDA error: unregister anyway
        finally:
            for slab in self.registered:
                torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())
            self.registered.clear()

    # -- shard bookkeeping
    def _todo(self, f: str) -> int:
        """Events a shard waits for: each tensor's digest, each quantized tensor's error record."""
        return sum(1 + (e.name in self.quantized_values) for e in self.entries_of[f])

    def _shard(self, f: str) -> ShardOut:
        with self.lock:
            s = self.shards.get(f)
            if s is None:
                s = self.shards[f] = ShardOut(self.out / f, self.entries_of[f], self._todo(f), self._closed,
                                              self.writeback, self.flusher)
                for e in self.entries_of[f]:
                    p = self.places[e.name]
                    self.tensor_digest[e.name] = TensorDigest(
                        s.fd, s.partial, p.offset, p.nbytes, self.chunk_bytes,
                        lambda d, e=e, s=s: self._tensor_hashed(s, e, d), self.plan.digest)
            return s

    def _tensor_hashed(self, shard: ShardOut, e: Entry, digest: str) -> None:
        with self.lock:
            self.stats.setdefault(e.name, {}).update(shard=self.places[e.name].shard, dtype=dtype_name(e.dtype),
                                                     shape=list(e.shape), digest=digest)
        shard.event()

    def _closed(self, shard: ShardOut) -> None:
        """Hands the finished shard's record to on_shard_done (the journal: a file write with fsync) outside
        the pipeline's lock, so only the workers that finish shards wait for those fsyncs; under it, every
        worker's next digest or progress update waited too (16 workers, --device cuda, 3.2 GB in 5 shards on
        the H200 machine: the journal writes held the lock for ~0.4 s of 1.35 s; benchmarks/convert_profile.py).
        End to end it measured within noise: 8.1 GB in 13 shards, 2.88 s now vs 2.79 s under the lock, one
        run each (benchmarks/results/convert_round6.md). A journal thread of its own, so that no worker waits
        for the fsync, measured no faster either (8.1 GB, 16 workers, --device cuda: 2.72-2.89 s vs 2.44-2.72 s
        here; benchmarks/results/convert_round7.md) and was not kept."""
        f = shard.path.name
        with self.lock:
            tensors = {e.name: dict(self.stats[e.name]) for e in shard.entries}
            record = {"header_sha256": shard.header_sha256, "tensors": tensors,
                      "digest": shard_digest(shard.header_sha256, [tensors[e.name]["digest"] for e in shard.entries])}
        with self.journal_lock:
            self.on_shard_done(f, record)

    def _record_error(self, t: OutTensor, record: dict) -> None:
        f = self.places[t.name].shard
        if f in self.done:
            return
        shard = self._shard(f)
        with self.lock:
            self.stats.setdefault(t.name, {}).update(record)
        shard.event()

    def deposit(self, name: str, offset: int, value: torch.Tensor, unit_cost: list) -> None:
        """Write value's bytes at `offset` within tensor `name` and hash the digest chunks this completes
        (from these bytes, or read back), so value can be dropped (or its buffer reused) once this returns."""
        place = self.places[name]
        if place.shard in self.done:
            return
        data = tensor_bytes(value)
        if offset + len(data) > place.nbytes:
            raise RuntimeError(f"{name}: produced bytes beyond its planned {place.nbytes}")
        shard = self._shard(place.shard)
        if not len(data):  # a 0-byte tensor: its digest completed when the shard opened (maybe closing it)
            return
        shard.write(data, place.offset + offset)
        self.tensor_digest[name].add(offset, data)

    # -- units
    def run(self, units: list) -> None:
        units = interleave_shards(units, lambda u: self.places[u.t.name].shard, shards_in_flight(self.workers))
        self.slab_bytes = pinned_slab_bytes([u.length if u.kind == "copy" else _src_bytes(u.t) for u in units],
                                            [u.t for u in units if u.t.quantize]) if self.pin else {}
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, available_cores() // self.workers))  # the CPU quantizer's torch ops (on
        # the GPU path: the parts quantized while its context starts) run on each worker's own share
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="porter-convert")
        if self.writeback == "thread":
            self.flusher = Writeback()
        if self.device.type == "cuda" and self.prefault_slabs:
            self._init_cuda_async()
        else:
            self.cuda_ready.set()
        try:
            futures = []
            for u in units:
                if self.error is not None or not self.budget.acquire(u.cost):
                    break
                futures.append(pool.submit(self._run_unit, u))
            for fut in futures:
                fut.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(threads)
            self.reader.close()
            if self.error is not None:
                for s in self.shards.values():
                    s.abort()
            if self.flusher is not None:
                self.flusher.stop()
            if self.cuda_init is not None:  # not left inside CUDA's init at interpreter exit (a fast failure)
                self.cuda_init.join()
                self.cuda_init = None
            try:
                self._release_slabs()  # last: after a worker's CUDA error its synchronize may raise too
            except Exception:
                if self.error is None:
                    raise  # else the worker's error (raised below) says what went wrong
        if self.error is not None:
            raise self.error[1]
        left = [f for f, s in self.shards.items() if s.fd is not None]
        if left:
            raise RuntimeError(f"internal: shard(s) {left} not complete after every unit ran")
        if self.parts_on_cpu:
            log.info("%d part(s) quantized on the CPU while the CUDA context started (the same bytes)",
                     self.parts_on_cpu)

    def _run_unit(self, u: Unit) -> None:
        cost = [u.cost]
        self.local.src_at = 0  # this worker's read slab is free again
        try:
            if self.error is None:
                {"expert": self._expert, "copy": self._copy, "whole": self._whole}[u.kind](u, cost)
                fault_point("unit")
                if self.progress is not None:
                    with self.lock:
                        self.progress.update(u.src_bytes)
        except BaseException as e:  # noqa: BLE001 — run() raises the first failure in plan order among the units that ran
            with self.lock:
                if self.error is None or u.index < self.error[0]:
                    self.error = (u.index, e)
            self.budget.abort()
        finally:
            self.budget.release(cost[0])

    def _copy(self, u: Unit, cost: list) -> None:
        src = u.t.sources[0]
        buf = self._slab("src", u.length)  # at most COPY_CHUNK_BYTES
        self.deposit(u.t.name, u.begin, self.reader.read_bytes(src, u.begin, u.length, into=buf), cost)

    def _whole(self, u: Unit, cost: list) -> None:
        t = u.t
        value = t.build(self.read)
        _check_produced(t, value, tuple(t.shape))
        if not t.quantize:
            self.deposit(t.name, 0, value.contiguous(), cost)
            return
        label = t.sources[0] if len(t.sources) == 1 else f"{t.name} (from {t.sources[0]}, ...)"
        keep = _check_kept(t, t.build(self.read_scale), value) if self._keeps_scales(t) else None
        k, errs = t.shape[-1], []
        for r, q, s, err in self._quantize(value, label, keep):  # row r of a 2-D tensor; 0 otherwise
            self.deposit(t.name, r * k, q, cost)
            self.deposit(scale_name(t.name), r * (k // mxfp8.BLOCK), s, cost)
            errs.append(err)
        self._record_error(t, error_record(t, value.dtype, _sum_errs(errs)))

    def _expert(self, u: Unit, cost: list) -> None:
        t, e = u.t, u.expert
        n, k = t.shape[1], t.shape[-1]
        job = self._job(t)
        row, errs = 0, []
        row_bytes = (1 if t.quantize else t.dtype.itemsize) * k
        parts = t.expert_rows(self.read, e)
        keeps = t.expert_rows(self.read_scale, e) if self._keeps_scales(t) else [None] * len(parts)
        if len(keeps) != len(parts):
            raise RuntimeError(f"{t.name}: expert {e} has {len(parts)} row parts but {len(keeps)} scale parts")
        for part, keep in zip(parts, keeps):  # [rows, K], [rows, K/32] or None
            _check_produced(t, part, (part.shape[0], k))
            if row + part.shape[0] > n:
                break
            if t.quantize:
                keep = None if keep is None else _check_kept(t, keep, part)
                try:
                    for r, q, s, err in self._quantize(part, t.name, keep):  # [rows', K] chunks, written at once
                        self.deposit(t.name, (e * n + row + r) * row_bytes, q, cost)
                        job.scale[e, row + r:row + r + q.shape[0]] = s
                        errs.append(err)
                except mxfp8.MXFP8Error as exc:  # name the offending source tensor, not the stacked output
                    raise mxfp8.MXFP8Error(str(exc).replace(t.name, _expert_label(t, e, self.read), 1)) from None
            else:
                self.deposit(t.name, (e * n + row) * row_bytes, part.contiguous(), cost)
            row += part.shape[0]
        if row != n:
            raise ProduceError(f"{t.name}: expert {e} has {row if row <= n else 'more than ' + str(n)} rows, "
                              f"expected {n}")
        self._expert_done(t, job, e, errs, cost)

    def _job(self, t: OutTensor) -> _Job:
        with self.lock:
            job = self.jobs.get(t.name)
            if job is None:
                scale = (torch.empty(tuple(t.shape[:-1]) + (t.shape[-1] // mxfp8.BLOCK,), dtype=torch.uint8)
                         if t.quantize else None)  # [E, N, K/32]
                job = self.jobs[t.name] = _Job(t.shape[0], scale, [None] * t.shape[0])
            return job

    def _expert_done(self, t: OutTensor, job: _Job, e: int, errs: list, cost: list) -> None:
        with job.lock:
            job.errs[e] = errs
            job.left -= 1
            last = job.left == 0
        if not last:
            return
        with self.lock:
            self.jobs.pop(t.name, None)
        if t.quantize:
            self.deposit(scale_name(t.name), 0, job.scale, [0])
            self._record_error(t, error_record(t, t.dtype, _sum_errs([x for es in job.errs for x in es])))

    def _quantize(self, w: torch.Tensor, name: str, keep: Optional[torch.Tensor] = None):
        """Yields (first row, q, scale, error sums) per chunk of rows of w, in row order, results on the CPU.
        keep: scale bytes to re-quantize with ([..., K/32]: an MXFP8 source's own), None for the rounding rule.
        CPU: chunks of quant_sizes(workers) elements (each is written out before the next is made).
        CUDA: the whole of w at once (_quantize_cuda); a part that is ready before the CUDA context (made on
        the init thread, ~0.3-0.5 s on the H200 machine) goes the CPU way instead of waiting for it, where the
        C quantizer takes it: the same bytes, and for a few seconds the machine's cores are not idle."""
        if self.device.type == "cuda":
            if not (self.cpu_start and not self.cuda_ready.is_set() and mxfp8_native.supports(w, keep)):
                yield (0, *self._quantize_cuda(w, name, keep))
                return
            with self.lock:
                self.parts_on_cpu += 1
        chunk, tile = self.quant_sizes
        rows = max(1, chunk // max(1, w.shape[-1])) if w.ndim == 2 else 0
        if w.ndim != 2 or rows >= w.shape[0]:
            yield (0, *mxfp8.quantize_with_error(w, self.rounding, name, keep_scale=keep, tile_blocks=tile))
            return
        for r in range(0, w.shape[0], rows):
            yield (r, *mxfp8.quantize_with_error(w[r:r + rows], self.rounding, name, tile_blocks=tile,
                                                 keep_scale=None if keep is None else keep[r:r + rows]))

    def _quantize_cuda(self, w: torch.Tensor, name: str, keep: Optional[torch.Tensor] = None) -> tuple:
        """One CUDA stream per worker thread: pinned part -> GPU (async), quantize and error sums on the
        GPU, values and scales -> pinned host buffers (async). Workers in flight overlap each other's
        copies, kernels and disk I/O (reads ahead, pwrite and hashing behind)."""
        self._register_pending()  # the read slab, once per worker
        stream = getattr(self.local, "stream", None)
        if stream is None:
            stream = self.local.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            x = w.to(self.device, non_blocking=True)
            keep = None if keep is None else keep.to(self.device, non_blocking=True)
            fused_quantizer = self._fused()
            fused = fused_quantizer is not None and fused_quantizer.supports(x, keep)
            if fused:  # two launches, no device sync inside; NaN/Inf are counted and refused below
                q, s, stats = fused_quantizer.quantize_with_error(x, self.rounding, name)
            else:
                q, s, err = mxfp8.quantize_with_error(x, self.rounding, name, host_stats=False, keep_scale=keep)
                stats = torch.stack([err["err_sq"], err["ref_sq"], err["max_abs_error"]])
            self.local.out_at = 0  # the previous part's results were written out before this part
            q_host = self._slab("out", q.numel()).view(q.dtype).view(q.shape)
            s_host = self._slab("out", s.numel()).view(s.shape)
            self._register_pending()  # the results slab, once per worker
            q_host.copy_(q, non_blocking=True)
            s_host.copy_(s, non_blocking=True)
            stats = stats.to("cpu", non_blocking=True)
            stream.synchronize()
        del x, q, s  # w (pinned slab) is reused only after this sync: its async copy has finished
        if fused and float(stats[3]) != 0:  # the fused kernel's count of NaN and Inf elements
            raise mxfp8.nonfinite_error(name)
        return q_host, s_host, {"err_sq": float(stats[0]), "ref_sq": float(stats[1]),
                                "max_abs_error": float(stats[2])}


def _load_libc():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()


def libc_function(name: str, *argtypes):
    """A glibc function through ctypes (which drops the GIL while it runs), with its argument types, or None
    where libc.so.6 or the function is unavailable: its callers treat it as a hint and skip it then."""
    fn = getattr(_LIBC, name, None)
    if fn is not None:
        fn.argtypes = list(argtypes)
    return fn


_SYNC_FILE_RANGE = libc_function("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_MADVISE = libc_function("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def prefault(buf: torch.Tensor) -> None:
    """Fault a fresh buffer's pages in before it is page-locked, as transparent huge pages where the kernel
    allows (madvise MADV_HUGEPAGE, then memset; ctypes drops the GIL for both). Registering fresh memory
    makes cudaHostRegister fault every page in itself, inside the CUDA driver: 16 workers registering ~114 MB
    each at the start of a --device cuda conversion spent 2.8 thread-seconds there (0.6 of them on a CPU),
    while the other workers' first CUDA calls waited (H200 machine, 3.2 GB checkpoint). Touched first,
    registering took 1.1 thread-seconds (0.2 on a CPU), the touching 2.4 (all on a CPU: first touch is slow
    in that VM). With the context made in the background (Pipeline._init_cuda_async), 8.1 GB on cuda went
    3.13 -> 2.84 s; how much of that each of the two gives was not separated."""
    n = buf.numel() * buf.element_size()
    if not n:
        return
    addr = buf.data_ptr()
    page = os.sysconf("SC_PAGE_SIZE")
    start, end = -(-addr // page) * page, (addr + n) // page * page
    if _MADVISE is not None and end > start:
        _MADVISE(start, end - start, 14)  # MADV_HUGEPAGE; a hint
    ctypes.memset(addr, 0, n)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing these bytes to disk now (SYNC_FILE_RANGE_WRITE: asynchronous), so the
    fsync before the index finds little left to do. Without it nothing is written back until gigabytes are
    dirty, and the whole output is flushed at the end. No-op where sync_file_range is unavailable."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, 2)


def sync_files(paths: list, workers: int) -> float:
    """fsync every file (in parallel; the kernel has been writing them back all along). Returns seconds."""
    import time
    t0 = time.perf_counter()

    def sync(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    with ThreadPoolExecutor(max(1, min(workers, len(paths)))) as pool:
        list(pool.map(sync, paths))
    return time.perf_counter() - t0


def _check_produced(t: OutTensor, value: torch.Tensor, shape: tuple) -> None:
    if value.dtype != t.dtype or tuple(value.shape) != shape:
        raise RuntimeError(f"{t.name}: planned {t.dtype} {shape}, produced {value.dtype} {tuple(value.shape)}")


def _check_kept(t: OutTensor, keep: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """keep must be the uint8 scale rows of value ([..., K/32]); anything else means t's builder did more
    than pick rows, so its scale rows cannot follow its value rows."""
    want = tuple(value.shape[:-1]) + (value.shape[-1] // mxfp8.BLOCK,)
    if keep.dtype != torch.uint8 or tuple(keep.shape) != want:
        raise RuntimeError(f"{t.name}: its builder applied to the source scales gave {keep.dtype} "
                           f"{tuple(keep.shape)}, expected uint8 {want}; a builder may only pick rows")
    return keep


def _sum_errs(errs: list) -> dict:
    total = {"err_sq": 0.0, "ref_sq": 0.0, "max_abs_error": 0.0}
    for err in errs:  # plan order: the same float sums whatever the worker count
        total["err_sq"] += err["err_sq"]
        total["ref_sq"] += err["ref_sq"]
        total["max_abs_error"] = max(total["max_abs_error"], err["max_abs_error"])
    return total


def error_record(t: OutTensor, src_dtype, err: dict) -> dict:
    rel = (err["err_sq"] / err["ref_sq"]) ** 0.5 if err["ref_sq"] else 0.0
    return {"source_dtype": dtype_name(src_dtype), "scale": scale_name(t.name),
            "rel_fro_error": rel, "max_abs_error": err["max_abs_error"]}


def _expert_label(t: OutTensor, e: int, read) -> str:
    """Names the source tensor(s) of expert e, the non-finite one first when there is one."""
    n = len(t.sources) // t.shape[0] if len(t.sources) % t.shape[0] == 0 else 0
    srcs = t.sources[e * n:(e + 1) * n] if n else t.sources
    bad = [s for s in srcs if n and not bool(torch.isfinite(read(s).float()).all())]
    return f"{bad[0] if bad else ', '.join(srcs)} (expert {e} of {t.name})"
