"""Where each artifact tensor comes from, written independently of the converter's plan.

`porter convert` plans its output in the converter (converters/<arch>/plan.py); if verify asked that plan
where a tensor came from, a layout bug (gate/up reversed, experts permuted, w2 transposed) would be on both
sides of every comparison. So verify keeps its own small declarative table per source layout (each
architecture's `verify_rules` capability, converters/<arch>/verify_rules.py, which imports nothing of its
converter's plan), reads source tensors by their own names straight from the safetensors shards, and
derives every artifact tensor (expert by expert) from them. A rule (converters.base.Rule) is
(artifact-name regex, source-name templates, op); the first rule whose regex matches and whose source
tensors all exist is used. Templates: the architecture's roots (e.g. {m} the model root, {h} the lm_head
root), {E} the expert, other fields from the regex's named groups.

ops: copy | gate_half / up_half (rows [:N/2] / [N/2:] of a fused [2N, K]) | experts_rows (expert E =
rows of the templates concatenated: [w1; w3]) | expert_slice (expert E = source[E]) |
expert_slice_interleaved (source[E] rows gate0, up0, gate1, … -> [gate; up]) | expert_slice_transposed
(source[E].T: an [E, in, out] source) + _interleaved | columns_interleaved (a whole tensor whose last dim
alternates gate0, up0, … -> [gate; up], e.g. a [E, 2I] bias) | index (source[E], E from the name: one
expert's 2-D weight) | index_w1 / index_w3 (the gate / up rows of source[E]), + _interleaved.
Stacked artifact tensors ([E, N, K]) are derived expert by expert by the expert_* ops.

A pre-quantized source (MXFP8 or block FP8, porter.format.prequantized) is read the way the conversion read
it: each quantized weight dequantized when read (its scale tensor is consumed, not mapped). Where the
conversion kept an MXFP8 source's scale bytes (porter.json options.source_quantization.scale_bytes),
Derivation.kept gives those bytes for the re-quantization: "kept-rows" — every op applied to the source
scale rows as to the value rows (a scale row belongs to its value row), rows of an unquantized source by
the rounding rule; "kept" (earlier porters) — only a value that is whole source weights (copy,
experts_rows). Every other value is re-quantized with the recorded rounding rule.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open

import converters
from converters.base import Rule
from porter.errors import PorterError, VerifyInputError
from porter.format import manifest, mxfp8
from porter.format.layout import layer_of
from porter.format.safe_files import read_json_object
from porter.format.safetensors_io import ST_DTYPES, nbytes, tensor_bytes
from porter.source.local import read_header, weight_files

CARRIED = Rule(r"(?P<name>.+)", ("{name}",))  # tensors outside the text model keep their source names


def rules_for(folder: Path, where: str):
    """The verify_rules capability of the converter of the checkpoint or artifact in `folder` (by its
    config.json); VerifyInputError when there is none."""
    try:
        raw = read_json_object(Path(folder) / "config.json", VerifyInputError, "config")
        conv = converters.for_config(raw, str(Path(folder) / "config.json"))
    except PorterError as e:
        raise VerifyInputError(f"{where}: {e}") from None
    if conv.verify_rules is None:
        raise VerifyInputError(
            f"{where}: porter verify has no source table for architecture {conv.ARCHITECTURE!r}"
        )
    return conv.verify_rules


class SourceShards:
    """A checkpoint's safetensors shards, read by the tensors' own names (no renaming, no plan).

    scheme (porter.format.prequantized.Scheme, None for a bf16 checkpoint): its quantized weights are listed
    in `meta` as their dequantized dtype and dequantized by read(); their scale tensors are not listed.
    keep_scales: the recorded scale_bytes rule, "kept-rows" or "kept" (None: no scale bytes were kept);
    kept_scale() gives an MXFP8 weight's scale bytes (the conversion re-quantized with them)."""

    def __init__(self, path: Path, scheme=None, keep_scales: Optional[str] = None):
        self.path = Path(path)
        self.files, self.stored = {}, {}  # name -> shard Path / (torch dtype, shape) as stored
        for f in weight_files(self.path):
            for name, info in read_header(f).items():
                self.files[name], self.stored[name] = f, (ST_DTYPES[info["dtype"]], tuple(info["shape"]))
        self.scheme, self.keep_scales = (
            scheme,
            keep_scales if scheme is not None and scheme.keeps_scales else None,
        )
        self.scales = {}  # quantized weight -> its scale tensor
        self.meta = self.stored  # name -> (dtype, shape) of what read() returns
        if scheme is not None:
            self.meta = scheme.adopt(self.stored, str(self.path))
            self.scales = dict(scheme.scales)
        self._handles: dict = {}
        self.stagings: list = []  # runtime.staging.Staging: tensors read onto a device ahead of use

    def _handle(self, name: str):
        return _open(self._handles, self.files[name])

    def _stored(self, name: str, row: Optional[int]) -> torch.Tensor:
        staged = _staged(self.stagings, name)
        if staged is not None:
            return staged if row is None else staged[row]
        h = self._handle(name)
        return h.get_tensor(name) if row is None else h.get_slice(name)[row]

    def stage(self, names, device: torch.device):
        """Read these tensors (as stored) onto `device` in the background (runtime.staging); read() hands
        them out from there until unstage()."""
        from runtime.staging import Staging, file_spans

        spans = file_spans({n: self.files[n] for n in names}, device)
        staging = Staging(spans, allocate_now=True, log_level=logging.DEBUG).start()
        self.stagings.append(staging)
        return staging

    def read(self, name: str, row: Optional[int] = None) -> torch.Tensor:
        """The tensor (or its [row] along dim 0); a quantized source weight dequantized by its scheme."""
        if name in self.scales:
            return self.scheme.dequantize(
                self._stored(name, row),
                self._stored(self.scales[name], row),
                f"{self.files[name]}: tensor {name!r}" + ("" if row is None else f"[{row}]"),
            )
        return self._stored(name, row)

    def kept_scale(self, name: str, row: Optional[int] = None) -> Optional[torch.Tensor]:
        """uint8 scale bytes of an MXFP8 source weight when the conversion kept them, else None."""
        if not self.keep_scales or name not in self.scales:
            return None
        return self._stored(self.scales[name], row).view(torch.uint8)

    def nbytes(self, name: str) -> int:
        """Bytes read from disk for this tensor (a quantized weight: values and scale)."""
        return nbytes(*self.stored[name]) + (
            nbytes(*self.stored[self.scales[name]]) if name in self.scales else 0
        )

    def close(self) -> None:
        self._handles.clear()


