"""device_map planning: whole decoder layers across the devices of one node, by their byte size.

    runtime.load(path, device_map="auto")                                 # every visible GPU, free memory
    runtime.load(path, device_map="auto", max_memory={0: "60GiB", 1: "60GiB"})
    runtime.load(path, device_map={"layers.0": "cuda:0", ..., "layers.59": "cuda:1"})

Embeddings go on the first device, the final norm and lm_head on the last; layers fill the devices in
order (the residual stream crosses each device boundary once per forward). The plan is made from the
tensor sizes in the shard headers, before any weight is read: a model that does not fit is refused with
one line saying how much it needs and how much the devices offer. Budgets cover weights only; "auto"
without max_memory keeps RESERVE of each GPU free for the KV cache and activations.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from porter.devices import resolve_device
from porter.errors import DeviceError, PlacementError
from porter.format.layout import layer_of
from runtime.loader import TOP_NAMES

GiB = 1 << 30
RESERVE_FRACTION, RESERVE_MIN = 0.05, 2 * GiB  # kept free per GPU by "auto" without max_memory
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


@dataclass(frozen=True)
class Sizes:
    """Bytes of the weights: embeddings, final norm + lm_head, each decoder layer."""

    embed: int
    head: int
    layers: tuple

    @property
    def total(self) -> int:
        return self.embed + self.head + sum(self.layers)


@dataclass(frozen=True)
class Placement:
    layers: tuple  # torch.device of decoder layer i
    embed: torch.device
    head: torch.device
    used: dict  # str(device) -> weight bytes placed there

    def describe(self) -> str:
        spans, start = [], 0
        for i in range(1, len(self.layers) + 1):
            if i == len(self.layers) or self.layers[i] != self.layers[start]:
                spans.append(f"layers {start}-{i - 1} on {self.layers[start]}")
                start = i
        used = ", ".join(f"{d} {fmt(b)}" for d, b in self.used.items())
        return f"embeddings on {self.embed}, {'; '.join(spans)}, lm_head on {self.head} ({used})"


def fmt(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def parse_bytes(v, what: str = "max_memory") -> int:
    """70 * 2**30, "70GiB", "70GB", "512MiB" -> bytes (a finite number >= 0)."""
    value = None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        value = float(v)
    elif m := re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", str(v)):
        if m.group(2).lower() in _UNITS:
            value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value is None or not math.isfinite(value) or value < 0:
        raise PlacementError(f"{what}: cannot read {v!r} as a size; use bytes >= 0 or e.g. '70GiB'")
    return int(value)


def as_device(d, what: str = "device_map") -> torch.device:
    """cpu, cuda, cuda:N or a GPU index -> torch.device (whether this machine has it is `resolve`'s check,
    so that plans can be made for other machines); anything else: PlacementError naming `what`."""
    try:
        dev = torch.device("cuda", d) if isinstance(d, int) and not isinstance(d, bool) else torch.device(d)
    except (RuntimeError, TypeError, ValueError):
        raise PlacementError(f"{what}: {d!r} is not a device; use cpu, cuda, cuda:N or a GPU index") from None
    if dev.type not in ("cpu", "cuda"):
        raise PlacementError(f"{what}: {d!r}: porter places layers on cpu or cuda devices only")
    return dev


def store_sizes(store, num_layers: int) -> Sizes:
    """Weight bytes from the store's headers (nothing is read)."""
    names = store.names()
    per_layer = [0] * num_layers
    embed = head = 0
    for n in names:
        b = store.nbytes(n)
        layer = layer_of(n)
        if layer is not None and layer < num_layers:
            per_layer[layer] += b
        elif n == TOP_NAMES[0]:
            embed += b
        elif n in TOP_NAMES[1:]:
            head += b
    return Sizes(embed, head, tuple(per_layer))


