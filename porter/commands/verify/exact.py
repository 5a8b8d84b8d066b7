"""Step 2 of `porter verify`: re-derive every artifact tensor from the source and compare bytes.

MXFP8 is deterministic, so each quantized tensor is re-quantized from its source (found through verify's
own mapping table, mapping.py) with porter.format.mxfp8 and the rule recorded in porter.json, and its e4m3
bytes and scale bytes must be identical; mismatches are counted per 32-element block (a block differs when any
of its 32 value bytes or its scale byte differs), per tensor and per expert. Tensors that were not
quantized must be bit-identical to their source (same dtype, same bytes). A pre-quantized source is
compared as the conversion read it (mapping.py): dequantized values, and an MXFP8 source's own scale
bytes where the conversion kept them (porter.json options.source_quantization). The relative weight error
||deq(Q) - W|| / ||W|| is computed on the same pass as a second opinion (threshold max_weight_error).

Streaming, tensor by tensor and expert by expert, in row chunks of bounded size: on the verify device
when it is a GPU, else on every CPU core (one single-threaded worker per core).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm import tqdm

from porter.commands.verify.mapping import ArtifactReader, Derivation, Mapping, unstage
from porter.commands.verify.verdict import ExactResult, TensorCheck
from porter.cores import available_cores
from porter.format import mxfp8
from porter.format.layout import layer_of

log = logging.getLogger("porter")

CHUNK_ELEMENTS = 1 << 20  # elements compared at a time per CPU worker: ~40 MB of temporaries each, beside the
# layers a streamed pass holds (exact bytes runs inside it)
READ_GBPS = 2.0  # disk read rate assumed by the cost estimate (NVMe class; a network disk is slower)


@dataclass
class UnitResult:
    """One expert (or a whole plain tensor): counts of compared and differing blocks (or elements)."""

    expert: Optional[int]
    compared: int = 0
    mismatched: int = 0
    scale_mismatched: int = 0
    first: Optional[str] = None
    err_sq: float = 0.0
    ref_sq: float = 0.0
    problem: Optional[str] = None

    @property
    def weight_error(self) -> float:
        return (
            math.sqrt(self.err_sq / self.ref_sq)
            if self.ref_sq > 0
            else (0.0 if self.err_sq == 0 else math.inf)
        )


def rederive(
    reader: ArtifactReader,
    mapping: Mapping,
    rounding: Optional[str],
    device: torch.device,
    progress: bool = False,
) -> ExactResult:
    """Every artifact tensor re-derived and compared, reading source and artifact itself."""
    exact = ExactBytes(reader, mapping, rounding, device, progress)
    exact.run()
    return exact.result()


class ExactBytes:
    """Step 2's work: every artifact tensor with its derivation, compared either by run() (reading the
    layers itself, the next one read ahead on a GPU) or a decoder layer at a time by run_layer() on what is
    staged now: inside a layer-streamed teacher-forced pass, on the pass's own reads of that layer, so that
    each layer of source and artifact is read once for both steps (docs/verify.md, "Cost")."""

    def __init__(self, reader: ArtifactReader, mapping: Mapping, rounding, device, progress: bool = False):
        self.reader, self.mapping, self.rounding, self.device = reader, mapping, rounding, device
        self.progress = progress
        jobs = [(n, mapping.derive(reader.canonical(n), reader.experts(n))) for n in reader.weights()]
        self.order = [n for n, _ in jobs]
        self.layers: dict = {}  # layer (None: outside the layers) -> [(name, derivation)], manifest order
        for n, d in jobs:
            self.layers.setdefault(layer_of(reader.canonical(n)), []).append((n, d))
        self.checks: dict = {}  # name -> TensorCheck
        self.seconds = 0.0
        self.workers = 2 if device.type == "cuda" else available_cores()  # the cores this process may use
        self._logged = False

    def source_bytes(self, layer) -> int:
        """Bytes of the source tensors a decoder layer (None: the tensors outside the layers) derives from."""
        return self._src_bytes(self.layers.get(layer, []))

    def artifact_names(self, layer) -> set:
        """The artifact tensors (values; their scales come with them) of a decoder layer."""
        return {n for n, _ in self.layers.get(layer, [])}

    def run(self, layers=None) -> None:
        """Compare the tensors of `layers` (default: every layer not compared yet), reading them itself."""
        todo = [k for k in (self.layers if layers is None else layers) if not self._done(k)]
        jobs = [j for k in todo for j in self.layers[k]]
        if not jobs:
            return
        self._log(jobs)
        bar = tqdm(
            total=self._src_bytes(jobs),
            unit="B",
            unit_scale=True,
            desc="exact bytes",
            disable=not self.progress,
        )
        self._compare([self.layers[k] for k in todo], reads_ahead(self.device), bar)
        bar.close()

    def run_layer(self, layer) -> list:
        """Compare the tensors of one decoder layer on the bytes staged for it now (or the mapped shards);
        the layer's TensorChecks."""
        if not self._done(layer):
            self.log_estimate()
            self._compare([self.layers[layer]], False, None)
        return [self.checks[n] for n, _ in self.layers.get(layer, [])]

    def proved(self) -> list:
        """MXFP8 tensors compared so far and byte-identical to their re-derivation (every block)."""
        return [n for n, c in self.checks.items() if c.quantized and c.exact and c.blocks]

    def result(self) -> ExactResult:
        checks = [self.checks[n] for n in self.order if n in self.checks]
        jobs = self._jobs()
        used = {s for _, d in jobs if d for s in d.sources}
        unmapped = sorted(set(self.mapping.shards.meta) - used)
        return ExactResult(
            all(c.exact for c in checks) and len(checks) == len(self.order) and not unmapped,
            self.mapping.layout,
            self.rounding if any(c.quantized for c in checks) else None,
            str(self.device),
            self._src_bytes(jobs) + sum(self.reader.nbytes(n) for n, _ in jobs),
            round(self.seconds, 3),
            checks,
            unmapped,
        )

    def log_estimate(self) -> None:
        """The reads and the estimated time of the whole step (once)."""
        self._log(self._jobs())

    def _jobs(self) -> list:
        return [j for js in self.layers.values() for j in js]

    def _done(self, layer) -> bool:
        return all(n in self.checks for n, _ in self.layers.get(layer, []))

    def _src_bytes(self, jobs) -> int:
        return sum(self.mapping.shards.nbytes(s) for _, d in jobs if d for s in d.sources)

    def _log(self, jobs) -> None:
        """The reads and the estimated time of `jobs`, once (the first call's)."""
        if self._logged:
            return
        self._logged = True
        src_bytes, art_bytes = self._src_bytes(jobs), sum(self.reader.nbytes(n) for n, _ in jobs)
        log.info(
            "verify: exact re-derivation reads %.3f GB (source %.3f GB + artifact %.3f GB); estimated %s on %s",
            (src_bytes + art_bytes) / 1e9,
            src_bytes / 1e9,
            art_bytes / 1e9,
            _estimate(jobs, self.mapping, src_bytes + art_bytes, self.device, self.workers),
            _where(self.device, self.workers),
        )

    def _compare(self, groups: list, ahead: bool, bar) -> None:
        t0 = time.perf_counter()
        with _pool(self.workers) as pool:
            checks = _run_window(
                groups,
                self.reader,
                self.mapping,
                self.rounding,
                self.device,
                pool,
                2 * self.workers,
                bar,
                ahead,
            )
        self.checks.update((c.tensor, c) for c in checks)
        self.seconds += time.perf_counter() - t0


