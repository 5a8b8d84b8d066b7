"""The rounded reference of `porter verify`: the source weights MXFP8-rounded by verify's own re-derivation.

The exact-bytes step (exact.py) re-quantizes every quantized artifact tensor from its source, through
verify's own mapping table (mapping.py) and porter.format.mxfp8 with the rule porter.json records (the
rounding rule; an MXFP8 source's kept scale bytes). This store hands out exactly those re-derived bytes
to the runtime, under the canonical names, beside the source's carried tensors: a model that computes what
the source computes under MXFP8 rounding, independent of the bytes the converter wrote. The numerics step
(numerics.py) runs it on the runtime's reference MoE backend (torch: dequantize, then matmul) and compares
the converted model with it layer by layer: a faithful conversion differs from it by float rounding only
(docs/verify.md, "Faithfulness"); a layout, parameter or runtime bug by much more.

Where the exact-bytes step found an artifact tensor byte-identical to its re-derivation (every block, value
and scale bytes), the re-derived bytes ARE the artifact's: the store reads them from the artifact (one
byte per element, no re-quantization) instead of reading the source again (two bytes per element) and
re-quantizing it. A tensor that differed, or was not compared, is re-derived from the source as before, so
the reference never holds a byte the exact step did not prove; so are an hf layout's per-expert tensors (how
their row parts stack is that layout's business, not verify's).

In a layer-streamed pass (share_reads()) the store shares its ReferenceStore with the bf16 reference, which
builds each layer first: the source tensors the rounded reference takes (the carried ones as they are, the
quantized ones it re-derives) are the bf16 reference's reads of them, not a second read of the source
(ReferenceStore.share). There exact bytes compares each layer inside the pass, before any model is built from
it, and proves that layer's tensors then (prove()): the store takes them from the same read of the artifact
exact bytes just compared (staged on a GPU). The proved MXFP8 tensors stay verify's own reads of the
artifact: taking them from the converted model's load would put the runtime's reading of the artifact on
both sides of the comparison.
"""

from __future__ import annotations

from typing import Optional

import torch

from porter.commands.verify.mapping import ArtifactReader, GroupReadAhead, ReferenceStore
from porter.format import mxfp8
from porter.format.layout import layer_of, scale_name


