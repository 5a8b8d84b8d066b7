"""porter.format.mxfp8's CPU quantizer as one C function (mxfp8_cpu.c beside this file), built on first use.

Why: as torch ops the rule makes ~20 passes over every tile (the fp32 -> e4m3 cast alone is a scalar loop);
the C loop reads each value once with the GIL released, so conversion workers scale with cores
(rates: docs/mxfp8.md).

How: the system C compiler (`cc`, else `gcc`) builds the file once per machine into porter's cache
(porter/cache.py: `$PORTER_CACHE_DIR`, else `$XDG_CACHE_HOME/porter`, else `~/.cache/porter`; read when the
quantizer is first needed), keyed by the
source, the compiler and the CPU's flags (it is built with -march=native); ctypes loads it. Only porter's
own source is ever compiled. No compiler or a failed build: porter.format.mxfp8's torch
path runs instead, with the same bytes (tests/test_mxfp8_native.py checks every bf16 value under many scales,
both roundings) and the same statistics up to the order of each block's 32-term fp32 sums (the C loop's order
is fixed, torch's follows its SIMD width).

Inputs it takes: contiguous CPU bf16 or fp32 with K % 32 == 0 and no kept scale bytes. A tensor holding a
NaN or an infinity comes back as None, for the torch path to refuse with its message. The same library
also dequantizes block-FP8 source weights to bf16 (`dequantize_fp8_block`: one lookup, multiply and
rounding per value instead of a table gather, a product and a cast over the whole tensor).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from porter.cache import cache_dir

log = logging.getLogger("porter")

SOURCE = Path(__file__).with_name("mxfp8_cpu.c")
BLOCK = 32  # elements per scale byte: the C source's BLOCK (the MX block of porter.format.mxfp8)
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-fast-math", "-ffp-contract=off")
FALLBACK_FLAGS = tuple(f for f in FLAGS if f != "-march=native")  # a compiler without -march=native
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}  # the dtypes it takes -> the C function's dtype code
_state = {"fn": None, "tried": False, "why": ""}
_lock = threading.Lock()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _compiler() -> tuple[str, Optional[str]]:
    """(the compiler's name, its path or None): the system's `cc`, else `gcc`."""
    cc = next((c for c in ("cc", "gcc") if shutil.which(c)), "cc")
    return cc, shutil.which(cc)


def _build(cc: str, out: Path, defines: tuple = ()) -> Optional[str]:
    """Compile SOURCE into `out` (atomically: a temp file renamed) with `defines` (-D flags) added;
    -> None, or why it failed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    why = ""
    try:
        for flags in (FLAGS, FALLBACK_FLAGS):
            proc = subprocess.run(
                [cc, *flags, *defines, "-o", tmp, str(SOURCE)], capture_output=True, text=True
            )
            if proc.returncode == 0:
                os.replace(tmp, out)
                return None
            why = (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]
        return why
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(path: Path):
    """porter_mxfp8_quantize from the library at `path`, typed for ctypes (its block-FP8 dequantizer bound
    as the function's `dequantize_fp8_block`)."""
    lib = ctypes.CDLL(str(path))
    deq = lib.porter_fp8_block_dequantize_bf16
    deq.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p]
    deq.restype = None
    fn = lib.porter_mxfp8_quantize
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    fn.restype = ctypes.c_int64
    fn.dequantize_fp8_block = deq
    return fn


def build_variant(out: Path, defines: tuple):
    """SOURCE built into `out` with `defines` added (e.g. ("-DPORTER_LANES=16",)), bound as function()'s C
    function is: for benchmarks and tests that compare builds, never the conversion's own (uncached).
    Raises RuntimeError without a compiler or when the build fails."""
    cc, cc_path = _compiler()
    why = f"no C compiler ({cc}) on PATH" if cc_path is None else _build(cc_path, Path(out), defines)
    if why is not None:
        raise RuntimeError(f"could not build {SOURCE.name} with {' '.join(defines)}: {why}")
    return _bind(Path(out))