def _run_window(
    groups, reader, mapping, rounding, device, pool, window: int, bar, ahead: bool
) -> list[TensorCheck]:
    """Tensors in order, at most ~`window` units in flight. Shard handles are dropped after each tensor
    so the pages mapped for it stop counting as resident (memory does not grow with the model). groups:
    [[(name, derivation)]] per decoder layer; ahead: each group read onto the device before its units
    compare it, the next one while they do (_ReadAhead)."""
    checks, pending = [], deque()

    def finish_oldest():
        name, der, fs = pending.popleft()
        checks.append(_aggregate(name, der, reader, [f.result() for f in fs], mapping.layout))
        reader.close()
        mapping.shards.close()
        if bar is not None:
            bar.update(sum(mapping.shards.nbytes(x) for x in der.sources) if der else 0)

    ahead = _ReadAhead(groups, reader, mapping, device) if ahead else None
    try:
        for g, group in enumerate(groups):
            if ahead is not None:
                ahead.enter(g)
            for n, d in group:
                units = range(d.experts) if d and d.experts is not None else [None]
                pending.append(
                    (
                        n,
                        d,
                        [pool.submit(_unit, reader, d, n, e, rounding, device) for e in units] if d else [],
                    )
                )
                while sum(len(fs) for _, _, fs in pending) > window:
                    finish_oldest()
            if ahead is not None:  # the layer leaves the device before the one after the next is read
                while pending:
                    finish_oldest()
                ahead.leave(g)
        while pending:
            finish_oldest()
    finally:
        if ahead is not None:
            ahead.close()
    return checks