class RoundedReferenceStore:
    """ReferenceStore's tensors, those the artifact holds as MXFP8 re-quantized as exact.py re-derives them:
    `name` -> e4m3 values [.., N, K], `scale_name(name)` -> uint8 scales [.., N, K/32]. device: where the
    re-quantization runs (a GPU, as exact.py's; the tensors are handed out there).
    proved: artifact tensor names the exact step found byte-identical to their re-derivation (read from
    the artifact here; see the module docstring)."""

    def __init__(
        self, ref: ReferenceStore, reader: ArtifactReader, rounding: Optional[str], device=None, proved=()
    ):
        self.ref, self.config, self.path, self.converter = ref, ref.config, ref.path, ref.converter
        self.rounding, self.device = rounding or "rceil", torch.device(device or "cpu")
        self.reader, self._parts = reader, artifact_parts(reader)
        self.quantized = set(self._parts) & ref.names()
        self.scales = {scale_name(n): n for n in self.quantized}
        self.shared = False  # share_reads(): source tensors from the bf16 reference's reads
        self.prove(proved)
        self._last: tuple = (None, None)  # (name, (q, s)): a weight and its scale are asked for in turn
        self.ahead = None  # GroupReadAhead, when read_ahead() was called

    def prove(self, proved) -> None:
        """The artifact tensors exact bytes found byte-identical to their re-derivation (module docstring),
        before the layers holding them are built: all of them for a resident pass, each layer's as exact
        bytes compares it inside a layer-streamed one."""
        parts, proved = self._parts, set(proved)
        # canonical name -> its artifact tensor, when that one tensor holds all of it (an hf layout's
        # per-expert row parts are re-derived: how they stack is the layout's, not verify's, knowledge)
        self.proved = {
            n: parts[n][0][0]
            for n in self.quantized
            if len(parts[n]) == 1 and parts[n][0][1] is None and parts[n][0][0] in proved
        }
        if self.shared:
            self._share()

    def share_reads(self) -> None:
        """Take the source tensors from the bf16 reference's reads (module docstring): for a layer-streamed
        pass whose bf16 reference loads from `self.ref` and builds each layer before this store's model
        does. Before read_ahead()."""
        self.shared = True
        self._share()

    def _share(self) -> None:
        """The bf16 reference keeps for this store what it still takes from it: all but the proved tensors."""
        self.ref.share(self.ref.names() - set(self.proved))

    def names(self) -> set:
        return self.ref.names() | set(self.scales)

    def read_ahead(self, device: torch.device) -> None:
        """Read a layer at a time onto `device` as the model is built (mapping.GroupReadAhead): the
        artifact's proved tensors, the source of the rest; not for a pre-quantized source."""
        if self.ref.mapping.shards.scheme is not None:
            return
        groups: dict = {}
        for n in self.ref.names():
            sources, artifact = groups.setdefault(layer_of(n), (set(), set()))
            if n in self.proved:
                artifact.add(self.proved[n])
            elif not self.shared:  # shared: the bf16 reference's read-ahead reads them
                sources.update(self.ref.derivation(n).sources)
        self.ahead = GroupReadAhead(groups, self.ref.mapping.shards, self.reader, device)

    def get(self, name: str) -> torch.Tensor:
        if self.ahead is not None:
            self.ahead.touch(name)
        if name in self.scales:
            return self._rounded(self.scales[name])[1]
        if name in self.quantized:
            return self._rounded(name)[0]
        return self.ref.value(name)

    def _rounded(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last[0] != name:
            self._last = (None, None)  # one tensor's copy at a time
            self._last = (name, self._artifact(name) if name in self.proved else self._requantize(name))
        return self._last[1]

    def _artifact(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, scale) of `name` as the artifact holds them, proved equal to the re-derivation."""
        return self.reader.get(self.proved[name])

    def _requantize(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, scale) of `name`, stacked experts expert by expert: each with its derivation's kept scale
        bytes (an MXFP8 source's own), else the rounding rule — the bytes exact.py compares against."""
        d = self.ref.derivation(name)
        on = lambda t: None if t is None else t.to(self.device)
        value = d.value  # expert by expert from the source: no second whole bf16 copy beside a resident model
        if self.shared:  # the whole tensor the bf16 reference's layer holds: its expert e is d.value(e)
            whole = self.ref.value(name)
            value = lambda e: whole if e is None else whole[e]

        def quantize(e):
            return mxfp8.quantize(on(value(e)), self.rounding, name, keep_scale=on(d.kept(e)))

        if d.experts is None:
            return quantize(None)
        q0, s0 = quantize(0)
        q = q0.new_empty((d.experts, *q0.shape))  # [E, N, K]: filled expert by expert, no second copy
        s = s0.new_empty((d.experts, *s0.shape))  # [E, N, K/32]
        q[0], s[0] = q0, s0
        for e in range(1, d.experts):
            q[e], s[e] = quantize(e)
        return q, s

    def close(self) -> None:
        self._last = (None, None)
        if self.ahead is not None:
            self.ahead.close()
        if self.shared:  # the bf16 reference's store: its read-ahead holds the layer this one builds next
            self.ref.mapping.shards.close()
        else:
            self.ref.close()
        self.reader.close()

    def release(self) -> None:
        """close(), and a layer read ahead dropped too (the pass is over, or was stopped)."""
        if self.ahead is not None:
            self.ahead.release()
        self.close()


def artifact_parts(reader: ArtifactReader) -> dict:
    """{canonical name: [(artifact name, expert or None)]} of the artifact tensors stored as MXFP8 (an hf
    layout's per-expert tensors under their stacked name, one part per expert)."""
    out: dict = {}
    for n in reader.weights():
        if reader.tensors[n].get("scale"):
            c = reader.canonical(n)
            found = reader.rules.experts_of(c)
            stacked, e = (c, None) if found is None else found
            out.setdefault(stacked, []).append((n, e))
    return out
