"""device_map planning (runtime/placement.py) with faked device sizes, and loading through a device_map on
CPU. The two-GPU split against a one-GPU load is in tests/test_runtime_gpu_decode.py (gpu)."""

from __future__ import annotations

import pytest
import runtime_fixtures as fx
import torch

import porter
import runtime
from porter.errors import PorterError
from porter.format.safetensors_io import parse_header
from runtime.placement import GiB, PlacementError, Sizes, explicit, parse_bytes, plan, store_sizes

C0, C1, C2 = (torch.device("cuda", i) for i in range(3))


def test_layers_fill_devices_in_order():
    sizes = Sizes(embed=4 * GiB, head=6 * GiB, layers=(10 * GiB,) * 8)  # 90 GiB
    p = plan(sizes, {0: 50 * GiB, 1: 50 * GiB})
    assert p.embed == C0 and p.head == C1
    assert p.layers == (C0,) * 4 + (C1,) * 4  # 4 + 40 on cuda:0; 40 + 6 on cuda:1
    assert p.used == {"cuda:0": 44 * GiB, "cuda:1": 46 * GiB}
    assert "layers 0-3 on cuda:0; layers 4-7 on cuda:1" in p.describe()


def test_everything_on_the_first_device_when_it_fits():
    p = plan(Sizes(GiB, GiB, (GiB,) * 3), {0: 80 * GiB, 1: 80 * GiB})
    assert set(p.layers) == {C0} and p.head == C0 and list(p.used) == ["cuda:0"]


def test_lm_head_moves_the_last_layer_when_it_does_not_fit_beside_it():
    sizes = Sizes(embed=GiB, head=5 * GiB, layers=(10 * GiB,) * 2)
    p = plan(sizes, {0: 21 * GiB, 1: 20 * GiB})  # layer 1 + head = 15 does not fit after 11 on cuda:0
    assert p.layers == (C0, C1) and p.head == C1 and p.used["cuda:1"] == 15 * GiB


def test_too_large_is_refused_with_needed_and_available():
    sizes = Sizes(embed=4 * GiB, head=6 * GiB, layers=(10 * GiB,) * 8)  # 90 GiB
    with pytest.raises(PlacementError) as e:
        plan(sizes, {0: 40 * GiB, 1: 40 * GiB})
    msg = str(e.value)
    assert "\n" not in msg and "90.00 GiB" in msg and "80.00 GiB" in msg, msg
    assert isinstance(e.value, PorterError)  # CLI exit 2


def test_whole_layers_that_do_not_pack_are_refused():
    # 26 GiB total in 2 x 30 GiB, but 12 GiB layers cannot be split: 1+12 | 12+1 fits, 3 layers do not
    sizes = Sizes(embed=GiB, head=GiB, layers=(12 * GiB,) * 3)
    plan(Sizes(GiB, GiB, (12 * GiB,) * 2), {0: 14 * GiB, 1: 14 * GiB})
    with pytest.raises(PlacementError, match="layer 2") as e:
        plan(sizes, {0: 20 * GiB, 1: 20 * GiB})
    assert "38.00 GiB" in str(e.value) and "40.00 GiB" in str(e.value)


def test_explicit_map_must_name_every_layer_and_fit():
    sizes = Sizes(GiB, 2 * GiB, (3 * GiB,) * 4)
    m = {f"layers.{i}": ("cuda:0" if i < 2 else "cuda:1") for i in range(4)}
    p = explicit(m, sizes, None)
    assert p.layers == (C0, C0, C1, C1) and p.embed == C0 and p.head == C1
    assert p.used == {"cuda:0": 7 * GiB, "cuda:1": 8 * GiB}
    with pytest.raises(PlacementError, match=r"layers \[3\]"):
        explicit({k: v for k, v in m.items() if k != "layers.3"}, sizes, None)
    with pytest.raises(PlacementError, match="layers.9"):
        explicit({**m, "layers.9": "cuda:0"}, sizes, None)
    with pytest.raises(PlacementError, match="8.00 GiB of weights on cuda:1"):
        explicit(m, sizes, {0: 10 * GiB, 1: 7 * GiB})


def test_parse_bytes():
    assert (
        parse_bytes("70GiB") == 70 * GiB
        and parse_bytes("1.5 GB") == 1_500_000_000
        and parse_bytes(123) == 123
    )
    with pytest.raises(PlacementError, match="max_memory"):
        parse_bytes("lots")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    base = tmp_path_factory.mktemp("devmap")
    src = fx.vendor_checkpoint(base / "src", seed=4)
    out = base / "mxfp8"
    porter.convert(src, out, quantize="all", progress=False)
    return src, out


def test_store_sizes_are_the_shard_bytes(artifact):
    src, art = artifact
    store = runtime.loader.open_store(art)
    sizes = store_sizes(store, store.config.num_hidden_layers)
    text, carried = 0, store.carried_names()  # the runtime never loads the vision tower
    for shard in sorted(art.glob("*.safetensors")):
        for name, info in parse_header(shard)[1].items():
            if name in store.names() and name not in carried:
                text += info["data_offsets"][1] - info["data_offsets"][0]
    assert sizes.total == text and all(b > 0 for b in sizes.layers)
    assert sizes.layers[1] > sizes.layers[0] / 4  # MoE layers hold the experts
    # the source checkpoint's sizes: bf16/fp32 as stored, bigger than the MXFP8 artifact
    src_sizes = store_sizes(runtime.loader.open_store(src), store.config.num_hidden_layers)
    assert src_sizes.total > sizes.total


def test_refused_before_any_weight_is_read(artifact, monkeypatch):
    _, art = artifact
    store = runtime.loader.open_store(art)
    monkeypatch.setattr(store, "get", lambda name: pytest.fail(f"read {name} before refusing"))
    with pytest.raises(PlacementError, match="does not fit"):
        runtime.load(store, device_map="auto", max_memory={"cpu": 1000})


def test_a_refused_load_closes_the_store_it_opened(artifact, monkeypatch):
    """runtime.load(path) that refuses leaves no shard handle open; a store the caller passed stays open."""
    _, art = artifact
    opened = []

    def open_tracked(path, **kw):
        store = runtime.loader.open_store(path, **kw)
        store.closed = 0
        close = store.close
        store.close = lambda: (setattr(store, "closed", store.closed + 1), close())
        opened.append(store)
        return store

    monkeypatch.setattr(runtime, "open_store", open_tracked)
    with pytest.raises(PlacementError, match="does not fit"):
        runtime.load(art, device_map="auto", max_memory={"cpu": 1000})
    assert [s.closed for s in opened] == [1]
    caller_store = open_tracked(art)
    with pytest.raises(PlacementError, match="does not fit"):
        runtime.load(caller_store, device_map="auto", max_memory={"cpu": 1000})
    assert caller_store.closed == 0


def test_device_map_load_on_cpu_equals_plain_load(artifact):
    _, art = artifact
    ids = fx.prompt(fx.LONG, seed=2)
    want = runtime.load(art, device="cpu")(ids)
    n = runtime.load(art).cfg.num_hidden_layers
    for dm in ("auto", {f"layers.{i}": "cpu" for i in range(n)}):
        model = runtime.load(art, device_map=dm, max_memory={"cpu": "1GiB"})
        assert model.placement.layers == (torch.device("cpu"),) * n
        assert torch.equal(model(ids), want)
