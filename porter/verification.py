"""`porter verify`: prove a porter MXFP8 artifact faithful to the checkpoint it came from, or say where not.

    porter verify out/m3-mxfp8                       # reference = the source named in porter.json
    porter verify out/m3-mxfp8 --reference DIR|REPO --prompt "..." --report r.json --plot r.svg

Order of work
-------------
1. Integrity (no model is run): every shard's sha256 against porter.json (on a mismatch the per-tensor
   sha256s locate the changed tensor), every tensor's dtype/shape in the shard header against the manifest
   and the index, scale tensors sane (U8, shape [..., K/32], no byte 255 = E8M0 NaN, no byte 0 on a block
   whose e4m3 values are non-zero: byte 0 means 2^-127, which only an all-zero block gets from a real
   weight), config.json's resolved config equal to porter.json `resolved_config` field by field, the
   manifest's SwiGLU record equal to it, and the reference's resolved config equal to it too.
   Any failure names the tensor and shard (or the config field) and is a *faithfulness* failure: exit 1.
   Numerics are not run after an integrity failure (their numbers would be about a broken artifact).
2. Numerics: the reference (original bf16 weights) and the artifact run through the same runtime, one
   decoder layer at a time, on the prompts tokenized by the checkpoint's own tokenizer.json. Per layer:
   - `cosine`, `rel_error`: the residual stream after the layer, reference vs converted, each model fed
     its own previous output (end to end: errors accumulate over depth);
   - `layer_error`: the layer alone — both layers fed the *reference* input, ||d_conv - d_ref|| / ||d_ref||
     for the layer's update d = layer(h) - h. Accumulated upstream error cannot leak into it, so it names
     the layer that is wrong;
   - `weight_error`: max over the layer's tensors (and over experts, one at a time) of
     ||deq(Q) - W_ref|| / ||W_ref||; tensors that were not quantized must be bit-identical (error 0).
     This sees experts that the prompt never routes to.
   Final logits (all prompt positions): KL(ref || conv) (mean per position, nats), top-1 agreement,
   top-5 overlap, max |logit difference|. Greedy generation of N tokens from both, first divergence.
3. Verdict against `Thresholds` (below; every one overridable). The failing layer is the first layer
   whose weight, layer or cosine metric crosses its threshold; logits failures with no failing layer
   name the final logits.

Default thresholds and how they were calibrated
-----------------------------------------------
Measured with this code on MXFP8 conversions of the tiny checkpoint (examples/tiny_checkpoint.py,
vendor layout, seeds 0-5) for each scope and scale rounding, each of four prompts run alone (9, 56, 73
and 156 tokens: DEFAULT_PROMPT, a greeting, a code line, a repeated sentence), CPU float32. Worst case
over the 24 runs of each setting, then the default threshold (defaults depend on the scope recorded in
porter.json; all of them are overridable):

    metric (worst faithful)     experts rceil  experts floor  all rceil  all floor | experts   all     none
    weight_error   (max)        0.0279         0.0312         0.0279     0.0317    | 0.06      0.06    0 (exact)
    layer_error    (max)        0.0362         0.0405         0.272      0.266     | 0.08      0.5     1e-6
    cosine         (min)        0.957          0.958          0.877      0.884     | 0.90      0.75    0.999999
    logits KL      (max, nats)  0.034          0.031          0.107      0.115     | 0.10      0.3     1e-6
    top-1 agreement (min)       0.67           0.67           0.51       0.44      | 0.50      0.30    1.0
    top-5 overlap   (min)       0.84           0.84           0.61       0.60      | 0.70      0.45    1.0

Tampered artifacts (tests/test_verify.py helpers; seeds 0-2, layer 2 tampered, porter.json re-sealed so
integrity passes): weight_error of the tampered layer 1.0 (one expert's w13 scales +1, or the whole
layer's), 0.50 (scales -1), 1.40 (gate/up halves of one expert swapped) against 0.028 faithful: a 17x
gap, so `weight_error` is the decisive check and names the tensor and expert. layer_error of the
tampered layer 1.75-1.87 (all w13 scales +1), 0.25-0.68 (one expert +1), 0.07-0.20 (one expert swapped
or -1; depends on how many prompt tokens route to it) against 0.036 faithful, and it is 0.03 on every
untouched layer, so it names the layer even downstream of a large error.

Why these numbers: MXFP8 with rceil scales bounds each element's error by half an e4m3 ulp (2^-4
relative), so a weight block lands at ~2.7-3.2 % rms and nothing faithful gets near 6 %, while any
scale byte off by one moves a whole block by 50-100 % and a row permutation by ~140 %. The activation
thresholds keep a ~2-3x margin over the faithful worst case; they are loose because the tiny random
model (vocabulary 384, untrained, near-flat logits, 8 experts with no routing margin) amplifies noise far
more than a trained model: with `--quantize all`, attention error moves the router input and flips
routes, hence the looser `all` column. Greedy generation is reported, not judged, by default
(`min_matching_tokens = 0`): on the tiny random model even a faithful conversion diverges at the first
token (logit margins ~1e-2). On real checkpoints, tighten with the flags (e.g. --min-matching-tokens).

Layer streaming
---------------
`streaming="auto"` (CLI default) runs both models with `runtime.load(..., lazy=True)` — each decoder layer
is loaded, run on every prompt, and freed before the next (reference and converted: two layers resident)
— when the estimated bytes of both models exceed 80 % of the memory available on the device (GPU free
memory, or MemAvailable on CPU). Generation in streaming mode streams every layer once per token.
The numbers are identical to a full load (the same code path runs layer by layer in both modes).
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

import click
import torch
from tqdm import tqdm

from converters import minimax_m3 as arch
from porter import manifest as manifest_mod
from porter import mxfp8
from porter.safetensors_io import DTYPE_NAMES, dtype_name, file_sha256, range_sha256
from porter.source import read_header, tensor_span
from porter.errors import PorterError

log = logging.getLogger("porter")

DEFAULT_PROMPT = ("The quick brown fox jumps over the lazy dog. MiniMax-M3 is a mixture of experts language "
                  "model: each token is routed to a few experts, and a shared expert sees every token.")
DEFAULT_MAX_NEW_TOKENS = 16
STREAM_FRACTION = 0.8  # stream when both models need more than this fraction of the available memory

# fields of the resolved config that fix tensor shapes: a reference that differs here is not the source
STRUCTURAL = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "dense_intermediate_size", "shared_intermediate_size",
              "n_shared_experts", "num_local_experts", "layer_types", "mlp_layer_types", "index_n_heads",
              "index_head_dim")


class VerifyInputError(PorterError, ValueError):
    """Bad input to verify (missing dir, not an artifact, reference not found): CLI exit 2."""


@dataclass
class Thresholds:
    """Verdict thresholds (module docstring: calibration). max_* fail above, min_* below. The defaults
    depend on the artifact's quantization scope (porter.json options.quantize): `SCOPE_DEFAULTS`."""
    max_weight_error: float = 0.06
    max_layer_error: float = 0.08
    min_cosine: float = 0.90
    max_kl: float = 0.10
    min_top1: float = 0.50
    min_top5: float = 0.70
    min_matching_tokens: int = 0  # greedy tokens that must match before the first divergence (0: report only)

    @classmethod
    def build(cls, overrides: Optional[dict] = None, scope: str = "experts") -> "Thresholds":
        t = cls(**SCOPE_DEFAULTS.get(scope, {}))
        for k, v in (overrides or {}).items():
            if v is None:
                continue
            if k not in {f.name for f in fields(cls)}:
                raise VerifyInputError(f"unknown threshold {k!r}; known: {', '.join(f.name for f in fields(cls))}")
            setattr(t, k, type(getattr(t, k))(v))
        return t


