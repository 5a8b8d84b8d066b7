"""The `porter` command line: convert and verify.

Exit codes (porter/errors.py; docs/architecture.md): 0 success, 1 `verify` says "not faithful",
2 bad input (a `PorterError`: one line naming the file, tensor or field and what to do),
3 internal error (a bug: please report; `-v` shows the traceback), 130 interrupted.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback

import click

from porter.cli_options import (
    VERIFY_HELP,
    common_options,
    convert_options,
    device_option,
    echo_error,
    hub_options,
    setup_logging,
    threshold_options,
)
from porter.devices import resolve_device
from porter.errors import EXIT_INTERNAL, PorterError

log = logging.getLogger("porter")

EXIT_INTERRUPTED = 130


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


class _Interrupts:
    """Ctrl-C while a command runs: the first raises KeyboardInterrupt (the command stops, closing what it
    has open); any further one while it stops is ignored, so a few quick presses still end in the one line
    and exit 130, never in a traceback from the middle of the clean-up."""

    def __init__(self):
        self.seen = False
        self.previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame):
        if self.seen:
            return
        self.seen = True
        raise KeyboardInterrupt

    def ignore_more(self) -> None:
        self.seen = True

    def __exit__(self, *exc):
        # After a Ctrl-C the `porter` program keeps ignoring further presses until it has exited (exit 130);
        # called in-process (porter.cli.main from Python, tests) the caller's handler comes back.
        if self.previous is not None and not (self.seen and _is_the_porter_program()):
            signal.signal(signal.SIGINT, self.previous)


def _is_the_porter_program() -> bool:
    """This process is `porter ...` or `python -m porter.cli ...`, not a Python program calling main()."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "porter.cli" or os.path.basename(sys.argv[0] or "") == "porter"


def _run(ctx, fn, interrupted=None):
    """The CLI boundary: run `fn`, turning a `PorterError` into one line + exit 2 and anything else into
    an internal-error line + exit 3. With `-v` the traceback is printed first; the exit code is the same.
    Ctrl-C: one line (`interrupted()`: what to do next, e.g. the exact command that resumes) and exit 130."""
    verbose = (ctx.obj or {}).get("verbose", 0)
    with _Interrupts() as interrupts:
        try:
            return fn()
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            interrupts.ignore_more()
            hint = interrupted() if interrupted is not None else None
            echo_error(f"porter: interrupted: {hint}" if hint else "porter: interrupted")
            sys.exit(EXIT_INTERRUPTED)
        except PorterError as e:
            if verbose:
                traceback.print_exc()
            echo_error(f"porter: error: {_one_line(e)}")
            sys.exit(e.exit_code)
        except Exception as e:  # noqa: BLE001 — anything that is not a PorterError is a bug in porter
            if verbose:
                traceback.print_exc()
            echo_error(
                f"porter: internal error: {type(e).__name__}: {_one_line(e)} "
                "(please report; -v shows the traceback)"
            )
            sys.exit(EXIT_INTERNAL)


@click.group()
@click.option("-v", "--verbose", count=True, help="More logging; show tracebacks on errors.")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors; no progress bars.")
@click.version_option(package_name="porter")
@click.pass_context
def main(ctx, verbose, quiet):
    """porter: MoE checkpoints -> MXFP8 artifacts that run fast and provably right.

    Exit codes: 0 ok, 1 not faithful or a quality threshold crossed (verify), 2 bad input, 3 internal error."""
    ctx.obj = {"verbose": verbose, "quiet": quiet}
    setup_logging(verbose, quiet)


@main.command()
@click.argument("source")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False), help="Output folder.")
@convert_options
@hub_options
@common_options
@click.pass_context
def convert(ctx, source, output, **options):
    """Convert SOURCE (a local dir or a Hugging Face repo id) to a porter MXFP8 artifact."""
    from porter.commands.convert import ConvertOptions, interrupted_hint
    from porter.commands.convert import convert as do_convert

    opts = ConvertOptions(**options, progress=not ctx.obj["quiet"])
    _run(ctx, lambda: do_convert(source, output, opts), interrupted=lambda: interrupted_hint(output))


@main.command("inspect")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@common_options
@click.pass_context
def inspect_command(ctx, path, as_json):
    """What PATH (a porter artifact or a checkpoint folder) holds: source and commit, resolved config with
    provenance, layout, quantized and ignored modules, sizes, the ten worst tensors by relative error.
    Reads headers and JSON only."""
    import json

    from porter.commands.inspect import inspect, render

    report = _run(ctx, lambda: inspect(path))
    click.echo(json.dumps(report, indent=1) if as_json else render(report))


