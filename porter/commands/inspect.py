"""`porter inspect DIR`: what a porter artifact or a checkpoint folder holds, without loading tensor data.

Reads config.json, porter.json (when present), the index and the safetensors headers only. Reports the
source and commit, every resolved config field with its provenance, the layout (porter, hf, vendor or
transformers checkpoint, pre-quantized scheme), which linears are quantized and which the
quantization_config lists as ignored (and whether each module is exactly one of the two), sizes by dtype,
and the ten tensors with the largest relative quantization error (from porter.json).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections import Counter
from pathlib import Path

import converters
from porter.errors import InspectError, PorterError
from porter.format import journal, mxfp4, prequantized
from porter.format import manifest as manifest_mod
from porter.format.safe_files import read_json_object
from porter.format.safetensors_io import ST_DTYPES, nbytes
from porter.source import INDEX_NAME
from porter.source.hub import snapshot_commit
from porter.source.local import read_header, weight_files

WORST = 10
FILES_SHOWN = 8  # the text report lists this many weight files (--json: all)
_SCALE = re.compile(r"(\.weight|_weight)_scale(_inv)?$")


def inspect(path) -> dict:
    """A JSON-able report of the artifact or checkpoint at `path`."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise InspectError(f"{path}: not a directory (give a porter artifact or a checkpoint folder)")
    incomplete = journal.interrupted(path)
    if not os.path.lexists(path / "config.json"):
        if incomplete:
            raise InspectError(str(incomplete))
        raise InspectError(f"{path / 'config.json'}: missing; not a checkpoint or porter artifact")
    raw = read_json_object(path / "config.json", InspectError, "config")
    man = _manifest(path) if manifest_mod.is_artifact(path) else None
    tensors = _tensor_meta(path)
    converter = _converter(raw, path)  # None: an architecture porter does not convert (headers only)
    cfg = converters.resolve(raw, tensors, str(path / "config.json"), converter)[1] if converter else None
    qc = prequantized.quantization_config_of(raw)
    quantized, unquantized = _modules(tensors)
    ignored = list((qc or {}).get("ignored_layers") or (qc or {}).get("modules_to_not_convert") or [])
    options = manifest_mod.read_options(man, str(path / manifest_mod.MANIFEST)) if man else None
    report = {
        "path": str(path.resolve()),
        "kind": f"porter output, {incomplete.state()}"
        if incomplete
        else "porter artifact"
        if man
        else "checkpoint",
        "source": _source(path, man),
        "layout": _layout(raw, man, tensors, converter) if converter else "checkpoint",
        "architecture": converter.ARCHITECTURE if converter else None,
        "model_type": raw.get("model_type"),
        "not_converted": None if converter else _not_converted(raw),
        "activation": _activation(man, converter, cfg) if converter else {},
        "quantization": {
            "quant_method": (qc or {}).get("quant_method"),
            "scope": options.quantize if options else None,
            "scale_rounding": options.scale_rounding if options else None,
            "quantized_modules": len(quantized),
            "quantized": _summarize(quantized),
            "ignored_layers": ignored,
            "modules_to_not_convert_equal": (qc or {}).get("modules_to_not_convert")
            == (qc or {}).get("ignored_layers"),
            "contract": _contract(quantized, unquantized, ignored, qc, converter),
        },
        "config": {k: {"value": v, "from": cfg.provenance.get(k)} for k, v in cfg.to_dict().items()}
        if cfg
        else {},
        "files": _files(tensors),
        "sizes": _sizes(tensors),
        "worst_tensors": _worst(man),
    }
    return report


