"""The converter registry (converters/__init__.py) and the Converter protocol (converters/base.py):
model_type -> converter, unknown architectures refused with a ConfigError naming the supported ones, the
MiniMax-M3 converter providing every protocol member, and callers using nothing outside the protocol."""

import ast
import inspect
import json
import shutil
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_checkpoint import transformers_config, vendor_config

import converters
import converters.minimax_m3
from converters.base import (
    CAPABILITIES,
    Converter,
    HfLayout,
    ResolvedConfig,
    VerifyRules,
    conformance_problems,
    protocol_members,
)
from porter.cli import main as cli
from porter.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SUPPORTED = "gpt_oss, minimax_m2, minimax_m3, minimax_m3_vl, minimax_m3_vl_text"


@pytest.mark.parametrize("model_type", ["minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3"])
def test_registry_maps_each_model_type_to_minimax_m3(model_type):
    assert converters.get(model_type) is converters.minimax_m3
    assert converters.for_config({"model_type": model_type}) is converters.minimax_m3


def test_for_config_resolves_both_source_layouts():
    vendor, flat = vendor_config(), transformers_config(vendor_config()["text_config"])
    assert (vendor["model_type"], flat["model_type"]) == ("minimax_m3_vl", "minimax_m3_vl_text")
    resolved = [converters.for_config(raw).resolve_config(raw) for raw in (vendor, flat)]
    layers = vendor["text_config"]["num_hidden_layers"]
    assert resolved[0].num_hidden_layers == resolved[1].num_hidden_layers == layers
    legacy = "legacy:text_config.sparse_attention_config.sparse_attention_freq"
    assert resolved[0].provenance["layer_types"] == legacy
    assert resolved[1].provenance["layer_types"] == "config:layer_types"
    assert resolved[0].layer_types == resolved[1].layer_types


def test_supported_lists_every_model_type_once():
    assert converters.supported() == (
        "gpt_oss",
        "minimax_m2",
        "minimax_m3",
        "minimax_m3_vl",
        "minimax_m3_vl_text",
    )
    by_module = {}
    for model_type, module in converters.MODEL_TYPES.items():
        by_module.setdefault(module, set()).add(model_type)
    for module, types_ in by_module.items():  # each converter lists exactly its registry keys
        assert set(converters.get(next(iter(types_))).MODEL_TYPES) == types_, module


@pytest.mark.parametrize("model_type", ["llama", "minimax_m1", "", None, ["minimax_m3_vl"]])
def test_unknown_model_type_is_a_config_error_naming_it_and_the_supported_ones(model_type):
    want = (
        f"config.json: model_type {model_type!r} is not an architecture porter converts "
        f"(supported: {SUPPORTED})"
    )
    with pytest.raises(ConfigError) as e:
        converters.get(model_type)
    assert str(e.value) == want
    with pytest.raises(ConfigError) as e:
        converters.for_config({"model_type": model_type, "text_config": {}}, "ckpt/config.json")
    assert str(e.value) == want.replace("config.json", "ckpt/config.json", 1)


def test_missing_model_type_and_non_object_config():
    with pytest.raises(ConfigError, match=r"^x/config.json: model_type None is not an architecture"):
        converters.for_config({"hidden_size": 8}, "x/config.json")
    with pytest.raises(ConfigError, match=r"^x/config.json must hold a JSON object$"):
        converters.for_config([1, 2], "x/config.json")


