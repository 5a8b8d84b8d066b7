"""Step 1 of `porter verify`, no model run: the artifact is what porter.json says it is.

Every shard's digest against porter.json, chunks hashed on every core (a mismatch names the changed
tensor, or the header; porter.format.safetensors_io.digest_rule) — in `porter verify` each header's sha256
here and the tensors' digests on the exact pass's reads (digests.py), so the artifact is read once;
every shard header entry (dtype, shape) against porter.json and the index; scale tensors sane (uint8
[..., K/32], no byte 255 = E8M0 NaN, no byte 0 on a block with non-zero values); config.json resolved
field by field against porter.json's resolved_config; the reference's resolved config against it too.
This proves the files were not changed after conversion; it cannot prove the conversion was right
(porter.json is written by the same converter): that is the exact re-derivation's job (exact.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

import converters
from porter.commands.verify.verdict import Failure, IntegrityResult
from porter.cores import available_cores
from porter.errors import ConfigError, PorterError, VerifyInputError
from porter.format import manifest, mxfp8, prequantized
from porter.format.digest import CHUNK_HASHES
from porter.format.safe_files import read_json_object
from porter.format.safetensors_io import (
    DTYPE_NAMES,
    ST_DTYPES,
    chunk_hash_of,
    dtype_name,
    file_digests,
    parse_header,
    pread_into,
)

INDEX = "model.safetensors.index.json"
_HEADER_DTYPES = {dtype_name(dt): name for dt, name in DTYPE_NAMES.items()}  # porter.json -> header spelling


def check_integrity(
    art: Path, man: dict, ref_config=None, progress: bool = False, data: bool = True
) -> IntegrityResult:
    """data=False: every check but the tensors' digests (each header's sha256 is checked, and that its
    tensors tile the shard): `porter verify` checks those on the exact pass's reads (digests.py)."""
    chunk_bytes, chunk_hash = digest_rule(man)
    tensors, shards = man.get("tensors", {}), man.get("shards", {})
    by_shard = _by_shard(tensors)
    if data:
        headers, issues = _check_shards(art, tensors, shards, by_shard, chunk_bytes, chunk_hash, progress)
    else:
        headers, issues = _check_shard_headers(art, shards)
    issues += _check_headers(headers, tensors, shards, by_shard)
    issues += _check_index(art, tensors)
    issues += _check_scales(art, tensors, headers)
    issues += _check_config(art, man, ref_config, headers)
    return IntegrityResult(not issues, len(shards), len(tensors), issues)


def _by_shard(tensors: dict) -> dict:
    out: dict = {}
    for name, rec in tensors.items():
        out.setdefault(rec.get("shard"), []).append(name)
    return out


MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 4096, 1 << 30  # porter writes 16 MiB (safetensors_io.DIGEST_CHUNK_BYTES)


def digest_rule(man: dict) -> tuple[int, str]:
    """The digest chunk size and chunk hash porter.json records (a manifest of another format version is
    refused)."""
    v = man.get("format_version")
    if v != manifest.FORMAT_VERSION:
        raise VerifyInputError(
            f"porter.json format_version {v!r}: this porter verifies version "
            f"{manifest.FORMAT_VERSION} (chunked digests); reconvert the artifact with it"
        )
    rule = man.get("digest")
    n = rule.get("chunk_bytes") if isinstance(rule, dict) else None
    chunk_hash = chunk_hash_of(rule)
    # bounds: a 1-byte chunk would queue one hash per byte, a huge one a buffer per core of that size
    if chunk_hash is None or type(n) is not int or not MIN_CHUNK_BYTES <= n <= MAX_CHUNK_BYTES:
        names = " or ".join(f"{h}-chunked" for h in CHUNK_HASHES)
        raise VerifyInputError(
            f"porter.json digest {rule!r} is not {names} with chunk_bytes in "
            f"[{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]; restore porter.json or reconvert"
        )
    return n, chunk_hash


