"""XXH3's long-input accumulation as a Triton kernel: one program per chunk of bytes already on the GPU, its
eight 64-bit accumulators out; runtime/kernels/xxh3.py merges them into the 128-bit digest on the host.

XXH3 (https://github.com/Cyan4973/xxHash, xxhash.h: XXH3_hashLong_internal_loop) reads an input of more than
240 bytes in blocks of 1024 bytes = 16 stripes of 64 bytes = 8 lanes of 64 bits. Stripe s of a block adds, to
lane l, (d ^ key) low 32 bits times high 32 bits (d: its word l, key: the secret's 64 bits at byte 8 s + 8 l)
and, to lane l ^ 1, d itself; after each block every lane is scrambled (xorshift 47, xor a key, times
PRIME32_1). Within a block the adds commute, so a program sums the 16 stripes of NB blocks at once (one
[NB, 16, 8] load) and then folds the NB block sums into its lanes in order, scrambling after each. The last
partial block (its stripes before the input's last byte) and the last stripe (the input's final 64 bytes,
at any alignment, with the secret at byte 121) follow. Lanes are uint64: adds and products wrap as in C.
"""

import triton
import triton.language as tl

# consts [160] int64 (the bits of uint64), built by runtime/kernels/xxh3.py: stripe keys [16, 8] at 0,
# scramble keys at 128, last-stripe keys at 136, the initial lanes at 144, PRIME32_1 at 152
SCRAMBLE, LAST, INIT, PRIME = tl.constexpr(128), tl.constexpr(136), tl.constexpr(144), tl.constexpr(152)


@triton.jit
def _u64(x):
    return x.to(tl.uint64, bitcast=True)


@triton.jit
def _stripe_terms(d, d_swapped, keys):
    """What stripes add to the lanes: (d ^ key)_lo * (d ^ key)_hi to lane l, d of lane l ^ 1."""
    dk = d ^ keys
    return ((dk << 32) >> 32) * (dk >> 32) + d_swapped


@triton.jit
def xxh3_lanes_kernel(
    words_ptr, bytes_ptr, starts_ptr, lens_ptr, consts_ptr, out_ptr, max_blocks, NB: tl.constexpr
):
    """Program c: the lanes of XXH3 over bytes [starts[c], starts[c] + lens[c]) (lens > 240; starts a multiple
    of 8; words_ptr: the same memory as int64, at least up to the last whole stripe) into out[c, 0:8].
    max_blocks: the most whole blocks before any chunk's last byte ((lens - 1) // 1024), the loop's bound."""
    c = tl.program_id(0)
    start = tl.load(starts_ptr + c)  # int64
    length = tl.load(lens_ptr + c)
    stripe = tl.arange(0, 16)
    lane = tl.arange(0, 8)
    blk = tl.arange(0, NB)
    keys = _u64(tl.load(consts_ptr + stripe[:, None] * 8 + lane[None, :]))  # [16, 8]
    scramble_key = _u64(tl.load(consts_ptr + SCRAMBLE + lane))  # [8]
    prime = _u64(tl.load(consts_ptr + PRIME))
    acc = _u64(tl.load(consts_ptr + INIT + lane))  # [8]
    nb_blocks = (length - 1) // 1024
    base = start // 8  # in words
    word = stripe[None, :, None] * 8 + lane[None, None, :]  # [1, 16, 8] within a block
    swapped = stripe[None, :, None] * 8 + (lane[None, None, :] ^ 1)
    for b0 in range(0, max_blocks, NB):
        b = b0 + blk[:, None, None]  # [NB, 1, 1]
        m = b < nb_blocks
        at = base + b * 128
        d = _u64(tl.load(words_ptr + at + word, mask=m, other=0))  # [NB, 16, 8]
        ds = _u64(tl.load(words_ptr + at + swapped, mask=m, other=0))
        sums = tl.sum(_stripe_terms(d, ds, keys[None, :, :]), axis=1)  # [NB, 8]
        for j in tl.static_range(NB):
            s = tl.sum(tl.where(blk[:, None] == j, sums, tl.zeros_like(sums)), axis=0)  # [8]
            nxt = acc + s
            nxt = (nxt ^ (nxt >> 47) ^ scramble_key) * prime
            acc = tl.where(b0 + j < nb_blocks, nxt, acc)
    # the last partial block: its stripes that end before the input's last byte
    n_stripes = ((length - 1) - nb_blocks * 1024) // 64
    m = stripe[:, None] < n_stripes  # [16, 1]
    at = base + nb_blocks * 128
    d = _u64(tl.load(words_ptr + at + stripe[:, None] * 8 + lane[None, :], mask=m, other=0))  # [16, 8]
    ds = _u64(tl.load(words_ptr + at + stripe[:, None] * 8 + (lane[None, :] ^ 1), mask=m, other=0))
    terms = _stripe_terms(d, ds, keys)
    acc += tl.sum(tl.where(m, terms, tl.zeros_like(terms)), axis=0)
    # the last stripe: the final 64 bytes, little-endian words assembled from bytes (any alignment)
    byte = tl.arange(0, 8)
    p = bytes_ptr + start + length - 64
    raw = tl.load(p + lane[:, None] * 8 + byte[None, :]).to(tl.uint64)  # [8, 8]
    raw_s = tl.load(p + (lane[:, None] ^ 1) * 8 + byte[None, :]).to(tl.uint64)
    shift = (byte * 8).to(tl.uint64)[None, :]
    d = tl.sum(raw << shift, axis=1)  # [8]
    ds = tl.sum(raw_s << shift, axis=1)
    acc += _stripe_terms(d, ds, _u64(tl.load(consts_ptr + LAST + lane)))
    tl.store(out_ptr + c * 8 + lane, acc.to(tl.int64, bitcast=True))
