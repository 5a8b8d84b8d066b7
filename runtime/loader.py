"""Weight stores (porter artifact or original HF checkpoint) and model assembly, eager or layer-streaming.

Both stores hand out tensors under the canonical names of their converter (converters/, picked by
config.json's model_type), memory-mapped from the safetensors shards (safe_open): nothing is read until
touched. On CPU the model keeps those mmapped tensors
as they are; on CUDA each tensor is copied to the device once. No dtype conversion happens at load (Linear
casts or MXFP8-dequantizes per call), so exactly one copy of every weight exists.

Layer streaming (`runtime.load(..., lazy=True)`): embeddings, final norm and lm_head are resident;
`model.layers` is a `LazyLayers` whose `[i]` builds decoder layer i from the store on first access and
drops the previously built layer first, so at most one decoder layer is materialized at a time (its KV
cache lives in the separate KVCache and survives). `model.layers.release()` frees the resident layer and
closes the store's shard handles, so pages mapped for it stop counting as resident.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import SafetensorError, safe_open

import converters
from porter.errors import LoadError, PorterError
from porter.format import journal, manifest
from porter.format.safe_files import inside, read_json_object, regular_file
from porter.format.safetensors_io import parse_header
from runtime import models
from runtime.models.layers import Rope

log = logging.getLogger("porter.runtime")

TOP_NAMES = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


class ArtifactStore:
    """A porter artifact: porter.json manifest + config.json + shards with a model.safetensors.index.json.

    What callers use (the same on SourceStore): `path`, `converter`, `config`, `is_artifact`, `names()`,
    `get(name)`, `experts(name)`, `carried_names()`, `get_carried(name)`, `total_bytes()`, `close()`."""

    is_artifact = True

    def __init__(self, path: Path):
        self.path = path
        try:
            self.manifest = manifest.read(path)
        except ValueError as e:
            raise LoadError(str(e)) from None
        raw = _json(path / "config.json")
        self.converter = converters.for_config(raw, str(path / "config.json"))
        self.config = self.converter.resolve_config(raw)
        index = path / "model.safetensors.index.json"
        if not index.exists() and not index.is_symlink():  # porter writes the index last: no index, no finish
            raise LoadError(
                f"{index}: missing — the conversion did not finish; rerun "
                "`porter convert ... --resume` into this folder"
            )
        self.files = _weight_map(path, index)
        self._handles: dict = {}
        self._headers: dict = {}  # shard -> parsed safetensors header (nbytes)
        self._check_shards(index)
        # hf layout (vendor names, per-expert tensors): canonical name -> hf name, or per expert the hf
        # row parts that stack to [E, N, K] when the model touches them (the converter's hf_canonical_map)
        try:
            hf = manifest.read_options(self.manifest, str(path / manifest.MANIFEST)).layout == "hf"
        except PorterError as e:
            raise LoadError(str(e)) from None
        if hf and self.converter.hf_layout is None:
            raise LoadError(
                f"{path}: porter.json says layout hf, which {self.converter.ARCHITECTURE} has not"
            )
        self._hf = self.converter.hf_layout.hf_canonical_map(self.files) if hf else None

    def _check_shards(self, index: Path) -> None:
        """Every shard is a valid safetensors file of this folder holding the tensors the index gives it
        (headers only), so a broken file fails here, named, not as a bare error in the middle of a forward."""
        for f in sorted(set(self.files.values())):
            try:
                self._headers[f] = parse_header(f)[1]
            except PorterError as e:
                raise LoadError(str(e)) from None
        for name, f in self.files.items():
            if name not in self._headers[f]:
                raise LoadError(
                    f"{index}: tensor {name!r} is listed in {f.name} but that shard does not "
                    "hold it; reconvert"
                )

    def names(self) -> set:
        return set(self.files) if self._hf is None else set(self._hf)

    def close(self) -> None:
        """Drop the safe_open handles (each maps a whole shard); tensors still referenced keep theirs."""
        self._handles.clear()

    def get(self, name: str) -> torch.Tensor:
        if self._hf is not None:
            if name not in self._hf:
                raise LoadError(f"tensor {name!r} is missing from {self.path}")
            spec = self._hf[name]
            if isinstance(spec, list):  # per-expert hf tensors -> stacked [E, N, K] (a copy, made here)
                return torch.stack([w for _, w in self.experts(name)])
            name = spec
        return self._get(name)

    def _get(self, name: str) -> torch.Tensor:
        f = self.files.get(name)
        if f is None:
            raise LoadError(f"tensor {name!r} is missing from {self.path / 'model.safetensors.index.json'}")
        h = self._handles.get(f)  # one lookup: a close() from another thread between two would KeyError
        try:
            if h is None:
                regular_file(f, LoadError, "shard")
                h = self._handles.setdefault(f, safe_open(str(f), framework="pt"))
            return h.get_tensor(name)  # memory-mapped
        except (SafetensorError, OSError) as e:  # changed on disk since the header check
            raise LoadError(f"{f}: cannot read tensor {name!r} ({e}); reconvert or restore it") from None

    def experts(self, name: str):
        """(e, expert e) of a stacked [E, N, K] tensor, one expert at a time (slices of the mapped tensor)."""
        if self._hf is not None:
            return ((e, torch.cat([self._get(p) for p in parts])) for e, parts in enumerate(self._hf[name]))
        w = self.get(name)
        return ((e, w[e]) for e in range(w.shape[0]))

    def nbytes(self, name: str) -> int:
        """Stored bytes of a canonical tensor, from the shard headers (no tensor data read)."""
        if self._hf is not None:
            spec = self._hf[name]
            parts = [p for e in spec for p in e] if isinstance(spec, list) else [spec]
            return sum(self._header_bytes(p) for p in parts)
        return self._header_bytes(name)

    def _header_bytes(self, name: str) -> int:
        f = self.files[name]
        if f not in self._headers:
            self._headers[f] = parse_header(f)[1]
        start, end = self._headers[f][name]["data_offsets"]
        return end - start

    def carried_names(self) -> set:
        """Tensors outside the text model (vision tower, projectors, MTP), under their source names."""
        return {n for n in self.files if self.converter.canonical_name(n) is None}

    def get_carried(self, name: str) -> torch.Tensor:
        return self._get(name)

    def total_bytes(self) -> int:
        """Bytes of the artifact's shards (from porter.json; no file is read)."""
        shards = self.manifest.get("shards")
        if not isinstance(shards, dict) or not all(isinstance(r, dict) for r in shards.values()):
            raise LoadError(f"{self.path / manifest.MANIFEST}: 'shards' must map file -> record; reconvert")
        try:
            return sum(int(r.get("bytes", 0)) for r in shards.values())
        except (TypeError, ValueError):
            raise LoadError(
                f"{self.path / manifest.MANIFEST}: a shard's 'bytes' is not a number; reconvert"
            ) from None