def _converter(raw: dict, path: Path):
    """The converter of config.json's model_type, or None when porter does not convert that architecture
    (inspect still reports the files, tensors, dtypes and sizes from the headers)."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in converters.supported():
        return None
    return converters.for_config(raw, str(path / "config.json"))


def _not_converted(raw: dict) -> str:
    return (
        f"model_type {raw.get('model_type')!r} is not an architecture porter converts (porter converts: "
        f"{', '.join(converters.supported())}); files, tensors and sizes are read from the safetensors headers"
    )


def _manifest(path: Path) -> dict:
    """porter.json, with the records inspect reports checked for shape (a hand-edited file is named)."""
    man = manifest_mod.read(path)
    where = path / manifest_mod.MANIFEST
    for key in ("source", "options", "tensors"):
        if not isinstance(man.get(key, {}), dict):
            raise InspectError(f"{where}: {key!r} must be a JSON object; reconvert or restore this file")
    for name, rec in man.get("tensors", {}).items():
        err = rec.get("rel_fro_error") if isinstance(rec, dict) else None
        if not isinstance(rec, dict) or not (err is None or type(err) in (int, float)):
            raise InspectError(
                f"{where}: tensors[{name!r}] is not a record with a numeric rel_fro_error; "
                "reconvert or restore this file"
            )
    return man


def _tensor_meta(path: Path) -> dict:
    """{name: (dtype name, shape)} from the safetensors headers (no tensor data read)."""
    try:
        files = weight_files(path)
    except PorterError as e:
        raise InspectError(str(e)) from None
    out = {}
    for f in files:
        for name, info in read_header(f).items():
            out[name] = (info["dtype"], tuple(info["shape"]), f.name)
    if (path / INDEX_NAME).exists():
        listed = set(read_json_object(path / INDEX_NAME, InspectError, "index").get("weight_map", {}))
        if listed != set(out):
            missing = sorted(listed - set(out))[:1] or sorted(set(out) - listed)[:1]
            raise InspectError(f"{path / INDEX_NAME}: index and shard headers disagree (e.g. {missing[0]!r})")
    return out


def _source(path: Path, man) -> dict:
    if man:
        src = man.get("source", {})
        return {
            "repo_id": src.get("repo_id"),
            "path": src.get("path"),
            "commit": src.get("commit"),
            "porter_version": man.get("porter_version"),
            "created": man.get("created"),
            "options": manifest_mod.read_options(man).record(),
        }
    return {"repo_id": None, "path": str(path.resolve()), "commit": snapshot_commit(path)}


def _layout(raw: dict, man, tensors: dict, converter) -> str:
    if man:
        return manifest_mod.read_options(man).layout
    qc = prequantized.quantization_config_of(raw)
    kind = converter.source_layout(raw, tensors)
    if qc and qc.get("quant_method") not in (None, "none"):
        block = qc.get("weight_block_size") or (
            [1, mxfp4.BLOCK] if qc.get("quant_method") == "mxfp4" else None
        )
        return f"{kind} checkpoint, pre-quantized ({qc.get('quant_method')}, block {block})"
    return f"{kind} checkpoint"


def _modules(tensors: dict) -> tuple[list, list]:
    """(quantized module names, unquantized 2-D `.weight` module names). A module is quantized when its
    weight is F8_E4M3 with a scale beside it, or MXFP4 (`X_blocks` with `X_scales` beside it)."""
    quantized, plain = [], []
    for name, (dtype, shape, _) in tensors.items():
        if _SCALE.search(name) or (
            name.endswith("_scales") and name[: -len("_scales")] + "_blocks" in tensors
        ):
            continue
        if name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in tensors:
            quantized.append(name[: -len("_blocks")])
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        has_scale = (
            any(module + suf in tensors for suf in (".weight_scale", ".weight_scale_inv"))
            or name + "_scale" in tensors
        )
        if dtype == "F8_E4M3" and has_scale:
            quantized.append(module)
        elif name.endswith(".weight") and len(shape) == 2:
            plain.append(module)
    return quantized, plain


def _summarize(modules: list) -> dict:
    """Quantized module names with layer and expert numbers folded: {pattern: count}."""
    pat = Counter(
        re.sub(r"\.experts\.\d+\.", ".experts.{e}.", re.sub(r"\.layers\.\d+\.", ".layers.{l}.", m))
        for m in modules
    )
    return dict(sorted(pat.items()))


def _activation(man, converter, cfg) -> dict:
    """The activation and where each of its values came from: porter.json's record for an artifact, the
    converter's resolution of config.json for a checkpoint."""
    record = (man or {}).get("activation")
    if isinstance(record, dict):
        return record
    return converter.manifest_facts(cfg).get("activation") or {}


def _contract(quantized: list, plain: list, ignored: list, qc, converter) -> dict:
    """Each text-model linear must be quantized or listed, not both and not neither (both engines load
    either mistake without an error)."""
    if not qc or qc.get("quant_method") in (None, "none"):
        return {"checked": False, "why": "no quantization_config"}
    both = sorted(m for m in quantized if _listed(m, ignored))
    if converter is None:  # which modules are the text model's linears is the architecture's knowledge
        return {"checked": False, "why": "an architecture porter does not convert"}
    neither = sorted(m for m in plain if not _listed(m, ignored) and _is_text_linear(m, converter))
    return {"checked": True, "both": both, "neither": neither, "ok": not both and not neither}


def _listed(module: str, ignored: list) -> bool:
    """The module is in the list: by name, or under a listed pattern (`model.layers.*.self_attn`, as the
    MXFP4 release writes its modules_to_not_convert, covers that module's linears)."""
    return module in ignored or any(
        fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module, p + ".*") for p in ignored if "*" in p
    )