def plan(sizes: Sizes, budgets: Mapping) -> Placement:
    """Fill the devices in order (dict order of budgets: device -> weight bytes allowed)."""
    devs = [as_device(d) for d in budgets]
    cap = [int(b) for b in budgets.values()]
    avail = ", ".join(f"{d} {fmt(c)}" for d, c in zip(devs, cap))
    if sizes.total > sum(cap):
        raise PlacementError(
            f"model does not fit: its weights need {fmt(sizes.total)}, the devices offer "
            f"{fmt(sum(cap))} ({avail}); add devices or raise max_memory"
        )
    used = [0] * len(devs)
    cur, where = 0, []
    if sizes.embed > cap[0]:
        raise PlacementError(
            f"model does not fit: embeddings ({fmt(sizes.embed)}) exceed {devs[0]} "
            f"({fmt(cap[0])}); raise its max_memory"
        )
    used[0] = sizes.embed
    n = len(sizes.layers)
    for i, size in enumerate(sizes.layers):
        need = size + (sizes.head if i == n - 1 else 0)  # the last layer's device also takes lm_head
        while used[cur] + need > cap[cur]:
            cur += 1
            if cur == len(devs):
                raise PlacementError(
                    f"model does not fit: {fmt(sizes.total)} of weights in whole layers (layer {i}: "
                    f"{fmt(size)}) do not pack into {fmt(sum(cap))} ({avail}); add devices or raise max_memory"
                )
        used[cur] += need
        where.append(devs[cur])
    if n == 0:
        used[0] += sizes.head
    head = where[-1] if where else devs[0]
    return Placement(
        tuple(where), devs[0], head, {str(d): u for d, u in zip(devs, used) if u or d == devs[0]}
    )


def explicit(device_map: Mapping, sizes: Sizes, budgets: Optional[Mapping]) -> Placement:
    """{"layers.N": device, ...} naming every decoder layer; checked against budgets when known."""
    n = len(sizes.layers)
    where = [None] * n
    for key, dev in device_map.items():
        m = re.fullmatch(r"(?:model\.)?layers\.(\d+)", str(key))
        if not m or int(m.group(1)) >= n:
            raise PlacementError(f"device_map key {key!r}: expected 'layers.N' with N < {n}")
        where[int(m.group(1))] = as_device(dev, f"device_map[{key!r}]")
    missing = [i for i, d in enumerate(where) if d is None]
    if missing:
        raise PlacementError(
            f"device_map names no device for layers {missing[:8]}{'...' if len(missing) > 8 else ''}; "
            "name every 'layers.N' or use device_map='auto'"
        )
    used: dict = {}
    for d, b in [(where[0], sizes.embed), (where[-1], sizes.head)] + list(zip(where, sizes.layers)):
        used[str(d)] = used.get(str(d), 0) + b
    if budgets is not None:
        caps = {str(as_device(d, "max_memory")): int(b) for d, b in budgets.items()}
        for d, u in used.items():
            if d in caps and u > caps[d]:
                raise PlacementError(
                    f"model does not fit: device_map puts {fmt(u)} of weights on {d}, which "
                    f"offers {fmt(caps[d])}; move layers elsewhere or raise max_memory"
                )
    return Placement(tuple(where), where[0], where[-1], used)


def device_budgets(max_memory: Optional[Mapping]) -> dict:
    """device -> weight bytes: max_memory as given, else every visible GPU's free memory less RESERVE."""
    if max_memory:
        if not isinstance(max_memory, Mapping):
            raise PlacementError(
                f"max_memory must be a dict {{device: size}}, not {type(max_memory).__name__}"
            )
        return {
            as_device(d, f"max_memory key {d!r}"): parse_bytes(v, f"max_memory[{d!r}]")
            for d, v in max_memory.items()
        }
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise PlacementError(
            "device_map='auto' found no CUDA device; pass max_memory={'cpu': ...} or load with device='cpu'"
        )
    out = {}
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out[torch.device("cuda", i)] = max(0, free - max(RESERVE_MIN, int(RESERVE_FRACTION * total)))
    return out


def resolve(device_map, store, max_memory: Optional[Mapping] = None) -> Placement:
    """The placement of `store`'s model for runtime.load: planned, and every device it uses present here."""
    sizes = store_sizes(store, store.config.num_hidden_layers)
    if isinstance(device_map, str):
        if device_map != "auto":
            raise PlacementError(f"device_map={device_map!r}: use 'auto' or a dict {{'layers.N': device}}")
        placement = plan(sizes, device_budgets(max_memory))
    elif isinstance(device_map, Mapping):
        placement = explicit(device_map, sizes, device_budgets(max_memory) if max_memory else None)
    else:
        raise PlacementError(f"device_map must be 'auto' or a dict, not {type(device_map).__name__}")
    for d in dict.fromkeys((placement.embed, *placement.layers, placement.head)):
        try:
            resolve_device(str(d))
        except DeviceError as e:
            raise PlacementError(f"device_map: {e}") from None
    return placement