# Per quantization scope (see the calibration table in the module docstring). "experts" = the dataclass
# defaults. "all" also quantizes attention, whose error moves the router input: on the tiny random model
# (8 experts, no routing margin) that flips routes, so activation thresholds are looser; "none" is exact.
SCOPE_DEFAULTS = {
    "experts": {},
    "all": {"max_layer_error": 0.5, "min_cosine": 0.75, "max_kl": 0.3, "min_top1": 0.30, "min_top5": 0.45},
    "none": {"max_weight_error": 0.0, "max_layer_error": 1e-6, "min_cosine": 0.999999, "max_kl": 1e-6,
             "min_top1": 1.0, "min_top5": 1.0},
}


@dataclass
class Failure:
    check: str  # integrity | weights | layer | cosine | logits | generation
    message: str
    layer: Optional[int] = None
    tensor: Optional[str] = None
    shard: Optional[str] = None
    field: Optional[str] = None
    value: Optional[float] = None
    threshold: Optional[float] = None


@dataclass
class VerifyResult:
    passed: bool
    report: dict
    failures: list = field(default_factory=list)

    @property
    def failing_layer(self) -> Optional[int]:
        return self.report.get("failing_layer")

    def __bool__(self) -> bool:
        return self.passed


# ---------------------------------------------------------------------------------------------------
# Inputs


def _artifact(path) -> tuple[Path, dict]:
    p = Path(path).expanduser()
    if not p.exists():
        raise VerifyInputError(f"{p}: no such directory")
    if not p.is_dir():
        raise VerifyInputError(f"{p}: not a directory (give the output folder of `porter convert`)")
    if not manifest_mod.is_artifact(p):
        raise VerifyInputError(f"{p}: not a porter artifact (no porter.json); run `porter convert` first")
    try:
        return p, manifest_mod.read(p)
    except ValueError as e:
        raise VerifyInputError(str(e)) from None


def _reference_path(man: dict, reference) -> Path:
    if reference is None:
        src = man.get("source", {})
        p = Path(src["path"]) if src.get("path") else None
        if p is not None and (p / "config.json").exists():
            return p
        if src.get("repo_id"):
            return _from_hub(src["repo_id"], src.get("commit"))
        raise VerifyInputError(f"reference checkpoint {p} (from porter.json) not found; pass --reference DIR|REPO_ID")
    p = Path(str(reference)).expanduser()
    if p.exists():
        if manifest_mod.is_artifact(p):
            raise VerifyInputError(f"{p}: --reference is a porter artifact; give the original bf16 checkpoint")
        if not (p / "config.json").exists():
            raise VerifyInputError(f"{p}: --reference has no config.json; not a MiniMax-M3 checkpoint dir")
        return p
    if str(reference).count("/") == 1 and not str(reference).startswith((".", "/", "~")):
        return _from_hub(str(reference), None)
    raise VerifyInputError(f"{reference}: --reference not found (no such directory, not a repo id)")