def _check_shards(
    art: Path, tensors: dict, shards: dict, by_shard: dict, chunk_bytes: int, chunk_hash: str, progress: bool
) -> tuple[dict, list[Failure]]:
    """Reads every header and hashes every shard, chunks on every core; returns ({shard: header}, failures)."""
    issues, headers = [], {}
    bar = tqdm(
        total=sum(r.get("bytes", 0) for r in shards.values()),
        unit="B",
        unit_scale=True,
        desc=chunk_hash,
        disable=not progress,
    )
    with ThreadPoolExecutor(available_cores(), thread_name_prefix="porter-digest") as pool:
        for f, rec in shards.items():
            got, failure = _read_shard(art, f, lambda p: file_digests(p, pool, chunk_bytes, chunk_hash))
            if failure is not None:
                issues.append(failure)
                continue
            headers[f] = got.header
            bar.update(rec.get("bytes", 0))
            if got.digest != rec.get("digest"):
                issues += _locate_change(f, got, by_shard.get(f, []), tensors, rec)
    bar.close()
    return headers, issues


def _check_shard_headers(art: Path, shards: dict) -> tuple[dict, list[Failure]]:
    """Every shard's header (validated: its tensors tile the data region to the file's end, so header and
    tensors cover every byte) and its sha256 against porter.json; returns ({shard: header}, failures)."""
    issues, headers = [], {}
    for f, rec in shards.items():
        got, failure = _read_shard(art, f, _header_and_sha256)
        if failure is not None:
            issues.append(failure)
            continue
        headers[f], head_sha = got
        if head_sha != rec.get("header_sha256"):
            issues.append(_header_changed(f, head_sha, rec))
    return headers, issues


def _header_changed(f: str, head_sha: str, rec: dict) -> Failure:
    return Failure(
        "integrity",
        f"shard {f}: header sha256 {head_sha[:12]}… differs from "
        f"porter.json {str(rec.get('header_sha256'))[:12]}… (the header changed)",
        shard=f,
    )


def changed_tensors(f: str, digests: dict, names: list, tensors: dict) -> list[Failure]:
    """One failure per tensor of shard f (names, in order) whose digest (digests: name -> hex) is not
    porter.json's (tensors: its records)."""
    return [
        Failure(
            "integrity",
            f"tensor {n} in shard {f}: digest differs from porter.json (the data changed after conversion)",
            tensor=n,
            shard=f,
        )
        for n in names
        if n in digests and n in tensors and digests[n] != tensors[n].get("digest")
    ]


def _read_shard(art: Path, f: str, read):
    """(read(path of shard f), None), or (None, the failure naming the shard: missing, malformed or
    unreadable (EIO, permissions): named, not fatal)."""
    p = art / f
    if not p.exists():
        return None, Failure("integrity", f"shard {f} is missing (listed in porter.json)", shard=f)
    try:
        return read(p), None
    except (PorterError, OSError) as e:
        return None, Failure("integrity", f"shard {f}: {e}", shard=f)


def _header_and_sha256(p: Path) -> tuple[dict, str]:
    """The shard's validated header (its tensors tile the data region to the file's end) and the sha256 of
    its header bytes."""
    start, header = parse_header(p)
    with open(p, "rb") as fh:
        return header, hashlib.sha256(fh.read(start)).hexdigest()


def _locate_change(f: str, got, names: list, tensors: dict, rec: dict) -> list[Failure]:
    out = changed_tensors(f, got.tensors, names, tensors)
    if got.header_sha256 != rec.get("header_sha256"):
        out.append(_header_changed(f, got.header_sha256, rec))
    if not out:
        out.append(
            Failure(
                "integrity",
                f"shard {f}: digest {got.digest[:12]}… differs from porter.json "
                f"{str(rec.get('digest'))[:12]}…",
                shard=f,
            )
        )
    return out


def _check_headers(headers: dict, tensors: dict, shards: dict, by_shard: dict) -> list[Failure]:
    out = []
    for f, header in headers.items():
        for n in sorted(set(header) - set(by_shard.get(f, []))):
            out.append(
                Failure("integrity", f"tensor {n} in shard {f} is not in porter.json", tensor=n, shard=f)
            )
    for name, rec in tensors.items():
        f = rec.get("shard")
        if f not in headers:
            if f not in shards:
                out.append(
                    Failure(
                        "integrity",
                        f"tensor {name}: shard {f} is not listed in porter.json",
                        tensor=name,
                        shard=f,
                    )
                )
            continue
        info = headers[f].get(name)
        if info is None:
            out.append(Failure("integrity", f"tensor {name} is missing from shard {f}", tensor=name, shard=f))
            continue
        want = _HEADER_DTYPES.get(rec.get("dtype"))
        if info.get("dtype") != want or list(info.get("shape", [])) != list(rec.get("shape", [])):
            out.append(
                Failure(
                    "integrity",
                    f"tensor {name} in shard {f}: header says {info.get('dtype')} "
                    f"{info.get('shape')}, porter.json {want} {rec.get('shape')}",
                    tensor=name,
                    shard=f,
                )
            )
    return out


