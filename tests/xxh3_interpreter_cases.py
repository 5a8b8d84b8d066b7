"""XXH3 on the "GPU" (runtime/kernels/xxh3.py) in Triton's CPU interpreter against the xxhash package: lengths
around every boundary of XXH3's long-input path (240, a stripe of 64, a block of 1024, several blocks, more
blocks than a program loads at once), chunks whose last stripe is not 8-byte aligned, short tails, and the
empty tensor. Run by tests/test_xxh3.py in a child process with TRITON_INTERPRET=1; prints one JSON line."""

import json
import random

import torch
import xxhash

from runtime.kernels import xxh3

LENGTHS = [0, 1, 240, 241, 255, 256, 1023, 1024, 1025, 1087, 1088, 2048, 8191, 8192, 8193, 9216 + 7, 20000]
CHUNKS = [4096, 8192, 16384]

rng = random.Random(0)
cases = [(n, c) for n in LENGTHS for c in CHUNKS] + [(rng.randint(0, 50000), 4104) for _ in range(20)]
g = torch.Generator().manual_seed(0)
bad, chunks = [], 0
for n, c in cases:
    flat = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    raw = flat.numpy().tobytes()
    want = [xxhash.xxh3_128(raw[b : b + c]).digest() for b in range(0, n, c)]
    chunks += len(want)
    for nb in (8, 32) if n > 20000 else (8,):  # another step size: its masked tail of blocks
        if xxh3.chunk_digests(flat, c, nb) != want:
            bad.append((n, c, nb))
print(json.dumps({"cases": len(cases), "chunks": chunks, "mismatches": bad}))
