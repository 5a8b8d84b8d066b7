"""The docs name only switches that exist: every `PORTER_*` environment name and every `--flag` in README.md,
docs/ and benchmarks/README.md is read by porter's code, is an option of a porter command (click) or of a
script in benchmarks/, examples/ or tests/ (argparse), or is one of the few flags of other tools the docs
quote."""

import re
from pathlib import Path

import click

from porter.cli import main as porter_cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
CODE = [
    p
    for folder in ("porter", "runtime", "converters", "benchmarks", "examples", "tests", ".ci")
    for p in sorted((ROOT / folder).rglob("*"))
    if p.suffix in (".py", ".c", ".sh", "") and p.is_file() and p.name != "test_docs.py"
]
# Flags of other tools that the docs quote in commands they show.
OTHER_TOOLS = {
    "--no-deps": "pip install (tests/engines/run.sh)",
    "--check": "ruff format --check (README command 2)",
}
ENV = re.compile(r"\bPORTER_[A-Z0-9_]+")
FLAG = re.compile(r"(?<![\w/.-])--[a-z][a-z0-9-]*")


def mentioned(pattern) -> dict:
    """{name: [doc:line, ...]} for every match of `pattern` in the docs."""
    out: dict = {}
    for doc in DOCS:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            for m in pattern.finditer(line):
                out.setdefault(m.group(0), []).append(f"{doc.relative_to(ROOT)}:{i}")
    return out


def cli_flags() -> set:
    flags = set()

    def walk(cmd):
        for p in cmd.params:
            flags.update(o for o in (*p.opts, *p.secondary_opts) if o.startswith("--"))
        if isinstance(cmd, click.Group):
            for sub in cmd.commands.values():
                walk(sub)

    walk(porter_cli)
    return flags | {"--help", "--version"}


def script_flags() -> set:
    found = set()
    for folder in ("benchmarks", "examples", "tests"):  # scripts run with python (e.g. test_verify_depth.py)
        for p in (ROOT / folder).glob("*.py"):
            text = p.read_text()
            found.update(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", text))
            found.update(re.findall(r"\"(--[a-z0-9-]+)\" in sys\.argv", text))  # a script's bare switch
    return found


def test_every_porter_env_name_in_the_docs_is_read_by_the_code():
    code = "\n".join(p.read_text(errors="replace") for p in CODE)
    missing = {name: where for name, where in mentioned(ENV).items() if name not in code}
    assert not missing, f"docs name environment switches no code reads: {missing}"


def test_every_flag_in_the_docs_exists():
    known = cli_flags() | script_flags() | set(OTHER_TOOLS)
    missing = {
        flag: where
        for flag, where in mentioned(FLAG).items()
        # `--max-*` in prose names the family of --max-... thresholds
        if not (flag in known or (flag.endswith("-") and any(k.startswith(flag) for k in known)))
    }
    assert not missing, f"docs name flags that no command or script has: {missing}"


def test_the_checks_see_the_switches_that_were_removed():
    """The scan finds names in prose and code blocks alike (a scan that found nothing would pass anything)."""
    assert {"--max-memory", "--resume", "--layout"} <= set(mentioned(FLAG))
    assert "PORTER_FAULT" in mentioned(ENV) and "--max-memory" in cli_flags() and "--tokens" in script_flags()
    for gone in (
        "PORTER_CPU_QUANTIZE",
        "PORTER_CUDA_CPU_START",
        "PORTER_CUDA_QUANTIZE",
        "PORTER_FUSED_DECODE",
    ):
        assert gone not in mentioned(ENV)
        assert ENV.search(f"run with `{gone}=0`").group(0) == gone
