"""Generation at scale: the converted model generates, the reference is scored by one teacher-forced pass.
Those numbers equal what a token-by-token run of both models gives (KV cache, one step per token), and
verify says what each pass costs before it runs."""

from __future__ import annotations

import logging

import pytest
import torch

import porter
import runtime
from porter.commands.verify import verify
from porter.commands.verify.numerics import kl_per_position

PROMPTS = [
    "Hello world, hello porter.",
    "The sparse attention keeps the best blocks of keys for each query. " * 2,
]
N = 6


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "art"
    porter.convert(tiny_vendor, out, progress=False)
    return out


def per_token(model, ids: torch.Tensor, tokens: list) -> torch.Tensor:
    """Logits [n, V] predicting each of `tokens`, one decoding step per token over the KV cache."""
    cache = model.new_cache(1, ids.shape[1] + len(tokens))
    rows = [model(ids, cache)[0, -1]]
    for t in tokens[:-1]:
        rows.append(model(torch.tensor([[t]]), cache)[0, -1])
    return torch.stack(rows)


def test_teacher_forced_equals_per_token(artifact, tiny_vendor):
    rep = verify(artifact, prompts=PROMPTS, max_new_tokens=N).report
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_vendor / "tokenizer.json"))
    ref, conv = runtime.load(tiny_vendor), runtime.load(artifact)
    assert len(rep.generation) == 2
    for g, prompt in zip(rep.generation, PROMPTS):
        ids = torch.tensor([tok.encode(prompt).ids])
        assert (
            g.converted_tokens == conv.generate(ids, N)[0, ids.shape[1] :].tolist()
            and len(g.converted_tokens) == N
        )
        lr, lc = per_token(ref, ids, g.converted_tokens), per_token(conv, ids, g.converted_tokens)
        assert lc.argmax(-1).tolist() == g.converted_tokens  # greedy: the converted model's own choices
        assert lr.argmax(-1).tolist() == g.reference_argmax
        kl = kl_per_position(lr, lc)
        assert torch.allclose(torch.tensor(g.kl, dtype=torch.float64), kl, rtol=1e-5, atol=1e-7), (
            g.kl,
            kl,
        )  # measured: 2e-8
        assert g.top1 == (lr.argmax(-1) == lc.argmax(-1)).double().tolist()
        want = next(
            (j for j, (a, b) in enumerate(zip(g.reference_argmax, g.converted_tokens)) if a != b), None
        )
        assert g.first_divergence == want


def test_costs_printed_before_running(artifact, caplog):
    with caplog.at_level(logging.INFO, logger="porter"):
        verify(artifact, max_new_tokens=3)
    text = caplog.text
    lines = [r.getMessage() for r in caplog.records]
    exact = next(m for m in lines if m.startswith("verify: exact re-derivation reads"))
    assert "GB (source" in exact and "estimated ~" in exact and "cpu (" in exact
    assert any(m.startswith("verify: generation (3 tokens, converted model resident) reads") for m in lines)
    assert any(
        m.startswith("verify: teacher-forced pass (reference, rounded reference + converted, ") for m in lines
    )
    assert text.index("exact re-derivation reads") < text.index("teacher-forced pass")
    # then the measured projection: after layer 0 (dense) and again after layer 1 (the first MoE layer)
    proj = [m for m in lines if "the teacher-forced pass projects to" in m]
    assert [m.split(" (")[0] for m in proj] == ["verify: layer 0", "verify: layer 1"], proj
    assert proj[0].endswith("for 4 layers (a kind not yet run counted as the slowest)")
    assert text.index("teacher-forced pass (reference") < text.index("projects to")


def test_projection_counts_each_kind_of_layer(caplog):
    """Layer 0 (dense) 1 s: 4 layers project to 4 s (the unseen MoE kind counted as the slowest); layer 1
    (MoE) 3 s: 1 + 3 x 3 = 10 s; later layers of a kind already timed log nothing."""
    from porter.commands.verify.numerics import _Projection

    class Cfg:
        num_hidden_layers = 4
        layer_kind = staticmethod(lambda i: "sparse/moe" if i else "full/dense")

    p = _Projection(Cfg())
    with caplog.at_level(logging.INFO, logger="porter"):
        for i, seconds in enumerate((1.0, 3.0, 5.0, 5.0)):
            p.done(i, seconds)
    totals = [r.getMessage().split("projects to ~")[1].split(" s")[0] for r in caplog.records]
    assert totals == ["4.0", "10.0"]


def test_no_generation_when_the_converted_model_does_not_fit(artifact, monkeypatch):
    import porter.commands.verify.generation as g

    monkeypatch.setattr(g, "memory_available", lambda device: 1 << 20)
    rep = verify(artifact).report
    assert rep.max_new_tokens == 0 and rep.generation == [] and rep.streaming.enabled
    asked = verify(artifact, max_new_tokens=2).report  # asked for: layer-streamed generation
    assert asked.streaming.generation == "streaming" and len(asked.generation[0].converted_tokens) == 2


def test_prompts_generate_as_one_padded_batch(artifact):
    """Left-padded prompts of different lengths decode together and give what each gives alone."""
    from porter.commands.verify import generation as g

    conv = runtime.load(artifact)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    ids = [torch.tensor([tok.encode(p).ids]) for p in PROMPTS + ["Hello"]]
    assert len({x.shape[1] for x in ids}) == 3
    alone = [g.greedy(conv, x, N, None) for x in ids]
    assert g.greedy_all(conv, ids, N, None) == alone
    eos = alone[0][1]  # row 0 stops after two tokens; the batch goes on for the others
    assert g.greedy_all(conv, ids, N, eos) == [g.greedy(conv, x, N, eos) for x in ids]
    assert len(g.greedy_all(conv, ids, N, eos)[0]) == alone[0].index(eos) + 1
    rep = verify(artifact, prompts=PROMPTS, max_new_tokens=2).report
    assert rep.streaming.generation == "resident, one padded batch of 2 prompts"


def test_device_map_choice_spreads_generation_over_gpus_only_when_asked(monkeypatch):
    """--device-map auto with a bare cuda device and two GPUs budgets both GPUs' free bytes and loads with
    device_map="auto"; --device-map none, or an indexed device, keeps the model on that one device."""
    import porter.commands.verify.generation as g

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    free = {0: 70 << 30, 1: 50 << 30}
    monkeypatch.setattr(
        g,
        "memory_available",
        lambda d: free[d.index if d.index is not None else 0] if d.type == "cuda" else 1 << 30,
    )
    cuda = torch.device("cuda")
    assert g.generation_budget(cuda, "auto") == (120 << 30, "auto")
    assert g.generation_budget(cuda, None) == (70 << 30, None)
    assert g.generation_budget(torch.device("cuda", 1), "auto") == (50 << 30, None)
    # an 80 GB model fits two GPUs (STREAM_FRACTION 0.8 of 120 GB), not one: resident over both, or skipped
    plan = g.plan_runs(False, None, cuda, 80 << 30, 80 << 30, "auto")
    assert (plan.device_map, plan.new_tokens) == ("auto", g.DEFAULT_MAX_NEW_TOKENS)
    plan = g.plan_runs(False, None, cuda, 80 << 30, 80 << 30, None)
    assert (plan.device_map, plan.new_tokens) == (None, 0) and plan.generation.startswith("skipped")
    with pytest.raises(g.VerifyInputError):
        g.generation_budget(cuda, "balanced")
