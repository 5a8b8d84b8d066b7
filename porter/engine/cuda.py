"""The GPU path: one CUDA stream per worker thread; a part goes pinned slab -> GPU (async), is quantized with
its error sums on the GPU, and its values and scales come back into pinned host buffers (async). Workers in
flight overlap each other's copies, kernels and disk I/O."""

from __future__ import annotations

import threading
from typing import Optional

import torch

from porter.engine.slabs import Slabs
from porter.format import mxfp8


class CudaQuantizer:
    def __init__(self, device: torch.device, rounding: str, slabs: Slabs):
        self.device, self.rounding, self.slabs = device, rounding, slabs
        self.ready = threading.Event()  # the CUDA context exists (or there is none to make)
        self.init_thread: Optional[threading.Thread] = None
        self.local = threading.local()  # per worker: its stream
        self.lock = threading.Lock()
        self.parts_on_cpu = 0  # parts quantized on the CPU while the context started (Pipeline._quantize)

    def start(self) -> None:
        """Make the CUDA context on a background thread while the workers start reading; their first CUDA
        call waits for it. An error here is left to that call to raise."""
        if self.device.type != "cuda":
            self.ready.set()
            return

        def init():
            try:
                torch.empty(1, device=self.device)
            except Exception:  # noqa: BLE001 — the workers' own CUDA calls raise it where it is handled
                pass
            finally:
                self.ready.set()

        self.init_thread = threading.Thread(target=init, name="porter-cuda-init", daemon=True)
        self.init_thread.start()

    def stop(self) -> None:
        """Not left inside CUDA's init at interpreter exit (after a fast failure)."""
        if self.init_thread is not None:
            self.init_thread.join()
            self.init_thread = None

    def count_cpu_part(self) -> None:
        with self.lock:
            self.parts_on_cpu += 1

    def quantize(self, w: torch.Tensor, name: str, keep: Optional[torch.Tensor] = None) -> tuple:
        """(q, scale, error sums) of w, q and scale in this worker's pinned `out` slab."""
        self.slabs.register_pending()  # the read slab, once per worker
        stream = getattr(self.local, "stream", None)
        if stream is None:
            stream = self.local.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            x = w.to(self.device, non_blocking=True)
            keep = None if keep is None else keep.to(self.device, non_blocking=True)
            q, s, err = mxfp8.quantize_with_error(x, self.rounding, name, host_stats=False, keep_scale=keep)
            stats = torch.stack([err["err_sq"], err["ref_sq"], err["max_abs_error"]])
            self.slabs.reset("out")  # the previous part's results were written out before this part
            q_host = self.slabs.take("out", q.numel()).view(q.dtype).view(q.shape)
            s_host = self.slabs.take("out", s.numel()).view(s.shape)
            self.slabs.register_pending()  # the results slab, once per worker
            q_host.copy_(q, non_blocking=True)
            s_host.copy_(s, non_blocking=True)
            stats = stats.to("cpu", non_blocking=True)
            stream.synchronize()
        del x, q, s  # w (pinned slab) is reused only after this sync: its async copy has finished
        return (
            q_host,
            s_host,
            {"err_sq": float(stats[0]), "ref_sq": float(stats[1]), "max_abs_error": float(stats[2])},
        )
