"""gpt-oss runtime == transformers 5.23 `models/gpt_oss` (the independent oracle) on tiny random checkpoints.

Both source layouts (examples/gpt_oss_tiny_checkpoint.py): the MXFP4 release, whose experts transformers
reads through its own dequantizer (integrations/mxfp4.py), and transformers' bf16 layout. The runtime runs
from the checkpoint, from `--quantize none` and from MXFP8 artifacts; prompts shorter and 6x longer than the
sliding window (4), prefill and token-by-token decode over the KV cache (sinks, windows, YaRN), left-padded
batches. Bounds are those of the MiniMax-M3 oracle tests (tests/test_runtime_oracle.py).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gpt_oss_tiny_checkpoint import TINY, build_tiny_checkpoint  # noqa: E402
from safetensors import safe_open  # noqa: E402

import runtime  # noqa: E402
from porter import convert  # noqa: E402
from porter.format import mxfp8  # noqa: E402

EXACT, MXFP8_TOL = 1e-5, 2e-3
SHORT, LONG = 3, 24  # prompt lengths: inside the sliding window (4) and 6x past it
pytestmark = pytest.mark.usefixtures("one_thread")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def prompt(n: int, batch: int = 2, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (batch, n), generator=g)


def _tensors(folder) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def hf_from_release(path):
    """transformers' GptOssForCausalLM on the release: config.json as transformers reads it, every tensor
    as stored, the MXFP4 experts through transformers' own dequantizer ([E, N, K/32, 16] -> [E, K, N])."""
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    raw = json.loads((path / "config.json").read_text())
    raw.pop("quantization_config")
    model = GptOssForCausalLM(GptOssConfig(**raw)).float().eval()
    state = {}
    for name, t in _tensors(path).items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            scales = _tensors(path)[name.replace("_blocks", "_scales")]
            name, t = name[: -len("_blocks")], convert_moe_packed_tensors(t, scales, dtype=torch.float32)
        state[name] = t.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def hf_from_bf16(path):
    from transformers import GptOssForCausalLM

    model, info = GptOssForCausalLM.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval()


def hf_logits(model, ids, attention_mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attention_mask).logits.float()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    d = build_tiny_checkpoint(tmp_path_factory.mktemp("gptoss-release") / "src", "mxfp4", seed=3)
    return d, hf_from_release(d)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    d = build_tiny_checkpoint(tmp_path_factory.mktemp("gptoss-bf16") / "src", "bf16", seed=5)
    return d, hf_from_bf16(d)


def _artifact(src, quantize):
    out = src.parent / f"artifact-{quantize}"
    if not out.exists():
        convert(src, out, quantize=quantize, progress=False)
    return out


def _load(path, **kw):
    return runtime.load(path, device="cpu", dtype=torch.float32, backend="torch", **kw)


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_release_runs_exactly_as_transformers_reads_it(release, n):
    """MXFP4 -> MXFP8 is exact, so the artifact's logits are transformers' on the release to fp32 round-off."""
    src, hf = release
    ids = prompt(n)
    want = hf_logits(hf, ids)
    for path in (src, _artifact(src, "experts")):
        model = _load(path)
        got = model(ids)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert rel(got, want) <= EXACT, (path.name, n, rel(got, want))
    moe = model.layers[0].mlp.quant
    assert moe.w13_weight.dtype == torch.float8_e4m3fn and moe.w13_bias.dtype == torch.float32


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_bf16_unquantized_matches_transformers(bf16, n):
    src, hf = bf16
    ids = prompt(n, seed=9)
    want = hf_logits(hf, ids)
    for path in (src, _artifact(src, "none")):
        got = _load(path)(ids)
        assert rel(got, want) <= EXACT, (path.name, n, rel(got, want))


def fake_quantize_hf(model):
    """transformers' experts replaced by their MXFP8 round trip, blocks along each GEMM's K (H for gate_up
    [E, H, 2I], I for down [E, I, H]): what the conversion does, in transformers' own orientation."""
    with torch.no_grad():
        for layer in model.model.layers:
            x = layer.mlp.experts
            x.gate_up_proj.copy_(mxfp8.fake_quantize(x.gate_up_proj.transpose(1, 2)).transpose(1, 2))
            x.down_proj.copy_(mxfp8.fake_quantize(x.down_proj.transpose(1, 2)).transpose(1, 2))
    return model


def test_bf16_mxfp8_matches_fake_quantized_transformers(bf16):
    src, hf = bf16
    ids = prompt(LONG, seed=11)
    plain = hf_logits(hf, ids)
    want = hf_logits(fake_quantize_hf(copy.deepcopy(hf)), ids)
    got = _load(_artifact(src, "experts"))(ids)
    err, quant_effect = rel(got, want), rel(want, plain)
    print(f"mxfp8 experts: rel {err:.2e} (quantization itself moves logits by {quant_effect:.2e})")
    assert err <= MXFP8_TOL and err < quant_effect


