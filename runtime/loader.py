"""Weight stores (porter artifact or original HF checkpoint) and model assembly, eager or layer-streaming.

Both stores hand out tensors under the canonical names of their converter (converters/, picked by
config.json's model_type), memory-mapped from the safetensors shards (safe_open): nothing is read until
touched. On CPU the model keeps those mmapped tensors as they are. An artifact loaded onto GPUs is staged
(runtime/staging.py, `stage_weights`): its shards are read by a pool of threads through a few page-locked
buffers straight into each tensor's device, each tensor checked against porter.json's digest, while the
model is built from the tensors already there; other loads onto a GPU copy each mapped tensor once. No dtype
conversion happens at load (Linear casts or MXFP8-dequantizes per call), so exactly one copy of every weight
exists.

Layer streaming (`runtime.load(..., lazy=True)`): embeddings, final norm and lm_head are resident;
`model.layers` is a `LazyLayers` whose `[i]` builds decoder layer i from the store on first access and
drops the previously built layer first, so at most one decoder layer is materialized at a time (its KV
cache lives in the separate KVCache and survives). `model.layers.release()` frees the resident layer and
closes the store's shard handles, so pages mapped for it stop counting as resident.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

import converters
from porter.errors import LoadError, PorterError
from porter.format import journal, manifest
from porter.format.checked import CheckedShards
from porter.format.layout import layer_of
from porter.format.safe_files import inside, read_json_object, regular_file
from porter.format.safetensors_io import ST_DTYPES, chunk_hash_of, parse_header
from runtime import models
from runtime.models.layers import Rope
from runtime.staging import DigestRule, Span, Staging

log = logging.getLogger("porter.runtime")

TOP_NAMES = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
# staged tensors' digests computed on their GPU rather than on the reading cores: off until measured against
# the CPU on a GPU host (benchmarks/load.py --hash-on-gpu both)
HASH_ON_GPU = False


class ArtifactStore:
    """A porter artifact: porter.json manifest + config.json + shards with a model.safetensors.index.json.

    What callers use (the same on SourceStore): `path`, `converter`, `config`, `is_artifact`, `names()`,
    `get(name)`, `experts(name)`, `carried_names()`, `get_carried(name)`, `total_bytes()`, `close()`."""

    is_artifact = True

    def __init__(self, path: Path, checked: Optional[CheckedShards] = None):
        self.path = path
        # this machine's record of shards a load checked (porter.format.checked): their tensors unchanged
        # since are staged without hashing (unless it rehashes), and what a staging checks is added.
        # None: every tensor hashed, nothing recorded.
        self.checked = checked
        try:
            self.manifest = manifest.read(path)
        except ValueError as e:
            raise LoadError(str(e)) from None
        raw = _json(path / "config.json")
        index = self.index = path / "model.safetensors.index.json"
        if not index.exists() and not index.is_symlink():  # porter writes the index last: no index, no finish
            raise LoadError(
                f"{index}: missing — the conversion did not finish; rerun "
                "`porter convert ... --resume` into this folder"
            )
        self.files = _weight_map(path, index)
        self._handles: dict = {}
        self._headers: dict = {}  # shard -> parsed safetensors header (nbytes)
        self._starts: dict = {}  # shard -> byte offset of its tensor data
        self._stagings: list = []  # Staging objects in flight (get() takes their tensors)
        self._check_shards(index)
        meta = {
            n: (self._headers[f][n]["dtype"], self._headers[f][n]["shape"]) for n, f in self.files.items()
        }
        self.converter, self.config = converters.resolve(raw, meta, str(path / "config.json"))
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
                self._starts[f], self._headers[f] = parse_header(f)
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
        """Stop staging and drop the safe_open handles; tensors still referenced keep their memory."""
        self.unstage()
        self.unmap()

    def unmap(self) -> None:
        """Drop the safe_open handles (each maps a whole shard); tensors still referenced keep theirs."""
        self._handles.clear()

    def stage(self, device_of: Callable[[str], Optional[torch.device]], progress=None, **kw) -> Staging:
        """Start reading the tensors the model uses onto their devices (device_of(canonical name), None: not
        staged) on background threads; until unstage(), get() hands those out as they arrive. Several
        stagings may be in flight (a layer-streaming model reads the next layer while one is in use).
        kw: Staging's threads, buffer_bytes."""
        devices = {}
        for name in self.names() - self.carried_names():
            dev = device_of(name)
            if dev is not None:
                devices.update({f: dev for f in self._file_names(name)})
        shards = {self.files[f] for f in devices}
        self._check_shard_records(shards)
        rule, records = self._digest_rule(), self.manifest.get("tensors")
        before = self.checked.snapshot(shards) if self.checked is not None and rule is not None else {}
        trusted = {f: self.checked.trusted(f, before) for f in before}
        spans, skipped, unhashed = [], 0, set()  # bytes and shards read without hashing
        for f, dev in devices.items():
            info, shard = self._headers[self.files[f]][f], self.files[f]
            begin, end = info["data_offsets"]
            rec = records.get(f) if isinstance(records, dict) else None
            digest = rec.get("digest") if isinstance(rec, dict) else None
            if digest is not None and f in trusted.get(shard, ()):
                digest, skipped = None, skipped + end - begin
                unhashed.add(shard)
            dtype = ST_DTYPES[info["dtype"]]
            spans.append(
                Span(
                    f,
                    shard,
                    self._starts[shard] + begin,
                    end - begin,
                    dtype,
                    tuple(info["shape"]),
                    dev,
                    digest,
                )
            )
        if skipped:
            log.log(
                kw.get("log_level", logging.INFO),
                "%s: %.2f GB checked by an earlier load on this machine, the files unchanged since: not hashed "
                "again (runtime.load(..., rehash=True) hashes every byte)",
                self.path,
                skipped / 1e9,
            )
        finished = (lambda spans: self._record_checked(before, unhashed, spans)) if before else None
        on_gpu = gpu_digests(rule, set(devices.values()))
        staging = Staging(spans, rule, progress=progress, finished=finished, hash_on_device=on_gpu, **kw)
        self._stagings.append(staging)
        return staging.start()

    def _record_checked(self, before: dict, unhashed: set, spans: list) -> None:
        """After a staging found every digest it checked matching: the shards read without hashing did not
        change while they were read (else LoadError), and the tensors checked are recorded."""
        moved = self.checked.moved(before, sorted(unhashed))
        if moved:
            raise LoadError(f"{moved[0]}: changed while it was being loaded; load again")
        by_shard: dict = {}
        for s in spans:
            by_shard.setdefault(s.path, []).append(s.name)
        self.checked.record(before, by_shard)

    def unstage(self, staging: Optional[Staging] = None) -> None:
        """Stop one staging (None: all; threads joined, tensors not taken dropped); get() reads the mapped
        shards again for their tensors."""
        for s in [staging] if staging is not None else list(self._stagings):
            s.close()
            if s in self._stagings:
                self._stagings.remove(s)

    def _file_names(self, name: str) -> list:
        """The shard tensors behind a canonical name (several per-expert parts in the hf layout)."""
        if self._hf is None:
            return [name]
        spec = self._hf[name]
        return [p for e in spec for p in e] if isinstance(spec, list) else [spec]

    def _digest_rule(self) -> Optional[DigestRule]:
        """porter.json's digest rule (None when it names none this porter reads: tensors are then not
        checked at load; `porter verify` refuses such a manifest)."""
        rule = self.manifest.get("digest")
        name, n = chunk_hash_of(rule), rule.get("chunk_bytes") if isinstance(rule, dict) else None
        if name is None or type(n) is not int or n < 4096:
            log.warning("%s: porter.json names no digest rule porter reads; tensors not checked", self.path)
            return None
        return DigestRule(n, name)

    def _check_shard_records(self, shards: set) -> None:
        """Each shard's size and header bytes are what porter.json recorded (the tensors' digests are
        checked as their bytes are read)."""
        records = self.manifest.get("shards")
        for f in sorted(shards):
            rec = records.get(f.name) if isinstance(records, dict) else None
            if not isinstance(rec, dict):
                continue
            size = f.stat().st_size
            if "bytes" in rec and rec["bytes"] != size:
                raise LoadError(
                    f"{f}: {size} bytes, porter.json records {rec['bytes']} (the shard changed after the "
                    "conversion); reconvert or restore it"
                )
            if "header_sha256" in rec:
                with open(f, "rb") as fh:
                    head = fh.read(self._starts[f])
                if hashlib.sha256(head).hexdigest() != rec["header_sha256"]:
                    raise LoadError(
                        f"{f}: header differs from porter.json's header_sha256 (the shard changed after "
                        "the conversion); reconvert or restore it"
                    )

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
        for staging in list(self._stagings):
            if name in staging:
                return staging.take(name)  # on its device, checked
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
        self.converter, self.config = converters.resolve(
            self.source.raw_config, self.source.meta, str(self.path / "config.json")
        )
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