@main.command("verify", help=VERIFY_HELP)
@click.argument("artifact", type=click.Path())
@click.option(
    "--prompt", "prompts", multiple=True, help="Prompt text (repeatable). Default: a built-in prompt."
)
@click.option(
    "--reference", default=None, help="Original checkpoint (dir or repo id). Default: porter.json's source."
)
@click.option(
    "--backend",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "torch", "triton", "flashinfer-trtllm"]),
    help="MoE backend of the artifact.",
)
@device_option("Where both models run (the byte re-derivation runs there too; on cpu it uses every core)")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16"]),
    default="auto",
    show_default=True,
    help="Compute dtype (auto: float32 on CPU, bfloat16 on CUDA).",
)
@click.option(
    "--device-map",
    type=click.Choice(["auto", "none"]),
    default="auto",
    show_default=True,
    help="auto: with --device cuda and several GPUs, the converted model's decoder layers are spread "
    "over all of them (runtime.load(device_map='auto')); none: it stays on --device.",
)
@click.option(
    "--max-new-tokens",
    default=None,
    type=click.IntRange(0),
    help="Greedy tokens of the converted model, scored by the reference teacher-forced. "
    "Default: 16 when the converted model fits the device, else 0 (say N to generate anyway, "
    "layer-streamed).",
)
@click.option(
    "--report",
    type=click.Path(dir_okay=False, allow_dash=True),
    default=None,
    help="Write the JSON report here; '-': to stdout (the table then goes to stderr).",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the per-layer picture here (.svg; .png needs matplotlib).",
)
@click.option(
    "--numerics",
    type=click.Choice(["w8a16", "serving", "both"]),
    default="w8a16",
    show_default=True,
    help="w8a16: MXFP8 weights, activations as given (the cost of quantizing the weights); "
    "serving: also the MoE input, the SwiGLU output and every MXFP8 linear's input as MXFP8, what serving "
    "engines compute (the rounded reference rounds them the same way: docs/verify.md); both: two runs side "
    "by side. The --max-*/--min-* flags apply to every run.",
)
@click.option(
    "--stream/--no-stream",
    "stream",
    default=None,
    help="Force layer streaming of the teacher-forced pass on/off (default: on when both models "
    "would not fit in memory).",
)
@threshold_options
@click.option(
    "--min-matching-tokens",
    type=click.IntRange(0),
    default=None,
    help="Quality: generated tokens the bf16 source's argmax must agree on. Default 0 (reported only).",
)
@hub_options
@common_options
@click.pass_context
def verify(
    ctx,
    artifact,
    prompts,
    reference,
    backend,
    device,
    dtype,
    device_map,
    max_new_tokens,
    report,
    plot,
    stream,
    numerics,
    token,
    cache_dir,
    **threshold_flags,
):
    import json

    import torch

    from porter.commands import verify as verify_module
    from porter.errors import EXIT_NOT_FAITHFUL, EXIT_OK

    torch_dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    to_stdout = report == "-"  # stdout is then the JSON report alone
    device = str(_run(ctx, lambda: resolve_device(device)))
    result = _run(
        ctx,
        lambda: verify_module.verify(  # through the module: tests replace it
            artifact,
            prompts=list(prompts) or None,
            reference=reference,
            backend=backend,
            device=device,
            max_new_tokens=max_new_tokens,
            report=None if to_stdout else report,
            plot=plot,
            thresholds=threshold_flags,
            streaming="auto" if stream is None else stream,
            dtype=torch_dtype,
            progress=not ctx.obj.get("quiet"),
            device_map=None if device_map == "none" else device_map,
            token=token,
            cache_dir=cache_dir,
            numerics=numerics,
        ),
    )
    click.echo(_run(ctx, lambda: verify_module.format_table(result.report)), err=to_stdout)
    if to_stdout:
        click.echo(json.dumps(result.report.to_dict(), indent=1))
    ctx.exit(EXIT_OK if result.passed else EXIT_NOT_FAITHFUL)


@main.command("generate")
@click.argument("path", type=click.Path())
@click.option("--prompt", required=True, help="The prompt text.")
@click.option(
    "--chat", is_flag=True, help="Apply the checkpoint's chat template to the prompt (a user turn)."
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(0),
    default=None,
    help="Tokens to generate at most [default: generation_config.json's, else 128].",
)
@click.option(
    "--temperature",
    type=click.FloatRange(0),
    default=None,
    help="Sample at this temperature (0 or unset: greedy).",
)
@click.option(
    "--top-p", type=click.FloatRange(0, 1, min_open=True), default=None, help="Nucleus sampling mass."
)
@click.option("--top-k", type=click.IntRange(0), default=None, help="Sample among the k most likely tokens.")
@click.option("--seed", type=int, default=None, help="Seed of the sampler (reproducible output).")
@click.option("--stop", multiple=True, help="Stop before this text (repeatable).")
@device_option("Where the model runs")
@click.option(
    "--backend",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "torch", "triton", "flashinfer-trtllm"]),
    help="MoE backend.",
)
@click.option(
    "--rehash",
    is_flag=True,
    help="Hash every weight byte onto the GPUs, even of shards an earlier load on this machine checked and "
    "that have not changed since (docs/runtime.md, Loading).",
)
@common_options
@click.pass_context
def generate_command(
    ctx, path, prompt, chat, max_new_tokens, temperature, top_p, top_k, seed, stop, device, backend, rehash
):
    """Continue PROMPT with the model in PATH (a porter artifact or a checkpoint folder), printing the text
    as it is generated and the speed at the end."""
    from porter.commands.generate import generate

    _run(
        ctx,
        lambda: generate(
            path,
            prompt,
            chat=chat,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            device=resolve_device(device),
            backend=backend,
            progress=not ctx.obj.get("quiet"),
            rehash=rehash,
        ),
    )


if __name__ == "__main__":
    main()
