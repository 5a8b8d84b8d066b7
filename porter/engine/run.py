"""The Pipeline: runs a plan's units on a pool of worker threads in a memory budget, each unit reading,
quantizing (on the CPU or the GPU) and handing its bytes to the shard writer."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from porter.cores import available_cores
from porter.engine.budget import Budget, memory_estimate
from porter.engine.cuda import CudaQuantizer
from porter.engine.faults import fault_point
from porter.engine.produce import (
    check_kept,
    check_produced,
    error_record,
    expert_label,
    quantize_on_cpu,
    sum_errs,
)
from porter.engine.slabs import Slabs
from porter.engine.units import (
    Unit,
    interleave_shards,
    pinned_slab_bytes,
    quant_sizes,
    shards_in_flight,
    src_bytes,
)
from porter.engine.writer import ShardWriter
from porter.errors import ProduceError
from porter.format import mxfp8, mxfp8_native
from porter.format.layout import OutTensor
from porter.format.safetensors_io import TensorReader

log = logging.getLogger("porter")


@dataclass
class _Job:
    """A stacked expert tensor in flight: its scale array and per-expert error sums, until all are in."""

    left: int
    scale: Optional[torch.Tensor]
    errs: list
    lock: threading.Lock = field(default_factory=threading.Lock)


class Pipeline:
    def __init__(
        self,
        plan,
        out: Path,
        done: dict,
        stats: dict,
        *,
        workers: int,
        max_memory: int,
        device: torch.device,
        on_shard_done: Callable[[str, dict], None],
        progress=None,
    ):
        self.plan, self.workers, self.device, self.progress = plan, workers, device, progress
        self.rounding = plan.options.scale_rounding
        self.quant_sizes = quant_sizes(workers)
        self.reader = TensorReader(plan.source.spans)
        self.writer = ShardWriter(plan, out, done, stats, on_shard_done)
        self.slabs = Slabs(device)
        self.gpu = CudaQuantizer(device, self.rounding, self.slabs)
        self.estimate = memory_estimate(plan.tensors, plan.source.stored_meta, workers, device, max_memory)
        self.budget = Budget(self.estimate["inflight"])
        self.lock = threading.Lock()  # error, jobs, progress
        self.jobs: dict = {}
        self.error: Optional[tuple] = None  # (unit index, exception) of the first failure in plan order

    # -- running
    def run(self, units: list) -> None:
        width = shards_in_flight(self.workers)
        units = interleave_shards(units, lambda u: self.writer.shard_of(u.t.name), width)
        if self.slabs.pin:
            reads = [u.length if u.kind == "copy" else src_bytes(u.t) for u in units]
            self.slabs.sizes = pinned_slab_bytes(reads, [u.t for u in units if u.t.quantize])
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, available_cores() // self.workers))  # each worker's torch ops: its share
        self.writer.start()
        self.gpu.start()
        try:
            self._run_all(units)
        finally:
            torch.set_num_threads(threads)
            self._shut_down()
        if self.error is not None:
            raise self.error[1]
        if left := self.writer.unfinished():
            raise RuntimeError(f"internal: shard(s) {left} not complete after every unit ran")
        if self.gpu.parts_on_cpu:
            log.info(
                "%d part(s) quantized on the CPU while the CUDA context started (the same bytes)",
                self.gpu.parts_on_cpu,
            )

    def _run_all(self, units: list) -> None:
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="porter-convert")
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

    def _shut_down(self) -> None:
        self.reader.close()
        self.writer.stop(failed=self.error is not None)
        self.gpu.stop()
        try:
            self.slabs.release()  # last: after a worker's CUDA error its synchronize may raise too
        except Exception:
            if self.error is None:
                raise  # else the worker's error (raised by run) says what went wrong

    def _run_unit(self, u: Unit) -> None:
        self.slabs.reset("src")
        try:
            if self.error is None:
                {"expert": self._expert, "copy": self._copy, "whole": self._whole}[u.kind](u)
                fault_point("unit")
                if self.progress is not None:
                    with self.lock:
                        self.progress.update(u.src_bytes)
        except BaseException as e:  # noqa: BLE001 — run() raises the first failure in plan order
            with self.lock:
                if self.error is None or u.index < self.error[0]:
                    self.error = (u.index, e)
            self.budget.abort()
        finally:
            self.budget.release(u.cost)

    # -- reads
    def read(self, name: str, index: Optional[int] = None) -> torch.Tensor:
        pre = (
            self.plan.source.prequantized
        )  # a quantized source weight: dequantized (porter.format.prequantized)
        if pre is not None and name in pre.scales:
            return pre.dequantize(
                self.reader.read(name, index),
                self.reader.read(pre.scales[name], index),
                f"{self.reader.spans[name][0]}: tensor {name!r}" + ("" if index is None else f"[{index}]"),
            )
        n = self.reader.nbytes(name, index)
        if self.slabs.stages(n):
            return self.reader.read(name, index, into=self.slabs.take("src", n))
        return self.reader.read(name, index)

    def read_scale(self, name: str, index: Optional[int] = None) -> torch.Tensor:
        """uint8 [..., K/32] scale bytes that re-quantizing source tensor `name` (or its row `index`) keeps:
        an MXFP8 source weight's own, any other tensor's by the rounding rule. A builder given this reader
        yields its value's scale rows (builders only pick rows: porter.format.layout.OutTensor)."""
        pre = self.plan.source.prequantized
        if name in pre.scales:
            return pre.kept_scale(self.reader.read(pre.scales[name], index))
        return mxfp8.quantize(self.reader.read(name, index), self.rounding, name)[1]

    def _keeps_scales(self, t: OutTensor) -> bool:
        """t is re-quantized with kept source scale bytes: an MXFP8 source weight is among its sources."""
        pre = self.plan.source.prequantized
        return t.quantize and pre is not None and pre.keeps_scales and any(s in pre.scales for s in t.sources)

    # -- units
    def _copy(self, u: Unit) -> None:
        buf = self.slabs.take("src", u.length)  # at most COPY_CHUNK_BYTES
        data = self.reader.read_bytes(u.t.sources[0], u.begin, u.length, into=buf)
        self.writer.deposit(u.t.name, u.begin, data)

    def _whole(self, u: Unit) -> None:
        t = u.t
        value = t.build(self.read)
        check_produced(t, value, tuple(t.shape))
        if not t.quantize:
            self.writer.deposit(t.name, 0, value.contiguous())
            return
        label = t.sources[0] if len(t.sources) == 1 else f"{t.name} (from {t.sources[0]}, ...)"
        keep = check_kept(t, t.build(self.read_scale), value) if self._keeps_scales(t) else None
        k, errs = t.shape[-1], []
        for r, q, s, err in self._quantize(value, label, keep):  # row r of a 2-D tensor; 0 otherwise
            self.writer.deposit(t.name, r * k, q)
            self.writer.deposit(t.scale, r * (k // mxfp8.BLOCK), s)
            errs.append(err)
        self.writer.record_error(t.name, error_record(t, value.dtype, sum_errs(errs)))

    def _expert(self, u: Unit) -> None:
        t, e = u.t, u.expert
        parts = t.expert_rows(self.read, e)
        keeps = t.expert_rows(self.read_scale, e) if self._keeps_scales(t) else [None] * len(parts)
        if len(keeps) != len(parts):
            raise RuntimeError(
                f"{t.name}: expert {e} has {len(parts)} row parts but {len(keeps)} scale parts"
            )
        job, n, row, errs = self._job(t), t.shape[1], 0, []
        for part, keep in zip(parts, keeps):  # [rows, K], [rows, K/32] or None
            check_produced(t, part, (part.shape[0], t.shape[-1]))
            if row + part.shape[0] > n:
                break
            errs += self._expert_part(t, e, job, row, part, keep)
            row += part.shape[0]
        if row != n:
            raise ProduceError(
                f"{t.name}: expert {e} has {row if row <= n else 'more than ' + str(n)} rows, expected {n}"
            )
        self._expert_done(t, job, e, errs)

    def _expert_part(
        self, t: OutTensor, e: int, job: _Job, row: int, part: torch.Tensor, keep: Optional[torch.Tensor]
    ) -> list:
        """Writes rows [row, row + len(part)) of expert e (scales into the job's array); their error sums."""
        n, k = t.shape[1], t.shape[-1]
        if not t.quantize:
            self.writer.deposit(t.name, (e * n + row) * t.dtype.itemsize * k, part.contiguous())
            return []
        keep = None if keep is None else check_kept(t, keep, part)
        errs = []
        try:
            for r, q, s, err in self._quantize(part, t.name, keep):  # [rows', K] chunks, written at once
                self.writer.deposit(t.name, (e * n + row + r) * k, q)
                job.scale[e, row + r : row + r + q.shape[0]] = s
                errs.append(err)
        except mxfp8.MXFP8Error as exc:  # name the offending source tensor, not the stacked output
            raise mxfp8.MXFP8Error(str(exc).replace(t.name, expert_label(t, e, self.read), 1)) from None
        return errs

    def _job(self, t: OutTensor) -> _Job:
        with self.lock:
            job = self.jobs.get(t.name)
            if job is None:
                scale = (
                    torch.empty(tuple(t.shape[:-1]) + (t.shape[-1] // mxfp8.BLOCK,), dtype=torch.uint8)
                    if t.quantize
                    else None
                )  # [E, N, K/32]
                job = self.jobs[t.name] = _Job(t.shape[0], scale, [None] * t.shape[0])
            return job

    def _expert_done(self, t: OutTensor, job: _Job, e: int, errs: list) -> None:
        with job.lock:
            job.errs[e] = errs
            job.left -= 1
            last = job.left == 0
        if not last:
            return
        with self.lock:
            self.jobs.pop(t.name, None)
        if t.quantize:
            self.writer.deposit(t.scale, 0, job.scale)
            errs = sum_errs([x for es in job.errs for x in es])  # plan order
            self.writer.record_error(t.name, error_record(t, t.dtype, errs))

    def _quantize(self, w: torch.Tensor, name: str, keep: Optional[torch.Tensor] = None):
        """Yields (first row, q, scale, error sums) per chunk of rows of w, in row order, results on the CPU.
        keep: scale bytes to re-quantize with ([..., K/32]), None for the rounding rule. CUDA: the whole of w
        at once, except a part ready before the CUDA context that the C quantizer takes: it goes the CPU way
        (the same bytes), so the cores are not idle while the context starts."""
        if self.device.type == "cuda":
            if self.gpu.ready.is_set() or not mxfp8_native.supports(w, keep):
                yield (0, *self.gpu.quantize(w, name, keep))
                return
            self.gpu.count_cpu_part()
        yield from quantize_on_cpu(w, self.rounding, name, keep, self.quant_sizes)