def gpu_digests(rule: Optional[DigestRule], devices: set) -> Optional[Callable]:
    """XXH3 chunk digests computed on the GPUs the tensors go to (runtime/kernels/xxh3.py) when HASH_ON_GPU
    and every destination is a GPU where the kernel gives xxhash's digests; None: hashed on the CPU."""
    from runtime.kernels import xxh3

    if not HASH_ON_GPU or rule is None or rule.name != "xxh3-128" or rule.chunk_bytes % 8:
        return None
    if not devices or any(d.type != "cuda" or not xxh3.works_on(d) for d in devices):
        return None
    return xxh3.PendingDigests


def open_store(path, record_checks: bool = False, rehash: bool = False) -> ArtifactStore | SourceStore:
    """The artifact or checkpoint at `path`. record_checks: this machine's record of checked shards is kept
    (porter.format.checked): what a staging checks is added, and the tensors of shards an earlier load
    checked, unchanged since, are not hashed again unless `rehash`."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise LoadError(f"{path}: not a directory (give a porter artifact or a checkpoint folder)")
    unfinished = journal.interrupted(path)  # a porter output whose conversion did not finish
    if unfinished is not None:
        raise LoadError(str(unfinished))
    if manifest.is_artifact(path):
        return ArtifactStore(path, CheckedShards(path, rehash) if record_checks else None)
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


def listing(store) -> Path:
    """The file that lists a store's tensors: an artifact's index, else the checkpoint folder."""
    return getattr(store, "index", store.path)


def getter(store, names: set, device: torch.device, progress=None) -> Callable[[str], Optional[torch.Tensor]]:
    """name -> tensor on device (None when absent: e.g. no weight_scale for an unquantized linear).
    progress: a bar updated with the bytes each tensor copied here moves (staged tensors arrive on their
    device and count in the staging's own bar)."""

    def get(name):
        if name not in names:
            if name.endswith("_scale"):
                return None
            raise LoadError(
                f"tensor {name!r} is missing from {listing(store)}; reconvert, or restore the file"
            )
        t = store.get(name)
        if t.device == device:
            return t
        t = t.to(device)
        if progress is not None:
            progress.update(t.nbytes)
        return t

    return get


def weight_devices(n: int, device: torch.device, placement=None) -> tuple[list, torch.device, torch.device]:
    """(device of each of the n decoder layers, of the embeddings, of the final norm and lm_head):
    placement's (runtime.placement.Placement), else all on `device`."""
    if placement is None:
        return [device] * n, device, device
    return list(placement.layers), placement.embed, placement.head


def device_of_weight(name: str, where: list, embed_dev, head_dev) -> Optional[torch.device]:
    """The device build_model puts canonical tensor `name` on (None: the model does not use it)."""
    layer = layer_of(name)
    if layer is not None:
        return where[layer] if layer < len(where) else None
    if name == TOP_NAMES[0]:
        return embed_dev
    return head_dev if name in TOP_NAMES[1:] else None


@contextlib.contextmanager
def loading(store, device: torch.device, placement=None, lazy: bool = False, progress: bool = False):
    """Around build_model: an artifact loaded onto GPUs is staged (ArtifactStore.stage) and every staged
    tensor is checked before the block ends (LoadError otherwise: no model is returned); other loads
    that move bytes to a GPU get a progress bar, yielded for build_model(progress=...). progress: show the
    bar (bytes, GB/s, ETA) on stderr."""
    where, embed_dev, head_dev = weight_devices(store.config.num_hidden_layers, device, placement)
    on_gpu = any(d.type == "cuda" for d in {*where, embed_dev, head_dev})
    device_of = lambda name: device_of_weight(name, where, embed_dev, head_dev)  # noqa: E731
    if on_gpu and isinstance(store, ArtifactStore):  # lazy: the resident tensors now, layers as they stream
        resident = (lambda n: None if layer_of(n) is not None else device_of(n)) if lazy else device_of
        staging = store.stage(resident, progress=progress)
        try:
            yield None
            staging.finish()
        finally:
            store.unstage(staging)
        return
    if not on_gpu or lazy:
        yield None
        return
    sized = hasattr(store, "nbytes")  # verify's reference store gives no sizes: a bar without a total
    total = sum(store.nbytes(n) for n in store.names() if device_of(n) is not None) if sized else None
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="load", disable=not progress)
    try:
        yield bar
    finally:
        bar.close()


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
            self._free()
            self._layer, self._index = self._build(i), i
        return self._layer

    def __iter__(self):
        return (self[i] for i in range(self._n))

    def resident(self) -> list:
        """The decoder layers built now (at most one): what a numerics switch changes in place."""
        return [] if self._layer is None else [self._layer]

    def free(self) -> None:
        """Free the resident layer now, not at the next access (a layer being read ahead goes on)."""
        if self._index is not None:
            self._free()

    def release(self) -> None:
        """Free the resident layer (and a layer being read ahead), unmap the shards."""
        self._free()
        if isinstance(self._build, _StagedLayers):
            self._build.close()

    def _free(self) -> None:
        self._index, self._layer = None, None
        self._on_release()  # e.g. store.close(): unmap the shards the layer (and anything since) touched
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def stream_from(self, store, device: torch.device) -> None:
        """Build each layer from staged reads of an artifact (ArtifactStore.stage) onto a GPU, and read the
        next layer's bytes while the one just built is used (when the device has room for both). Other
        stores keep the plain builder (runtime.load calls this for a GPU; on the CPU mapped tensors need no
        reading ahead)."""
        if isinstance(store, ArtifactStore):
            self._build = _StagedLayers(store, device, self._n, self._build)
            self._on_release = store.unmap  # a layer's release keeps the next one's reads going