def reads_ahead(device: torch.device) -> bool:
    """Layers read onto the device ahead of their use (this pass's comparison; the reference models'
    building, mapping.GroupReadAhead): on a GPU (on the CPU the units read the mapped shards, which is
    what the CPU's workers would do with staged bytes too)."""
    return device.type == "cuda"


READ_AHEAD_RESERVE = 2 << 30  # device memory left free for the comparison's temporaries


class _ReadAhead:
    """On a GPU: each layer's source and artifact tensors are read onto the device (runtime.staging: large
    reads through page-locked buffers on a pool of threads) before its units compare them, and the next
    layer's while this one is compared, as device memory allows (else the units read the mapped shards).
    A pre-quantized source is read as before (its scheme dequantizes on the CPU)."""

    def __init__(self, groups: list, reader: ArtifactReader, mapping: Mapping, device: torch.device):
        self.groups, self.reader, self.shards, self.device = groups, reader, mapping.shards, device
        self.staged: dict = {}  # group index -> [Staging]
        self.usable = self.shards.scheme is None

    def enter(self, g: int) -> None:
        for k in (g, g + 1):
            if k < len(self.groups) and k not in self.staged and self.usable and self._room(k):
                self.staged[k] = self._stage(k)

    def leave(self, g: int) -> None:
        for s, owner in self.staged.pop(g, []):
            unstage(owner, s)

    def close(self) -> None:
        for g in list(self.staged):
            self.leave(g)

    def _sources(self, g: int) -> set:
        return {s for _, d in self.groups[g] if d for s in d.sources}

    def _stage(self, g: int) -> list:
        art = [n for n, _ in self.groups[g]]
        return [
            (self.shards.stage(self._sources(g), self.device), self.shards),
            (self.reader.stage(art, self.device), self.reader),
        ]

    def _room(self, g: int) -> bool:
        if self.device.type != "cuda":
            return True
        need = sum(self.shards.nbytes(s) for s in self._sources(g))
        need += sum(self.reader.nbytes(n) for n, _ in self.groups[g])
        return torch.cuda.mem_get_info(self.device)[0] >= need + READ_AHEAD_RESERVE


def _where(device: torch.device, workers: int) -> str:
    return str(device) if device.type == "cuda" else f"cpu ({workers} worker(s), one per core)"


def _estimate(jobs, mapping: Mapping, read_bytes: int, device: torch.device, workers: int) -> str:
    """Wall time from one chunk compared now, as the workers will (single-threaded on CPU), plus reading
    at an assumed disk rate."""
    elems = sum(math.prod(mapping.shards.meta[s][1]) for _, d in jobs if d for s in d.sources)
    w = torch.randn(256, 4096, generator=torch.Generator().manual_seed(0)).bfloat16()
    q, s = mxfp8.quantize(w)
    _compare_quantized(w, q, s, "rceil", device, None, "estimate")  # warm-up
    t = time.perf_counter()
    _compare_quantized(w, q, s, "rceil", device, None, "estimate")
    rate = w.numel() / max(time.perf_counter() - t, 1e-9)  # elements/s of one worker
    compute = elems / (rate * (1 if device.type == "cuda" else workers))
    disk = read_bytes / (READ_GBPS * 1e9)
    return (
        f"~{compute + disk:.1f} s (compare ~{compute:.1f} s at {rate / 1e6:.0f} M elem/s per worker, "
        f"reads ~{disk:.1f} s at an assumed {READ_GBPS:g} GB/s)"
    )


