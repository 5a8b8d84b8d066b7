"""Units of work and their sizes: one expert of a stacked expert tensor, a byte range of a tensor carried
verbatim, or one whole plain tensor, each with the bytes it takes from the memory budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from porter.format import mxfp8, mxfp8_native
from porter.format.layout import OutTensor
from porter.format.safetensors_io import SHARD_METADATA, header_bytes

COPY_CHUNK_BYTES = 64 << 20  # verbatim tensors are copied in ranges of this size
QUANT_CHUNK_ELEMS = (
    1 << 20
)  # elements per CPU quantize call up to 2 workers (porter.format.mxfp8 tiles them itself)
MANY_WORKERS_QUANT_ELEMS = 1 << 22  # ... and per call, in one tile, past 2 workers (quant_sizes)
# Working memory of one CPU quantize call per element, besides its results: 16 bounds the torch path's
# reference fallback, 9 the C quantizer's statistics plus what the allocator keeps (docs/convert.md).
TORCH_WORK_BYTES_PER_ELEM = 16
NATIVE_WORK_BYTES_PER_ELEM = 9
SLAB_MAX_BYTES = 256 << 20  # CPU reads up to this size go into the worker's reused buffer
# Output shards written at once: buffered writes into one file serialize on its inode lock, so a few files
# at once spread them; few enough that a killed run loses at most this many partial shards to --resume.
SHARDS_IN_FLIGHT = 4


@dataclass
class Place:
    shard: str
    offset: int  # absolute byte offset of the entry's data in its shard
    nbytes: int


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


def places_of(shards: list) -> dict:
    """entry name -> Place, from the plan's shards [(file, [Entry, ...])] (the header is fixed up front)."""
    places = {}
    for f, entries in shards:
        offset = len(header_bytes(entries, SHARD_METADATA))
        for e in entries:
            places[e.name] = Place(f, offset, e.nbytes)
            offset += e.nbytes
    return places


def src_bytes(t: OutTensor) -> int:
    """Bytes one unit of t reads (one expert, or the whole tensor), at t's dtype."""
    shape = tuple(t.shape[1:]) if t.per_expert else tuple(t.shape)
    n = t.dtype.itemsize
    for d in shape:
        n *= d
    return n


def out_bytes(t: OutTensor) -> int:
    """Values + scales of one unit of a quantized tensor (one expert, or the whole tensor)."""
    elems = src_bytes(t) // t.dtype.itemsize
    return elems + elems // mxfp8.BLOCK


def verbatim_source(t: OutTensor, meta: dict) -> Optional[str]:
    """The source tensor that `t` is a byte-for-byte copy of, or None: one source of t's dtype and shape whose
    builder hands the read on unchanged. Such tensors (embeddings, lm_head) are copied in ranges, never held
    whole."""
    if t.per_expert or t.quantize or len(t.sources) != 1:
        return None
    src = t.sources[0]
    if meta.get(src) is None or (meta[src][0], tuple(meta[src][1])) != (t.dtype, tuple(t.shape)):
        return None
    return None if builder_copies(t, meta) else src


def builder_copies(t: OutTensor, meta: dict) -> bool:
    """Whether building one unit of t (expert 0, or the whole tensor) makes a new tensor from what it reads
    (uninterleaving a fused gate_up, dequantizing, concatenating) rather than handing the reads on. Found by
    calling the builder with a reader of shape-only (meta) tensors; any failure counts as a copy."""
    probes = []

    def read(name, index=None):
        dtype, shape = meta[name]
        shape = tuple(shape) if index is None else tuple(shape)[1:]
        probes.append(torch.empty(shape, dtype=dtype, device="meta"))
        return probes[-1]

    try:
        parts = t.expert_rows(read, 0) if t.per_expert else [t.build(read)]
    except Exception:  # noqa: BLE001 — a builder that cannot run on shapes alone: assume it copies
        return True
    if not t.per_expert and tuple(parts[0].shape) != tuple(t.shape):
        return True
    return not all(any(p is q for q in probes) for p in parts)


