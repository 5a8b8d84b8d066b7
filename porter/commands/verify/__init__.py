"""`porter verify`: prove a porter MXFP8 artifact faithful to the checkpoint it came from, or say where not.

    porter verify out/model-mxfp8                       # reference = the source named in porter.json
    porter verify out/model-mxfp8 --reference DIR|REPO --prompt "..." --report r.json --plot r.svg

Steps (one module each; what each proves and what it does not: docs/verify.md):
1. integrity.py — the files are what porter.json says (chunked digests, headers, index, scales, config);
   the tensors' digests checked on exact bytes' reads of them (digests.py), the artifact read once.
2. exact.py — every tensor re-derived from the source through verify's own mapping table (mapping.py)
   and porter.format.mxfp8 with the recorded rule: bytes identical, carried tensors bit-identical; weight
   error as a second opinion. When the pass of step 3 is layer-streamed (a model larger than the device),
   each decoder layer is compared inside it, on the read that builds the references from that layer, so
   source and artifact are read once for both steps; a tensor with no comparable source, or changed since
   the conversion, stops the pass before the converted model is built from it.
3. generation.py + numerics.py — the converted model generates; one teacher-forced pass (same runtime, every
   numerics run in it) compares it layer by layer with the rounded reference (rounded.py: the source weights
   rounded by the re-derivation of step 2) within float rounding (faithfulness.py: decides), and with the
   bf16 source (quality: KL, top-k, per-layer error; judged only against thresholds the user sets).
4. thresholds.py, verdict.py — thresholds, failures, the report (report.py: table, JSON; plot.py).
Exit codes (CLI): 0 faithful (and within the quality thresholds set), 1 not faithful or a quality threshold
crossed, 2 bad input (VerifyInputError and other PorterErrors), 3 internal error.
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import torch

import converters
from porter.commands.verify import exact as exact_step
from porter.commands.verify import generation as gen
from porter.commands.verify.digests import TensorDigests
from porter.commands.verify.exact import ExactBytes
from porter.commands.verify.inputs import (
    DEFAULT_PROMPT,
    check_output_paths,
    check_outputs_apart,
    check_reference_commit,
    encode_prompts,
    open_artifact,
    reference_path,
    source_quantization,
    tokenizer,
)
from porter.commands.verify.integrity import check_integrity, digest_rule
from porter.commands.verify.mapping import ArtifactReader, Mapping, ReferenceStore, SourceShards
from porter.commands.verify.numerics import compare_models
from porter.commands.verify.report import format_table, write_outputs
from porter.commands.verify.rounded import RoundedReferenceStore
from porter.commands.verify.thresholds import NUMERICS, QUALITY, Thresholds, numerics_runs
from porter.commands.verify.verdict import (
    Failure,
    LayerRow,
    NumericsRun,
    Report,
    StreamingInfo,
    VerifyResult,
    conclude,
    judge_exact,
    judge_numerics,
)
from porter.errors import ConfigError, LoadError, PorterError, VerifyInputError
from porter.format import manifest
from porter.format.safe_files import read_json_object
from porter.format.safetensors_io import dtype_name
from porter.source.local import read_header, weight_files

__all__ = [
    "verify",
    "Thresholds",
    "VerifyResult",
    "VerifyInputError",
    "Report",
    "Failure",
    "DEFAULT_PROMPT",
    "NUMERICS",
    "format_table",
]

log = logging.getLogger("porter")
DEFAULT_MAX_NEW_TOKENS = gen.DEFAULT_MAX_NEW_TOKENS


@dataclass
class _Inputs:
    art: Path
    man: dict
    options: manifest.Options  # porter.json's options
    ref_path: Path
    ref_config: object
    tok: object
    device: torch.device
    source_quantization: tuple = (None, None)  # (prequantized.Scheme or None, kept MXFP8 scales rule)


def verify(
    artifact,
    prompts=None,
    reference=None,
    backend: str = "auto",
    device="cpu",
    max_new_tokens: Optional[int] = None,
    report=None,
    plot=None,
    thresholds=None,
    streaming="auto",
    dtype: Optional[torch.dtype] = None,
    progress: bool = False,
    device_map: Optional[str] = "auto",
    token: Optional[str] = None,
    cache_dir=None,
    numerics: str = "w8a16",
) -> VerifyResult:
    """Verify a porter artifact against its reference checkpoint; mirrors `porter verify`.

    prompts: list of strings (default: DEFAULT_PROMPT). reference: dir or repo id (default: porter.json's
    source). max_new_tokens: greedy tokens of the converted model (None: 16 when it fits the device, else 0).
    report / plot: file paths (their folders must exist). thresholds: Thresholds or {name: value} (finite,
    in range: thresholds.THRESHOLD_RANGES); the quality ones (thresholds.QUALITY) decide only when set.
    streaming: "auto" | True | False (layer streaming of the teacher-forced pass). device_map: "auto"
    spreads the converted model over every visible GPU when device is a bare "cuda" and there are several;
    None keeps it on `device`. token / cache_dir: Hugging Face token and cache folder when the reference is
    a repo id (None: HF_TOKEN / HF_HOME).
    numerics: "w8a16" (weights MXFP8, activations as given: the cost of quantizing the weights), "serving"
    (also the MoE input, the SwiGLU output and every MXFP8 linear's input as MXFP8, what a serving engine
    computes; the rounded reference rounds them the same way) or "both" (two runs, side by side).
    Raises PorterError subclasses for bad input; returns the result otherwise.
    """
    t0 = time.time()
    check_output_paths(report, plot)  # before any work: a path that cannot be written is bad input
    runs = numerics_runs(numerics)
    inp, rep = _open(artifact, prompts, reference, backend, device, thresholds, token, cache_dir, runs)
    check_outputs_apart(report, plot, inp.art, inp.ref_path)  # never over the artifact or the reference
    rep.max_new_tokens = max_new_tokens
    digest_rule(inp.man)  # a manifest porter cannot read is bad input: one line, before any log line
    with _phase(rep, "integrity"):  # all but the tensors' digests, checked on exact bytes' reads
        rep.integrity = check_integrity(inp.art, inp.man, inp.ref_config, progress=progress, data=False)
    if not rep.integrity.passed:  # numbers about a broken artifact would mislead: stop here
        return _finish(rep, list(rep.integrity.issues), report, plot, t0)
    digests = TensorDigests(inp.art, inp.man, *digest_rule(inp.man))
    shards = SourceShards(inp.ref_path, *inp.source_quantization)
    reader = ArtifactReader(inp.art, inp.man, digests=digests)
    mapping = Mapping(
        shards,
        interleaved=_interleaved(inp.man, inp.ref_config),
        rounding=inp.options.scale_rounding,
    )
    exact = ExactBytes(reader, mapping, inp.options.scale_rounding, inp.device, progress)
    ref_store = ReferenceStore(mapping, reader, inp.ref_config)  # the source: both references read it
    rounded_store = RoundedReferenceStore(ref_store, reader, inp.options.scale_rounding, inp.device)
    sizes = _Sizes.of(inp, ref_store, rounded_store)
    plan = gen.plan_runs(
        streaming, max_new_tokens, inp.device, sizes.conv, sizes.ref, device_map, sizes.rounded
    )
    _log_projection(runs, plan.stream, sizes, exact)  # the whole, then each step's own in the order they run
    exact.log_estimate()
    gen.log_costs(plan, *sizes)
    outcome = refused = None
    if plan.stream:  # exact bytes checks each layer inside the pass, on the pass's own read of it
        with _phase(rep, "exact"):  # the tensors outside the layers, before any model is built from them
            exact.run([None])
        if not _problems(exact.result()):
            try:
                outcome = _numerics(
                    rep, inp, ref_store, rounded_store, plan, sizes, backend, dtype, progress, exact, digests
                )
            except (ConfigError, LoadError) as e:  # a model refused a tensor exact bytes has not reached
                refused = e
    with _phase(rep, "exact"):
        exact.run()  # all of it (a resident pass), or what the pass did not read
    reader.digests = None  # the numerics' reads are the runtime's (it checks digests as it loads)
    with _phase(rep, "integrity"):  # the tensors exact bytes did not read are hashed here
        changed = digests.finish()
    if changed:  # the integrity failure explains every difference exact bytes saw: those are not shown
        rep.integrity.passed, rep.integrity.issues, rep.exact = False, changed, None
        log.info("verify: exact bytes' results withheld: the artifact changed after conversion (integrity)")
        return _finish(rep, list(changed), report, plot, t0)
    rep.exact = exact.result()
    failures = judge_exact(rep.exact, rep.thresholds)
    if _problems(rep.exact):
        log.info("verify: numerics skipped: some artifact tensors have no comparable source (see above)")
        return _finish(rep, failures, report, plot, t0)
    if refused is not None:  # neither integrity nor exact bytes explains it: the load's own words
        raise refused
    assert outcome is not None or not plan.stream, "the pass stopped for a reason exact bytes does not show"
    if outcome is None:  # a resident pass: the rounded reference takes the tensors exact bytes proved
        rounded_store.prove(exact.proved())
        outcome = _numerics(rep, inp, ref_store, rounded_store, plan, sizes, backend, dtype, progress)
    _record(rep, outcome)
    return _finish(rep, failures + judge_numerics(rep, rep.thresholds), report, plot, t0)


def _problems(res) -> bool:
    """Some artifact tensor has no comparable source (no mapping, a shape or dtype that cannot be)."""
    return any(t.problem for t in res.tensors)


@contextmanager
def _phase(rep: Report, name: str):
    """Adds the block's wall seconds to rep.phases[name] (the report's and the final log line's split)."""
    t = time.perf_counter()
    try:
        yield
    finally:
        rep.phases[name] = round(rep.phases.get(name, 0.0) + time.perf_counter() - t, 3)


