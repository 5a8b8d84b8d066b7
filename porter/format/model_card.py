"""The source's model card (README.md) and license files, carried into the artifact.

LICENSE* files are copied byte for byte. README.md is the source's card, unchanged, with a section appended
that says what porter did (version, source and commit, quantization scope, layout) and points to
porter.json; a source without a card gets a card holding that section only. Appending keeps the card's
YAML front matter (license, tags) first, where the Hub reads it.
"""

from __future__ import annotations

from pathlib import Path

from porter.errors import OutputFolderError
from porter.format.safe_files import copy_into
from porter.format.safetensors_io import atomic_write_text
from porter.version import __version__

CARD = "README.md"
SECTION_TITLE = "## Converted to MXFP8 with porter"

SCOPES = {
    "experts": "the routed experts' weights",
    "all": "every linear weight except the embeddings, lm_head, router and norms",
    "none": "no tensor (every weight keeps its source dtype)",
}
LAYOUTS = {
    "porter": "`porter`: stacked experts, for porter's runtime (`runtime.load(DIR)`)",
    "hf": "`hf`: the vendor release's tensor names with per-expert weights, which vLLM and sglang load",
}


def is_card_file(name: str) -> bool:
    """A file kind this module writes into an artifact."""
    return name == CARD or name.startswith("LICENSE")


def license_files(src: Path) -> list[Path]:
    return sorted(p for p in src.glob("LICENSE*") if p.is_file())


def section(options, repo_id, commit, source_path) -> str:
    """The appended Markdown section. options: porter.json's options (porter.format.manifest.Options)."""
    if repo_id:
        origin = f"[`{repo_id}`](https://huggingface.co/{repo_id})"
        origin += f" at commit `{commit}`" if commit else ""
    else:
        origin = f"the local checkpoint `{Path(source_path).name}`"
    scope = options.quantize
    quantized = SCOPES.get(scope, scope)
    if scope != "none":
        quantized += (
            f" are MXFP8 (e4m3 values, one power-of-two E8M0 scale per 32 weights, {options.scale_rounding} "
            "scale rule); every other tensor is unchanged"
        )
    if options.source_quantization:
        method = options.source_quantization.get("method")
        quantized += f". The source was pre-quantized ({method}) and was dequantized first"
    return "\n".join(
        [
            SECTION_TITLE,
            "",
            f"This folder was converted from {origin} by porter {__version__}.",
            "",
            f"- quantization scope `{scope}`: {quantized}.",
            f"- layout {LAYOUTS.get(options.layout, options.layout)}.",
            "- `porter.json` records the source, every option, each tensor's quantization error and the shard "
            "digests; `porter verify DIR` checks this folder against the source.",
            "",
        ]
    )


def write(src: Path, out: Path, options, repo_id, commit) -> None:
    """README.md (the source's card + the porter section) and the source's LICENSE* files into `out`.
    options: porter.json's options (porter.format.manifest.Options)."""
    for f in license_files(src):
        copy_into(f, out / f.name, OutputFolderError)  # never through a link planted in `out`
    card = (src / CARD).read_text(encoding="utf-8") if (src / CARD).is_file() else ""
    if card and not card.endswith("\n"):
        card += "\n"
    title = "" if card else f"# {Path(repo_id or src).name} (MXFP8)\n"
    atomic_write_text(
        out / CARD,
        card
        + ("\n" if card else "")
        + title
        + ("\n" if title else "")
        + section(options, repo_id, commit, src),
    )