class SourceStore:
    """An original (bf16) HF checkpoint, vendor or transformers layout, via porter.source: experts are
    stacked to [E, 2I, H] [gate; up] / [E, H, I] when read (one layer at a time). Same methods as
    ArtifactStore."""

    is_artifact = False

    def __init__(self, path: Path):
        from porter import source

        self.source = source.open_source(path)
        self.path = self.source.path
        self.converter = converters.for_config(self.source.raw_config, str(self.path / "config.json"))
        self.config = self.converter.resolve_config(self.source.raw_config)
        plan = self.converter.plan_tensors(self.config, self.source.meta, quantize="none")
        self.plan = {t.name: t for t in plan if not t.carried}
        self._carried = {t.name for t in plan if t.carried}

    def names(self) -> set:
        return set(self.plan)

    def get(self, name: str) -> torch.Tensor:
        return self.plan[name].build(self.source.read)

    def experts(self, name: str):
        """(e, expert e) of a stacked [E, N, K] tensor, reading only that expert's source rows each time."""
        t = self.plan[name]
        return ((e, t.build_expert(self.source.read, e)) for e in range(t.shape[0]))

    def nbytes(self, name: str) -> int:
        """Bytes of a canonical tensor as the runtime holds it (source dtype), from the plan (nothing read)."""
        from porter.format.safetensors_io import nbytes

        t = self.plan[name]
        return nbytes(t.dtype, t.shape)

    def carried_names(self) -> set:
        """Tensors outside the text model (vision tower, projectors, MTP), under their source names."""
        return set(self._carried)

    def get_carried(self, name: str) -> torch.Tensor:
        """A carried tensor exactly as stored in the checkpoint."""
        return self.source.read(name)

    def total_bytes(self) -> int:
        """Bytes of the checkpoint's tensors (from the safetensors headers; no tensor data read)."""
        return self.source.total_bytes

    def close(self) -> None:
        self.source.close()


