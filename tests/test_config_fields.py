"""converters/config_fields.py: the field reading every family's config.py shares."""

import pytest

from converters.config_fields import check_fixed, provenance_key, read_fields, typed
from porter.errors import ConfigError

_FIELDS = {
    "experts": ("num_local_experts", "num_experts", 8, "int"),
    "width": ("sub.width", None, 2.0, "float"),
    "tied": ("tie_word_embeddings", None, False, "bool"),
}


def test_read_fields_prefers_key_then_legacy_then_fallback_then_default():
    text = {"num_local_experts": 4, "num_experts": 5, "sub": {"width": 3}}
    values, prov = read_fields(text, _FIELDS, "text_config.")
    assert values == {"experts": 4, "width": 3.0, "tied": False}
    assert prov == {
        "experts": "config:text_config.num_local_experts",
        "width": "config:text_config.sub.width",
        "tied": "default",
    }
    values, prov = read_fields(
        {"num_experts": 5}, _FIELDS, fallback=lambda n: (True, "top") if n == "tied" else None
    )
    assert (values["experts"], prov["experts"]) == (5, "legacy:num_experts")
    assert (values["tied"], prov["tied"]) == (True, "top")
    assert (values["width"], prov["width"]) == (2.0, "default")


def test_read_fields_names_the_full_key_of_a_mistyped_value():
    with pytest.raises(ConfigError, match=r"^config field 'text_config\.sub\.width' must be a finite number"):
        read_fields({"sub": {"width": float("nan")}}, _FIELDS, "text_config.")
    with pytest.raises(ConfigError, match=r"^config field 'act' must be a string, got 3$"):
        typed("act", 3, "str")


def test_provenance_key_and_fixed_keys():
    assert provenance_key("legacy:text_config.num_experts", "n") == "text_config.num_experts"
    assert provenance_key("default (head_dim / 2)", "n") == "n (default)"
    assert provenance_key("architecture (x: y)", "n") == "n (default)"
    check_fixed({}, {"use_qk_norm": ({True}, "true")}, "Fam")  # absent: the family's value
    with pytest.raises(
        ConfigError,
        match=r"^config field 'p\.use_qk_norm' = 1 is not supported: porter implements Fam, which needs true$",
    ):
        check_fixed({"use_qk_norm": 1}, {"use_qk_norm": ({True}, "true")}, "Fam", "p.")
