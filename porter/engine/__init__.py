"""The conversion engine: read -> quantize -> hash -> write on every core (or the GPU), in a memory budget.

Work is cut into units in plan order (units.py): one expert of a stacked expert tensor, a byte range of a
tensor carried verbatim, or one whole plain tensor; they run interleaved over a few output shards at a time,
each shard's own units in plan order. The plan fixes every shard's header, so every output byte has a known
place: a worker writes its results with pwrite as soon as they exist, in any order (writer.py), and each
16 MiB digest chunk is hashed by the worker whose write completes it (digests.py). A unit takes its working
set plus its output bytes from the budget before it starts (budget.py), so memory stays flat with model
size. Bytes, digests and error statistics do not depend on the worker count or on timing.

Generic over `porter.format.layout.OutTensor` lists: nothing here knows an architecture. docs/convert.md, "How the
engine works", gives the tuning constants' reasons and measurements.
"""

from porter.engine.budget import default_max_memory, default_workers, memory_estimate
from porter.engine.faults import arm as arm_faults
from porter.engine.faults import fault_point
from porter.engine.run import Pipeline
from porter.engine.sysio import libc_function, sync_files
from porter.engine.units import make_units

__all__ = [
    "Pipeline",
    "arm_faults",
    "default_max_memory",
    "default_workers",
    "fault_point",
    "libc_function",
    "make_units",
    "memory_estimate",
    "sync_files",
]