def test_quantize_all_matches_fake_quantized_attention(release):
    src, hf = release
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for layer in ref.model.layers:
            for lin in (
                layer.self_attn.q_proj,
                layer.self_attn.k_proj,
                layer.self_attn.v_proj,
                layer.self_attn.o_proj,
            ):
                lin.weight.copy_(mxfp8.fake_quantize(lin.weight))
    ids = prompt(LONG, seed=12)
    model = _load(_artifact(src, "all"))
    assert model.layers[1].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    err = rel(model(ids), hf_logits(ref, ids))
    assert err <= MXFP8_TOL, err


def test_decode_over_the_cache_matches_full_forward(release):
    """Prefill 5 tokens, then one token at a time past the window: each step's logits are transformers'
    at that position (the decode path gathers each sliding layer's window from the cache)."""
    src, hf = release
    ids = prompt(LONG, seed=13)
    want = hf_logits(hf, ids)  # [B, T, V]
    model = _load(_artifact(src, "experts"))
    cache = model.new_cache(ids.shape[0], LONG)
    got = [model(ids[:, :5], cache)]
    for t in range(5, LONG):
        got.append(model(ids[:, t : t + 1], cache))
    got = torch.cat(got, dim=1)
    assert rel(got, want) <= EXACT, rel(got, want)


def test_left_padded_batch_matches_each_prompt_alone(bf16):
    src, hf = bf16
    long_, short = prompt(LONG, 1, seed=14)[0], prompt(7, 1, seed=15)[0]
    ids = torch.stack([long_, torch.cat([torch.zeros(LONG - 7, dtype=torch.long), short])])
    mask = torch.ones_like(ids)
    mask[1, : LONG - 7] = 0
    model = _load(src)
    got = model(ids, attention_mask=mask)
    assert rel(got[0], hf_logits(hf, long_[None])[0]) <= EXACT
    assert rel(got[1, LONG - 7 :], hf_logits(hf, short[None])[0]) <= EXACT
    # and generation of the batch continues each row as it would alone (greedy, over the cache)
    out = model.generate(ids, max_new_tokens=6, attention_mask=mask, eos_token_id=[])
    alone = model.generate(short[None], max_new_tokens=6, eos_token_id=[])
    assert out[1, LONG:].tolist() == alone[0, 7:].tolist()


def test_hidden_states_layer_by_layer_and_streamed(bf16):
    src, hf = bf16
    ids = prompt(LONG, seed=16)
    with torch.no_grad():
        want = list(hf(input_ids=ids, output_hidden_states=True).hidden_states)
    model = _load(src)
    logits, states = model(ids, output_hidden_states=True)
    assert len(states) == len(want) == model.cfg.num_hidden_layers + 1
    for i, (a, b) in enumerate(zip(states[:-1], want[:-1])):  # transformers' last entry is final-normed
        assert rel(a, b) <= EXACT, (i, rel(a, b))
    lazy = _load(src, lazy=True)
    pos = torch.arange(ids.shape[1])
    for i in range(len(lazy.layers)):
        assert rel(lazy.layers[i](want[i].float(), pos), states[i + 1]) <= EXACT, i
    assert rel(lazy.final(states[-1]), logits) <= EXACT


def test_generate_matches_transformers_greedy(release):
    src, hf = release
    ids = prompt(6, 1, seed=17)
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = _load(_artifact(src, "experts")).generate(ids, max_new_tokens=10, eos_token_id=[])
    assert got.tolist() == want.tolist()


def test_harmony_chat_template_renders_as_transformers_does(release):
    """The checkpoint's harmony template, rendered in porter's sandbox, is transformers' rendering."""
    from transformers import PreTrainedTokenizerFast

    src, _ = release
    messages = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2}}}],
        },
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "Thanks"},
    ]
    model = _load(_artifact(src, "experts"))
    got = model.tokenizer.apply_chat_template(messages)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"))
    tok.chat_template = (src / "chat_template.jinja").read_text()
    want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got == want
    assert got.startswith("<|start|>system<|message|>") and got.endswith("<|start|>assistant")
    assert '<|start|>functions.add to=assistant<|channel|>commentary<|message|>"4"<|end|>' in got
    ids = model.tokenizer.encode(got, add_special_tokens=False)
    assert model.tokenizer.backend.token_to_id("<|start|>") in ids  # harmony tokens are single tokens
    text = model.generate("What is 2 + 2?", chat=True, max_new_tokens=4)
    assert isinstance(text, str)
