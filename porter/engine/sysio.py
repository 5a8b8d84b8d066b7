"""Linux calls the engine uses through ctypes (which drops the GIL while they run): each is a hint its
callers skip where glibc or the call is unavailable."""

from __future__ import annotations

import ctypes
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

MADV_HUGEPAGE = 14
SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def libc_function(name: str, *argtypes):
    """A glibc function with its argument types, or None where libc.so.6 or the function is unavailable."""
    fn = getattr(_libc(), name, None)
    if fn is not None:
        fn.argtypes = list(argtypes)
    return fn


@functools.cache
def _sync_file_range():
    return libc_function("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


@functools.cache
def _madvise():
    return libc_function("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def prefault(buf: torch.Tensor) -> None:
    """Fault a fresh buffer's pages in (as transparent huge pages where the kernel allows) before it is
    page-locked: cudaHostRegister would otherwise fault every page in itself, inside the CUDA driver, while
    other workers wait on it (docs/convert.md, "How the engine works")."""
    n = buf.numel() * buf.element_size()
    if not n:
        return
    addr = buf.data_ptr()
    page = os.sysconf("SC_PAGE_SIZE")
    start, end = -(-addr // page) * page, (addr + n) // page * page
    madvise = _madvise()
    if madvise is not None and end > start:
        madvise(start, end - start, MADV_HUGEPAGE)
    ctypes.memset(addr, 0, n)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing these bytes to disk now (asynchronously), so the fsync before the
    index finds little left to do; otherwise nothing is written back until gigabytes are dirty."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, length, SYNC_FILE_RANGE_WRITE)


def sync_files(paths: list, workers: int) -> float:
    """fsync every file (in parallel; the kernel has been writing them back all along). Returns seconds."""
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


def memory_status() -> dict:
    """This process's RssAnon / RssFile / VmHWM / VmRSS and the machine's MemAvailable / MemTotal (bytes)."""
    out = {}
    for path, keys in (
        ("/proc/self/status", ("RssAnon", "RssFile", "VmHWM", "VmRSS")),
        ("/proc/meminfo", ("MemAvailable", "MemTotal")),
    ):
        try:
            for line in open(path):
                k, _, v = line.partition(":")
                if k in keys:
                    out[k] = int(v.split()[0]) * 1024
        except OSError:
            pass
    return out