def test_convert_refuses_an_unknown_architecture_with_exit_2(tiny_vendor, tmp_path):
    src = tmp_path / "llama"
    src.mkdir()
    for f in tiny_vendor.iterdir():  # copies: a symlink pointing out of the folder is refused on its own
        shutil.copy(f, src / f.name)
    (src / "config.json").write_text(json.dumps({**vendor_config(), "model_type": "llama"}))
    res = CliRunner().invoke(cli, ["convert", str(src), "--output", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [
        f"porter: error: {src / 'config.json'}: model_type 'llama' is not an architecture porter converts "
        f"(supported: {SUPPORTED})"
    ]
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_protocol_members():
    """A small core, and two optional capabilities (each a module-like object under a core name)."""
    members = protocol_members()
    assert {n for n, k in members.items() if k == "constant"} == {
        "ARCHITECTURE",
        "MODEL_TYPES",
        "LAYOUTS",
        "DEFAULT_SCOPE",
        "hf_layout",
        "verify_rules",
        "SIZE_RULES",
    }
    assert {n for n, k in members.items() if k == "function"} == {
        "resolve_config",
        "config_sizes",
        "manifest_facts",
        "source_layout",
        "plan_tensors",
        "canonical_name",
    }
    assert set(protocol_members(HfLayout)) == {
        "check_hf_source",
        "hf_config_json",
        "hf_quantization_config",
        "hf_canonical_map",
    }
    assert set(protocol_members(VerifyRules)) == {"source_rules", "roots", "canonical", "experts_of"}
    assert set(CAPABILITIES) == {"hf_layout", "verify_rules"}


def _same_signatures(obj, proto):
    for name, kind in protocol_members(proto).items():
        value = getattr(obj, name)
        if kind != "function":
            continue
        want = list(inspect.signature(getattr(proto, name)).parameters.values())[1:]
        have = list(inspect.signature(value).parameters.values())
        assert [(p.name, p.default) for p in have] == [(p.name, p.default) for p in want], name


def test_minimax_m3_satisfies_the_protocol():
    m3 = converters.minimax_m3
    assert conformance_problems(m3) == []
    for name, kind in protocol_members().items():
        value = getattr(m3, name)
        assert callable(value) if kind == "function" else not callable(value), name
    _same_signatures(m3, Converter)  # same parameters, same defaults as the protocol states
    _same_signatures(m3.hf_layout, HfLayout)
    _same_signatures(m3.verify_rules, VerifyRules)
    assert m3.ARCHITECTURE == "minimax_m3" and m3.LAYOUTS == ("porter", "hf")
    assert m3.DEFAULT_SCOPE == {"porter": "experts", "hf": "all"}


def test_gpt_oss_satisfies_the_core_and_verify_rules_without_an_hf_layout():
    oss = converters.get("gpt_oss")
    assert conformance_problems(oss) == []
    _same_signatures(oss, Converter)
    _same_signatures(oss.verify_rules, VerifyRules)
    assert oss.hf_layout is None and oss.LAYOUTS == ("porter",) and oss.DEFAULT_SCOPE == {"porter": "experts"}


def test_verify_rules_import_nothing_of_their_converter():
    """verify's source table is written apart from the plan: a converter's verify_rules module imports no
    module of its own package (a layout bug in the plan must not reach both sides of the comparison)."""
    for module in sorted(set(converters.MODEL_TYPES.values())):
        rules = converters.get(next(t for t, m in converters.MODEL_TYPES.items() if m == module)).verify_rules
        if rules is None:
            continue
        tree = ast.parse(Path(rules.__file__).read_text())
        own = [
            n.module
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(f"converters.{module}")
        ]
        own += [
            a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.Import)
            for a in n.names
            if a.name.startswith(f"converters.{module}")
        ]
        assert own == [], (module, own)


def test_resolved_config_provides_what_callers_read():
    cfg = converters.minimax_m3.resolve_config(vendor_config())
    for name in ResolvedConfig.__annotations__:
        assert hasattr(cfg, name), name
    for name in ("to_dict", "is_moe", "layer_kind"):
        assert callable(getattr(cfg, name)), name
    assert isinstance(cfg.to_dict(), dict) and "provenance" not in cfg.to_dict()
    assert set(cfg.STRUCTURAL) <= set(cfg.to_dict())
    assert [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)] == [
        "full/dense",
        "sparse/moe",
        "sparse/moe",
        "sparse/moe",
    ]


def test_conformance_problems_names_what_is_wrong():
    m3 = converters.minimax_m3
    broken = types.SimpleNamespace(**{n: getattr(m3, n) for n in protocol_members()})
    del broken.source_layout
    broken.LAYOUTS = ["porter"]
    broken.canonical_name = "not a function"
    broken.plan_tensors = lambda cfg, meta: []
    broken.hf_layout = types.SimpleNamespace(
        **{n: getattr(m3.hf_layout, n) for n in protocol_members(HfLayout) if n != "hf_config_json"}
    )
    assert conformance_problems(broken) == [
        "LAYOUTS is a list, not a tuple",
        "source_layout is missing",
        "plan_tensors('cfg', 'meta') does not take the protocol's parameters "
        "('cfg', 'src_meta', 'quantize', 'gate_up', 'layout')",
        "canonical_name is not callable",
        "hf_layout.hf_config_json is missing",
    ]
    broken = types.SimpleNamespace(**{n: getattr(m3, n) for n in protocol_members()})
    broken.hf_layout = None  # LAYOUTS still names "hf"
    assert conformance_problems(broken) == [
        'LAYOUTS lists "hf" exactly when the hf_layout capability is provided'
    ]


def test_registry_refuses_an_incomplete_converter_module(monkeypatch):
    """A converter module without the protocol is a porter bug (TypeError), found on first use."""
    fake = types.ModuleType("converters.fake_arch")
    fake.resolve_config = lambda raw: None
    monkeypatch.setitem(sys.modules, "converters.fake_arch", fake)
    monkeypatch.setitem(converters.MODEL_TYPES, "fake_vl", "fake_arch")
    with pytest.raises(
        TypeError,
        match=r"converters\.fake_arch does not provide the Converter protocol: "
        r"ARCHITECTURE is missing;",
    ):
        converters.get("fake_vl")


