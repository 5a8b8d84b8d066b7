"""Every option of `porter convert`, in one typed object.

`ConvertOptions` is the one place each option is named, typed, defaulted, documented and checked: the CLI's
flags are made from its fields (porter.cli_options.convert_options: `--max-shard-size` is the field
`max_shard_size`, its help is the field's), `porter.convert(...)` takes the same names as keywords, and the
journal records them so that an interrupted conversion can say the exact command that resumes it.
What the output is made with (porter.json's `options`) is `artifact_options()`, a
porter.format.manifest.Options whose defaults are the artifact's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Optional, Union

from porter.devices import DEVICE_HELP
from porter.errors import ConvertError
from porter.format import mxfp8
from porter.format.digest import CHUNK_HASHES, DEFAULT_DIGEST
from porter.format.manifest import Options

ARTIFACT_DEFAULTS = Options()
SCOPES = ("experts", "all", "none")
LAYOUTS = ("porter", "hf")
GATE_UP = ("auto", "interleaved", "uninterleaved")


def _cli(help: str, **kw) -> dict:
    """Field metadata the CLI makes its flag from: help, and `choices`, `flag` (a switch), `type`,
    `show_default`. A field without it is set another way (the Hub options, -q)."""
    return {"cli": {"help": help, **kw}}


@dataclass(frozen=True)
class ConvertOptions:
    """The options of one conversion, as given (checked and normalized by the methods below)."""

    revision: Optional[str] = field(
        default=None, metadata=_cli("Hub revision (branch, tag or commit) for a repo id.")
    )
    quantize: Optional[str] = field(
        default=None,
        metadata=_cli(
            "experts: routed experts; all: every linear but embeddings, lm_head, router and norms; "
            "none: keep bf16 (exact comparisons). Default: experts (porter layout), all (hf layout).",
            choices=SCOPES,
        ),
    )
    layout: str = field(
        default=ARTIFACT_DEFAULTS.layout,
        metadata=_cli(
            "porter: stacked experts for porter's runtime; hf: the vendor release's names and per-expert "
            "tensors, which vLLM and sglang load (docs/serving-engines.md).",
            choices=LAYOUTS,
            show_default=True,
        ),
    )
    gate_up: str = field(
        default=ARTIFACT_DEFAULTS.gate_up,
        metadata=_cli(
            "Row order of a fused source gate_up_proj (auto: the config's gate_up_interleaved). Output is "
            "always [gate; up].",
            choices=GATE_UP,
            show_default=True,
        ),
    )
    scale_rounding: str = field(
        default=ARTIFACT_DEFAULTS.scale_rounding,
        metadata=_cli(
            "rceil: smallest power of two that fits (never clips). floor: OCP reference rule, lossier.",
            choices=mxfp8.ROUNDING_MODES,
            show_default=True,
        ),
    )
    max_shard_size: Union[int, str] = field(
        default="5GB", metadata=_cli("Shard size cap, e.g. 5GB, 500MB.", show_default=True)
    )
    force: bool = field(
        default=False,
        metadata=_cli(
            "Replace an earlier porter output in the output folder (only files porter wrote; anything else "
            "is refused: docs/convert.md).",
            flag=True,
        ),
    )
    resume: bool = field(
        default=False, metadata=_cli("Continue an interrupted conversion into the same folder.", flag=True)
    )
    dry_run: bool = field(
        default=False,
        metadata=_cli("Print the plan (reads, quantized tensors, shards, memory); write nothing.", flag=True),
    )
    workers: Optional[int] = field(
        default=None,
        metadata=_cli(
            "Worker threads for read/quantize/hash/write [default: the cores available + 1].", type=int
        ),
    )
    max_memory: Union[int, str, None] = field(
        default=None,
        metadata=_cli("Memory budget, e.g. 16GB [default: this process's memory + half the available RAM]."),
    )
    device: str = field(
        default="auto",
        metadata=_cli(
            f"Where to quantize (the output is byte-identical either way): {DEVICE_HELP}.", show_default=True
        ),
    )
    digest: str = field(
        default=DEFAULT_DIGEST,
        metadata=_cli(
            "Chunk hash of the shard digests in porter.json: xxh3-128 (fast checksum, like rsync's) or "
            "sha256 (for a manifest that is signed or published apart from the shards).",
            choices=tuple(CHUNK_HASHES),
            show_default=True,
        ),
    )
    token: Optional[str] = None  # Hugging Face token (--token; never recorded anywhere)
    cache_dir: Optional[str] = None  # Hugging Face cache folder (--cache-dir)
    progress: bool = True  # progress bars (-q turns them off)

    # -- checked values
    def check(self) -> "ConvertOptions":
        """Refuses a value no flag would take (the Python API skips click's checks), naming the option."""
        for f in fields(self):
            choices = f.metadata.get("cli", {}).get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ConvertError(f"{flag(f.name)} {value!r}: give one of {', '.join(choices)}")
        self.shard_bytes()
        self.worker_count()
        if self.max_memory is not None:
            parse_size(self.max_memory, "--max-memory")
        return self

    def shard_bytes(self) -> int:
        return parse_size(self.max_shard_size, "--max-shard-size")

    def worker_count(self) -> Optional[int]:
        """--workers as given (None: the engine's default)."""
        w = self.workers
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ConvertError(f"--workers {w!r}: give a positive number of worker threads")
        return w

    def scope(self, default_scope: dict) -> str:
        """--quantize, or the converter's default scope for the layout (its DEFAULT_SCOPE)."""
        return self.quantize or default_scope.get(self.layout, ARTIFACT_DEFAULTS.quantize)

    def artifact_options(self, default_scope: dict, source_quantization: Optional[dict]) -> Options:
        """What the output is made with: porter.json's options."""
        return Options(
            quantize=self.scope(default_scope),
            gate_up=self.gate_up,
            scale_rounding=self.scale_rounding,
            max_shard_size=self.shard_bytes(),
            layout=self.layout,
            source_quantization=source_quantization,
        )

    # -- the journal: what was given, and the command that resumes it
    def record(self) -> dict:
        """The options as given, for the journal (never the token; not force/resume/dry_run/progress)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in RECORDED}

    @classmethod
    def from_record(cls, rec) -> "ConvertOptions":
        """The options a journal recorded (fields it lacks, or holds in another type, take their default)."""
        rec = rec if isinstance(rec, dict) else {}
        ok = {
            f.name: rec[f.name]
            for f in fields(cls)
            if f.name in RECORDED and f.name in rec and _json_scalar(rec[f.name])
        }
        return replace(cls(), **ok)

    def command(self, source: str, output: str, commit: Optional[str] = None) -> list:
        """argv of the `porter convert` that resumes this conversion: every recorded option that is not its
        default, in field order; a Hub source pinned to the commit it was read at."""
        argv = ["porter", "convert", str(source), "--output", str(output)]
        pinned = replace(self, revision=commit) if commit else self
        default = ConvertOptions()
        for f in fields(self):
            value = getattr(pinned, f.name)
            if f.name in RECORDED and value is not None and value != getattr(default, f.name):
                argv += [flag(f.name), str(value)]
        return argv + ["--resume"]


# what the journal keeps and a resume command repeats: how the output is made, where from, how it runs
RECORDED = (
    "revision",
    "quantize",
    "layout",
    "gate_up",
    "scale_rounding",
    "max_shard_size",
    "workers",
    "max_memory",
    "device",
    "digest",
    "cache_dir",
)


def flag(name: str) -> str:
    """The CLI flag of a ConvertOptions field (porter.cli_options.convert_options makes it the same way)."""
    return "--" + name.replace("_", "-")


def _json_scalar(v) -> bool:
    return v is None or type(v) in (str, int, bool)


def parse_size(text, option: str = "--max-shard-size") -> int:
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(text).upper())
    if not m or float(m.group(1)) <= 0:
        raise ConvertError(f"{option} {text!r}: use a size like 5GB, 500MB or a byte count")
    unit = m.group(2) or "B"
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    size = int(float(m.group(1)) * scale)
    if size < 1:
        raise ConvertError(
            f"{option} {text!r} is less than one byte: use a size like 5GB, 500MB or a byte count"
        )
    return size
