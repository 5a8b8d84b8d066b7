"""Where the new tokens of a forward pass sit (Step) and the static, position-indexed KV / indexer caches.

Slot s of row b holds row b's token at position s, so left-padded batches of different prompt lengths run
together: pad tokens (`attention_mask` 0) are never written and get position 0 (docs/runtime-decode.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class Step:
    """Where the T new tokens of one forward pass sit.

    pos [B, T] absolute positions = cache slots (pad tokens: 0); valid [B, T] bool or None (all real);
    kv_len: the slots attended are [0, kv_len) (host int, static under CUDA-graph capture);
    fresh: every row's positions are 0..T-1 with no earlier keys (plain causal prefill);
    decode: T == 1 over a cache (static-shape decode attention)."""

    pos: torch.Tensor
    valid: Optional[torch.Tensor]
    kv_len: int
    fresh: bool = False
    decode: bool = False
    _copies: dict = field(default_factory=dict, repr=False)
    _memo: dict = field(default_factory=dict, repr=False)

    def memo(self, key, make: Callable[[], object]):
        """What depends only on the positions (cos/sin, causal masks, forced blocks): made once per
        forward and shared by the layers (a captured decode step clears it, so the graph makes it)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def rope(self, rope: Callable, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, T, r] of these positions (rope: a runtime.models.layers.Rope)."""
        return self.memo(("rope", id(rope), dtype), lambda: rope(self.pos, dtype))

    def on(self, device: torch.device) -> "Step":
        """This step with pos/valid on `device` (one copy per device: layers spread by a device_map)."""
        device = torch.device(device)
        if self.pos.device == device:
            return self
        if device not in self._copies:
            self._copies[device] = Step(
                self.pos.to(device),
                None if self.valid is None else self.valid.to(device),
                self.kv_len,
                self.fresh,
                self.decode,
            )
        return self._copies[device]

    @classmethod
    def of(
        cls,
        positions: torch.Tensor,
        batch: int,
        cache: Optional["LayerCache"] = None,
        valid: Optional[torch.Tensor] = None,
    ) -> "Step":
        """From explicit positions ([T] shared by the rows, or [B, T]); the layer-at-a-time API."""
        pos = positions.expand(batch, positions.shape[-1]) if positions.dim() == 1 else positions
        T = pos.shape[1]
        if cache is None:
            if valid is None and positions.dim() == 1:
                if int(positions[0]) != 0:
                    raise ValueError("without a cache, positions must start at 0")
                return cls(pos, None, T, fresh=True)
            return cls(pos, valid, int(pos.max()) + 1)
        return cls(pos, valid, int(pos.max()) + 1, decode=T == 1 and valid is None)


@dataclass
class LayerCache:
    """Static per-layer cache, position-indexed: slot s of row b holds row b's token at position s."""

    k: torch.Tensor  # [B, nkv, S_max, d]
    v: torch.Tensor  # [B, nkv, S_max, d]
    idx_k: Optional[torch.Tensor] = None  # [B, S_max, di] (sparse layers: the indexer's key cache)

    @classmethod
    def empty(cls, cfg, sparse: bool, batch: int, slots: int, dtype, device) -> "LayerCache":
        """Zeroed k/v [B, nkv, slots, d]; sparse (an indexer layer): also the index keys [B, slots, di]."""
        kv = (batch, cfg.num_key_value_heads, slots, cfg.head_dim)
        idx = torch.zeros(batch, slots, cfg.index_head_dim, dtype=dtype, device=device) if sparse else None
        return cls(
            torch.zeros(kv, dtype=dtype, device=device), torch.zeros(kv, dtype=dtype, device=device), idx
        )

    def put(self, name: str, new: torch.Tensor, step: Step) -> None:
        """new [B, T, ...] (k/v: [B, T, nkv, d]; idx_k: [B, T, di]) -> slots step.pos of its rows."""
        buf = getattr(self, name)
        slots = buf.shape[1] if name == "idx_k" else buf.shape[2]
        if step.kv_len > slots:
            raise ValueError(f"KV cache holds {slots} tokens; {step.kv_len} needed (raise max_len)")
        B, T = new.shape[:2]
        rows = step.memo(("rows", B, T), lambda: torch.arange(B, device=new.device)[:, None].expand(B, T))
        pos = step.pos
        if step.valid is not None:  # pad tokens are never written
            rows, pos, new = rows[step.valid], pos[step.valid], new[step.valid]
        if name == "idx_k":
            buf[rows, pos] = new.to(buf.dtype)
        else:
            buf[rows, :, pos] = new.to(buf.dtype)  # advanced dims first: [B, T, nkv, d]


class KVCache:
    """Per-layer caches plus where each row continues: `length` (host) = token columns consumed so far,
    `next_pos` [B] (device) = the next position of each row (< length when the row had pad tokens)."""

    def __init__(self, layers: list[LayerCache], next_pos: torch.Tensor):
        self.layers, self.length, self.next_pos = layers, 0, next_pos

    @property
    def max_len(self) -> int:
        return self.layers[0].k.shape[2]

    def reset(self) -> None:
        """Empty, in place (a captured decode step keeps these tensors): as a new cache of this size."""
        for lc in self.layers:
            for t in (lc.k, lc.v, lc.idx_k):
                if t is not None:
                    t.zero_()
        self.next_pos.zero_()
        self.length = 0
