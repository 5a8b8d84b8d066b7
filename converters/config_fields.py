"""Config-field reading and checking every family's config.py shares: typed reads with provenance
(`config:<key>`, `legacy:<key>`, `default`), the positive-field and rule checks, and the keys whose only
supported value is the family's own. What a family reads (its keys, defaults, rules) stays in its config.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Callable, Iterable, Optional

from porter.errors import ConfigError


class ResolvedConfig:
    """Mixin for a family's config dataclass: `to_dict` is every resolved field, without provenance."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("provenance")
        return d


def require_object(raw) -> None:
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object")


def lookup(cfg: dict, path: str) -> tuple[bool, object]:
    """(found, value) of a dotted key path ('a.b' is cfg['a']['b'])."""
    node = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def typed(name: str, value, kind: str):
    """`value` checked as kind int | float (finite; returned as float) | bool | str | tokenid (an int, a
    list of them, or None); `name` is the config key the error names."""
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"config field {name!r} must be an integer, got {value!r}")
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"config field {name!r} must be a finite number, got {value!r}")
        value = float(value)
    if kind == "bool" and not isinstance(value, bool):
        raise ConfigError(f"config field {name!r} must be true or false, got {value!r}")
    if kind == "str" and not isinstance(value, str):
        raise ConfigError(f"config field {name!r} must be a string, got {value!r}")
    if kind == "tokenid" and value is not None:
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ConfigError(f"config field {name!r} must be a token id or a list of them, got {value!r}")
    return value


def read_fields(
    text: dict,
    fields: dict,
    prefix: str = "",
    fallback: Callable[[str], Optional[tuple]] = lambda name: None,
) -> tuple[dict, dict]:
    """Every field of `fields` ({field: (key, legacy key or None, default, kind)}), typed, and its
    provenance: the key, else the legacy key, else `fallback(field)` ((value, provenance) or None), else the
    default. `prefix` is where `text` sits in config.json (provenance and errors name the full key)."""
    values, prov = {}, {}
    for name, (key, legacy, default, kind) in fields.items():
        found, value = lookup(text, key)
        where = f"config:{prefix}{key}"
        if not found and legacy:
            found, value = lookup(text, legacy)
            where = f"legacy:{prefix}{legacy}"
        if not found and (other := fallback(name)) is not None:
            found, (value, where) = True, other
        if not found:
            value, where = default, "default"
        values[name], prov[name] = typed(f"{prefix}{key}", value, kind), where
    return values, prov


def provenance_key(provenance: str, name: str) -> str:
    """'config:text_config.num_experts' -> 'text_config.num_experts'; 'default' -> '<name> (default)'."""
    kind, _, key = provenance.partition(":")
    return key if key and kind in ("config", "legacy") else f"{name} (default)"


def is_allowed(value, allowed) -> bool:
    """`value` equals one of `allowed` with the same type (True is not 1)."""
    return any(value == a and type(value) is type(a) for a in allowed)


def check_fixed(text: dict, fixed: dict, family: str, prefix: str = "") -> None:
    """Keys ({key: (allowed values, what is needed)}) whose only supported values are the family's own;
    anything else would silently change the model. An absent key is the family's value."""
    for key, (allowed, want) in fixed.items():
        found, value = lookup(text, key)
        if found and not is_allowed(value, allowed):
            raise ConfigError(
                f"config field '{prefix}{key}' = {value!r} is not supported: porter implements "
                f"{family}, which needs {want}"
            )


# The grouped-query MoE decoder's shape fields every family has: a verify reference that differs in one is not
# the source (each family's STRUCTURAL adds its own), and each must be positive (check_positive).
DECODER_SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_local_experts",
)
DECODER_POSITIVE_FIELDS = (*DECODER_SHAPE_FIELDS, "num_experts_per_tok", "max_position_embeddings")


def check_positive(cfg, names: Iterable[str]) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"config field {name!r} must be positive, got {getattr(cfg, name)}")


def head_and_expert_rules(c) -> list:
    """The rules every family's grouped-query MoE config obeys, as (holds, what must hold) pairs: whole
    query-head groups per KV head, top-k within the experts."""
    return [
        (
            c.num_attention_heads % c.num_key_value_heads == 0,
            "num_attention_heads must be a multiple of num_key_value_heads",
        ),
        (
            c.num_experts_per_tok <= c.num_local_experts,
            "num_experts_per_tok must not exceed num_local_experts",
        ),
    ]


def check_rules(rules: Iterable[tuple]) -> None:
    """rules: (holds, what must hold); the first that fails is the error."""
    for ok, msg in rules:
        if not ok:
            raise ConfigError("config: " + msg)
