"""A config's size fields checked against the tensors in the files, before anything is planned from them.

The size fields of a config (layers, experts, heads, vocabulary, hidden and intermediate widths) drive
porter's loops and allocations: one absurd value (`num_local_experts` = 10**9) would have it plan a billion
experts or allocate a cache for them. Each architecture's converter declares what in its files each size
field must match, as rules over canonical tensor names (`SIZE_RULES`, made of the `Dim` and `Count` below),
and reads its size fields from a raw config without building anything from them (`config_sizes`).
`check` runs the rules on the names and shapes from the safetensors headers, in one pass over the names,
at a cost independent of the values, and raises a ConfigError naming the field, its value and what the
files hold. `converters.resolve` runs it before the config is resolved, for every caller that has the files
(convert, verify, inspect, runtime.load). Adding an architecture: docs/architecture.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Optional

from porter.errors import ConfigError


@dataclass(frozen=True)
class Dim:
    """Every tensor whose canonical name matches `pattern` has, in dimension `dim`, the product of the
    `fields` times `factor` (e.g. q_proj rows = num_attention_heads x head_dim)."""

    fields: tuple
    pattern: str
    dim: int
    factor: int = 1


@dataclass(frozen=True)
class Count:
    """`field` equals the number of distinct values the pattern's last group takes among the canonical
    names: the layers the files hold, say. With two groups the count is taken per value of the first (the
    experts of each layer: `per` names what the first group is), and every count must agree; a first
    group that never matches constrains nothing. `what` names the counted thing. `extra`: a field whose
    value the files may hold beyond it (blocks numbered after the counted ones, such as the
    multi-token-prediction layers a checkpoint may carry after its decoder layers)."""

    field: str
    pattern: str
    what: str
    per: str = ""
    extra: str = ""


def fields_of(rules) -> tuple:
    """The config fields a SIZE_RULES table reads, in first-use order (a converter's SIZE_FIELDS)."""
    return tuple(
        dict.fromkeys(
            f
            for r in rules
            for f in (r.fields if isinstance(r, Dim) else (r.field,) + ((r.extra,) if r.extra else ()))
        )
    )


_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")


def check(rules, sizes: dict, tensors: dict, canonical: Callable[[str], Optional[str]], where: str) -> None:
    r"""ConfigError unless every rule holds. sizes: {field: (value, config key)} (`config_sizes`); tensors:
    {file name: (dtype, shape, ...)} from the headers; canonical: file name -> canonical name (None for
    tensors the rules do not speak of).

    Names are grouped by their form, every numeric component read as 0 (`model.layers.0.mlp...`), and a
    pattern is matched once per form: a checkpoint of 60 layers x 128 experts has ~23,000 names but ~60
    forms. Rules therefore match a numeric name component with `\d+`, never with a literal number."""
    forms: dict = {}  # form -> [(canonical name, file name, shape)]
    for name, meta in tensors.items():
        c = canonical(name)
        if c is not None:
            forms.setdefault(_NUMBER.sub("0", c), []).append((c, name, tuple(meta[1])))
    for rule in rules:
        pattern = re.compile(rule.pattern)
        members = [m for form, ms in forms.items() if pattern.fullmatch(form) for m in ms]
        if isinstance(rule, Dim):
            _check_dim(rule, sizes, members, where)
        else:
            _check_count(rule, pattern, sizes, members, where)


def _fields(fields, sizes) -> tuple[int, str]:
    value = math.prod(sizes[f][0] for f in fields)
    keys = " x ".join(repr(sizes[f][1]) for f in fields)
    return value, f"config field{'s' if len(fields) > 1 else ''} {keys}"


def _check_dim(rule: Dim, sizes: dict, members: list, where: str) -> None:
    value, said = _fields(rule.fields, sizes)
    want = value * rule.factor
    for _, name, shape in members:
        have = shape[rule.dim] if -len(shape) <= rule.dim < len(shape) else None
        if have != want:
            holds = (
                f"{have:,} in dimension {rule.dim}" if have is not None else f"only {len(shape)} dimension(s)"
            )
            times = f"{rule.factor} x " if rule.factor != 1 else ""
            raise ConfigError(
                f"{where}: {times}{said} = {want:,}, but tensor {name!r} has shape {list(shape)}: {holds}; "
                "this config.json does not describe these weights"
            )


def _check_count(rule: Count, pattern, sizes: dict, members: list, where: str) -> None:
    value, said = _fields((rule.field,), sizes)
    extra = sizes[rule.extra][0] if rule.extra else 0
    if rule.extra:
        said += f" (+ up to {sizes[rule.extra][1]!r} = {extra:,} more)"
    seen: dict = {}  # first group (None with one group) -> the distinct values of the last group
    for canon, _, _ in members:
        m = pattern.fullmatch(canon)
        outer = m.group(1) if pattern.groups > 1 else None
        seen.setdefault(outer, set()).add(m.group(pattern.groups))
    for outer, found in sorted(seen.items(), key=lambda kv: int(kv[0]) if kv[0] and kv[0].isdigit() else -1):
        if not value <= len(found) <= value + extra:
            scope = f" in {rule.per} {outer}" if outer is not None else ""
            raise ConfigError(
                f"{where}: {said} = {value:,}, but the files hold {len(found):,} {rule.what}{scope}; "
                "this config.json does not describe these weights"
            )
    if not seen and pattern.groups == 1 and value != 0:
        raise ConfigError(
            f"{where}: {said} = {value:,}, but the files hold no {rule.what}; "
            "this config.json does not describe these weights"
        )