PREFETCH_RESERVE = 2 << 30  # free device memory left after a prefetched layer (activations, the caller's)


class _StagedLayers:
    """LazyLayers' builder for a layer-streaming artifact on a GPU: layer i is staged (or taken from the
    prefetch started when layer i - 1 was built), built, checked (Staging.finish), then layer i + 1 starts
    reading in the background. At most two layers' bytes are on the device: the one in use, the next."""

    def __init__(self, store, device: torch.device, n: int, build: Callable):
        self.store, self.device, self.n, self.build = store, device, n, build
        self.next: Optional[tuple] = None  # (layer index, its Staging)

    def close(self) -> None:
        if self.next is not None:
            self.store.unstage(self.next[1])
            self.next = None

    def __call__(self, i: int):
        ahead, self.next = self.next, None
        if ahead is not None and ahead[0] != i:  # another layer than the next was asked for
            self.store.unstage(ahead[1])
            ahead = None
        staging = ahead[1] if ahead is not None else self._stage(i)
        try:
            layer = self.build(i)
            staging.finish()
        finally:
            self.store.unstage(staging)
        if i + 1 < self.n and self._room(i + 1):
            self.next = (i + 1, self._stage(i + 1))
        return layer

    def _stage(self, i: int):
        # memory taken now, before the caller queues work on the layer just built: the copies then wait
        # only for work queued before this point (Staging allocate_now)
        return self.store.stage(
            lambda name: self.device if layer_of(name) == i else None,
            allocate_now=True,
            log_level=logging.DEBUG,
        )

    def _room(self, i: int) -> bool:
        if self.device.type != "cuda":
            return True
        need = sum(self.store.nbytes(n) for n in self.store.names() if layer_of(n) == i)
        return torch.cuda.mem_get_info(self.device)[0] >= need + PREFETCH_RESERVE