def native_quantizes(t: OutTensor, meta: dict) -> bool:
    """Whether the CPU path quantizes t with the compiled C quantizer: t's dtype and shape are ones it takes
    and every source is stored as it is read (stored_meta leaves out pre-quantized weights)."""
    return all(s in meta for s in t.sources) and mxfp8_native.takes(t.dtype, t.shape[-1])


def quant_sizes(workers: int) -> tuple[int, Optional[int]]:
    """(elements per CPU quantize call, blocks per tile or None for mxfp8's default). Every torch op re-takes
    the GIL, so past 2 workers a call is one large tile: far fewer ops per byte for a little more CPU time.
    Same bytes and statistics."""
    if workers <= 2:
        return QUANT_CHUNK_ELEMS, None
    return MANY_WORKERS_QUANT_ELEMS, MANY_WORKERS_QUANT_ELEMS // mxfp8.BLOCK


def unit_costs(t: OutTensor, device: torch.device, workers: int, meta: dict) -> tuple[int, int]:
    """(working set, output bytes) of one unit of t, in bytes. meta: the source's stored_meta (a source it
    lacks counts as a builder copy and the torch quantizer)."""
    src = src_bytes(t)
    read = src if device.type == "cpu" and src > SLAB_MAX_BYTES else 0  # smaller reads live in the slab
    if not t.quantize:
        return read, src  # the value: the read itself, or a copy a builder makes of it
    copied = src if builder_copies(t, meta) else 0
    chunk = min(src // t.dtype.itemsize, quant_sizes(workers)[0])
    per_elem = NATIVE_WORK_BYTES_PER_ELEM if native_quantizes(t, meta) else TORCH_WORK_BYTES_PER_ELEM
    work = per_elem * chunk  # one CPU quantize call
    out = chunk + chunk // mxfp8.BLOCK  # its q and scale bytes
    if device.type == "cpu":
        return read + copied + work, out
    # GPU: reads and results live in pinned slabs; a part quantized on the CPU while the CUDA context
    # starts takes the CPU call's memory
    return copied + work + out, 0


def make_units(
    tensors: list, meta: dict, skip: Callable[[OutTensor], bool], device: torch.device, workers: int = 1
) -> list:
    units = []
    for t in tensors:
        if not skip(t):
            units.extend(_units_of(t, meta, device, workers, len(units)))
    return units


def _units_of(t: OutTensor, meta: dict, device: torch.device, workers: int, first: int) -> list:
    work, out = unit_costs(t, device, workers, meta)
    if t.per_expert:
        return [
            Unit(first + e, t, "expert", expert=e, src_bytes=src_bytes(t), cost=work + out)
            for e in range(t.shape[0])
        ]
    if verbatim_source(t, meta) is None:
        return [Unit(first, t, "whole", src_bytes=src_bytes(t), cost=work + out)]
    total, units = src_bytes(t), []
    for begin in range(0, max(total, 1), COPY_CHUNK_BYTES):  # a 0-byte tensor still gets its unit
        n = min(COPY_CHUNK_BYTES, total - begin)  # cost 0: its bytes live in the worker's read slab
        units.append(Unit(first + len(units), t, "copy", begin=begin, length=n, src_bytes=n, cost=0))
    return units


def shards_in_flight(workers: int) -> int:
    """Output shards written at once: SHARDS_IN_FLIGHT, never more than one per worker."""
    return max(1, min(SHARDS_IN_FLIGHT, workers))


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


def pinned_slab_bytes(reads: list, quantized: list) -> dict:
    """Sizes of one worker's staging buffers on the GPU path, for units reading up to max(reads) bytes each
    and quantizing these tensors: src holds a unit's reads (each 64-byte aligned), out one part's results."""
    out = max((out_bytes(t) for t in quantized), default=0)
    return {"src": max(reads, default=0) + 4096, "out": out + 4096}
