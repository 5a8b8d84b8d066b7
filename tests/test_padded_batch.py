"""Padded batches: prompts of different lengths in one batch (left padding, attention_mask, per-row
positions, a position-indexed KV cache) give each row what it gives alone — logits, generated tokens,
and the lightning indexer's block selections — on the tiny checkpoint (4 layers, 3 sparse; index block 4,
top-2 -> a row runs sparse past 8 keys). Also the static-shape decode attention against plain masked
attention."""

from __future__ import annotations

import pytest
import runtime_fixtures as fx
import torch

import runtime
from runtime.kernels.attention import decode_attention, decode_attention_reference
from runtime.models.layers import gqa_attention, keep_mask

EXACT = 1e-5
LENGTHS = (3, 13, fx.LONG)  # below the sparse threshold, just above it, 5x above it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    src = fx.vendor_checkpoint(tmp_path_factory.mktemp("padded") / "src", seed=21)
    return runtime.load(src, device="cpu", dtype=torch.float32, backend="torch")


def _prompts():
    return [fx.prompt(n, batch=1, seed=30 + n)[0] for n in LENGTHS]


def _excluded(model):
    return [l.self_attn.indexer.last_excluded for l in model.layers if l.self_attn.indexer is not None]


def test_padded_logits_equal_each_prompt_alone(model):
    prompts = _prompts()
    ids, mask = fx.left_pad(prompts)
    T = ids.shape[1]
    alone, excluded = [], []
    for p in prompts:
        alone.append(model(p[None]))
        excluded.append(_excluded(model))
    for cache in (None, model.new_cache(len(prompts), T)):  # without a cache, and prefill into one
        got = model(ids, cache, attention_mask=mask)
        assert got.shape == (len(prompts), T, fx.TINY_TEXT["vocab_size"])
        for b, p in enumerate(prompts):
            err = fx.rel(got[b, T - len(p) :], alone[b][0])
            assert err <= EXACT, (b, len(p), err)
        # the indexer honours the mask: the batch drops exactly the blocks the rows drop alone
        assert _excluded(model) == [sum(e) for e in zip(*excluded)]
    assert excluded[-1] and all(e > 0 for e in excluded[-1])  # the long row really ran sparse
    assert excluded[0] == [0, 0, 0]  # the short row is below the threshold


def test_all_ones_mask_is_the_unpadded_call(model):
    ids = fx.prompt(fx.LONG, batch=2, seed=5)
    assert torch.equal(model(ids), model(ids, attention_mask=torch.ones_like(ids)))


def test_padded_generate_equals_each_prompt_alone(model):
    prompts = _prompts()
    ids, mask = fx.left_pad(prompts)
    n_new = 2 * fx.THRESHOLD + 3  # the 3-token row crosses into sparse decoding
    out = model.generate(ids, max_new_tokens=n_new, attention_mask=mask)
    assert out.shape == (len(prompts), ids.shape[1] + n_new)
    for b, p in enumerate(prompts):
        want = model.generate(p[None], max_new_tokens=n_new)[0, len(p) :]
        assert torch.equal(out[b, ids.shape[1] :], want), b


def test_padded_decode_steps_match_recomputation(model):
    """Cache + per-row positions over several steps == the whole padded sequence run again."""
    prompts = _prompts()
    ids, mask = fx.left_pad(prompts)
    cache = model.new_cache(len(prompts), ids.shape[1] + 12)
    logits = model(ids, cache, attention_mask=mask)
    seq, m = ids, mask
    for step in range(12):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
        logits = model(nxt, cache)
        full = model(seq, attention_mask=m)
        assert fx.rel(logits[:, -1], full[:, -1]) <= EXACT, step
    assert cache.length == ids.shape[1] + 12
    assert cache.next_pos.tolist() == [len(p) + 12 for p in prompts]


def _masked_reference(q, k, v, pos, kv_len, blocks, block, scale):
    """Plain masked attention over [0, kv_len): causal by position, selected blocks only."""
    mask = (torch.arange(kv_len) <= pos[:, None])[:, None, None]  # [B, 1, 1, S]
    if blocks is not None:
        mask = mask & keep_mask(blocks[:, :, None], kv_len, block)  # [B, nkv, 1, S]
    out = gqa_attention(q[:, :, None], k[:, :, :kv_len], v[:, :, :kv_len], mask, scale)
    return out[:, :, 0]


@pytest.mark.parametrize("sparse", [False, True])
def test_decode_attention_reads_only_its_keys(sparse):
    g = torch.Generator().manual_seed(3)
    B, nq, nkv, d, block, s_max = 3, 8, 2, 16, 4, 64
    q = torch.randn(B, nq, d, generator=g)
    k, v = torch.randn(B, nkv, s_max, d, generator=g), torch.randn(B, nkv, s_max, d, generator=g)
    pos = torch.tensor([5, 37, 63])
    nblk = s_max // block
    blocks = None
    if sparse:  # 3 distinct picks per (row, kv head), own block included; row 0 has an unused entry (nblk)
        blocks = torch.tensor(
            [[[1, 0, nblk], [0, 1, nblk]], [[9, 2, 5], [9, 0, 7]], [[15, 2, 14], [3, 15, 0]]]
        )
    want = _masked_reference(q, k, v, pos, s_max, blocks, block, 0.25)
    got = decode_attention(q, k, v, pos, s_max, blocks, block, 0.25)
    assert fx.rel(got, want) <= EXACT
    # keys past each row's position do not matter (they hold junk in a static cache)
    k2, v2 = k.clone(), v.clone()
    for b, p in enumerate(pos.tolist()):
        k2[b, :, p + 1 :], v2[b, :, p + 1 :] = 1e4, -1e4
    assert fx.rel(decode_attention_reference(q, k2, v2, pos, s_max, blocks, block, 0.25), want) <= EXACT


def test_cuda_graph_decoding_needs_cuda_devices(model):
    from runtime.graph import DecodeGraph

    with pytest.raises(ValueError, match="need every layer on a CUDA device"):
        DecodeGraph(model, model.new_cache(1, 8))
    with pytest.raises(ValueError, match="need every layer on a CUDA device"):
        model.generate(fx.prompt(4, batch=1), 3, cuda_graph=True)
    assert model.generate(fx.prompt(4, batch=1), 3).shape == (1, 7)  # the default decodes eagerly on CPU
