"""What `porter verify` is given: the artifact, its reference checkpoint, the tokenizer and the prompts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from porter.errors import PorterError, VerifyInputError
from porter.format import journal, prequantized
from porter.format import manifest as manifest_mod
from porter.format.safe_files import inside
from porter.source.hub import snapshot_commit

DEFAULT_PROMPT = (
    "The quick brown fox jumps over the lazy dog. MiniMax-M3 is a mixture of experts language "
    "model: each token is routed to a few experts, and a shared expert sees every token."
)


def open_artifact(path) -> tuple[Path, dict]:
    p = Path(path).expanduser()
    if not p.exists():
        raise VerifyInputError(f"{p}: no such directory")
    if not p.is_dir():
        raise VerifyInputError(f"{p}: not a directory (give the output folder of `porter convert`)")
    unfinished = journal.interrupted(p)  # the index is written last: without it, nothing to verify yet
    if unfinished is not None:
        raise VerifyInputError(str(unfinished))
    if not manifest_mod.is_artifact(p):
        raise VerifyInputError(f"{p}: not a porter artifact (no porter.json); run `porter convert` first")
    try:
        man = manifest_mod.read(p)
    except (PorterError, ValueError) as e:  # ManifestError; a manifest without the ManifestError class
        raise VerifyInputError(str(e)) from None
    for key in ("source", "options", "tensors", "shards", "resolved_config", "swiglu"):
        if not isinstance(man.get(key, {}), dict):
            raise VerifyInputError(
                f"{p / manifest_mod.MANIFEST}: {key!r} must be a JSON object; reconvert or restore this file"
            )
    _check_shard_names(p, man)
    return p, man


def _check_shard_names(art: Path, man: dict) -> None:
    """Every shard porter.json names is a file of the artifact folder (verify opens them by these names) and
    every record is an object: a hand-edited manifest can neither crash verify nor point it outside."""
    where = art / manifest_mod.MANIFEST
    for f, rec in man.get("shards", {}).items():
        inside(art, f, VerifyInputError, manifest_mod.MANIFEST)
        if not isinstance(rec, dict) or type(rec.get("bytes", 0)) is not int:
            raise VerifyInputError(f"{where}: shards[{f!r}] is not a record with integer bytes; reconvert")
    for name, rec in man.get("tensors", {}).items():
        if not isinstance(rec, dict):
            raise VerifyInputError(f"{where}: tensors[{name!r}] is not a record; reconvert or restore it")
        if "shard" in rec:
            inside(art, rec["shard"], VerifyInputError, manifest_mod.MANIFEST)


def reference_path(man: dict, reference, token: Optional[str] = None, cache_dir=None) -> Path:
    """--reference (dir or repo id), else the source recorded in porter.json (path, then repo id + commit).
    token / cache_dir: for a repo id (--token, --cache-dir)."""
    if reference is None:
        src = man.get("source", {})
        p = Path(src["path"]) if src.get("path") else None
        if p is not None and (p / "config.json").exists():
            return p
        if src.get("repo_id"):
            return _from_hub(src["repo_id"], src.get("commit"), token, cache_dir)
        raise VerifyInputError(
            f"reference checkpoint {p} (from porter.json) not found; pass --reference DIR|REPO_ID"
        )
    p = Path(str(reference)).expanduser()
    if p.exists():
        if manifest_mod.is_artifact(p) and _layout(p) != "hf":  # an hf-layout artifact is an MXFP8 checkpoint
            raise VerifyInputError(
                f"{p}: --reference is a porter artifact (porter layout); give the checkpoint it "
                "was converted from"
            )
        if not (p / "config.json").exists():
            raise VerifyInputError(f"{p}: --reference has no config.json; not a checkpoint dir")
        return p
    if str(reference).count("/") == 1 and not str(reference).startswith((".", "/", "~")):
        return _from_hub(str(reference), None, token, cache_dir)
    raise VerifyInputError(f"{reference}: --reference not found (no such directory, not a repo id)")


def _layout(p: Path) -> Optional[str]:
    try:
        return manifest_mod.read_options(manifest_mod.read(p)).layout
    except (PorterError, ValueError):
        return None


def source_quantization(
    man: dict, raw: dict, ref_path: Path
) -> tuple[Optional[prequantized.Scheme], Optional[str]]:
    """(scheme, keep_scales): how to read the reference — its quantization (porter.format.prequantized, from
    its config.json), which must be the one porter.json records the artifact was converted from
    (options.source_quantization, absent for a bf16 source); keep_scales: which MXFP8 scale bytes were
    kept (the recorded scale_bytes "kept-rows" or "kept": porter.commands.verify.mapping.SourceShards), or
    None."""
    try:
        scheme = prequantized.detect(raw, ref_path / "config.json")
    except PorterError as e:
        raise VerifyInputError(f"reference {e}") from None
    rec = manifest_mod.read_options(man).source_quantization
    found = None if scheme is None else scheme.record()
    what = lambda r: (
        "an unquantized checkpoint"
        if r is None
        else f"a pre-quantized {r.get('method')} checkpoint (block {r.get('weight_block_size')})"
    )
    if (rec is None) != (found is None) or (
        rec is not None and any(rec.get(k) != found[k] for k in ("method", "weight_block_size"))
    ):
        raise VerifyInputError(
            f"reference {ref_path}: {what(found)}, but porter.json options.source_quantization "
            f"says the artifact was converted from {what(rec)}; pass that checkpoint with "
            "--reference"
        )
    if rec is not None and (
        rec.get("dequantized_dtype") != found["dequantized_dtype"]
        or rec.get("scale_bytes") not in (prequantized.KEPT_ROWS, "kept", "rederived")
    ):
        raise VerifyInputError(
            f"porter.json options.source_quantization {rec} is not a rule this porter "
            f"re-derives (it reads {found}); verify with the porter that converted it"
        )
    return scheme, None if rec is None or rec["scale_bytes"] == "rederived" else rec["scale_bytes"]


def _from_hub(repo_id: str, commit: Optional[str], token=None, cache_dir=None) -> Path:
    from porter.source import hub

    try:
        return hub.download(repo_id, commit, token, cache_dir)[0]
    except PorterError as e:
        raise VerifyInputError(f"reference: {e}") from None


def tokenizer(art: Path, ref: Path):
    """(the tokenizers.Tokenizer, its path) of the artifact, else of the reference: the runtime's loader."""
    from runtime.text import TextError, load_tokenizer

    for d in (art, ref):
        try:
            tok = load_tokenizer(d)
        except TextError as e:
            raise VerifyInputError(str(e)) from None
        if tok is not None:
            return tok.backend, tok.path
    raise VerifyInputError(f"{art}: no tokenizer.json in the artifact or the reference {ref}")


