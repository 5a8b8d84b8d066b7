"""XXH3-128 digests of bytes already on a GPU, bit for bit `xxhash.xxh3_128(bytes).digest()` (the chunk hash
of porter's default digest rule, porter/format/digest.py): the staged loader checks each tensor after its
copy instead of hashing on the cores that read the files (runtime/staging.py).

    digests = chunk_digests(flat, chunk_bytes)   # flat: uint8 [n] on a GPU; one 16-byte digest per chunk

Chunks over 240 bytes run XXH3's long-input accumulation on the GPU (runtime/kernels/xxh3_triton.py, one
program per chunk), whose eight lanes the host merges here (two 64-bit halves, each four 64x64->128-bit
products folded, then an avalanche: xxhash.h's XXH3_mergeAccs and XXH3_avalanche); shorter chunks (a tensor's
short tail, a tiny tensor) are copied to the host and hashed there by the xxhash package. The constants are
XXH3's default secret and primes (xxhash.h: XXH3_kSecret, XXH_PRIME32_*, XXH_PRIME64_*, PRIME_MX1).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import struct

import torch
import xxhash

from runtime.kernels.fused import use_triton

log = logging.getLogger("porter.runtime")

LONG = 240  # XXH3_MIDSIZE_MAX: longer inputs take the long-input path the kernel runs
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
MASK = (1 << 64) - 1
PRIME32 = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)
PRIME64 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
PRIME_MX1 = 0x165667919E3779F9
INIT = (PRIME32[2], PRIME64[0], PRIME64[1], PRIME64[2], PRIME64[3], PRIME32[1], PRIME64[4], PRIME32[0])
# blocks of 1 KiB a program loads at once (xxh3_triton.xxh3_lanes_kernel's NB; 8 warps from 16 on): a guess
# until benchmarks/load.py --hash-on-gpu measures 4 to 32 on a GPU
BLOCKS_PER_STEP = 8


def _le64(b: bytes, at: int) -> int:
    return struct.unpack_from("<Q", b, at)[0]


def _signed(u: int) -> int:
    return u - (1 << 64) if u >> 63 else u


@functools.lru_cache(maxsize=None)
def _consts(device: torch.device) -> torch.Tensor:
    """The kernel's table (xxh3_triton: stripe keys, scramble keys, last-stripe keys, initial lanes,
    PRIME32_1) as int64 bits on `device`."""
    stripe_keys = [_le64(SECRET, 8 * s + 8 * lane) for s in range(16) for lane in range(8)]
    scramble = [_le64(SECRET, len(SECRET) - 64 + 8 * lane) for lane in range(8)]
    last = [_le64(SECRET, len(SECRET) - 64 - 7 + 8 * lane) for lane in range(8)]
    table = stripe_keys + scramble + last + list(INIT) + [PRIME32[0]] + [0] * 7
    return torch.tensor([_signed(v) for v in table], dtype=torch.int64, device=device)


def _merge(lanes: list, secret_at: int, start: int) -> int:
    r = start
    for i in range(4):
        a = lanes[2 * i] ^ _le64(SECRET, secret_at + 16 * i)
        b = lanes[2 * i + 1] ^ _le64(SECRET, secret_at + 16 * i + 8)
        p = a * b
        r = (r + ((p & MASK) ^ (p >> 64))) & MASK
    r ^= r >> 37
    r = (r * PRIME_MX1) & MASK
    return r ^ (r >> 32)


def digest_from_lanes(lanes: list, length: int) -> bytes:
    """The canonical XXH3-128 digest (high half first, big-endian) of a long input from its lanes."""
    low = _merge(lanes, 11, (length * PRIME64[0]) & MASK)
    high = _merge(lanes, len(SECRET) - 64 - 11, ~(length * PRIME64[1]) & MASK)
    return high.to_bytes(8, "big") + low.to_bytes(8, "big")


def applies(flat: torch.Tensor, chunk_bytes: int) -> bool:
    """Whether chunk_digests hashes `flat` on its GPU: a CUDA uint8 vector, 8-byte aligned, Triton
    installed, chunks a multiple of 8 bytes (the kernel reads whole 64-bit words from each chunk's start)."""
    return (
        use_triton(flat)
        and flat.dtype == torch.uint8
        and flat.dim() == 1
        and flat.data_ptr() % 8 == 0
        and chunk_bytes % 8 == 0
    )


class PendingDigests:
    """The XXH3-128 digest of each chunk_bytes-long piece of flat (the last one shorter), launched on the
    current CUDA stream of flat's device: the kernel's lanes and the short chunks' bytes are copied to
    page-locked host memory behind it; ready() says whether they are in, result() waits and merges."""

    def __init__(self, flat: torch.Tensor, chunk_bytes: int, blocks_per_step: int = BLOCKS_PER_STEP):
        # Triton launches on the current device: flat's, whatever the caller's (a device_map's second GPU)
        with torch.cuda.device(flat.device) if flat.is_cuda else contextlib.nullcontext():
            self._launch(flat, chunk_bytes, blocks_per_step)

    def _launch(self, flat: torch.Tensor, chunk_bytes: int, nb: int) -> None:
        from runtime.kernels.xxh3_triton import xxh3_lanes_kernel

        n, dev = flat.numel(), flat.device
        self.spans = [(b, min(chunk_bytes, n - b)) for b in range(0, n, chunk_bytes)]
        long = [(b, m) for b, m in self.spans if m > LONG]
        pin = flat.is_cuda
        self.lanes = None
        if long:
            starts = torch.tensor([b for b, _ in long], dtype=torch.int64).to(dev, non_blocking=True)
            lens = torch.tensor([m for _, m in long], dtype=torch.int64).to(dev, non_blocking=True)
            lanes = torch.empty((len(long), 8), dtype=torch.int64, device=dev)
            words = flat[: n - n % 8].view(torch.int64)
            most = max((m - 1) // 1024 for _, m in long)
            xxh3_lanes_kernel[(len(long),)](
                words, flat, starts, lens, _consts(dev), lanes, most, NB=nb, num_warps=8 if nb >= 16 else 4
            )
            self.lanes = torch.empty(lanes.shape, dtype=torch.int64, pin_memory=pin)
            self.lanes.copy_(lanes, non_blocking=pin)
        self.short = {}
        for b, m in self.spans:
            if m <= LONG:  # at most one per tensor (its tail), or a tiny tensor
                self.short[b] = torch.empty(m, dtype=torch.uint8, pin_memory=pin)
                self.short[b].copy_(flat[b : b + m], non_blocking=pin)
        self.event = torch.cuda.Event() if pin else None
        if pin:
            self.event.record()
        self.long = long

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def result(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        out = {b: xxhash.xxh3_128(v.numpy().tobytes()).digest() for b, v in self.short.items()}
        for (b, m), row in zip(self.long, self.lanes.tolist() if self.lanes is not None else []):
            out[b] = digest_from_lanes([v & MASK for v in row], m)
        return [out[b] for b, _ in self.spans]


def chunk_digests(flat: torch.Tensor, chunk_bytes: int, blocks_per_step: int = BLOCKS_PER_STEP) -> list:
    """The XXH3-128 digest of each chunk_bytes-long piece of flat (the last one shorter), in order: on the
    current CUDA stream of flat's device, waited for. blocks_per_step: the kernel's NB (benchmarks)."""
    return PendingDigests(flat, chunk_bytes, blocks_per_step).result()


@functools.lru_cache(maxsize=None)
def works_on(device: torch.device) -> bool:
    """Whether chunk_digests gives xxhash's digests on `device` (checked once per process on 5003 bytes:
    whole blocks, a partial block, an unaligned last stripe); False, with a warning, sends the
    staged loader back to hashing on the CPU rather than failing loads on a wrong digest."""
    data = torch.arange(5003, dtype=torch.int64).mul_(2654435761).remainder_(251).to(torch.uint8)
    want = [xxhash.xxh3_128(data[b : b + 4096].numpy().tobytes()).digest() for b in (0, 4096)]
    try:
        flat = data.to(device)
        ok = applies(flat, 4096) and chunk_digests(flat, 4096) == want
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run here: the CPU hashes instead
        log.warning(
            "XXH3 on %s failed (%s: %s); digests are computed on the CPU", device, type(e).__name__, e
        )
        return False
    if not ok:
        log.warning("XXH3 on %s does not give xxhash's digests; they are computed on the CPU", device)
    return ok