def _is_text_linear(module: str, converter) -> bool:
    """A linear of the decoder layers or the lm_head, by its canonical name (any layout's spelling)."""
    c = converter.canonical_name(module + ".weight")
    return c is not None and (c.startswith("model.layers.") or c == "lm_head.weight")


def _files(tensors: dict) -> list:
    """[{file, tensors, bytes}] of every safetensors file, in name order (from the headers)."""
    per: dict = {}
    for dtype, shape, f in tensors.values():
        rec = per.setdefault(f, {"file": f, "tensors": 0, "bytes": 0})
        rec["tensors"] += 1
        rec["bytes"] += nbytes(ST_DTYPES[dtype], shape)
    return [per[f] for f in sorted(per)]


def _sizes(tensors: dict) -> dict:
    by_dtype: Counter = Counter()
    for dtype, shape, _ in tensors.values():
        by_dtype[dtype] += nbytes(ST_DTYPES[dtype], shape)
    return {
        "tensors": len(tensors),
        "shards": len({f for *_, f in tensors.values()}),
        "bytes": sum(by_dtype.values()),
        "bytes_by_dtype": dict(sorted(by_dtype.items())),
    }


def _worst(man) -> list:
    if not man:
        return []
    rows = [
        {"tensor": n, "rel_fro_error": r["rel_fro_error"], "max_abs_error": r.get("max_abs_error")}
        for n, r in man.get("tensors", {}).items()
        if r.get("rel_fro_error") is not None
    ]
    return sorted(rows, key=lambda r: -r["rel_fro_error"])[:WORST]


def _human(n: int) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def render(rep: dict) -> str:
    """The report as terminal text."""
    src, q, sz = rep["source"], rep["quantization"], rep["sizes"]
    lines = [
        f"{rep['path']}: {rep['kind']}, layout {rep['layout']}",
        f"source: {src.get('repo_id') or src.get('path')}  commit: {src.get('commit') or 'unknown'}",
    ]
    if rep.get("not_converted"):
        lines.append(f"architecture: {rep['not_converted']}")
    if src.get("options"):
        lines.append("options: " + ", ".join(f"{k}={v}" for k, v in src["options"].items()))
    lines.append(
        f"size: {_human(sz['bytes'])} in {sz['tensors']} tensors, {sz['shards']} shard(s); "
        + ", ".join(f"{d} {_human(b)}" for d, b in sz["bytes_by_dtype"].items())
    )
    files = rep["files"]
    for f in files if len(files) <= FILES_SHOWN else files[: FILES_SHOWN - 1]:
        lines.append(f"  {f['file']}  {f['tensors']} tensors, {_human(f['bytes'])}")
    if len(files) > FILES_SHOWN:
        lines.append(f"  ... and {len(files) - FILES_SHOWN + 1} more file(s) (--json lists all)")
    lines.append(
        f"quantization: {q['quant_method'] or 'none'}"
        + (f" (scope {q['scope']})" if q["scope"] else "")
        + f"; {q['quantized_modules']} quantized modules"
    )
    for pat, n in q["quantized"].items():
        lines.append(f"  quantized {n:5d} x {pat}")
    lines.append(
        f"ignored_layers ({len(q['ignored_layers'])}): "
        + (
            ", ".join(q["ignored_layers"][:8]) + (" ..." if len(q["ignored_layers"]) > 8 else "")
            if q["ignored_layers"]
            else "none"
        )
    )
    c = q["contract"]
    if c["checked"]:
        lines.append(
            "each linear quantized xor listed: "
            + ("yes" if c["ok"] else f"NO (both: {c['both'][:3]}, neither: {c['neither'][:3]})")
        )
    act = rep.get("activation") or {}
    if act:
        values = {k: v for k, v in act.items() if k not in ("name", "formula", "provenance")}
        prov = act.get("provenance") or {}
        lines.append(f"activation: {act.get('name')}  {act.get('formula', '')}".rstrip())
        for k, v in values.items():
            lines.append(f"  {k:26s} {json.dumps(v):60s} <- {prov.get(k, '?')}")
    if rep["config"]:
        lines.append("resolved config (value  <- from):")
    for k, v in rep["config"].items():
        val = json.dumps(v["value"])
        lines.append(f"  {k:26s} {val if len(val) <= 60 else val[:57] + '...':60s} <- {v['from']}")
    if rep["worst_tensors"]:
        lines.append(f"worst {len(rep['worst_tensors'])} tensors by relative error ||W - deq(Q)|| / ||W||:")
        for r in rep["worst_tensors"]:
            lines.append(f"  {r['rel_fro_error']:.4e}  max|err| {r['max_abs_error']:.3e}  {r['tensor']}")
    else:
        lines.append("worst tensors: n/a (no porter.json with error statistics)")
    return "\n".join(lines)
