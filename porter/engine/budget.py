"""How much the engine may hold at once: the memory estimate (--dry-run), the budget units run in, and the
worker count a conversion starts from. (The device is checked by porter.devices.resolve_device, the one
rule every command and runtime.load use.)"""

from __future__ import annotations

import logging
import math
import threading

import torch

from porter.cores import available_cores
from porter.engine.sysio import memory_status
from porter.engine.units import (
    COPY_CHUNK_BYTES,
    SLAB_MAX_BYTES,
    pinned_slab_bytes,
    shards_in_flight,
    src_bytes,
    unit_costs,
    verbatim_source,
)
from porter.format import mxfp8, safetensors_io
from porter.format.layout import OutTensor

log = logging.getLogger("porter")

ESTIMATE_MARGIN_BYTES = 32 << 20  # a conversion's peak moves by ~20 MB between runs (docs/convert.md)
CUDA_CONTEXT_BYTES = 400 << 20  # host memory of the CUDA context, its libraries and kernels (docs/convert.md)


def default_workers() -> int:
    """`--workers` when not given: one more than the cores this process may run on, so that a worker blocked
    (in the journal's fsync, on the memory budget, on a page the kernel is reading) leaves no core idle."""
    return available_cores() + 1


def default_max_memory() -> int:
    """What this process holds now plus half of the memory available (the page cache and the rest of the
    machine keep the other half). The budget caps the process's peak, and the pages it already holds are
    not part of MemAvailable: on a busy machine a small conversion still fits."""
    mem = memory_status()
    return resident_bytes(mem) + int(mem.get("MemAvailable", 8 << 30) * 0.5)


def resident_bytes(mem: dict) -> int:
    """This process as it is now: its resident anonymous and file-backed pages (/proc/self/status)."""
    return mem.get("RssAnon", 0) + mem.get("RssFile", 0)


def memory_estimate(tensors: list, meta: dict, workers: int, device: torch.device, max_memory: int) -> dict:
    """Expected peak RSS of a conversion (what --dry-run prints) and the budget the pipeline runs in: this
    process as it is now (+ the CUDA context on a GPU) and the workers' slabs, plus the bytes in flight (each
    worker's unit, capped by --max-memory), plus the scale arrays of the stacked expert tensors being filled,
    plus the hash read-back buffers, plus ESTIMATE_MARGIN_BYTES."""
    base = _base_bytes(tensors, meta, workers, device)
    copied = [verbatim_source(t, meta) is not None for t in tensors]
    costs = [
        (0, 0) if c else unit_costs(t, device, workers, meta)  # a copied range lives in the slab
        for t, c in zip(tensors, copied)
    ]
    unit = max((w + o for w, o in costs), default=0)
    scales = _open_scale_bytes(tensors, workers)
    readback = workers * readback_bytes(tensors)  # each worker may read a chunk back to hash it
    inflight = max(unit, min(workers * unit, budget_for(max_memory, base, scales + readback)))
    return {
        "base": base,
        "unit": unit,
        "workers": workers,
        "inflight": inflight,
        "scales": scales,
        "readback": readback,
        "margin": ESTIMATE_MARGIN_BYTES,
        "total": base + inflight + scales + readback + ESTIMATE_MARGIN_BYTES,
        "max_memory": max_memory,
    }


def readback_bytes(tensors: list) -> int:
    """The part of a worker's read-back buffer a hash touches: one digest chunk, or the largest tensor of a
    plan whose tensors are all smaller (the buffer's other pages are never written, so never resident)."""
    written = (math.prod(t.shape) * (1 if t.quantize else t.dtype.itemsize) for t in tensors)  # e4m3: 1 byte
    return min(safetensors_io.DIGEST_CHUNK_BYTES, max(written, default=0))


def _base_bytes(tensors: list, meta: dict, workers: int, device: torch.device) -> int:
    """This process now (what is resident: resident_bytes), the CUDA context on a GPU unless this process has
    started it already (then it is resident), and every worker's slabs (kept for the whole run)."""
    base = resident_bytes(memory_status())
    reads = [
        min(COPY_CHUNK_BYTES, src_bytes(t)) if verbatim_source(t, meta) is not None else src_bytes(t)
        for t in tensors
    ]  # one unit's reads
    if device.type == "cuda":  # pinned slabs, registered at their size
        slabs = sum(pinned_slab_bytes(reads, [t for t in tensors if t.quantize]).values())
        context = 0 if torch.cuda.is_initialized() else CUDA_CONTEXT_BYTES
        return base + context + workers * slabs
    return base + workers * max((r for r in reads if r <= SLAB_MAX_BYTES), default=0)


def _open_scale_bytes(tensors: list, workers: int) -> int:
    """Scale arrays being filled: one per shard in flight, plus one where a shard moves from one tensor to
    the next (an array's pages become resident as its experts land, so not every open one is full)."""
    return sum(sorted(scale_array_bytes(t) for t in tensors)[-(shards_in_flight(workers) + 1) :])


def scale_array_bytes(t: OutTensor) -> int:
    """The [E, N, K/32] scale array a stacked expert tensor keeps in memory until its last expert is in."""
    if not (t.per_expert and t.quantize):
        return 0
    n = t.shape[-1] // mxfp8.BLOCK
    for d in t.shape[:-1]:
        n *= d
    return n


def budget_for(max_memory: int, base: int, reserved: int) -> int:
    return max_memory - base - reserved


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