def _log_projection(runs, in_pass: bool, sizes: "_Sizes", exact: ExactBytes) -> None:
    """The bytes every step reads and the total time they take at an assumed disk rate, before the first
    step starts (each step logs its own estimate as it begins; the teacher-forced pass projects its total
    from its first layers). in_pass: a layer-streamed pass, exact bytes inside it."""
    from porter.commands.verify.exact import READ_GBPS

    art, src = sizes.conv, sizes.ref
    if in_pass:
        # each layer of source and artifact read once for exact bytes (integrity's digests on the same read)
        # and both references, the artifact once more by the converted model (the runtime's own reads);
        # the tensors outside the layers are compared before the models are built: their source read again
        outside = exact.source_bytes(None)
        total = src + 2 * art + outside
        how = (
            f"source {src / 1e9:.1f} GB once and artifact {art / 1e9:.1f} GB twice (exact bytes and both "
            f"references a layer at a time in the pass, on one read; the converted model), +{outside / 1e9:.1f}"
            " GB: the source's tensors outside the layers, compared before the models are built"
        )
    else:
        # exact bytes reads the artifact (integrity's digests checked on the same reads), exact bytes and
        # the bf16 reference the source; the pass reads the converted model and the rounded reference (the
        # artifact's proved MXFP8 tensors, the source's carried ones: about the artifact's size)
        total = 2 * src + 2 * art + sizes.rounded
        how = (
            f"artifact {art / 1e9:.1f} GB in exact bytes (integrity's digests on the same read), source "
            f"{src / 1e9:.1f} GB in exact bytes and the bf16 reference, {(art + sizes.rounded) / 1e9:.1f} GB "
            f"in the numerics pass (the converted model{' and the rounded reference' if sizes.rounded else ''})"
        )
    log.info(
        "verify: reads ~%.1f GB in all: %s, every numerics run (%d) in one pass: ~%.1f min at an assumed "
        "%g GB/s, compute aside",
        total / 1e9,
        how,
        len(runs),
        total / (READ_GBPS * 1e9) / 60,
        READ_GBPS,
    )