def _converter_attributes(tree) -> list[tuple[int, str]]:
    """(line, attribute) for every attribute taken from a converter: `converter.X`, `<...>.converter.X`,
    `converters.for_config(...).X` / `converters.get(...).X`, and the tests' `arch.X`; a capability's
    member as "capability.X" (`<converter>.hf_layout.X`, a local `hf = <converter>.hf_layout`'s `hf.X`)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if isinstance(v, ast.Attribute) and v.attr in CAPABILITIES and _is_converter(v.value):
            found.append((node.lineno, f"{v.attr}.{node.attr}"))
        elif _is_converter(v):
            found.append((node.lineno, node.attr))
    return found


def _is_converter(v) -> bool:
    return (
        (isinstance(v, ast.Name) and v.id in ("converter", "arch"))
        or (isinstance(v, ast.Attribute) and v.attr == "converter")
        or (
            isinstance(v, ast.Call)
            and isinstance(v.func, ast.Attribute)
            and v.func.attr in ("for_config", "get")
            and isinstance(v.func.value, ast.Name)
            and v.func.value.id == "converters"
        )
    )


def test_callers_use_only_protocol_members_and_never_import_a_converter_module():
    members = set(protocol_members()) | {
        f"{cap}.{n}" for cap, proto in CAPABILITIES.items() for n in protocol_members(proto)
    }
    files = [
        p
        for d in ("porter", "runtime", "examples", "tests")
        for p in (ROOT / d).rglob("*.py")
        if p.name != "test_converters.py"
    ]
    used, bad = set(), []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT)
        for line, attr in _converter_attributes(tree):
            used.add(attr)
            if attr not in members:
                bad.append(f"{rel}:{line}: uses converter attribute {attr!r}, not a Converter member")
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            # runtime/models/<arch>.py takes its own config class; tests may test a converter's internals
            if (
                any(n.startswith("converters.") and n != "converters.base" for n in names)
                and rel.parts[0] != "tests"
                and rel.parts[:2] != ("runtime", "models")
            ):
                bad.append(f"{rel}:{node.lineno}: imports a converter module; use converters.for_config")
    assert not bad, "\n".join(bad)
    assert {
        "resolve_config",
        "plan_tensors",
        "hf_layout.hf_canonical_map",
        "hf_layout.check_hf_source",
        "manifest_facts",
        "source_layout",
    } <= used


def test_every_converter_has_a_runtime_model_and_the_registry_refuses_others():
    """runtime/models/__init__.py maps each converter's ARCHITECTURE to its model module (loaded, checked
    for the members the loader uses); an architecture without one is a LoadError naming it."""
    from porter.errors import LoadError
    from runtime import models

    for model_type in converters.supported():
        arch = converters.get(model_type).ARCHITECTURE
        module = models.get(arch)
        assert models.conformance_problems(module) == [], arch
    with pytest.raises(LoadError, match=r"the runtime has no model for architecture 'llama' \(it runs: "):
        models.get("llama")
    assert models.conformance_problems(types.SimpleNamespace(Model=int)) == [
        "DecoderLayer is missing",
        "moe_block is missing",
        "experts_quantized is missing",
    ]


@pytest.mark.parametrize("module", sorted(set(converters.MODEL_TYPES.values())))
def test_every_registered_converter_satisfies_the_protocol(module):
    """Core and each capability it provides: names, parameter names and defaults as the protocols state."""
    conv = converters.get(next(t for t, m in converters.MODEL_TYPES.items() if m == module))
    assert conformance_problems(conv) == []
    _same_signatures(conv, Converter)
    for cap, proto in CAPABILITIES.items():
        if getattr(conv, cap) is not None:
            _same_signatures(getattr(conv, cap), proto)
    assert conv.ARCHITECTURE == module


@pytest.mark.parametrize("model_type", sorted(converters.MODEL_TYPES))
def test_size_rules_are_declared_over_the_fields_config_sizes_reads(model_type):
    """Every registered converter declares its size rules (porter/format/sizes.py) as Dim / Count rules with
    patterns that compile, over fields its config_sizes reads (docs/architecture.md)."""
    import re

    from porter.format.sizes import Count, Dim

    conv = converters.get(model_type)
    assert conv.SIZE_RULES and all(isinstance(r, (Dim, Count)) for r in conv.SIZE_RULES)
    for rule in conv.SIZE_RULES:
        pattern = re.compile(rule.pattern)
        assert isinstance(rule, Dim) or 1 <= pattern.groups <= 2, rule
        assert not re.search(r"(^|\\\.)\d", rule.pattern), f"{rule}: match numeric name parts with \\d+"
    m3 = converters.get("minimax_m3_vl")
    fields = {f for r in m3.SIZE_RULES for f in (r.fields if isinstance(r, Dim) else (r.field,))}
    assert fields == set(m3.config_sizes(vendor_config()))
    assert {
        "num_hidden_layers",
        "num_local_experts",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
    } <= fields