def _from_hub(repo_id: str, commit: Optional[str]) -> Path:
    from porter import hub
    from porter.source import SourceError
    try:
        return hub.download(repo_id, commit)[0]
    except SourceError as e:
        raise VerifyInputError(f"reference: {e}") from None


def _tokenizer(art: Path, ref: Path):
    from tokenizers import Tokenizer
    for d in (art, ref):
        if (d / "tokenizer.json").exists():
            return Tokenizer.from_file(str(d / "tokenizer.json")), d / "tokenizer.json"
    raise VerifyInputError(f"{art}: no tokenizer.json in the artifact or the reference {ref}")


# ---------------------------------------------------------------------------------------------------
# Integrity


_TORCH_DTYPES = {dtype_name(dt): name for dt, name in DTYPE_NAMES.items()}  # porter.json -> header spelling


def check_integrity(art: Path, man: dict, ref_config=None, progress: bool = False) -> list[Failure]:
    """Every check of step 1; returns the failures (empty: intact)."""
    from porter.source import SourceError
    issues: list[Failure] = []
    tensors, shards = man.get("tensors", {}), man.get("shards", {})
    by_shard: dict = {}
    for name, rec in tensors.items():
        by_shard.setdefault(rec.get("shard"), []).append(name)
    headers = {}
    total = sum(r.get("bytes", 0) for r in shards.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="sha256", disable=not progress)
    for f, rec in shards.items():
        p = art / f
        if not p.exists():
            issues.append(Failure("integrity", f"shard {f} is missing (listed in porter.json)", shard=f))
            continue
        try:
            headers[f] = read_header(p)
        except SourceError as e:
            issues.append(Failure("integrity", f"shard {f}: {e}", shard=f))
            continue
        sha = file_sha256(p)
        bar.update(rec.get("bytes", 0))
        if sha != rec.get("sha256"):
            changed = [n for n in by_shard.get(f, []) if n in headers[f]
                       and range_sha256(p, *tensor_span(p, headers[f][n])) != tensors[n].get("sha256")]
            for n in changed:
                issues.append(Failure("integrity", f"tensor {n} in shard {f}: sha256 differs from porter.json "
                                      "(the data changed after conversion)", tensor=n, shard=f))
            if not changed:
                issues.append(Failure("integrity", f"shard {f}: sha256 {sha[:12]}… differs from porter.json "
                                      f"{str(rec.get('sha256'))[:12]}… (header or padding changed)", shard=f))
    bar.close()
    # headers vs manifest
    for f, header in headers.items():
        for n in sorted(set(header) - set(by_shard.get(f, []))):
            issues.append(Failure("integrity", f"tensor {n} in shard {f} is not in porter.json", tensor=n, shard=f))
    for name, rec in tensors.items():
        f = rec.get("shard")
        if f not in headers:
            if f not in shards:
                issues.append(Failure("integrity", f"tensor {name}: shard {f} is not listed in porter.json",
                                      tensor=name, shard=f))
            continue
        info = headers[f].get(name)
        if info is None:
            issues.append(Failure("integrity", f"tensor {name} is missing from shard {f}", tensor=name, shard=f))
            continue
        want = _TORCH_DTYPES.get(rec.get("dtype"))
        if info.get("dtype") != want or list(info.get("shape", [])) != list(rec.get("shape", [])):
            issues.append(Failure("integrity", f"tensor {name} in shard {f}: header says {info.get('dtype')} "
                                  f"{info.get('shape')}, porter.json {want} {rec.get('shape')}", tensor=name, shard=f))
    issues += _check_index(art, tensors)
    issues += _check_scales(art, tensors, headers)
    issues += _check_config(art, man, ref_config)
    return issues


def _check_index(art: Path, tensors: dict) -> list[Failure]:
    p = art / "model.safetensors.index.json"
    if not p.exists():
        return [Failure("integrity", f"{p.name} is missing (an interrupted conversion?)")]
    try:
        wm = json.loads(p.read_text()).get("weight_map", {})
    except json.JSONDecodeError as e:
        return [Failure("integrity", f"{p.name}: invalid JSON ({e})")]
    out = []
    for n in sorted(set(wm) ^ set(tensors)):
        where = "index but not porter.json" if n in wm else "porter.json but not the index"
        out.append(Failure("integrity", f"tensor {n} is in the {where}", tensor=n, shard=wm.get(n)))
    for n in sorted(set(wm) & set(tensors)):
        if wm[n] != tensors[n].get("shard"):
            out.append(Failure("integrity", f"tensor {n}: index says shard {wm[n]}, porter.json "
                               f"{tensors[n].get('shard')}", tensor=n, shard=wm[n]))
    return out


def _where(idx: tuple, ndim: int) -> str:
    return f"expert {idx[0]}, row {idx[1]}, block {idx[2]}" if ndim == 3 else \
        ", ".join(f"{k} {v}" for k, v in zip(("row", "block"), idx[-2:]))