def _open(
    artifact, prompts, reference, backend, device, thresholds, token=None, cache_dir=None, runs=("w8a16",)
) -> tuple[_Inputs, Report]:
    art, man = open_artifact(artifact)
    options = manifest.read_options(man)  # porter.json's options, with their defaults
    scope = options.quantize
    overrides = vars(thresholds) if isinstance(thresholds, Thresholds) else thresholds
    if "serving" in runs:
        _check_serving(art, scope, backend)
    th = Thresholds.build(overrides)
    ref_path = reference_path(man, reference, token, cache_dir)
    check_reference_commit(man, ref_path)
    try:
        raw = read_json_object(ref_path / "config.json", VerifyInputError, "config")
        ref_config = converters.resolve(raw, reference_meta(ref_path), str(ref_path / "config.json"))[1]
    except PorterError as e:
        raise VerifyInputError(f"reference {ref_path / 'config.json'}: {e}") from None
    source_q = source_quantization(man, raw, ref_path)  # a pre-quantized reference is read as converted
    tok, tok_path = tokenizer(art, ref_path)
    prompts = list(prompts) if prompts else [DEFAULT_PROMPT]
    rep = Report(
        str(art.resolve()),
        str(ref_path),
        str(tok_path),
        man.get("porter_version"),
        backend,
        str(device),
        scope,
        options.scale_rounding,
        th,
        prompts,
        0,
    )
    rep.numerics_mode = "both" if len(runs) > 1 else runs[0]
    rep.numerics = {n: NumericsRun(n, backend, "", th) for n in runs}
    rep.quality_judged = [n for n in QUALITY if th.is_set(n)]
    return _Inputs(art, man, options, ref_path, ref_config, tok, torch.device(device), source_q), rep


