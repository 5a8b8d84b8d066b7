"""The output folder of `porter convert`: what may be reused or replaced, the journal that lets `--resume` skip
finished shards, and the checks that a finished shard is intact."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from porter.commands.convert.options import ConvertOptions, flag
from porter.commands.convert.plan import COPY_FILES, Plan, fingerprint
from porter.engine import fault_point, output_guard
from porter.errors import ConvertError, MalformedSafetensors, PorterError
from porter.format import journal as porter_journal
from porter.format import manifest, model_card
from porter.format.journal import JOURNAL
from porter.format.safe_files import read_json_object
from porter.format.safetensors_io import SHARD_METADATA, file_digests, header_bytes
from porter.source import INDEX_NAME
from porter.version import __version__

log = logging.getLogger("porter")


def prepare_output(out: Path, plan: Plan, run: "Run", workers: int = 1) -> Optional[dict]:
    """Returns the shards already complete (for --resume) as {file: journal record}; None when --resume
    finds this very conversion already complete (nothing to do). Leaves `out` with this run's journal."""
    fp, opts = run.journal["fingerprint"], run.options
    journal = read_journal(out)
    if output_guard.has_content(out):
        if opts.resume:  # nothing planted where a resume writes or reads back (--force: foreign_files)
            output_guard.check_own_names(out, own_names(plan))
        if opts.resume and _complete_fingerprint(out) == fp:
            done = _intact_finished_shards(out, plan, workers)
            if len(done) == len(plan.shards):
                (out / JOURNAL).unlink(missing_ok=True)  # a crash after the index, before this cleanup
                log.info(
                    "resume: %s is already complete (same source, options and porter version; every "
                    "shard matches porter.json's digest); nothing to do",
                    out,
                )
                return None
            # journal first, then drop the index: the output reads as interrupted, never as complete
            write_journal(out, {**run.journal, "shards": done})
            (out / INDEX_NAME).unlink()
            return done
        if opts.resume and journal.get("fingerprint") == fp:
            if journal.get("removing"):  # an interrupted --force removal of the output before this one
                output_guard.remove_listed(out, output_guard.removal_order(journal["removing"]))
                write_journal(out, run.journal)
                return {}
            return _verified_done(out, journal, workers, plan.digest)
        if (
            opts.resume
            and not journal
            and all(
                p.is_file() and p.name == JOURNAL + ".tmp"
                for p in out.iterdir()
                if p.name != output_guard.LOCK_NAME
            )
        ):
            # killed before the first journal write: nothing finished, start over in place
            log.info("resume: %s holds no finished shard yet; starting from the beginning", out)
            (out / (JOURNAL + ".tmp")).unlink(missing_ok=True)
            out.mkdir(parents=True, exist_ok=True)
            write_journal(out, run.journal)
            return {}
        if opts.resume:
            raise ConvertError(_resume_mismatch(out, plan, run, journal))
        if not opts.force:
            raise ConvertError(_not_empty(out, plan, run, journal))
        output_guard.clear_for_force(out, _carried_names(out), run.journal)  # only what porter wrote
        return {}
    out.mkdir(parents=True, exist_ok=True)
    write_journal(out, run.journal)
    return {}


@dataclass
class Run:
    """One conversion's options and the journal it starts (no shard done): its fingerprint, the options
    as given and as porter.json will record them, the command that resumes it, the source's digests and
    every file it may write."""

    options: ConvertOptions
    journal: dict

    @classmethod
    def start(cls, plan: Plan, opts: ConvertOptions, source, out: Path) -> "Run":
        src = plan.source
        where = src.repo_id or os.path.abspath(str(source))
        command = opts.command(where, os.path.abspath(out), src.commit if src.repo_id else None)
        return cls(
            opts,
            {
                "fingerprint": fingerprint(plan),
                "porter": __version__,
                "options": opts.record(),
                "plan_options": {**plan.options.record(), "digest": plan.digest},
                "command": command,
                "source": plan.source_digests,
                "source_path": src.repo_id or str(src.path),
                "shard_count": len(plan.shards),
                "shards": {},
                "files": _planned_files(plan),
            },
        )


def own_names(plan: Plan) -> list:
    """Every name this conversion writes or reads back in the output folder, temporaries included."""
    names = [*_planned_files(plan), JOURNAL]
    return names + [n + ".tmp" for n in names] + [f + ".partial" for f, _ in plan.shards]


