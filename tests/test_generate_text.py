"""Prompt to text on the tiny checkpoint (CPU): tokenizer and generation defaults from the folder, sampling,
EOS, stop strings, streaming, the chat template, batched prompts, `porter generate` and argument checks."""

import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner

import runtime
from porter.cli import main as cli
from porter.errors import DeviceError, TextError

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "art"
    res = CliRunner().invoke(cli, ["convert", str(tiny_vendor), "--output", str(out), "-q"])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def model(artifact):
    return runtime.load(artifact)


def greedy_ids(model, ids: list, n: int) -> list:
    """Reference: n argmax steps by full recomputation (no cache, no EOS)."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids


def test_tokenizer_and_defaults_come_from_the_folder(model):
    tok = model.tokenizer
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert model.generation_config.eos_token_ids == (tok.backend.token_to_id("</s>"),)
    assert model.generation_config.max_new_tokens == 128 and model.generation_config.greedy


def test_text_in_text_out_equals_ids(model):
    ids = model.tokenizer.encode(PROMPT)
    want = greedy_ids(model, ids, 6)
    assert model.generate(ids, 6, eos_token_id=[]) == want  # a list of ids in, a list out
    out = model.generate(torch.tensor([ids]), 6, eos_token_id=[])
    assert out.tolist() == [want]
    assert model.generate(PROMPT, 6, eos_token_id=[]) == model.tokenizer.decode(want[len(ids) :])


def test_sampling_with_a_seed_is_reproducible(model):
    runs = {
        s: model.generate(PROMPT, 8, do_sample=True, temperature=1.5, seed=s, eos_token_id=[])
        for s in range(4)
    }
    assert all(
        model.generate(PROMPT, 8, do_sample=True, temperature=1.5, seed=s, eos_token_id=[]) == t
        for s, t in runs.items()
    )
    assert len(set(runs.values())) >= 2  # the seed changes the draw
    greedy = model.generate(PROMPT, 8, eos_token_id=[])
    assert model.generate(PROMPT, 8, do_sample=True, temperature=0, eos_token_id=[]) == greedy
    assert model.generate(PROMPT, 8, do_sample=True, top_k=1, seed=5, eos_token_id=[]) == greedy
    assert model.generate(PROMPT, 8, do_sample=True, top_p=1e-6, seed=5, eos_token_id=[]) == greedy


def test_top_k_and_top_p_only_draw_allowed_tokens():
    from runtime.sampling import choose
    from runtime.text import GenerationConfig

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)  # probs .64 .23 .09 .03 .01
    gen = torch.Generator().manual_seed(0)
    top2 = choose(logits, GenerationConfig(do_sample=True, top_k=2), gen)
    assert set(top2.tolist()) == {0, 1}
    nucleus = choose(logits, GenerationConfig(do_sample=True, top_p=0.8), gen)  # .64 + .23 >= .8
    assert set(nucleus.tolist()) == {0, 1}
    share = (nucleus == 0).float().mean().item()
    assert abs(share - 0.64 / 0.87) < 0.04  # renormalised over the kept set (binomial sd ~0.01)


def test_eos_from_generation_config_stops(artifact, tmp_path):
    folder = tmp_path / "eos"
    shutil.copytree(artifact, folder)
    probe = runtime.load(folder)
    ids = probe.tokenizer.encode(PROMPT)
    first, second = greedy_ids(probe, ids, 2)[len(ids) :]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [999999, second]}))
    model = runtime.load(folder)
    assert model.generation_config.eos_token_ids == (999999, second)
    assert model.generate(ids, 10) == ids + [first, second]  # stops at EOS, EOS kept in ids
    assert model.generate(PROMPT, 10) == probe.tokenizer.decode([first])  # not in the text


def test_finished_rows_are_padded_while_others_go_on(model):
    ids = model.tokenizer.encode(PROMPT)
    other = model.tokenizer.encode("hello there, world")
    first = greedy_ids(model, ids, 1)[-1]
    out = model.generate([ids, other], 5, eos_token_id=first)
    pad = model.tokenizer.pad_token_id
    assert out[0] == ids + [first] + [pad] * 4
    assert out[1] == model.generate(other, 5, eos_token_id=first)


def test_batched_strings_equal_single_runs(model):
    prompts = ["hi", PROMPT, "a much longer prompt, with more words than the others"]
    batched = model.generate(prompts, 7, eos_token_id=[])
    assert batched == [model.generate(p, 7, eos_token_id=[]) for p in prompts]


def test_stop_strings_and_streaming(model):
    full = model.generate(PROMPT, 12, eos_token_id=[])
    stop = full[4:6]
    cut = full.find(stop)
    pieces = []
    got = model.generate(
        PROMPT, 12, eos_token_id=[], stop=[stop], stream=lambda row, t: pieces.append((row, t))
    )
    assert got == full[:cut]
    assert "".join(t for _, t in pieces) == got and {r for r, _ in pieces} <= {0}
    streamed = []
    assert model.generate(PROMPT, 12, eos_token_id=[], stream=lambda r, t: streamed.append(t)) == full
    assert "".join(streamed) == full


def test_chat_template(model):
    tok = model.tokenizer
    rendered = tok.apply_chat_template("hi there")
    assert rendered == "<s>user: hi there</s>\nassistant:"
    two = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}],
        add_generation_prompt=False,
    )
    assert two == "<s>system: be brief</s>\nuser: x</s>\n"
    ids = tok.encode(rendered, add_special_tokens=False)
    assert ids[0] == tok.backend.token_to_id("<s>")
    want = tok.decode(greedy_ids(model, ids, 5)[len(ids) :])
    assert model.generate("hi there", 5, chat=True, eos_token_id=[]) == want
    assert model.generate([{"role": "user", "content": "hi there"}], 5, eos_token_id=[]) == want


def test_chat_template_runs_sandboxed(model):
    from runtime.text import render_template

    with pytest.raises(TextError, match="SecurityError|unsafe"):
        render_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", messages=[])
    with pytest.raises(TextError, match="chat template: no system role"):
        render_template("{{ raise_exception('no system role') }}")


@pytest.mark.parametrize(
    "bad, match",
    [
        (3.5, "prompt must be"),
        ([], "prompt must be"),
        ([1, "a"], "prompt must be"),
        (torch.zeros(1, 3), "integer tensor"),
    ],
)
def test_bad_prompts_are_one_line_errors(model, bad, match):
    with pytest.raises(TextError, match=match):
        model.generate(bad, 2)


@pytest.mark.parametrize(
    "option",
    [
        dict(temperature=-1.0),
        dict(temperature=math.nan),
        dict(top_p=0.0),
        dict(top_p=math.nan),
        dict(top_k=-2),
        dict(max_new_tokens=-1),
    ],
)
def test_bad_generation_options(model, option):
    with pytest.raises(TextError, match=next(iter(option))):
        model.generate(PROMPT, **({"max_new_tokens": 2} | option))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dtype="bfloat17"), "dtype 'bfloat17'"),
        (dict(device="bfloat16"), "'bfloat16' is not a device"),
        (dict(device="tpu"), "tpu' is not a device"),
        (dict(device="meta"), "porter runs on cpu or cuda"),
        (dict(device=f"cuda:{torch.cuda.device_count()}"), "no CUDA GPU|CUDA device"),  # one past the last
    ],
)
def test_load_checks_device_and_dtype_first(artifact, kw, match):
    with pytest.raises(DeviceError, match=match):
        runtime.load(artifact, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", torch.bfloat16, "auto", None])
def test_load_accepts_dtype_strings_and_objects(artifact, dtype):
    model = runtime.load(artifact, dtype=dtype)
    assert model.dtype == (torch.bfloat16 if dtype in ("bfloat16", torch.bfloat16) else torch.float32)


def test_porter_generate_command(artifact):
    res = CliRunner().invoke(cli, ["generate", str(artifact), "--prompt", PROMPT, "--max-new-tokens", "6"])
    assert res.exit_code == 0, res.output
    model = runtime.load(artifact)
    assert model.generate(PROMPT, 6) in res.output
    assert "tokens/s" in res.output
    res = CliRunner().invoke(
        cli,
        [
            "generate",
            str(artifact),
            "--prompt",
            "hi",
            "--chat",
            "--temperature",
            "0.7",
            "--seed",
            "1",
            "--max-new-tokens",
            "3",
            "-q",
        ],
    )
    assert res.exit_code == 0 and "tokens/s" not in res.output
    assert model.generate("hi", 3, chat=True, do_sample=True, temperature=0.7, seed=1) in res.output


@pytest.mark.parametrize(
    "args", [["--device", "bfloat16"], ["--device", f"cuda:{torch.cuda.device_count()}"]]
)
def test_device_errors_are_one_line_in_every_command(artifact, args):
    for cmd in (
        ["generate", str(artifact), "--prompt", "x"],
        ["verify", str(artifact)],
        ["convert", str(artifact), "--output", str(artifact) + "-never"],
    ):
        res = CliRunner().invoke(cli, cmd + args)
        assert res.exit_code == 2, (cmd, res.output)
        lines = [ln for ln in res.output.splitlines() if ln.startswith("porter:")]
        assert len(lines) == 1 and "device" in lines[0] and "Traceback" not in res.output


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbosity_flags_in_either_position(artifact, where):
    for cmd in (
        ["inspect", str(artifact)],
        ["generate", str(artifact), "--prompt", "x", "--max-new-tokens", "1"],
    ):
        args = ["-q", *cmd] if where == "before" else [*cmd, "-q"]
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 0, res.output
        args = ["-v", *cmd] if where == "before" else [*cmd, "-v"]
        assert CliRunner().invoke(cli, args).exit_code == 0


@pytest.mark.parametrize(
    "tokens, slots", [(1, 128), (128, 128), (129, 256), (1057, 1152), (8225, 9216), (65536, 65536)]
)
def test_reusable_cache_sizes(tokens, slots):
    """Eighths of an octave, whole index blocks (128): at most 1/8 more cache read than needed, at least
    the tokens asked for."""
    from runtime.generate import cache_slots

    assert cache_slots(tokens, 128) == slots
    assert tokens <= slots <= max(128, tokens * 9 // 8 + 128)


def test_cache_reset_equals_a_new_cache(model):
    used = model.new_cache(2, 12)
    model(torch.tensor([[5, 6, 7], [8, 9, 10]]), used)
    used.reset()
    fresh = model.new_cache(2, 12)
    assert used.length == 0 and int(used.next_pos.abs().sum()) == 0
    for a, b in zip(used.layers, fresh.layers):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        assert (a.idx_k is None) == (b.idx_k is None) and (a.idx_k is None or torch.equal(a.idx_k, b.idx_k))
