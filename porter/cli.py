"""The `porter` command line: convert and verify.

Exit codes (porter/errors.py; docs/architecture.md): 0 success, 1 `verify` says "not faithful",
2 bad input (a `PorterError`: one line naming the file, tensor or field and what to do),
3 internal error (a bug: please report; `-v` shows the traceback), 130 interrupted.
"""
from __future__ import annotations

import logging
import sys
import traceback

import click

from porter.errors import EXIT_INTERNAL, PorterError
from porter.verification import verify_command

log = logging.getLogger("porter")

EXIT_INTERRUPTED = 130


def _setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose > 1 else logging.INFO)
    logging.basicConfig(level=level, format="%(levelname)s %(message)s" if verbose else "%(message)s",
                        stream=sys.stderr, force=True)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def _run(ctx, fn):
    """The CLI boundary: run `fn`, turning a `PorterError` into one line + exit 2 and anything else into
    an internal-error line + exit 3. With `-v` the traceback is printed first; the exit code is the same."""
    verbose = (ctx.obj or {}).get("verbose", 0)
    try:
        return fn()
    except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
        raise
    except KeyboardInterrupt:
        click.echo("porter: interrupted (finished shards are kept; rerun with --resume)", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except PorterError as e:
        if verbose:
            traceback.print_exc()
        click.echo(f"porter: error: {_one_line(e)}", err=True)
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 — anything that is not a PorterError is a bug in porter
        if verbose:
            traceback.print_exc()
        click.echo(f"porter: internal error: {type(e).__name__}: {_one_line(e)} "
                   "(please report; -v shows the traceback)", err=True)
        sys.exit(EXIT_INTERNAL)


@click.group()
@click.option("-v", "--verbose", count=True, help="More logging; show tracebacks on errors.")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors; no progress bars.")
@click.version_option(package_name="porter")
@click.pass_context
def main(ctx, verbose, quiet):
    """porter: MiniMax-M3 checkpoints -> MXFP8 artifacts that run fast and provably right.

    Exit codes: 0 ok, 1 not faithful (verify), 2 bad input, 3 internal error."""
    ctx.obj = {"verbose": verbose, "quiet": quiet}
    _setup_logging(verbose, quiet)


@main.command()
@click.argument("source")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False), help="Output folder.")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) for a repo id.")
@click.option("--quantize", type=click.Choice(["experts", "all", "none"]), default=None,
              help="experts: routed experts; all: every linear but embeddings, lm_head, router and norms; "
                   "none: keep bf16 (exact comparisons). Default: experts (porter layout), all (hf layout).")
@click.option("--layout", type=click.Choice(["porter", "hf"]), default="porter", show_default=True,
              help="porter: stacked experts for porter's runtime; hf: the vendor release's names and per-expert "
                   "tensors, which vLLM and sglang load (docs/serving-engines.md).")
@click.option("--gate-up", type=click.Choice(["auto", "interleaved", "uninterleaved"]), default="auto",
              show_default=True, help="Row order of a fused source gate_up_proj (auto: the config's "
                                      "gate_up_interleaved). Output is always [gate; up].")
@click.option("--scale-rounding", type=click.Choice(["rceil", "floor"]), default="rceil", show_default=True,
              help="rceil: smallest power of two that fits (never clips). floor: OCP reference rule, lossier.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Shard size cap, e.g. 5GB, 500MB.")
@click.option("--force", is_flag=True, help="Overwrite a non-empty output folder.")
@click.option("--resume", is_flag=True, help="Continue an interrupted conversion into the same folder.")
@click.option("--dry-run", is_flag=True, help="Print the plan (reads, quantized tensors, shards, memory); write nothing.")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors; no progress bar.")
@click.pass_context
def convert(ctx, source, output, revision, quantize, layout, gate_up, scale_rounding, max_shard_size, force, resume,
            dry_run, quiet):
    """Convert SOURCE (a local dir or a Hugging Face repo id) to a porter MXFP8 artifact."""
    from porter.conversion import convert as do_convert
    if quiet:
        ctx.obj["quiet"] = True
        _setup_logging(ctx.obj["verbose"], True)
    _run(ctx, lambda: do_convert(source, output, revision=revision, quantize=quantize, gate_up=gate_up,
                                 scale_rounding=scale_rounding, max_shard_size=max_shard_size, force=force,
                                 resume=resume, dry_run=dry_run, progress=not ctx.obj["quiet"], layout=layout))


@main.command("inspect")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def inspect_command(ctx, path, as_json):
    """What PATH (a porter artifact or a checkpoint folder) holds: source and commit, resolved config with
    provenance, layout, quantized and ignored modules, sizes, the ten worst tensors by relative error.
    Reads headers and JSON only."""
    import json

    from porter.inspect import inspect, render
    report = _run(ctx, lambda: inspect(path))
    click.echo(json.dumps(report, indent=1) if as_json else render(report))


main.add_command(verify_command)

if __name__ == "__main__":
    main()