def _not_empty(out: Path, plan: Plan, run: Run, journal: dict) -> str:
    """Why a plain run (no --resume, no --force) refuses a folder that is not empty, and what to do."""
    state = porter_journal.interrupted(out)
    if state is not None:
        same = journal.get("fingerprint") == run.journal["fingerprint"]
        return f"{out}: {state.state()}" + (
            "" if same else "; or add --force to start over with these options"
        )
    foreign = output_guard.foreign_files(out, _carried_names(out))
    if foreign:  # --force would refuse too: say so now
        return (
            f"{out}: output folder is not empty ({out / foreign[0]} was not written by porter); choose an "
            "empty or new --output folder"
        )
    return f"{out}: output folder is not empty (an earlier porter output); use --force to overwrite"


def _resume_mismatch(out: Path, plan: Plan, run: Run, journal: dict) -> str:
    """Why --resume refuses: the first source file whose digest differs from the one the output recorded
    (journal, or a complete artifact's index), else the option that differs, else the porter version."""
    recorded = journal.get("source")
    if not isinstance(recorded, dict):
        try:
            recorded = json.loads((out / INDEX_NAME).read_text())["metadata"]["porter_source"]
        except (OSError, ValueError, KeyError, TypeError):
            recorded = None
    command = porter_journal.resume_command(journal, out)
    hint = f"resume with {command}" if command else ""
    again = f"{hint} (or --force to start over)" if hint else "use --force to start over"
    if isinstance(recorded, dict):
        now = plan.source_digests
        for name in sorted(set(recorded) | set(now)):
            if recorded.get(name) != now.get(name):
                what = (
                    "is new"
                    if name not in recorded
                    else "is gone"
                    if now.get(name) is None
                    else "changed (its header or sampled bytes differ)"
                )
                return (
                    f"{plan.source.path / name}: --resume into {out}, but this source file {what} since "
                    "that output was started; use --force to start over"
                )
    differs = _option_differs(out, plan, run, journal)
    if differs:
        made = "this conversion was started" if journal.get("plan_options") else "this output was made"
        return f"{out}: --resume with {differs[1]}, but {made} with {differs[2]}; {again}"
    made_by = journal.get("porter") or _manifest_version(out)
    if made_by and made_by != __version__:
        return (
            f"{out}: --resume, but this output was made by porter {made_by} and this is porter "
            f"{__version__}; finish it with porter {made_by}, or use --force to start over"
        )
    what = "options or porter version" if isinstance(recorded, dict) else "source, options or porter version"
    return f"{out}: --resume, but what is there was made with different {what}; {again}"


def _option_differs(out: Path, plan: Plan, run: Run, journal: dict) -> Optional[tuple]:
    """(field, 'FLAG now', 'FLAG then') of an option whose effect on the output differs from what the journal
    (or a complete artifact's porter.json) recorded, preferring one given differently (a changed --layout,
    rather than the --quantize default it implies); None if none differs."""
    then = journal.get("plan_options")
    given = ConvertOptions.from_record(journal.get("options"))
    if not isinstance(then, dict):  # a complete artifact: porter.json's options and digest rule
        try:
            man = manifest.read(out)
            then = manifest.read_options(man).record()
            then["digest"] = str(man.get("digest", {}).get("algorithm", "")).removesuffix("-chunked")
        except (PorterError, AttributeError):
            return None
        given = None
    now = {**plan.options.record(), "digest": plan.digest}
    differ = [
        f.name
        for f in fields(ConvertOptions)
        if f.name in now and then.get(f.name, now[f.name]) != now[f.name]
    ]
    if not differ:
        return None
    if given is not None:
        changed = {
            f.name for f in fields(ConvertOptions) if getattr(given, f.name) != getattr(run.options, f.name)
        }
        differ.sort(key=lambda n: n not in changed)  # stable: field order among the rest
    name = differ[0]
    shown_now, shown_then = getattr(run.options, name), getattr(given, name) if given is not None else None
    shown_now = now[name] if shown_now is None else shown_now
    shown_then = then[name] if shown_then is None else shown_then
    return name, f"{flag(name)} {shown_now}", f"{flag(name)} {shown_then}"