def reference_meta(ref_path: Path) -> dict:
    """{name: (dtype, shape)} of the reference's tensors, from its shard headers (its config's sizes are
    checked against them: converters.resolve)."""
    return {n: (i["dtype"], i["shape"]) for f in weight_files(ref_path) for n, i in read_header(f).items()}


def _check_serving(art: Path, scope: str, backend: str) -> None:
    """Serving numerics need MXFP8 experts (every MoE backend computes them: docs/moe-backends.md)."""
    if scope == "none":
        raise VerifyInputError(
            f"{art}: --numerics serving needs MXFP8 experts; this artifact was converted "
            "with --quantize none (use --numerics w8a16)"
        )


def _interleaved(man: dict, ref_config) -> bool:
    """Row order of a fused source gate_up_proj, as the conversion was told (porter.json options.gate_up)."""
    opt = manifest.read_options(man).gate_up
    return ref_config.gate_up_interleaved if opt == "auto" else opt == "interleaved"


class _Sizes(NamedTuple):
    """Bytes of the models the pass loads (generation.log_costs' arguments, in order)."""

    conv: int  # the artifact's shards
    ref: int  # the source's tensors as the bf16 reference reads them
    rounded: int  # the rounded reference, about the artifact's size; 0 when it is the bf16 reference

    @classmethod
    def of(cls, inp: _Inputs, ref_store, rounded_store) -> "_Sizes":
        conv = sum(int(r.get("bytes", 0)) for r in inp.man.get("shards", {}).values() if isinstance(r, dict))
        ref = sum(ref_store.mapping.shards.nbytes(n) for n in ref_store.mapping.shards.meta)
        return cls(conv, ref, conv if rounded_store.quantized else 0)


@dataclass
class _Outcome:
    """What the numerics step computed, recorded into the report only once exact bytes and integrity hold
    (_record): with a layer-streamed pass it runs before they are complete."""

    plan: gen.RunPlan
    prompt_tokens: list
    continuations: list
    streaming: StreamingInfo
    dtype: str
    cfg: object
    results: list  # numerics.PassResult per run
    tok: object  # the tokenizer the continuations are scored with


class _PassStopped(Exception):
    """Exact bytes found, in the layer the pass was about to build, a tensor with no comparable source or
    changed since the conversion: the numerics would describe a broken artifact (verify() says why)."""