def _load():
    cc, cc_path = _compiler()
    if cc_path is None:
        return None, f"no C compiler ({cc}) on PATH"
    key = hashlib.sha256(
        b"\0".join(
            [
                SOURCE.read_bytes(),
                cc_path.encode(),
                " ".join(FLAGS).encode(),
                _cpu_flags().encode(),
                platform.machine().encode(),
            ]
        )
    ).hexdigest()[:16]
    path = cache_dir() / f"mxfp8_cpu-{key}.so"
    if not path.exists():
        t0 = time.perf_counter()
        try:
            why = _build(cc_path, path)
        except OSError:  # an unwritable cache: build into a private temp dir instead
            path = Path(tempfile.mkdtemp(prefix="porter-")) / path.name
            why = _build(cc_path, path)
        if why is not None:
            return None, f"{cc_path} could not build {SOURCE.name}: {why}"
        log.debug("built the native MXFP8 quantizer in %.2f s: %s", time.perf_counter() - t0, path)
    return _bind(path), ""


def function():
    """The C function, or None (why: reason())."""
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                try:
                    _state["fn"], _state["why"] = _load()
                except OSError as e:
                    _state["fn"], _state["why"] = None, f"could not load the native quantizer: {e}"
                if _state["fn"] is None:
                    log.debug("native MXFP8 quantizer unavailable (%s); using torch ops", _state["why"])
                _state["tried"] = True
    return _state["fn"]


def reason() -> str:
    return _state["why"]


def takes(dtype: torch.dtype, last_dim: int) -> bool:
    """Whether the C quantizer (built, or loaded from porter's cache, here) quantizes tensors of this dtype and
    last dimension: the rule behind supports, also for a plan's tensors before any is read."""
    return dtype in _DTYPES and last_dim % BLOCK == 0 and function() is not None


def supports(w: torch.Tensor, keep_scale=None) -> bool:
    return (
        keep_scale is None
        and w.device.type == "cpu"
        and w.numel() > 0
        and w.is_contiguous()
        and takes(w.dtype, w.shape[-1])
    )


def quantize_blocks(w: torch.Tensor, rounding: str, with_error: bool):
    """w [..., K] (supports(w)) -> (q [..., K] e4m3, byte [..., K/32] uint8, (ref_sq, err_sq, max |err|) fp32
    [NB] each or None), the return of mxfp8._quantize_cpu_tiles; None when w holds a NaN or an infinity."""
    nb = w.numel() // BLOCK
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    byte = torch.empty((*w.shape[:-1], w.shape[-1] // BLOCK), dtype=torch.uint8)
    stats = torch.empty(nb, 3) if with_error else None  # [NB, 3] fp32
    bad = function()(
        w.data_ptr(),
        _DTYPES[w.dtype],
        nb,
        int(rounding == "floor"),
        q.data_ptr(),
        byte.data_ptr(),
        stats.data_ptr() if with_error else None,
    )
    if bad:
        return None
    return q, byte, (tuple(stats.unbind(1)) if with_error else None)


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple) -> Optional[torch.Tensor]:
    """Block-FP8 (q [..., N, K] e4m3, scale_inv [..., ceil(N/bn), ceil(K/bk)]) -> bf16 values with
    porter.format.mxfp8.dequantize_fp8_block's bytes, one pass in C; None when the C library is not here or
    the inputs are not contiguous CPU tensors (the caller's torch ops run instead)."""
    fn = function()
    if fn is None or q.device.type != "cpu" or q.numel() == 0:
        return None
    q, s = q.contiguous(), scale_inv.float().contiguous()
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    n, k = q.shape[-2], q.shape[-1]
    fn.dequantize_fp8_block(
        q.data_ptr(), s.data_ptr(), q.numel() // (n * k), n, k, block[0], block[1], out.data_ptr()
    )
    return out