class Numerics:
    """What a loaded model's layers compute: runtime.load's moe_numerics ("w8a16" | "serving" | None, the MoE
    backend's own), switched by runtime.set_numerics. Both are per-call attributes, so a switch reads no
    weight: each MXFP8 Linear's `mxfp8_act` (serving: its input rounded to MXFP8) and the MoE backend's
    `numerics` (torch and triton compute either; flashinfer-trtllm only serving, which check_numerics
    enforces: runtime/moe/contract.py). The model builder applies it to every layer it builds, so the layers
    a streaming model builds after a switch compute the new numerics too."""

    def __init__(self, moe_backend: str, quantized: bool, moe: Optional[str] = None):
        self.moe_backend, self.quantized, self.moe = moe_backend, quantized, moe

    def apply(self, layer) -> None:
        for lin in layer.linears():
            lin.mxfp8_act = self.moe == "serving"
        experts = layer.moe_backend()  # None on a dense layer
        if hasattr(experts, "numerics"):  # flashinfer-trtllm has none: it computes serving only
            experts.numerics = self.moe or "w8a16"


def build_model(
    store,
    device: torch.device,
    dtype: torch.dtype,
    make_backend: Callable,
    lazy: bool,
    numerics: Numerics,
    placement=None,
    progress=None,
):
    """The store's model (runtime.models registry, by its converter's architecture).
    placement (runtime.placement.Placement): decoder layer i on placement.layers[i], embeddings on
    placement.embed, final norm + lm_head on placement.head; None = everything on `device`.
    numerics: applied to each layer as it is built, kept as model.numerics (runtime.set_numerics switches it).
    progress: the bar `loading` yields (None: none)."""
    model_module = models.for_store(store)
    cfg, names = store.config, store.names()
    n = cfg.num_hidden_layers
    tied = getattr(cfg, "tie_word_embeddings", False)  # else lm_head is a tensor of its own
    for name in TOP_NAMES[:2] if tied else TOP_NAMES:
        if name not in names:
            raise LoadError(
                f"tensor {name!r} is missing from {listing(store)}; reconvert, or restore the file"
            )
    where, embed_dev, head_dev = weight_devices(n, device, placement)
    make_rope = getattr(model_module, "rope", None) or (
        lambda cfg, d: Rope(cfg.rotary_dim, cfg.rope_theta, d)
    )
    getters, ropes = {}, {}
    for d in {*where, embed_dev, head_dev}:  # one getter and one Rope (inv_freq) per device
        getters[d], ropes[d] = getter(store, names, d, progress), make_rope(cfg, d)
    top = {nm: getters[embed_dev if nm == TOP_NAMES[0] else head_dev](nm) for nm in TOP_NAMES if nm in names}
    if "lm_head.weight" not in top and head_dev != embed_dev:  # tied: lm_head needs the embedding there too
        top["lm_head.weight"] = getters[head_dev](TOP_NAMES[0])

    def build(i: int):
        layer = model_module.DecoderLayer(cfg, getters[where[i]], i, ropes[where[i]], where[i], make_backend)
        numerics.apply(layer)  # the model's numerics now: a switch after load reaches layers built later
        return layer

    layers = LazyLayers(n, build, store.close) if lazy else [build(i) for i in range(n)]
    model = model_module.Model(cfg, top, layers, embed_dev, dtype, layer_devices=where)
    model.numerics = numerics
    return model
