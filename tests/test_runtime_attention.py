"""runtime.kernels.attention's block pick from the indexer's block scores (top_blocks, the torch reference of the
split-K kernel's in-kernel ranking) and decode_attention_topk's reference path, on CPU. The Triton
kernels are checked against these on the GPU (tests/test_runtime_gpu_decode.py)."""

from __future__ import annotations

import pytest
import runtime_fixtures as fx
import torch

from runtime.kernels.attention import decode_attention_reference, decode_attention_topk, top_blocks

INF = float("inf")


def _sequential_pick(row: list, topk: int) -> list:
    """topk rounds of 'take the best left, lowest index on ties'; nothing visible left (-inf) -> len(row)."""
    left, out = list(row), []
    for _ in range(topk):
        best = max(left)
        if best == -INF:
            out.append(len(row))
            continue
        i = left.index(best)
        out.append(i)
        left[i] = -INF
    return out


def test_top_blocks_best_first_ties_low_index_and_none():
    scores = torch.tensor(
        [[[0.5, INF, 0.5, -INF, 2.0, INF, 0.5, -1.0], [-INF, 1.0, -INF, -INF, -INF, -INF, 3.0, -INF]]]
    )  # [1, 2, 8]
    top = top_blocks(scores, 5)
    assert top.dtype == torch.int64 and top.shape == (1, 2, 5)
    assert top[0, 0].tolist() == [1, 5, 4, 0, 2]  # +inf ties and 0.5 ties: lower block first
    assert top[0, 1].tolist() == [6, 1, 8, 8, 8]  # two visible blocks, then none (nblk = 8)
    g = torch.Generator().manual_seed(0)
    rnd = torch.randint(0, 4, (3, 4, 40), generator=g).float() - 1.0  # many ties
    rnd = rnd.masked_fill(rnd < 0, -INF).masked_fill(rnd > 1.5, INF)
    want = [[_sequential_pick(r.tolist(), 16) for r in rows] for rows in rnd]
    assert top_blocks(rnd, 16).tolist() == want


def test_decode_attention_topk_reference_path():
    """On CPU decode_attention_topk is decode_attention_reference over top_blocks' picks (one index head
    for all kv heads, or one per kv head)."""
    g = torch.Generator().manual_seed(1)
    B, nq, nkv, d, block, S, topk = 2, 8, 2, 16, 4, 64, 3
    q = torch.randn(B, nq, d, generator=g)
    k, v = torch.randn(B, nkv, S, d, generator=g), torch.randn(B, nkv, S, d, generator=g)
    pos = torch.tensor([63, 21])
    for n in (nkv, 1):
        scores = torch.randn(B, n, S // block, generator=g)
        scores = scores.masked_fill(torch.arange(S // block) * block > pos[:, None, None], -INF)
        out, top = decode_attention_topk(q, k, v, pos, S, scores, topk, block, 0.3)
        assert torch.equal(top, top_blocks(scores, topk))
        want = decode_attention_reference(q, k, v, pos, S, top.expand(B, nkv, topk), block, 0.3)
        assert fx.rel(out, want) == 0.0
        # only the picked blocks count: changing a block not picked leaves the output unchanged
        unpicked = sorted(set(range(S // block)) - set(top[0].flatten().tolist()))[0]
        k2 = k.clone()
        k2[0, :, unpicked * block : (unpicked + 1) * block] += 5.0
        assert torch.equal(decode_attention_topk(q, k2, v, pos, S, scores, topk, block, 0.3)[0], out)


def test_decode_attention_topk_index_heads_must_match():
    """One index head for all kv heads or one per kv head; anything else is refused before any kernel runs."""
    q, k, v = torch.randn(1, 6, 8), torch.randn(1, 3, 16, 8), torch.randn(1, 3, 16, 8)
    with pytest.raises(ValueError, match="2 index heads for 3 kv heads"):
        decode_attention_topk(q, k, v, torch.tensor([15]), 16, torch.randn(1, 2, 4), 2, 4)