def _numerics(
    rep: Report,
    inp: _Inputs,
    ref_store: ReferenceStore,
    rounded_store: RoundedReferenceStore,
    plan: gen.RunPlan,
    sizes: _Sizes,
    backend,
    dtype,
    progress,
    exact: Optional[ExactBytes] = None,
    digests: Optional[TensorDigests] = None,
) -> Optional[_Outcome]:
    """Every numerics run (rep.numerics) in one teacher-forced pass (numerics.compare_models): the converted
    model, the rounded reference and the bf16 reference are each loaded once, the first two switched between
    the runs' numerics (runtime.set_numerics). The first run's numerics also generate. The converted model
    runs on the backend asked for, without the Triton backend's e4m3 prefill (w8a16 means activations as
    given); the rounded reference on the torch backend (dequantize, then matmul), with the run's activation
    rounding. With `exact` (a layer-streamed pass), exact bytes compares each decoder layer as the bf16
    reference is first built from it, on the same staged read of its source and artifact tensors; None when
    it stopped the pass (_PassStopped)."""
    import runtime

    if plan.stream and rounded_store.quantized:  # each layer built by the bf16 reference first: shared reads
        rounded_store.share_reads()
    if exact_step.reads_ahead(inp.device):  # each layer read onto the GPU while the one before is built
        layers = {k: exact.artifact_names(k) for k in exact.layers if k is not None} if exact else None
        ref_store.read_ahead(inp.device, artifact=layers)
        if not rounded_store.shared:  # shared: it takes the bf16 reference's (and exact bytes') reads
            rounded_store.read_ahead(inp.device)
    if exact is not None:
        ref_store.on_layer = _exact_in_pass(rep, exact, digests, rounded_store)
    ids = encode_prompts(inp.tok, rep.prompts)
    prompt_tokens = [int(x.shape[1]) for x in ids]
    runs = list(rep.numerics.values())
    backend = runs[0].backend  # every run asks for the same one (_open)
    moe = tuple("serving" if r.numerics == "serving" else None for r in runs)  # None: the backend's own
    load = lambda lazy: runtime.load(
        inp.art,
        device=inp.device,
        dtype=dtype,
        backend=backend,
        lazy=lazy,
        moe_numerics=moe[0],
        moe_fp8_prefill=False,
        progress=progress,
    )
    with _phase(rep, "numerics.load"):
        shared = None if plan.stream or plan.device_map else load(False)  # generates, then the pass
    with _phase(rep, "generation"):
        conts = _generate(shared, inp, plan, ids, backend, dtype, moe[0], progress)
    streaming = StreamingInfo(plan.stream, plan.stream_reason, sizes.conv, sizes.ref, plan.generation)
    seqs = [gen.teacher_forced_input(x, c) for x, c in zip(ids, conts)]
    models: list = [shared]  # released whatever happens
    in_pass = rep.phases.get("exact", 0.0)
    try:
        with _phase(rep, "numerics.load"):
            conv = shared if shared is not None else load(plan.stream)
            models.append(conv)
            as_conv = dict(device=inp.device, dtype=conv.dtype, lazy=plan.stream, progress=progress)
            ref = runtime.load(ref_store, backend="auto", **as_conv)  # the bf16 source: the same in every run
            models.append(ref)
            rref = None
            if rounded_store.quantized:
                rref = runtime.load(rounded_store, backend="torch", moe_numerics=moe[0], **as_conv)
                models.append(rref)
            if not plan.stream:  # built: the last layer's staged bytes leave the device
                ref_store.close()
                rounded_store.close()
        with _phase(rep, "numerics.pass"):  # layers of lazy models are read here, once for every run
            results = compare_models(ref, conv, seqs, prompt_tokens, progress, rounded=rref, runs=moe)
        cfg, dt = conv.cfg, dtype_name(conv.dtype)
    except _PassStopped:
        results = None
    finally:
        if "numerics.pass" in rep.phases:  # exact bytes' share of the pass is counted once, as exact bytes
            rep.phases["numerics.pass"] = round(
                rep.phases["numerics.pass"] - (rep.phases.get("exact", 0.0) - in_pass), 3
            )
        ref_store.on_layer = None
        for m in models:
            if m is not None and hasattr(m.layers, "release"):
                m.layers.release()
        ref_store.release()  # a stopped pass leaves a layer read ahead
        rounded_store.release()
        del models, shared
        gc.collect()
    if results is None:
        return None
    return _Outcome(plan, prompt_tokens, conts, streaming, dt, cfg, results, inp.tok)