def _staged(stagings: list, name: str) -> Optional[torch.Tensor]:
    """`name` from the first staging that holds it (waiting for its bytes), else None."""
    for s in list(stagings):  # a copy: the verify thread adds and drops stagings while workers read
        if name in s:
            return s.get(name)
    return None


def unstage(reader, staging) -> None:
    """Stop a staging of a SourceShards or ArtifactReader and drop its tensors."""
    staging.close()
    if staging in reader.stagings:
        reader.stagings.remove(staging)


@dataclass
class Derivation:
    """How artifact tensor `tensor` is re-derived: value(None) for a plain tensor, value(e) -> expert e
    ([N, K]) for a stacked [E, N, K] one."""

    tensor: str
    rule: Rule
    sources: list  # every source tensor read
    experts: Optional[int]
    value: Callable[[Optional[int]], torch.Tensor]
    kept: Callable[[Optional[int]], Optional[torch.Tensor]] = lambda e: (
        None
    )  # scale bytes to re-quantize with


class Mapping:
    """The source side: artifact tensor name -> Derivation from `shards`, by one layout's table.

    rules: the architecture's verify_rules capability (default: the one of the checkpoint's config.json)."""

    def __init__(
        self,
        shards: SourceShards,
        interleaved: bool = False,
        rounding: Optional[str] = "rceil",
        rules=None,
    ):
        self.shards, self.rounding = shards, rounding or "rceil"
        rules = rules or rules_for(shards.path, f"reference {shards.path}")
        names = set(shards.meta)
        self.layout, self.rules = rules.source_rules(names, interleaved)
        if shards.scheme is not None:
            kept = {"kept-rows": "scale bytes kept", "kept": "scale bytes of whole weights kept"}.get(
                shards.keep_scales, f"{self.rounding} scales re-derived"
            )
            self.layout += f", pre-quantized {shards.scheme.method} source ({kept})"
        self.roots = rules.roots(names)

    def derive(self, tensor: str, experts: Optional[int]) -> Optional[Derivation]:
        """None when no rule finds this tensor's sources (the caller reports it)."""
        for rule in self.rules + (CARRIED,):
            m = re.fullmatch(rule.artifact, tensor)
            if not m:
                continue
            fields = self.roots | m.groupdict()
            per_expert = rule.op.startswith("expert")
            if per_expert and not experts:
                continue
            units = range(experts) if per_expert else [None]
            srcs = [t.format(**{**fields, "E": e}) for e in units for t in rule.sources]
            if srcs and all(s in self.shards.meta for s in srcs):
                op = rule.op.format(**fields)
                return Derivation(
                    tensor,
                    rule,
                    list(dict.fromkeys(srcs)),
                    experts if per_expert else None,
                    self._reader(op, rule.sources, fields),
                    self._kept(op, rule.sources, fields, srcs),
                )
        return None

    def _reader(self, op: str, templates: tuple, fields: dict, read: Optional[Callable] = None) -> Callable:
        """value(e) by op; with `read` a reader of scale rows, the scale rows of the same value."""
        read, src = (
            read or self.shards.read,
            lambda e=None: [t.format(**{**fields, "E": e}) for t in templates],
        )
        if op == "copy":
            return lambda e: read(src()[0])
        if op in ("gate_half", "up_half"):
            return lambda e: _half(read(src()[0]), op == "up_half")
        if op == "experts_rows":
            return lambda e: torch.cat([read(s) for s in src(e)])  # [w1; w3] rows: [2I, H]
        if op == "expert_slice":
            return lambda e: read(src()[0], e)
        if op == "expert_slice_interleaved":
            return lambda e: _deinterleave(read(src()[0], e))
        if op == "expert_slice_transposed":
            return lambda e: read(src()[0], e).t()
        if op == "expert_slice_transposed_interleaved":
            return lambda e: _deinterleave(read(src()[0], e).t())
        if op == "columns_interleaved":
            return lambda e: _deinterleave(read(src()[0]).t()).t()
        if op.startswith("index"):  # expert E named in the tensor's own name
            pick = {
                "index": lambda w: w,
                "index_w1": lambda w: _half(w, False),
                "index_w3": lambda w: _half(w, True),
                "index_w1_interleaved": lambda w: w[0::2],
                "index_w3_interleaved": lambda w: w[1::2],
            }[op]
            return lambda e: pick(read(src()[0], int(fields["E"])))
        raise ValueError(f"mapping table: unknown op {op!r}")

    def _kept(self, op: str, templates: tuple, fields: dict, srcs: list) -> Callable:
        """Scale bytes [N, K/32] the conversion re-quantized unit e with, None for the rounding rule alone.
        "kept-rows": the op applied to the sources' scale rows (whole weights, halves, interleaved rows,
        one expert of a fused tensor alike), when an MXFP8 weight is among the sources. "kept": only a
        value that is whole source weights (copy; experts_rows, part by part); row slices re-derived."""
        if self.shards.keep_scales == "kept-rows" and any(s in self.shards.scales for s in srcs):
            return self._reader(op, templates, fields, read=self._scale_rows)
        if self.shards.keep_scales != "kept" or op not in ("copy", "experts_rows"):
            return lambda e: None
        src = lambda e=None: [t.format(**{**fields, "E": e}) for t in templates]
        if op == "copy":
            return lambda e: self.shards.kept_scale(src()[0])
        return lambda e: self._rows_kept(src(e))

    def _scale_rows(self, name: str, row: Optional[int] = None) -> torch.Tensor:
        """A source tensor's (or its [row]'s) scale rows: an MXFP8 weight's own, else the rounding rule's."""
        kept = self.shards.kept_scale(name, row)
        return (
            kept if kept is not None else mxfp8.quantize(self.shards.read(name, row), self.rounding, name)[1]
        )

    def _rows_kept(self, names: list) -> Optional[torch.Tensor]:
        """Row parts' scales concatenated; a part that was not an MXFP8 weight gets its rounding-rule bytes."""
        parts = [self.shards.kept_scale(n) for n in names]
        if all(p is None for p in parts):
            return None
        return torch.cat(
            [
                p if p is not None else mxfp8.quantize(self.shards.read(n), self.rounding, n)[1]
                for n, p in zip(names, parts)
            ]
        )