def _check_index(art: Path, tensors: dict) -> list[Failure]:
    p = art / INDEX
    if not p.exists():
        return [Failure("integrity", f"{p.name} is missing (an interrupted conversion?)")]
    try:
        wm = read_json_object(p, VerifyInputError, "index").get("weight_map", {})
    except PorterError as e:
        return [Failure("integrity", str(e))]
    if not isinstance(wm, dict):
        return [Failure("integrity", f"{p.name}: weight_map is not a JSON object")]
    out = []
    for n in sorted(set(wm) ^ set(tensors)):
        where = "index but not porter.json" if n in wm else "porter.json but not the index"
        out.append(Failure("integrity", f"tensor {n} is in the {where}", tensor=n, shard=wm.get(n)))
    for n in sorted(set(wm) & set(tensors)):
        if wm[n] != tensors[n].get("shard"):
            out.append(
                Failure(
                    "integrity",
                    f"tensor {n}: index says shard {wm[n]}, porter.json {tensors[n].get('shard')}",
                    tensor=n,
                    shard=wm[n],
                )
            )
    return out


def _check_scales(art: Path, tensors: dict, headers: dict) -> list[Failure]:
    out = []
    for w, rec in tensors.items():
        s = rec.get("scale")
        if rec.get("dtype") == "float8_e4m3fn" and not s:
            out.append(
                Failure(
                    "integrity",
                    f"tensor {w}: float8 values without a scale in porter.json",
                    tensor=w,
                    shard=rec.get("shard"),
                )
            )
        if not s:
            continue
        srec, f = tensors.get(s), rec.get("shard")
        if srec is None:
            out.append(
                Failure("integrity", f"tensor {w}: its scale {s} is not in porter.json", tensor=w, shard=f)
            )
            continue
        sf = srec.get("shard")
        if f not in headers or sf not in headers or w not in headers[f] or s not in headers[sf]:
            continue  # already reported
        bad = _scale_shape_problem(rec, srec)
        if bad:
            out.append(Failure("integrity", f"tensor {s} in shard {sf}: {bad}", tensor=s, shard=sf))
            continue
        scale = _read_tensor(art / sf, headers[sf][s])
        # the values matter only beside a scale byte 0 (zeroed_scale_problem): read then only, the scales
        # being ~3% of the artifact's bytes and the values what exact bytes reads anyway
        values = _read_tensor(art / f, headers[f][w]) if bool((scale.view(torch.uint8) == 0).any()) else None
        out += _scale_bytes(values, scale, s, sf)
    return out