def _manifest_version(out: Path) -> Optional[str]:
    try:
        return manifest.read(out).get("porter_version")
    except PorterError:
        return None


def _intact_finished_shards(out: Path, plan: Plan, workers: int) -> dict:
    """A complete artifact's shards whose size and digest still match porter.json, as journal records
    ({file: {"header_sha256", "digest", "tensors"}}); each missing or altered shard is logged by name."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        man = manifest.read(out)
        recorded, tensors = man["shards"], man["tensors"]
    except (PorterError, KeyError, TypeError):
        recorded, tensors = {}, {}
    done = {}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for f, _ in plan.shards:
            rec, path = recorded.get(f) if isinstance(recorded, dict) else None, out / f
            why = (
                "missing"
                if not path.is_file()
                else "not in porter.json"
                if not isinstance(rec, dict)
                else None
            )
            if why is None and path.stat().st_size != rec.get("bytes"):
                why = f"{path.stat().st_size} bytes, porter.json says {rec.get('bytes')}"
            if why is None:
                try:
                    ok = file_digests(path, pool, chunk_hash=plan.digest).digest == rec.get("digest")
                except (OSError, MalformedSafetensors):
                    ok = False
                why = None if ok else "its digest differs from porter.json's"
            if why:
                log.warning(
                    "resume: %s is %s; it will be rewritten",
                    path,
                    why if why == "missing" else f"altered ({why})",
                )
                continue
            done[f] = {
                "header_sha256": rec["header_sha256"],
                "digest": rec["digest"],
                "tensors": {n: r for n, r in tensors.items() if isinstance(r, dict) and r.get("shard") == f},
            }
    return done


def _planned_files(plan: Plan) -> list:
    """Every file this conversion may write (the journal keeps the list: what --force may remove later)."""
    copied = [n for n in COPY_FILES if (plan.source.path / n).exists()]
    card = [model_card.CARD] + [p.name for p in model_card.license_files(plan.source.path)]
    return [f for f, _ in plan.shards] + copied + card + ["config.json", manifest.MANIFEST, INDEX_NAME]


def _carried_names(out: Path) -> tuple:
    """Names a complete porter output may hold beside its shards: the copied files, model card and licenses."""
    return (*COPY_FILES, *(p.name for p in out.iterdir() if model_card.is_card_file(p.name)))


def planned_bytes(plan: Plan) -> int:
    """Disk space the output needs: every shard with its header, the copied files, and room for the JSON
    files (porter.json holds a record of ~300 bytes per tensor)."""
    shards = sum(len(header_bytes(es, SHARD_METADATA)) + sum(e.nbytes for e in es) for _, es in plan.shards)
    copied = sum(
        (plan.source.path / n).stat().st_size for n in COPY_FILES if (plan.source.path / n).is_file()
    )
    return shards + copied + (1 << 20) + 1024 * len(plan.tensors)


def _complete_fingerprint(out: Path) -> Optional[str]:
    """The fingerprint recorded in a complete artifact's index (written last); its shards are checked
    apart (_intact_finished_shards)."""
    try:
        return read_json_object(out / INDEX_NAME, ConvertError, "index")["metadata"]["porter_fingerprint"]
    except (PorterError, KeyError, TypeError):  # unreadable, not a regular file, not an artifact's index
        return None


def read_journal(out: Path) -> dict:
    return porter_journal.read(out)  # unreadable, not a regular file or not an object: as if absent


def write_journal(out: Path, journal: dict) -> None:
    porter_journal.write(out, journal, before_rename=lambda: fault_point("journal-tmp"))
    fault_point("journal")


def _verified_done(out: Path, journal: dict, workers: int, chunk_hash: str) -> dict:
    """The journaled shards whose bytes still hash to the digest the journal says (chunks re-hashed on every
    worker: a shard torn by a power loss, or edited, is rewritten)."""
    from concurrent.futures import ThreadPoolExecutor

    shards, done = journal.get("shards", {}), {}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for f, rec in shards.items():
            try:
                intact = file_digests(out / f, pool, chunk_hash=chunk_hash).digest == rec.get("digest")
            except (OSError, MalformedSafetensors):
                intact = False
            if intact:
                done[f] = rec
            else:
                log.warning("resume: %s is missing or changed; it will be rewritten", f)
    log.info("resume: %d shard(s) already complete and verified", len(done))
    return done