def open_store(path) -> ArtifactStore | SourceStore:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise LoadError(f"{path}: not a directory (give a porter artifact or a checkpoint folder)")
    unfinished = journal.interrupted(path)  # a porter output whose conversion did not finish
    if unfinished is not None:
        raise LoadError(str(unfinished))
    if manifest.is_artifact(path):
        return ArtifactStore(path)
    if (path / "config.json").exists() or (path / "config.json").is_symlink():
        return SourceStore(path)
    raise LoadError(f"{path}: neither a porter artifact (porter.json) nor a checkpoint dir (config.json)")


def _json(p: Path) -> dict:
    return read_json_object(p, LoadError)


def _weight_map(folder: Path, index: Path) -> dict:
    """tensor name -> shard path from the index, each shard a regular file inside `folder`."""
    weight_map = _json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise LoadError(f"{index}: no weight_map object (tensor name -> shard file); reconvert")
    files = {}
    for name, f in weight_map.items():
        if not isinstance(f, str) or not f.endswith(".safetensors"):
            raise LoadError(
                f"{index}: weight_map[{name!r}] = {f!r} is not a .safetensors file name; reconvert"
            )
        files[name] = regular_file(inside(folder, f, LoadError, index.name), LoadError, "shard")
    return files


def getter(store, names: set, device: torch.device) -> Callable[[str], Optional[torch.Tensor]]:
    """name -> tensor on device (None when absent: e.g. no weight_scale for an unquantized linear)."""

    def get(name):
        if name not in names:
            if name.endswith("_scale"):
                return None
            raise LoadError(f"tensor {name!r} is missing from {store.path}")
        t = store.get(name)
        return t if t.device == device else t.to(device)

    return get


class LazyLayers:
    """Sequence of decoder layers built on access; at most one is resident (see module docstring)."""

    def __init__(self, n: int, build: Callable[[int], object], on_release: Callable[[], None] = lambda: None):
        self._n, self._build, self._on_release = n, build, on_release
        self._index, self._layer = None, None

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int):
        if not 0 <= i < self._n:
            raise IndexError(i)
        if self._index != i:
            self.release()
            self._layer, self._index = self._build(i), i
        return self._layer

    def __iter__(self):
        return (self[i] for i in range(self._n))

    def release(self) -> None:
        self._index, self._layer = None, None
        self._on_release()  # e.g. store.close(): unmap the shards the layer (and anything since) touched
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def build_model(
    store,
    device: torch.device,
    dtype: torch.dtype,
    make_backend: Callable,
    lazy: bool,
    placement=None,
    mxfp8_act: bool = False,
):
    """The store's model (runtime.models registry, by its converter's architecture).
    placement (runtime.placement.Placement): decoder layer i on placement.layers[i], embeddings on
    placement.embed, final norm + lm_head on placement.head; None = everything on `device`.
    mxfp8_act: every MXFP8 linear rounds its input to MXFP8 first (the serving numerics, Linear.input)."""
    model_module = models.for_store(store)
    cfg, names = store.config, store.names()
    n = cfg.num_hidden_layers
    if placement is None:
        where, embed_dev, head_dev = [device] * n, device, device
    else:
        where, embed_dev, head_dev = list(placement.layers), placement.embed, placement.head
    make_rope = getattr(model_module, "rope", None) or (
        lambda cfg, d: Rope(cfg.rotary_dim, cfg.rope_theta, d)
    )
    getters, ropes = {}, {}
    for d in {*where, embed_dev, head_dev}:  # one getter and one Rope (inv_freq) per device
        getters[d], ropes[d] = getter(store, names, d), make_rope(cfg, d)
    top = {nm: getters[embed_dev if nm == TOP_NAMES[0] else head_dev](nm) for nm in TOP_NAMES if nm in names}
    if "lm_head.weight" not in top and head_dev != embed_dev:  # tied: lm_head needs the embedding there too
        top["lm_head.weight"] = getters[head_dev](TOP_NAMES[0])

    def build(i: int):
        layer = model_module.DecoderLayer(cfg, getters[where[i]], i, ropes[where[i]], where[i], make_backend)
        for lin in layer.linears():
            lin.mxfp8_act = mxfp8_act
        return layer

    layers = LazyLayers(n, build, store.close) if lazy else [build(i) for i in range(n)]
    return model_module.Model(cfg, top, layers, embed_dev, dtype, layer_devices=where)
