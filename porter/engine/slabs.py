"""Each worker thread's reused buffers: `src` holds a unit's reads, `out` one part's results on the GPU path.
Allocated once per worker and reset per unit, so slab memory stays workers x (unit + part) bytes and no read
page-faults fresh memory in. On the GPU path they are page-locked (async copies need it)."""

from __future__ import annotations

import logging
import threading

import torch

from porter.engine.sysio import prefault
from porter.engine.units import SLAB_MAX_BYTES

log = logging.getLogger("porter")


class Slabs:
    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"  # every read staged (async host->device copies need pinned memory)
        self.sizes: dict = {}  # which -> bytes, from the plan (pinned_slab_bytes); a slab grows only past it
        self.local = threading.local()
        self.registered: list = []
        self.lock = threading.Lock()

    def stages(self, n: int) -> bool:
        """Whether a read of n bytes goes into the src slab (on the CPU: a reused buffer instead of a fresh
        large allocation, which is mmapped and page-faulted in every time)."""
        return self.pin or n <= SLAB_MAX_BYTES

    def reset(self, which: str) -> None:
        """This worker's slab `which` is free again (views handed out before must be done with)."""
        setattr(self.local, which + "_at", 0)

    def take(self, which: str, n: int) -> torch.Tensor:
        """n bytes of this worker's slab `which`, 64-byte aligned after the previous take."""
        at = getattr(self.local, which + "_at", 0)
        slab = getattr(self.local, which, None)
        if slab is None or at + n > slab.numel():
            slab = self._new(max(self.sizes.get(which, 0), at + n))
            setattr(self.local, which, slab)
            at = 0  # views already handed out keep the old slab alive until the unit ends
        setattr(self.local, which + "_at", at + (n + 63) // 64 * 64)
        return slab[at : at + n]

    def _new(self, n: int) -> torch.Tensor:
        """On the GPU path the pages are faulted in here, in parallel and outside the CUDA driver, and the
        slab is registered with CUDA at exactly n bytes (torch's pinned allocator would round up to a power
        of two) at the worker's next GPU call, by when the CUDA context is ready (register_pending)."""
        slab = torch.empty(n, dtype=torch.uint8)
        if self.device.type != "cuda" or not n:
            return slab
        prefault(slab)
        pending = getattr(self.local, "pending", None)
        if pending is None:
            pending = self.local.pending = []
        pending.append(slab)
        return slab

    def register_pending(self) -> None:
        """Page-lock this worker's slabs made since its last GPU call."""
        pending = getattr(self.local, "pending", None)
        while pending:
            self._register(pending.pop())

    def _register(self, slab: torch.Tensor) -> None:
        """cudaHostRegister the slab. If that fails it stays pageable: CUDA then copies through its own
        staging buffers, synchronously for the host (slower, the same bytes)."""
        code = int(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), slab.numel(), 0))
        if code == 0:
            with self.lock:
                self.registered.append(slab)
            return
        # a failed call leaves CUDA's per-thread last error set, which torch's next launch check would raise
        torch.cuda.cudart().cudaGetLastError()
        log.debug(
            "cudaHostRegister of %d bytes failed (error %d); copying from pageable memory", slab.numel(), code
        )

    def release(self) -> None:
        """After the workers are done: unlock the registered slabs (once no copy can still read them)."""
        try:
            if self.registered:
                torch.cuda.synchronize(self.device)  # raises after a sticky CUDA error: unregister anyway
        finally:
            for slab in self.registered:
                torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())
            self.registered.clear()