def _check_scales(art: Path, tensors: dict, headers: dict) -> list[Failure]:
    from safetensors import safe_open
    out = []
    handles = {}
    for w, rec in tensors.items():
        s = rec.get("scale") or (arch.scale_name(w) if arch.scale_name(w) in tensors else None)
        if not s or w.endswith("_scale"):
            continue
        f = rec.get("shard")
        srec = tensors.get(s)
        if srec is None:
            out.append(Failure("integrity", f"tensor {w}: its scale {s} is not in porter.json", tensor=w, shard=f))
            continue
        sf = srec.get("shard")
        if f not in headers or sf not in headers or w not in headers[f] or s not in headers[sf]:
            continue  # already reported
        shape, sshape = list(rec["shape"]), list(srec["shape"])
        if srec.get("dtype") != "uint8" or rec.get("dtype") != "float8_e4m3fn" or \
                sshape != shape[:-1] + [shape[-1] // mxfp8.BLOCK] or shape[-1] % mxfp8.BLOCK:
            out.append(Failure("integrity", f"tensor {s} in shard {sf}: {srec.get('dtype')} {sshape} does not fit "
                               f"MXFP8 values {rec.get('dtype')} {shape} (want uint8 [..., K/32])", tensor=s, shard=sf))
            continue
        for file in (f, sf):
            if file not in handles:
                handles[file] = safe_open(str(art / file), framework="pt")
        scale = handles[sf].get_tensor(s)
        bad = (scale == 255).nonzero()
        if len(bad):
            out.append(Failure("integrity", f"tensor {s} in shard {sf}: {len(bad)} scale byte(s) 255 (E8M0 NaN), "
                               f"first at {_where(tuple(bad[0].tolist()), scale.ndim)}", tensor=s, shard=sf))
            continue
        zero = scale == 0
        if bool(zero.any()):
            vals = handles[f].get_tensor(w).view(torch.uint8).reshape(*scale.shape, mxfp8.BLOCK)
            nonzero = (vals & 0x7F).amax(-1) > 0  # e4m3 magnitude bits (sign-only -0.0 counts as zero)
            bad = (zero & nonzero).nonzero()
            if len(bad):
                first = tuple(bad[0].tolist())
                out.append(Failure("integrity", f"tensor {s} in shard {sf}: {len(bad)} block(s) with scale byte 0 "
                                   f"(2^-127) but non-zero values, first at {_where(first, scale.ndim)} — a zeroed "
                                   f"scale (only all-zero blocks get byte 0)", tensor=s, shard=sf))
    return out


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _check_config(art: Path, man: dict, ref_config) -> list[Failure]:
    from converters.minimax_m3 import ConfigError
    out = []
    want = man.get("resolved_config", {})
    try:
        cfg = arch.resolve_config(json.loads((art / "config.json").read_text()))
    except FileNotFoundError:
        return [Failure("integrity", "config.json is missing from the artifact")]
    except (json.JSONDecodeError, ConfigError) as e:
        return [Failure("integrity", f"config.json: {e}")]
    have = json.loads(json.dumps(cfg.to_dict()))
    for k in sorted(set(have) | set(want)):
        if not _same(have.get(k), want.get(k)):
            out.append(Failure("integrity", f"config.json resolves {k} = {have.get(k)!r} but porter.json "
                               f"resolved_config says {want.get(k)!r}", field=k))
    sw = man.get("swiglu", {})
    for k in ("alpha", "beta", "limit"):
        if not _same(sw.get(k), want.get(f"swiglu_{k}")):
            out.append(Failure("integrity", f"porter.json swiglu.{k} = {sw.get(k)!r} but resolved_config "
                               f"swiglu_{k} = {want.get(f'swiglu_{k}')!r}", field=f"swiglu_{k}"))
    qc = json.loads((art / "config.json").read_text()).get("quantization_config") or {}
    scope = man.get("options", {}).get("quantize")
    if scope and qc.get("scope") not in (None, scope):
        out.append(Failure("integrity", f"config.json quantization_config.scope = {qc.get('scope')!r} but "
                           f"porter.json options.quantize = {scope!r}", field="quantization_config.scope"))
    if ref_config is not None:
        ref = json.loads(json.dumps(ref_config.to_dict()))
        for k in sorted(set(ref) | set(want)):
            if _same(ref.get(k), want.get(k)):
                continue
            if k in STRUCTURAL:
                raise VerifyInputError(f"the reference is not the source of this artifact: {k} is "
                                       f"{ref.get(k)!r} there, {want.get(k)!r} in porter.json")
            out.append(Failure("integrity", f"the reference resolves {k} = {ref.get(k)!r} but the artifact "
                               f"(porter.json) says {want.get(k)!r}", field=k))
    return out


# ---------------------------------------------------------------------------------------------------
# Numerics


class _Acc:
    """Running sums for cosine / relative error over many tensors (float64)."""

    def __init__(self):
        self.dot = self.aa = self.bb = self.dd = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:  # a: converted, b: reference
        a, b = a.double().flatten(), b.double().flatten()
        self.dot += float(a @ b)
        self.aa += float(a @ a)
        self.bb += float(b @ b)
        self.dd += float((a - b) @ (a - b))

    @property
    def cosine(self) -> float:
        den = math.sqrt(self.aa * self.bb)
        return self.dot / den if den > 0 else (1.0 if self.dd == 0 else 0.0)

    @property
    def rel(self) -> float:
        return math.sqrt(self.dd / self.bb) if self.bb > 0 else (0.0 if self.dd == 0 else math.inf)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| for weights (fp32 elementwise, the norms accumulate in fp32 over <= one expert)."""
    b = b.float()
    num, den = float(torch.linalg.vector_norm(a.float() - b)), float(torch.linalg.vector_norm(b))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _ref_pieces(store, name: str):
    """The reference tensor `name` as (expert, piece): one expert at a time for stacked experts."""
    if arch.is_stacked_experts(name):
        yield from store.experts(name)
    else:
        yield None, store.get(name)


def weight_errors(conv_store, ref_store, names: list, tensors: dict, device=None) -> list[dict]:
    """One row per (tensor, expert): rel error of the artifact weight (dequantized) vs the reference.
    Computed one expert at a time on `device` (the verify device)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    ref_names, conv_names = ref_store.names(), conv_store.names()
    rows = []
    for name in names:
        shard = tensors.get(name, {}).get("shard")
        src = getattr(ref_store, "source", None)
        if name not in ref_names and src is not None and name in src.meta:  # carried (vision) tensor
            same = torch.equal(conv_store.get(name), src.read(name))
            rows.append({"tensor": name, "expert": None, "shard": shard, "error": 0.0 if same else 1.0,
                         "quantized": False, "note": None if same else "carried tensor differs from the source"})
            continue
        if name not in ref_names:
            rows.append({"tensor": name, "expert": None, "shard": shard, "error": math.inf, "quantized": False,
                         "note": "not in the reference"})
            continue
        s_name = arch.scale_name(name)
        q = conv_store.get(name)
        scale = conv_store.get(s_name) if s_name in conv_names else None
        for e, ref in _ref_pieces(ref_store, name):
            qe, ref = (q if e is None else q[e]).to(dev), ref.to(dev)
            if tuple(qe.shape) != tuple(ref.shape):
                rows.append({"tensor": name, "expert": e, "shard": shard, "error": math.inf, "quantized": False,
                             "note": f"shape {tuple(qe.shape)} vs reference {tuple(ref.shape)}"})
                continue
            if scale is not None:
                deq = mxfp8.dequantize(qe, (scale if e is None else scale[e]).to(dev), torch.float32)
                err = _rel(deq, ref)
            else:
                err = 0.0 if torch.equal(qe, ref) else max(_rel(qe, ref), 1e-30)
            rows.append({"tensor": name, "expert": e, "shard": shard, "error": err, "quantized": scale is not None})
    return rows


def _layer_names(names, layer: Optional[int]) -> list:
    return sorted(n for n in names if not n.endswith("_scale") and arch.layer_of(n) == layer)


def _memory_available(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def model_bytes(man: dict, ref_store) -> tuple[int, int]:
    """(artifact bytes, reference bytes) from porter.json / the reference's safetensors headers."""
    conv = sum(int(r.get("bytes", 0)) for r in man.get("shards", {}).values())
    return conv, ref_store.source.total_bytes


def decide_streaming(streaming, device: torch.device, need: int) -> tuple[bool, str]:
    avail = _memory_available(device)
    if streaming in (True, "on", "yes", "stream"):
        return True, "requested"
    if streaming in (False, "off", "no", "full"):
        return False, "requested off"
    if streaming != "auto":
        raise VerifyInputError(f"streaming must be auto, True or False, not {streaming!r}")
    gb = lambda b: f"{b / 1e9:.2f} GB"
    if need > STREAM_FRACTION * avail:
        return True, f"auto: both models need ~{gb(need)}, {gb(avail)} available on {device}"
    return False, f"auto: both models need ~{gb(need)}, {gb(avail)} available on {device}"


def _generate(model, ids: torch.Tensor, n: int, eos) -> list:
    """Greedy continuation of ids [1, T] (new token ids). With layer streaming (model.layers lazy) every
    decoding step streams the layers again; releasing a layer also unmaps its shards."""
    return model.generate(ids, max_new_tokens=n, eos_token_id=eos)[0, ids.shape[1]:].tolist()


def _kl_top(lr: torch.Tensor, lc: torch.Tensor) -> dict:
    """lr, lc [T, V] fp32 -> sums over positions."""
    lpr, lpc = torch.log_softmax(lr.double(), -1), torch.log_softmax(lc.double(), -1)
    kl = (lpr.exp() * (lpr - lpc)).sum(-1)  # [T]
    top1 = (lr.argmax(-1) == lc.argmax(-1)).double()
    k = min(5, lr.shape[-1])
    t5r, t5c = lr.topk(k, -1).indices, lc.topk(k, -1).indices
    overlap = (t5r[:, :, None] == t5c[:, None, :]).any(-1).double().sum(-1) / k
    return {"kl": float(kl.sum()), "top1": float(top1.sum()), "top5": float(overlap.sum()),
            "max_abs": float((lr.double() - lc.double()).abs().max()), "n": lr.shape[0]}


def _layer_kind(cfg, i: int) -> str:
    return f"{'sparse' if cfg.is_sparse_attention(i) else 'full'}/{'moe' if cfg.is_moe(i) else 'dense'}"


def verify(artifact, prompts=None, reference=None, backend: str = "auto", device="cpu",
           max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, report=None, plot=None, thresholds=None,
           streaming="auto", dtype: Optional[torch.dtype] = None, progress: bool = False) -> VerifyResult:
    """Verify a porter artifact against its reference checkpoint; mirrors `porter verify`.

    prompts: list of strings (default: DEFAULT_PROMPT). reference: dir or repo id (default: porter.json's
    source). thresholds: Thresholds or {name: value} overrides. streaming: "auto" | True | False.
    report: write the JSON report there; plot: write the per-layer picture (.svg, or .png with matplotlib).
    Raises VerifyInputError (and runtime LoadError / BackendUnavailable) for bad input; returns the result
    (result.passed) otherwise.
    """
    import runtime
    from runtime.loader import open_store

    t0 = time.time()
    art, man = _artifact(artifact)
    scope = man.get("options", {}).get("quantize", "experts")
    th = thresholds if isinstance(thresholds, Thresholds) else Thresholds.build(thresholds, scope)
    ref_path = _reference_path(man, reference)
    prompts = list(prompts) if prompts else [DEFAULT_PROMPT]
    if plot is not None and str(plot).lower().endswith(".png"):
        from porter.plot import png_available
        if not png_available():
            raise VerifyInputError(f"{plot}: PNG needs matplotlib (not installed); use an .svg path")
    try:
        ref_store = open_store(ref_path)
    except Exception as e:  # noqa: BLE001 — any failure to open the reference is an input problem
        raise VerifyInputError(f"reference {ref_path}: {e}") from None
    if not hasattr(ref_store, "source"):
        raise VerifyInputError(f"{ref_path}: the reference must be the original checkpoint, not an artifact")
    device = torch.device(device)
    tok, tok_path = _tokenizer(art, ref_path)
    rep: dict = {"artifact": str(art.resolve()), "reference": str(ref_path), "tokenizer": str(tok_path),
                 "porter_version": man.get("porter_version"), "backend": backend, "device": str(device),
                 "thresholds": asdict(th), "prompts": prompts, "max_new_tokens": max_new_tokens, "scope": scope,
                 "scale_rounding": man.get("options", {}).get("scale_rounding")}
    failures: list[Failure] = []

    log.info("verify: integrity of %s", art)
    issues = check_integrity(art, man, ref_store.config, progress=progress)
    rep["integrity"] = {"passed": not issues, "shards": len(man.get("shards", {})),
                        "tensors": len(man.get("tensors", {})), "issues": [asdict(i) for i in issues]}
    if issues:
        failures += issues
        return _finish(rep, failures, None, report, plot, t0)

    # ---- numerics
    conv_bytes, ref_bytes = model_bytes(man, ref_store)
    stream, why = decide_streaming(streaming, device, conv_bytes + ref_bytes)
    rep["streaming"] = {"enabled": stream, "reason": why, "artifact_bytes": conv_bytes, "reference_bytes": ref_bytes}
    log.info("verify: %s mode (%s)", "layer-streaming" if stream else "full-load", why)
    # runtime.load on the opened stores: verify keeps them for the weight comparison
    ref = runtime.load(ref_store, device=device, dtype=dtype, backend="auto", lazy=stream)
    conv_store = open_store(art)
    conv = runtime.load(conv_store, device=device, dtype=dtype, backend=backend, lazy=stream)
    rep["dtype"] = dtype_name(conv.dtype)
    cfg = conv.cfg
    ids = []
    for p in prompts:
        enc = tok.encode(p).ids
        if not enc:
            raise VerifyInputError(f"prompt {p!r} tokenizes to nothing")
        ids.append(torch.tensor([enc], dtype=torch.long))
    rep["prompt_tokens"] = [int(x.shape[1]) for x in ids]

    top_rows = weight_errors(conv_store, ref_store, _layer_names(conv_store.names(), None), man["tensors"], device)
    layers = []
    with torch.inference_mode():
        h_ref = [ref.embed(x) for x in ids]
        h_conv = [conv.embed(x) for x in ids]
        emb = _Acc()
        for a, b in zip(h_conv, h_ref):
            emb.add(a, b)
        rep["embeddings"] = {"cosine": emb.cosine, "rel_error": emb.rel}
        for i in tqdm(range(cfg.num_hidden_layers), desc="verify layers", disable=not progress):
            lr, lc = ref.layers[i], conv.layers[i]
            e2e, local = _Acc(), _Acc()
            for k, x in enumerate(ids):
                pos = torch.arange(x.shape[1], device=device)
                r = lr(h_ref[k], pos)
                c = lc(h_conv[k], pos)
                loc = lc(h_ref[k], pos)
                e2e.add(c, r)
                local.add(loc - h_ref[k], r - h_ref[k])
                h_ref[k], h_conv[k] = r, c
            del lr, lc
            wrows = weight_errors(conv_store, ref_store, _layer_names(conv_store.names(), i), man["tensors"], device)
            # streaming: the next layer access releases this one, which also unmaps what it touched
            worst = max(wrows, key=lambda w: w["error"]) if wrows else None
            layers.append({"layer": i, "kind": _layer_kind(cfg, i), "cosine": e2e.cosine, "rel_error": e2e.rel,
                           "layer_error": local.rel, "weight_error": worst["error"] if worst else 0.0,
                           "worst_tensor": _tensor_label(worst) if worst else None,
                           "worst_shard": worst["shard"] if worst else None,
                           "bad_tensors": [_tensor_label(w) for w in wrows if w["error"] > th.max_weight_error]})
        if stream:
            ref.layers.release()
            conv.layers.release()
        sums = None
        for a, b in zip(h_ref, h_conv):
            s = _kl_top(ref.final(a)[0], conv.final(b)[0])
            sums = s if sums is None else {k: (max(sums[k], s[k]) if k == "max_abs" else sums[k] + s[k]) for k in s}
        n = sums["n"]
        rep["logits"] = {"kl": sums["kl"] / n, "top1": sums["top1"] / n, "top5": sums["top5"] / n,
                         "max_abs_diff": sums["max_abs"], "positions": n}
    rep["layers"] = layers
    worst_top = max(top_rows, key=lambda w: w["error"]) if top_rows else None
    rep["top_level"] = {"weight_error": worst_top["error"] if worst_top else 0.0,
                        "worst_tensor": _tensor_label(worst_top) if worst_top else None}

    # ---- generation
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else None
    gens = []
    if max_new_tokens > 0:
        for p, x in zip(prompts, ids):
            gr = _generate(ref, x, max_new_tokens, eos)
            gc = _generate(conv, x, max_new_tokens, eos)
            div = next((j for j, (a, b) in enumerate(zip(gr, gc)) if a != b),
                       None if len(gr) == len(gc) else min(len(gr), len(gc)))
            gens.append({"prompt": p, "reference_tokens": gr, "converted_tokens": gc, "first_divergence": div,
                         "reference_text": tok.decode(gr), "converted_text": tok.decode(gc)})
        if stream:
            ref.layers.release()
            conv.layers.release()
    rep["generation"] = gens

    # ---- verdict
    failures += _judge(rep, th, worst_top, top_rows)
    return _finish(rep, failures, _failing_layer(failures), report, plot, t0)


def _tensor_label(w: dict) -> str:
    return w["tensor"] + (f"[expert {w['expert']}]" if w.get("expert") is not None else "")


def _judge(rep: dict, th: Thresholds, worst_top, top_rows) -> list[Failure]:
    out = []
    for w in top_rows:
        if w["error"] > th.max_weight_error or (not w["quantized"] and w["error"] > 0):
            out.append(Failure("weights", f"tensor {_tensor_label(w)} (shard {w['shard']}): weight error "
                               f"{w['error']:.4g} vs the reference > {th.max_weight_error}", tensor=w["tensor"],
                               shard=w["shard"], value=w["error"], threshold=th.max_weight_error))
    for row in rep["layers"]:
        i = row["layer"]
        if row["weight_error"] > th.max_weight_error:
            out.append(Failure("weights", f"layer {i}: tensor {row['worst_tensor']} (shard {row['worst_shard']}) "
                               f"differs from the reference: weight error {row['weight_error']:.4g} > "
                               f"{th.max_weight_error}" + (f" ({len(row['bad_tensors'])} tensor/expert(s) over)"
                                                           if len(row["bad_tensors"]) > 1 else ""),
                               layer=i, tensor=row["worst_tensor"], shard=row["worst_shard"],
                               value=row["weight_error"], threshold=th.max_weight_error))
        if row["layer_error"] > th.max_layer_error:
            out.append(Failure("layer", f"layer {i} ({row['kind']}): output error of the layer alone "
                               f"{row['layer_error']:.4g} > {th.max_layer_error}", layer=i,
                               value=row["layer_error"], threshold=th.max_layer_error))
        if row["cosine"] < th.min_cosine:
            out.append(Failure("cosine", f"layer {i} ({row['kind']}): residual-stream cosine {row['cosine']:.6f} "
                               f"< {th.min_cosine}", layer=i, value=row["cosine"], threshold=th.min_cosine))
    lg = rep["logits"]
    for key, bad, thr, what in (("kl", lg["kl"] > th.max_kl, th.max_kl, "KL(ref||conv)"),
                                ("top1", lg["top1"] < th.min_top1, th.min_top1, "top-1 agreement"),
                                ("top5", lg["top5"] < th.min_top5, th.min_top5, "top-5 overlap")):
        if bad:
            out.append(Failure("logits", f"final logits: {what} {lg[key]:.4g} crosses {thr}", value=lg[key],
                               threshold=thr))
    for g in rep["generation"]:
        d = g["first_divergence"]
        if th.min_matching_tokens and d is not None and d < th.min_matching_tokens:
            out.append(Failure("generation", f"greedy generation diverges at token {d} < {th.min_matching_tokens}",
                               value=d, threshold=th.min_matching_tokens))
    return out


def _failing_layer(failures: list[Failure]) -> Optional[int]:
    layers = [f.layer for f in failures if f.layer is not None]
    return min(layers) if layers else None


def _finish(rep: dict, failures: list[Failure], failing_layer, report, plot, t0) -> VerifyResult:
    passed = not failures
    rep["verdict"] = "pass" if passed else "fail"
    rep["passed"] = passed
    rep["failing_layer"] = failing_layer
    first = ([f for f in failures if f.layer == failing_layer] or failures)[:1] if failures else []
    rep["summary"] = first[0].message if first else "faithful: every check within its threshold"
    rep["failures"] = [asdict(f) for f in failures]
    rep["seconds"] = round(time.time() - t0, 3)
    if report is not None:
        Path(report).write_text(json.dumps(_jsonable(rep), indent=1))
        log.info("verify: JSON report written to %s", report)
    if plot is not None and rep.get("layers"):
        from porter.plot import write_plot
        write_plot(rep, plot)
        log.info("verify: per-layer plot written to %s", plot)
    return VerifyResult(passed, rep, failures)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------------------
# Terminal output and the CLI


def format_table(rep: dict) -> str:
    lines = [f"porter verify {rep['artifact']}", f"  reference {rep['reference']}"]
    integ = rep.get("integrity", {})
    if integ.get("passed"):
        lines.append(f"integrity: ok ({integ['shards']} shard sha256, {integ['tensors']} tensors, scales, config)")
    else:
        lines.append(f"integrity: FAILED ({len(integ.get('issues', []))} issue(s))")
        for i in integ.get("issues", [])[:20]:
            lines.append(f"  - {i['message']}")
    if rep.get("layers"):
        st = rep.get("streaming", {})
        lines.append(f"numerics: backend {rep['backend']}, {rep['device']} {rep.get('dtype')}, "
                     f"{'layer-streaming' if st.get('enabled') else 'full load'}, "
                     f"{sum(rep['prompt_tokens'])} prompt token(s) in {len(rep['prompt_tokens'])} prompt(s)")
        th = rep["thresholds"]
        head = f"{'layer':>5}  {'type':<12} {'cosine':>10} {'rel.err':>9} {'layer.err':>10} {'weight.err':>10}  status"
        lines += [head, f"{'':>5}  {'':<12} {'>=' + str(th['min_cosine']):>10} {'':>9} "
                        f"{'<=' + str(th['max_layer_error']):>10} {'<=' + str(th['max_weight_error']):>10}"]
        bad = {f["layer"] for f in rep["failures"] if f.get("layer") is not None}
        for r in rep["layers"]:
            mark = "FAIL" if r["layer"] in bad else "ok"
            if r["layer"] == rep.get("failing_layer"):
                mark += "  <- first failing layer"
            lines.append(f"{r['layer']:>5}  {r['kind']:<12} {r['cosine']:>10.6f} {r['rel_error']:>9.4f} "
                         f"{r['layer_error']:>10.4f} {r['weight_error']:>10.4f}  {mark}")
        lg = rep["logits"]
        lines.append(f"logits ({lg['positions']} positions): KL(ref||conv) {lg['kl']:.3g}  top-1 {lg['top1']:.1%}  "
                     f"top-5 {lg['top5']:.1%}  max|diff| {lg['max_abs_diff']:.3g}")
        for g in rep.get("generation", []):
            d = g["first_divergence"]
            lines.append(f"generation ({len(g['reference_tokens'])} tokens): "
                         + ("identical" if d is None else f"first divergence at token {d}"))
            lines.append(f"  reference: {g['reference_text']!r}")
            lines.append(f"  converted: {g['converted_text']!r}")
    verdict = "PASS" if rep["passed"] else "FAIL"
    lines.append(f"verdict: {verdict} — {rep['summary']}")
    return "\n".join(lines)


def _threshold_help(name: str) -> str:
    per = ", ".join(f"{Thresholds.build(None, sc).__dict__[name]:g} ({sc})" for sc in SCOPE_DEFAULTS)
    return f"Default by the artifact's quantize scope: {per}."


@click.command("verify")
@click.argument("artifact", type=click.Path())
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable). Default: a built-in prompt.")
@click.option("--reference", default=None, help="Original checkpoint (dir or repo id). Default: porter.json's source.")
@click.option("--backend", default="auto", show_default=True,
              type=click.Choice(["auto", "torch", "triton", "flashinfer-trtllm"]), help="MoE backend of the artifact.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:1, ...")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="Compute dtype (auto: float32 on CPU, bfloat16 on CUDA).")