def _read_tensor(path: Path, info: dict) -> torch.Tensor:
    """A tensor of a shard (info: its header entry), read with the kernel's readahead off for this read: a
    scale tensor lies between values exact bytes reads later, which a readahead window (MBs on many disks)
    would read from the disk a first time here."""
    begin, end = info["data_offsets"]
    out = torch.empty(end - begin, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        start = 8 + int.from_bytes(os.pread(fd, 8, 0), "little")
        pread_into(fd, memoryview(out.numpy()), start + begin, path)
    finally:
        os.close(fd)
    return out.view(ST_DTYPES[info["dtype"]]).view(info["shape"])


def _scale_shape_problem(rec: dict, srec: dict):
    shape, sshape = list(rec["shape"]), list(srec["shape"])
    if (
        srec.get("dtype") != "uint8"
        or rec.get("dtype") != "float8_e4m3fn"
        or shape[-1] % mxfp8.BLOCK
        or sshape != shape[:-1] + [shape[-1] // mxfp8.BLOCK]
    ):
        return (
            f"{srec.get('dtype')} {sshape} does not fit MXFP8 values {rec.get('dtype')} {shape} "
            "(want uint8 [..., K/32])"
        )
    return None


def _scale_bytes(values: Optional[torch.Tensor], scale: torch.Tensor, s: str, sf: str) -> list[Failure]:
    problem = prequantized.zeroed_scale_problem(values, scale)  # the rule convert applies to a source
    if not problem:
        return []
    return [Failure("integrity", f"tensor {s} in shard {sf}: {problem}", tensor=s, shard=sf)]


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _check_config(art: Path, man: dict, ref_config, headers: dict) -> list[Failure]:
    want = man.get("resolved_config", {})
    try:
        if not os.path.lexists(art / "config.json"):
            return [Failure("integrity", "config.json is missing from the artifact")]
        raw = read_json_object(art / "config.json", VerifyInputError, "config")
        conv = converters.for_config(raw)
        if not _sizes_match_shards(conv, raw, headers):
            return _size_findings(conv, raw, want)
        resolved = conv.resolve_config(raw)
        have = json.loads(json.dumps(resolved.to_dict()))
        facts = json.loads(json.dumps(conv.manifest_facts(resolved)))
    except PorterError as e:
        return [Failure("integrity", f"config.json: {e}")]
    out = [
        Failure(
            "integrity",
            f"config.json resolves {k} = {have.get(k)!r} but porter.json resolved_config "
            f"says {want.get(k)!r}",
            field=k,
        )
        for k in sorted(set(have) | set(want))
        if not _same(have.get(k), want.get(k))
    ]
    # the architecture's records (its name, its activation) as the artifact's config.json resolves them;
    # their provenance is the source's (an hf-layout config.json spells out defaults the engines need)
    out += [
        Failure(
            "integrity",
            f"porter.json {k} = {_values(man.get(k))!r} but config.json resolves it to {_values(v)!r}",
            field=k,
        )
        for k, v in facts.items()
        if not _same(_values(man.get(k)), _values(v))
    ]
    qc, scope = raw.get("quantization_config") or {}, manifest.read_options(man).quantize
    if scope and qc.get("scope") not in (None, scope):
        out.append(
            Failure(
                "integrity",
                f"config.json quantization_config.scope = {qc.get('scope')!r} but "
                f"porter.json options.quantize = {scope!r}",
                field="quantization_config.scope",
            )
        )
    return out + (_check_reference_config(want, ref_config) if ref_config is not None else [])


def _sizes_match_shards(conv, raw: dict, headers: dict) -> bool:
    """Whether config.json's size fields match the shards (converters.check_sizes). When they do not,
    resolving it could build per-layer lists of any length (a config of 10**9 layers without its own
    lists), so it is not resolved: its sizes are compared with porter.json, and the shapes are judged by
    the header checks and the re-derivation."""
    meta = {n: (i.get("dtype"), i.get("shape", ())) for h in headers.values() for n, i in h.items()}
    try:
        converters.check_sizes(conv, raw, meta)
    except ConfigError:
        return False
    return True


def _size_findings(conv, raw: dict, want: dict) -> list[Failure]:
    return [
        Failure(
            "integrity",
            f"config.json resolves {k} = {v!r} but porter.json resolved_config says {want.get(k)!r}",
            field=k,
        )
        for k, (v, _) in sorted(conv.config_sizes(raw).items())
        if not _same(v, want.get(k))
    ]


def _values(record):
    """A porter.json record without its provenance entries (nested)."""
    if isinstance(record, dict):
        return {k: _values(v) for k, v in record.items() if k != "provenance"}
    return record


def _check_reference_config(want: dict, ref_config) -> list[Failure]:
    ref, out = json.loads(json.dumps(ref_config.to_dict())), []
    for k in sorted(set(ref) | set(want)):
        if _same(ref.get(k), want.get(k)):
            continue
        if k in getattr(ref_config, "STRUCTURAL", ()):
            raise VerifyInputError(
                f"the reference is not the source of this artifact: {k} is "
                f"{ref.get(k)!r} there, {want.get(k)!r} in porter.json"
            )
        out.append(
            Failure(
                "integrity",
                f"the reference resolves {k} = {ref.get(k)!r} but the artifact "
                f"(porter.json) says {want.get(k)!r}",
                field=k,
            )
        )
    return out
