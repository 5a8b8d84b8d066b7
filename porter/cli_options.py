"""Options and console helpers shared by the porter commands: logging above progress bars, -v/-q in either
position, --device, the Hub options, and the verify thresholds as finite-float options."""

from __future__ import annotations

import logging
import sys

import click

from porter.devices import DEVICE_HELP


class _AboveBars(logging.StreamHandler):
    """Log lines go above any progress bar (tqdm.write), never glued onto its end."""

    def emit(self, record):
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 — logging must never raise
            self.handleError(record)


def setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose > 1 else logging.INFO)
    handler = _AboveBars(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s" if verbose else "%(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    if quiet:  # huggingface_hub's download bars as well as porter's
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def _close_bars() -> None:
    """Progress bars still open when a command fails are closed before its message is printed."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def echo_error(text: str) -> None:
    _close_bars()
    click.echo(text, err=True)


def _verbosity(ctx, param, value):
    """-v / -q given after a subcommand's name count the same as before it."""
    root = ctx.find_root()
    root.obj = root.obj or {"verbose": 0, "quiet": False}
    if param.name == "verbose" and value:
        root.obj["verbose"] += value
    elif param.name == "quiet" and value:
        root.obj["quiet"] = True
    else:
        return
    setup_logging(root.obj["verbose"], root.obj["quiet"])


def common_options(f):
    """Options every subcommand takes, in either position."""
    f = click.option(
        "-q",
        "--quiet",
        is_flag=True,
        expose_value=False,
        callback=_verbosity,
        help="Only warnings and errors; no progress bars.",
    )(f)
    return click.option(
        "-v",
        "--verbose",
        count=True,
        expose_value=False,
        callback=_verbosity,
        help="More logging; show tracebacks on errors.",
    )(f)


def device_option(what: str):
    return click.option("--device", default="auto", show_default=True, help=f"{what}: {DEVICE_HELP}.")


def convert_options(f):
    """One flag per field of porter.commands.convert.ConvertOptions that has CLI metadata, in field order:
    `--max-shard-size` for `max_shard_size`, its help, choices and default from the field."""
    from dataclasses import MISSING, fields

    from porter.commands.convert.options import ConvertOptions, flag

    for field in reversed([x for x in fields(ConvertOptions) if "cli" in x.metadata]):
        cli = field.metadata["cli"]
        kw = {"help": cli["help"], "default": None if field.default is MISSING else field.default}
        if cli.get("flag"):
            kw["is_flag"] = True
        if cli.get("choices"):
            kw["type"] = click.Choice(list(cli["choices"]))
        elif cli.get("type"):
            kw["type"] = cli["type"]
        if cli.get("show_default"):
            kw["show_default"] = True
        f = click.option(flag(field.name), field.name, **kw)(f)
    return f


def hub_options(f):
    """--token and --cache-dir, for every command that reads the Hugging Face Hub."""
    f = click.option(
        "--cache-dir",
        type=click.Path(file_okay=False),
        default=None,
        help="Hugging Face cache folder for repo ids [default: HF_HUB_CACHE, else HF_HOME/hub].",
    )(f)
    return click.option(
        "--token",
        default=None,
        metavar="TOKEN",
        help="Hugging Face token for gated or private repos [default: HF_TOKEN, else the "
        "stored login]. On a shared machine prefer HF_TOKEN: arguments show in `ps`.",
    )(f)


class FiniteFloat(click.ParamType):
    """A finite float in [lo, hi] (hi None: no upper bound). click.FloatRange lets nan and inf through,
    and a nan threshold compares false with everything: every check would pass."""

    name = "float"

    def __init__(self, lo: float, hi=None):
        self.lo, self.hi = lo, hi

    def convert(self, value, param, ctx):
        import math

        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(x) or x < self.lo or (self.hi is not None and x > self.hi):
            want = (
                f"a finite number >= {self.lo:g}"
                if self.hi is None
                else f"a number in [{self.lo:g}, {self.hi:g}]"
            )
            self.fail(f"{value!r} is not {want}", param, ctx)
        return x

    def __repr__(self) -> str:
        return f"FiniteFloat({self.lo}, {self.hi})"


def threshold_options(f):
    """One --max-*/--min-* flag per float threshold (thresholds.FLOAT_THRESHOLDS, in order), with its help."""
    from porter.commands.verify.thresholds import FLOAT_THRESHOLDS, THRESHOLD_RANGES, threshold_help

    for name in reversed(FLOAT_THRESHOLDS):
        f = click.option(
            "--" + name.replace("_", "-"),
            type=FiniteFloat(*THRESHOLD_RANGES[name]),
            default=None,
            help=threshold_help(name),
        )(f)
    return f


VERIFY_HELP = """Check a porter artifact against the checkpoint it came from.

    \b
    What it proves:
    1. integrity: the files are what porter.json says (chunked shard digests, headers, index, scale bytes, config);
    2. bytes: every tensor re-derived from the source (verify's own source->artifact mapping table, not the
       converter's plan) with porter.format.mxfp8 and the recorded scale rule: e4m3 and scale bytes identical,
       unquantized tensors bit-identical; mismatching 32-blocks named per tensor and expert;
    3. faithfulness with the same runtime: each layer, the embeddings and the logits of the converted model
       against the source with its weights rounded by step 2's re-derivation, on the same input: any
       difference beyond float rounding (the limit is derived, not tuned: docs/verify.md) fails.
    Quality, reported apart: what MXFP8 costs against the bf16 source (per-layer error, KL/top-1/top-5, the
    greedy continuation scored teacher-forced); it decides only against the --max-*/--min-* you set.

    \b
    What it does not prove: that porter's runtime computes the architecture correctly (both models run through
    it; that is checked by the oracle tests against transformers), nor that the source checkpoint is right.

    The table and the JSON report mark which figures decide the verdict (with their threshold) and which
    are information only: docs/verify.md, "Reading the report".

    Exit 0 faithful, 1 not faithful (the tensor, expert or layer is named) or a quality threshold you set
    crossed (the verdict line says which), 2 bad input, 3 internal error.
    """