@click.option("--max-new-tokens", default=DEFAULT_MAX_NEW_TOKENS, show_default=True, type=click.IntRange(0),
              help="Greedy tokens generated by both models.")
@click.option("--report", type=click.Path(dir_okay=False), default=None, help="Write the JSON report here.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Write the per-layer picture here (.svg; .png needs matplotlib).")
@click.option("--stream/--no-stream", "stream", default=None,
              help="Force layer streaming on/off (default: on when both models would not fit in memory).")
@click.option("--max-weight-error", type=float, default=None, help=_threshold_help("max_weight_error"))
@click.option("--max-layer-error", type=float, default=None, help=_threshold_help("max_layer_error"))
@click.option("--min-cosine", type=float, default=None, help=_threshold_help("min_cosine"))
@click.option("--max-kl", type=float, default=None, help=_threshold_help("max_kl"))
@click.option("--min-top1", type=float, default=None, help=_threshold_help("min_top1"))
@click.option("--min-top5", type=float, default=None, help=_threshold_help("min_top5"))
@click.option("--min-matching-tokens", type=int, default=None, help="Default 0 (generation is reported only).")
@click.pass_context
def verify_command(ctx, artifact, prompts, reference, backend, device, dtype, max_new_tokens, report, plot, stream,
                   **threshold_flags):
    """Check a porter artifact against its original checkpoint: integrity, per-layer numerics, logits,
    generation. Exit 0 pass, 1 fail (not faithful), 2 bad input."""
    from porter.cli import _run
    obj = ctx.obj or {}
    ctx.obj = obj
    obj.setdefault("verbose", 0)
    torch_dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    result = _run(ctx, lambda: verify(
        artifact, prompts=list(prompts) or None, reference=reference, backend=backend, device=device,
        max_new_tokens=max_new_tokens, report=report, plot=plot, thresholds=threshold_flags,
        streaming="auto" if stream is None else stream, dtype=torch_dtype, progress=not obj.get("quiet")))
    click.echo(format_table(result.report))
    ctx.exit(0 if result.passed else 1)