def encode_prompts(tok, prompts: list[str]) -> list[torch.Tensor]:
    """Each prompt as LongTensor [1, T]."""
    ids = []
    for p in prompts:
        if not isinstance(p, str) or not _utf8(p):
            raise VerifyInputError(f"prompt {p!r} is not text (a str of valid UTF-8)")
        enc = tok.encode(p).ids
        if not enc:
            raise VerifyInputError(f"prompt {p!r} tokenizes to nothing")
        ids.append(torch.tensor([enc], dtype=torch.long))
    return ids


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")  # lone surrogates: bytes that were not UTF-8 on the command line
        return True
    except UnicodeEncodeError:
        return False


def check_output_paths(report, plot) -> None:
    """Refuse --report / --plot paths that cannot be written before any work is done."""
    for path, option in ((report, "--report"), (plot, "--plot")):
        if path is None:
            continue
        p = Path(path)
        if str(path) == "-":
            raise VerifyInputError(
                f"{option} -: this writes a file; `porter verify --report -` prints the "
                "JSON report (from Python: result.report.to_dict())"
            )
        if not p.parent.is_dir():
            raise VerifyInputError(
                f"{option} {p}: folder {p.parent} does not exist; create it or give another path"
            )
        if p.is_dir():
            raise VerifyInputError(f"{option} {p}: is a folder; give a file path")
    check_plot_path(plot)


def check_plot_path(plot) -> None:
    if plot is not None and str(plot).lower().endswith(".png"):
        from porter.commands.verify.plot import png_available

        if not png_available():
            raise VerifyInputError(f"{plot}: PNG needs matplotlib (not installed); use an .svg path")


def check_outputs_apart(report, plot, art: Path, ref: Path) -> None:
    """--report / --plot may not name a file inside the artifact or the reference checkpoint (after
    symlinks: a Hugging Face snapshot's files are links into its repo's blobs/, which count as the
    reference's): writing there would overwrite porter.json, the index or the source's config.json."""
    guarded = [("artifact", Path(art)), ("reference", Path(ref))]
    if snapshot_commit(ref) is not None:
        guarded.append(("reference", Path(ref).resolve().parent.parent / "blobs"))
    for path, option in ((report, "--report"), (plot, "--plot")):
        if path is None or str(path) == "-":
            continue
        spelled, resolved = Path(os.path.abspath(path)), Path(path).resolve()
        for what, folder in guarded:
            roots = {Path(os.path.abspath(folder)), folder.resolve()}
            if any(r == q or r in q.parents for r in roots for q in (spelled, resolved)):
                raise VerifyInputError(
                    f"{option} {path}: inside the {what} {folder}; porter verify never writes there: give a "
                    "path outside it"
                )


def check_reference_commit(man: dict, ref: Path) -> None:
    """The reference is the source commit porter.json names. A reference whose commit is known (a Hugging
    Face snapshot folder names it) and differs, or a commit porter.json names that no reference folder can
    show, would certify the artifact against another checkpoint than the one it says it came from."""
    recorded = (man.get("source") or {}).get("commit")
    if not recorded:
        return
    found = snapshot_commit(ref)
    if found is None:
        raise VerifyInputError(
            f"reference {ref}: porter.json says the artifact was converted from commit {recorded}, and this "
            "folder is not a Hugging Face snapshot that shows its commit; pass --reference REPO_ID (or that "
            "commit's snapshot folder)"
        )
    if found != recorded:
        raise VerifyInputError(
            f"reference {ref} is commit {found}, but porter.json says the artifact was converted from "
            f"commit {recorded}; verify against that commit (--reference its snapshot folder, or the repo id)"
        )