@contextmanager
def _pool(workers: int):
    """Worker threads, each running single-threaded torch ops (no oversubscription)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="porter-verify")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(threads)


def _unit(reader: ArtifactReader, d: Derivation, name: str, e: Optional[int], rounding, device) -> UnitResult:
    src = d.value(e)
    q, s = reader.get(name, e)
    label = f"{name}" + (f"[expert {e}]" if e is not None else "")
    if tuple(q.shape) != tuple(src.shape):
        return UnitResult(
            e, problem=f"{label}: shape {list(q.shape)} but re-derived from {_srcs(d)} {list(src.shape)}"
        )
    if s is None:
        if q.dtype != src.dtype:
            return UnitResult(
                e,
                problem=f"{label}: dtype {q.dtype} but its source {_srcs(d)} is {src.dtype} "
                "(an unquantized tensor must be carried bit-identical)",
            )
        return _compare_carried(src, q, e)
    if q.dtype != torch.float8_e4m3fn or s.dtype != torch.uint8:
        return UnitResult(
            e, problem=f"{label}: values {q.dtype} / scale {s.dtype}, MXFP8 needs float8_e4m3fn / uint8"
        )
    return _compare_quantized(src, q, s, rounding, device, e, name, d.kept(e))


def _srcs(d: Derivation) -> str:
    return d.sources[0] + (f" (+{len(d.sources) - 1})" if len(d.sources) > 1 else "")


def _compare_quantized(src, q, s, rounding, device, e, name, kept=None) -> UnitResult:
    """src [N, K], q [N, K] e4m3, s [N, K/32] uint8; row chunks re-quantized on `device`, with the scale
    bytes `kept` ([N, K/32] uint8: an MXFP8 source's own) when given, else by the rounding rule. The
    counts and sums stay on the device until the unit ends (one synchronization per unit, not four per
    chunk: on a GPU those waits, not the arithmetic, set the pace); the first differing block is looked
    up only when there is one."""
    res = UnitResult(e)
    chunks = _Chunks(src, q, s, kept, device)
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # differing blocks, scale bytes, err², ref²
    for _, w, keep, qa, sa in chunks:
        bad, scale_bad = _bad_blocks(w, keep, qa, sa, rounding, name)
        wf = w.float()
        err = (mxfp8.dequantize(qa, sa) - wf).double().square().sum()
        sums += torch.stack([bad.sum().double(), scale_bad.sum().double(), err, wf.double().square().sum()])
        res.compared += sa.numel()
    n_bad, n_scale, res.err_sq, res.ref_sq = sums.tolist()
    res.mismatched, res.scale_mismatched = int(n_bad), int(n_scale)
    if res.mismatched:
        res.first = _first_bad(chunks, rounding, name, e)
    return res


GPU_CHUNK_ELEMENTS = 1 << 24  # on a GPU: fewer, larger chunks (~0.6 GB of temporaries per worker)


class _Chunks:
    """Row chunks of one unit, on `device`: (first row, source rows [n, K], kept scale rows or None,
    artifact values [n, K], artifact scales [n, K/32])."""

    def __init__(self, src, q, s, kept, device):
        k = src.shape[-1]
        self.src, self.q = src.reshape(-1, k), q.reshape(-1, k)
        self.s = s.reshape(-1, k // mxfp8.BLOCK)
        self.kept = None if kept is None else kept.reshape(-1, k // mxfp8.BLOCK)
        self.device = device
        self.step = max(1, (GPU_CHUNK_ELEMENTS if device.type == "cuda" else CHUNK_ELEMENTS) // k)

    def __iter__(self):
        on = lambda t, r0: None if t is None else t[r0 : r0 + self.step].to(self.device)
        for r0 in range(0, self.src.shape[0], self.step):
            yield r0, on(self.src, r0), on(self.kept, r0), on(self.q, r0), on(self.s, r0)


def _bad_blocks(w, keep, qa, sa, rounding, name) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks whose value or scale bytes differ, blocks whose scale byte differs), both [n, K/32] bool,
    of the artifact's qa [n, K] / sa [n, K/32] against the re-quantization of w [n, K]."""
    qr, sr = mxfp8.quantize(w, rounding, name, keep_scale=keep)
    scale_bad = sa != sr
    values_bad = (qa.view(torch.uint8) != qr.view(torch.uint8)).reshape(*sa.shape, mxfp8.BLOCK).any(-1)
    return values_bad | scale_bad, scale_bad


def _first_bad(chunks: _Chunks, rounding, name, e) -> str:
    """The first differing block of a unit that has one (its chunks compared again up to it)."""
    for r0, w, keep, qa, sa in chunks:
        bad, _ = _bad_blocks(w, keep, qa, sa, rounding, name)
        if bool(bad.any()):
            row, block = bad.nonzero()[0].tolist()
            return _position(e, r0 + row, block)
    raise AssertionError(f"{name}: a differing block counted but not found again")


def _compare_carried(src: torch.Tensor, art: torch.Tensor, e) -> UnitResult:
    """Byte equality, element by element, in chunks where the tensors are (on CPU: a memory compare needs
    no device); the count stays there until the end, the first difference looked up only if there is one."""
    res = UnitResult(e)
    a, b = src.reshape(-1), art.reshape(-1)
    step = GPU_CHUNK_ELEMENTS if a.device.type == "cuda" else CHUNK_ELEMENTS
    differs = lambda ca, cb: (
        ca.view(torch.uint8).reshape(ca.numel(), -1) != cb.view(torch.uint8).reshape(cb.numel(), -1)
    ).any(-1)
    total = torch.zeros((), dtype=torch.int64, device=a.device)
    for i in range(0, a.numel(), step):
        total += differs(a[i : i + step], b[i : i + step]).sum()
    res.compared, res.mismatched = a.numel(), int(total)
    for i in range(0, a.numel(), step) if res.mismatched else ():
        diff = differs(a[i : i + step], b[i : i + step])
        if bool(diff.any()):
            res.first = _element(i + int(diff.nonzero()[0]), src.shape, e)
            break
    return res


def _position(e, row: int, block: int) -> str:
    lead = f"expert {e}, " if e is not None else ""
    return f"{lead}row {row}, block {block} (elements {block * mxfp8.BLOCK}..{block * mxfp8.BLOCK + mxfp8.BLOCK - 1})"


def _element(flat: int, shape, e) -> str:
    idx = []
    for dim in reversed(shape):
        flat, r = divmod(flat, dim)
        idx.append(r)
    return (f"expert {e}, " if e is not None else "") + f"element {list(reversed(idx))}"


def _aggregate(
    name: str, d: Optional[Derivation], reader: ArtifactReader, units: list, layout: str
) -> TensorCheck:
    rec = reader.tensors[name]
    tc = TensorCheck(
        name,
        rec.get("shard"),
        layer_of(reader.canonical(name)),
        bool(rec.get("scale")),
        d.sources if d else [],
        units=len(units),
    )
    if d is None:
        tc.problem = f"no source tensor for it in the {layout} mapping table (see docs/verify.md)"
        return tc
    problems = [u.problem for u in units if u.problem]
    if problems:
        tc.problem = problems[0] + (f" (and {len(problems) - 1} more expert(s))" if len(problems) > 1 else "")
        return tc
    tc.blocks, tc.mismatched = sum(u.compared for u in units), sum(u.mismatched for u in units)
    tc.scale_mismatched = sum(u.scale_mismatched for u in units)
    bad = [u for u in units if u.mismatched]
    tc.first_mismatch = bad[0].first if bad else None
    if d.experts is not None:
        tc.mismatched_by_expert = {u.expert: u.mismatched for u in bad}
    if tc.quantized:
        worst = max(units, key=lambda u: u.weight_error)
        tc.weight_error, tc.worst_expert = worst.weight_error, worst.expert
    return tc