def _exact_in_pass(rep: Report, exact: ExactBytes, digests: TensorDigests, rounded: RoundedReferenceStore):
    """ReferenceStore.on_layer for a layer-streamed pass: exact bytes compares layer i on the bytes just
    staged for it, before any model is built from them; the rounded reference then takes the tensors it
    proved from that same read (rounded.py). A tensor with no comparable source, or changed since the
    conversion, stops the pass (verify() then reports it as it does without a pass)."""

    def check(i: int) -> None:
        with _phase(rep, "exact"):
            checks = exact.run_layer(i)
        if any(c.problem for c in checks) or digests.changed(exact.artifact_names(i)):
            raise _PassStopped(i)
        rounded.prove(exact.proved())

    return check


def _record(rep: Report, out: _Outcome) -> None:
    """The numerics step's figures into the report: per run, and the first run's at the top level."""
    rep.max_new_tokens, rep.prompt_tokens, rep.streaming = (
        out.plan.new_tokens,
        out.prompt_tokens,
        out.streaming,
    )
    rep.dtype = out.dtype
    for k, (run, res) in enumerate(zip(rep.numerics.values(), out.results)):
        run.embeddings, run.logits, run.faithfulness = res.embeddings, res.logits, res.faithfulness
        run.layers = [_layer_row(rep, out.cfg, i, s) for i, s in enumerate(res.layers)]
        if k == 0:
            rep.backend, rep.embeddings, rep.faithfulness = run.backend, run.embeddings, run.faithfulness
            rep.logits, rep.layers = run.logits, run.layers
            rep.generation = [
                gen.score(p, c, tr, tc, out.tok)
                for p, c, (tr, tc) in zip(rep.prompts, out.continuations, res.tails)
                if c
            ]


def _generate(
    shared, inp: _Inputs, plan: gen.RunPlan, ids: list, backend, dtype, moe_numerics=None, progress=False
) -> list:
    """Continuations of the converted model (empty lists when generation is skipped). Uses `shared` (the
    resident model of the teacher-forced pass) when there is one, else a model of its own, freed after."""
    if not plan.new_tokens:
        return [[] for _ in ids]
    import runtime

    if shared is not None:
        model = shared
    elif plan.device_map:  # spread over the visible GPUs
        model = runtime.load(
            inp.art,
            dtype=dtype,
            backend=backend,
            device_map=plan.device_map,
            moe_numerics=moe_numerics,
            moe_fp8_prefill=False,
            progress=progress,
        )
    else:  # resident on the device while the pass streams, or layer-streamed when asked for
        model = runtime.load(
            inp.art,
            device=inp.device,
            dtype=dtype,
            backend=backend,
            lazy=plan.generation == "streaming",
            moe_numerics=moe_numerics,
            moe_fp8_prefill=False,
            progress=progress,
        )
    eos = model.cfg.eos_token_id if isinstance(model.cfg.eos_token_id, int) else None
    out = gen.greedy_all(model, ids, plan.new_tokens, eos)
    model.release_decode_state()  # the teacher-forced pass needs that memory more than a next generate
    if len(ids) > 1:
        plan.generation += f", one padded batch of {len(ids)} prompts"
    if model is not shared:
        if hasattr(model.layers, "release"):
            model.layers.release()
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _layer_row(rep: Report, cfg, i: int, s) -> LayerRow:
    kind = cfg.layer_kind(i)
    mine = [t for t in rep.exact.tensors if t.layer == i and t.quantized]
    worst = max(mine, key=lambda t: t.weight_error) if mine else None
    faith = {"faith_error": s.faith_error, "faith_limit": s.faith_limit}
    if worst is None:
        return LayerRow(i, kind, s.cosine, s.rel_error, s.layer_error, 0.0, None, None, **faith)
    return LayerRow(
        i,
        kind,
        s.cosine,
        s.rel_error,
        s.layer_error,
        worst.weight_error,
        worst.worst_label,
        worst.shard,
        **faith,
    )


def _finish(rep: Report, failures: list[Failure], report, plot, t0) -> VerifyResult:
    conclude(rep, failures)
    rep.seconds = round(time.time() - t0, 3)
    log.info(
        "verify: %.1f s in all: %s",
        rep.seconds,
        ", ".join(f"{k} {v:.1f} s" for k, v in rep.phases.items()) or "no step ran",
    )
    write_outputs(rep, report, plot)
    return VerifyResult(rep)