def _open(handles: dict, f: Path):
    """A shard's safe_open handle, opened on first use; close() may clear `handles` from another thread
    at any time (tensors already read keep their mapping)."""
    h = handles.get(f)
    if h is None:
        h = handles[f] = safe_open(str(f), framework="pt")
    return h


def _half(w: torch.Tensor, second: bool) -> torch.Tensor:
    n = w.shape[0] // 2
    return w[n:] if second else w[:n]


def _deinterleave(w: torch.Tensor) -> torch.Tensor:
    """[2I, H] rows gate0, up0, gate1, up1, … -> [gate; up]."""
    return torch.cat([w[0::2], w[1::2]])


class ArtifactReader:
    """The artifact side, per artifact layout (porter.json options.layout); each tensor's scale is the one
    porter.json names for it. porter: canonical names, experts stacked [E, N, K] (read expert by expert);
    hf: the vendor release's names with one 2-D tensor per expert (the architecture's verify rules give
    the canonical name of each).

    rules: the architecture's verify_rules capability (default: the one of the artifact's config.json).
    digests: a digests.TensorDigests that every read is handed to (integrity's data check on the exact
    pass's reads), until it is set to None."""

    LAYOUTS = ("porter", "hf")

    def __init__(self, art: Path, man: dict, rules=None, digests=None):
        self.layout = manifest.read_options(man).layout
        if self.layout not in self.LAYOUTS:
            raise VerifyInputError(
                f"{art}: artifact layout {self.layout!r} (porter.json options.layout) cannot be "
                f"verified by this porter; it verifies {', '.join(self.LAYOUTS)}"
            )
        self.art, self.tensors = Path(art), man.get("tensors", {})
        self.rules = rules or rules_for(art, str(art))
        self._handles: dict = {}
        self.stagings: list = []  # runtime.staging.Staging: tensors read onto a device ahead of use
        self.digests = digests

    def weights(self) -> list[str]:
        """Artifact tensors that are values (not scales), in manifest order."""
        scales = {r.get("scale") for r in self.tensors.values() if r.get("scale")}
        return [n for n in self.tensors if n not in scales]

    def experts(self, name: str) -> Optional[int]:
        """E of a stacked [E, N, K] expert tensor (by its canonical name), None for any other tensor."""
        found = self.rules.experts_of(self.canonical(name))
        return int(self.tensors[name]["shape"][0]) if found and found[1] is None else None

    def canonical(self, name: str) -> str:
        """The canonical (porter) name the mapping table is written for."""
        return self.rules.canonical(name, self.layout)

    def text_model(self) -> dict:
        """{canonical name: experts or None} the runtime reads, stacked experts grouped per layer."""
        out = {}
        for n in self.weights():
            c = self.canonical(n)
            if not c.startswith(("model.", "lm_head.")):
                continue
            found = self.rules.experts_of(c)
            if found is None or found[1] is None:
                out[c] = self.experts(n)
                continue
            stacked, e = found
            out[stacked] = max(out.get(stacked) or 0, e + 1)
        return out

    def get(self, name: str, e: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(values, scale or None) of tensor `name`, or of its expert e."""
        rec = self.tensors[name]
        scale = rec.get("scale")
        return self._read(name, e), (self._read(scale, e) if scale else None)

    def _read(self, name: str, e: Optional[int] = None) -> torch.Tensor:
        """The tensor, or its expert e along dim 0: a slice of the shard, so that comparing E experts
        reads a stacked tensor once, not E times."""
        staged = _staged(self.stagings, name)
        if staged is not None:
            return staged if e is None else staged[e]
        h = _open(self._handles, self.art / self.tensors[name]["shard"])
        t = h.get_tensor(name) if e is None else h.get_slice(name)[e]
        if self.digests is not None:  # expert e: bytes [e * its size, (e + 1) * its size) of the tensor
            self.digests.add(name, 0 if e is None else e * t.nbytes, tensor_bytes(t))
        return t

    def stage(self, names, device: torch.device):
        """Read these tensors (and their scales) onto `device` in the background (runtime.staging); get()
        hands them out from there until unstage()."""
        from runtime.loader import gpu_digests
        from runtime.staging import DigestRule, Staging, file_spans

        names = {x for n in names for x in (n, self.tensors[n].get("scale")) if x}
        spans = file_spans({n: self.art / self.tensors[n]["shard"] for n in names}, device)
        rule, checked = None, None
        if self.digests is not None:  # hashed as they are read, porter.json's digests to compare
            spans = [replace(s, digest=self.tensors[s.name].get("digest", "")) for s in spans]
            d = self.digests
            rule, checked = DigestRule(d.chunk_bytes, d.chunk_hash), d.staged
        on_gpu = gpu_digests(rule, {device})  # the digests computed on the GPU where the loader's are
        staging = Staging(
            spans, rule, allocate_now=True, log_level=logging.DEBUG, checked=checked, hash_on_device=on_gpu
        ).start()
        self.stagings.append(staging)
        return staging

    def nbytes(self, name: str) -> int:
        """Bytes of the tensor and its scale."""
        rec = self.tensors[name]
        names = [name] + ([rec["scale"]] if rec.get("scale") else [])
        return sum(manifest.record_bytes(self.tensors[n]) for n in names)

    def close(self) -> None:
        self._handles.clear()


READ_AHEAD_RESERVE = 2 << 30  # device memory left free beside a group read ahead (the model being built)


class GroupReadAhead:
    """A reference store's tensors read onto a GPU a group at a time (a decoder layer; the tensors outside
    the layers one group) by the runtime's staged reader (runtime.staging: large reads on a pool of threads
    through page-locked buffers), instead of tensor by tensor from the mapped shards with a pageable copy
    each. When the store is first asked for a tensor of a group, that group's source and artifact tensors
    are staged, and the next group's too, as device memory allows (else they are read from the mapped
    shards as before), so the next layer is read while this one is derived; a group's bytes leave the
    device when a later group is asked for or the store is closed (what the model holds was derived from
    them: copies). groups: {layer or None: (source names, artifact names)}."""

    def __init__(self, groups: dict, shards: SourceShards, reader: "ArtifactReader", device: torch.device):
        self.order = sorted(groups, key=lambda k: -1 if k is None else k)  # the order runtime builds in
        self.groups, self.shards, self.reader, self.device = groups, shards, reader, device
        self.staged: dict = {}  # group -> [(Staging, owner)]
        self.current = None

    def touch(self, name: str) -> None:
        key = layer_of(name)
        if key not in self.groups or (key == self.current and key in self.staged):
            return
        at = self.order.index(key)
        for k in self.order[:at]:
            self._leave(k)
        pending = 0  # bytes still to be derived on the device from the groups this touch staged
        for k in self.order[at : at + 2]:
            if k not in self.staged and self._room(k, pending):
                self.staged[k] = self._stage(k)
            pending += self._need(k)
        self.current = key

    def close(self) -> None:
        """Drop the groups up to the current one; a group read ahead stays for the next touch."""
        at = self.order.index(self.current) if self.current in self.groups else len(self.order) - 1
        for k in self.order[: at + 1]:
            self._leave(k)
        self.current = None

    def release(self) -> None:
        """Drop every group, the one read ahead too (the model will ask for nothing more)."""
        for k in list(self.staged):
            self._leave(k)
        self.current = None

    def _stage(self, key) -> list:
        sources, artifact = self.groups[key]
        out = [(self.shards.stage(sources, self.device), self.shards)] if sources else []
        return out + ([(self.reader.stage(artifact, self.device), self.reader)] if artifact else [])

    def _leave(self, key) -> None:
        for staging, owner in self.staged.pop(key, []):
            unstage(owner, staging)

    def _need(self, key) -> int:
        sources, artifact = self.groups[key]
        return sum(self.shards.nbytes(s) for s in sources) + sum(self.reader.nbytes(a) for a in artifact)

    def _room(self, key, pending: int) -> bool:
        """Room for the group's bytes and for what is derived from them (a stacked copy as large), beside
        `pending` bytes still to be derived from a group staged before it."""
        if self.device.type != "cuda":
            return True
        need = pending + 2 * self._need(key) + READ_AHEAD_RESERVE
        return torch.cuda.mem_get_info(self.device)[0] >= need


class ReferenceStore:
    """The reference model's weights for runtime.load, derived through the Mapping (not the converter's
    plan): canonical names, unquantized, stacked experts built expert by expert."""

    def __init__(self, mapping: Mapping, reader: ArtifactReader, config):
        self.mapping, self.config, self.path = mapping, config, mapping.shards.path
        raw = read_json_object(self.path / "config.json", VerifyInputError, "config")
        self.converter = converters.for_config(raw)  # the runtime picks its model by it
        self._derivations = {}
        for n, experts in reader.text_model().items():
            d = mapping.derive(n, experts)
            if d is not None:
                self._derivations[n] = d

        self.reader, self.ahead = reader, None
        self._shared: set = set()  # names a second model takes too (share())
        self._kept: dict = {}  # name -> tensor handed out once, kept for its second taker
        self._group: Optional[int] = None  # layer group (layer_of) of the tensors in _kept
        # called with a decoder layer's index when it is first asked for (verify's exact bytes in the pass)
        self.on_layer: Optional[Callable] = None
        self._entered = object()  # the layer group asked for last

    def names(self) -> set:
        return set(self._derivations)

    def derivation(self, name: str) -> Derivation:
        """How tensor `name` is derived from the source (the rounded reference re-quantizes through it)."""
        return self._derivations[name]

    def read_ahead(self, device: torch.device, artifact: Optional[dict] = None) -> None:
        """Read the source a layer at a time onto `device` as the model is built (GroupReadAhead), with
        each layer's `artifact` tensors ({layer: artifact names}: what exact bytes compares in the pass,
        on_layer); not for a pre-quantized source (its scheme dequantizes what the mapped shards hold)."""
        if self.mapping.shards.scheme is not None:
            return
        groups: dict = {}
        for n, d in self._derivations.items():
            groups.setdefault(layer_of(n), (set(), set()))[0].update(d.sources)
        for k, names in (artifact or {}).items():
            if k in groups:
                groups[k][1].update(names)
        self.ahead = GroupReadAhead(groups, self.mapping.shards, self.reader, device)

    def share(self, names) -> None:
        """Hand out each of `names` to two takers from one read: a layer-streamed pass builds layer i of the
        bf16 reference, then of the rounded reference, which takes the same source tensors from this store
        (rounded.py), so a shared tensor is kept from its first hand-out to its second, or until a tensor of
        another layer group (porter.format.layout.layer_of) is asked for: at most one layer's tensors, which
        the first model's resident layer holds anyway. Safe because no model writes into its weights (the
        runtime casts or dequantizes per call: runtime/loader.py). close() keeps them: the second model
        closes the store as it drops its previous layer, before it builds this one (runtime LazyLayers)."""
        self._shared = set(names) & self.names()

    def get(self, name: str) -> torch.Tensor:
        self._enter(name)
        return self.value(name)

    def _enter(self, name: str) -> None:
        """A tensor the model being built asks for: its layer read ahead (and the next), and on_layer told
        when a decoder layer is first asked for, after its bytes are staged."""
        if self.ahead is not None:
            self.ahead.touch(name)
        key = layer_of(name)
        if key != self._entered:
            self._entered = key
            if key is not None and self.on_layer is not None:
                self.on_layer(key)

    def value(self, name: str) -> torch.Tensor:
        """get() without touching the read-ahead (a second taker: the bf16 reference's own drives it)."""
        if name not in self._shared:
            return self._derive(name)
        group = layer_of(name)
        if group != self._group:  # another group: the one before is built by both models, or never will be
            self._kept, self._group = {}, group
        t = self._kept.pop(name, None)  # the second taker: the bytes read for the first
        if t is None:
            t = self._kept[name] = self._derive(name)
        return t

    def _derive(self, name: str) -> torch.Tensor:
        d = self._derivations[name]
        return d.value(None) if d.experts is None else torch.stack([d.value(e) for e in range(d.experts)])

    def experts(self, name: str):
        self._enter(name)
        d = self._derivations[name]
        return ((e, d.value(e)) for e in range(d.experts))

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
        self.mapping.shards.close()

    def release(self) -> None:
        """close(), and a layer read ahead dropped too (the pass is over, or was stopped)."""
        if self.ahead is not None:
            self.ahead.release()
        self.close()
