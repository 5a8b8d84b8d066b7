"""The layering rule of docs/architecture.md, checked on the imports of every module (parsed, not run).

    cli (porter.cli, the porter package's API)
      > conversion | verification | inspect      (siblings: none imports another)
      > runtime
      > converters                               (the registry, one package per architecture)
      > format (porter.mxfp8, safetensors_io, source, manifest, layout, errors, hub, plot, ...)

A module may import its own layer or any layer below, never one above. Imports inside functions count.
Also: transformers (a test-only oracle) is never imported outside tests, flashinfer only by the TRT-LLM
backend, and nothing unpickles.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("porter", "converters", "runtime")

CLI, ENTRY, RUNTIME, CONVERTERS, FORMAT = 4, 3, 2, 1, 0
LAYER_NAMES = {CLI: "cli", ENTRY: "conversion|verification|inspect", RUNTIME: "runtime",
               CONVERTERS: "converters", FORMAT: "format"}
ENTRY_MODULES = {"porter.conversion", "porter.verification", "porter.inspect"}
FLASHINFER_MODULES = {"runtime.moe.flashinfer_trtllm"}


def entry_of(module: str):
    """The entry module a module belongs to (an entry module may be a package: porter.verification.*)."""
    return next((m for m in ENTRY_MODULES if module == m or module.startswith(m + ".")), None)


def layer(module: str) -> int:
    if module in ("porter", "porter.cli", "porter.__main__"):
        return CLI
    if entry_of(module):
        return ENTRY
    top = module.split(".")[0]
    if top == "runtime":
        return RUNTIME
    if top == "converters":
        return CONVERTERS
    if top == "porter":
        return FORMAT
    raise KeyError(module)


def modules() -> dict:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


MODULES = modules()


def imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement, at any depth. `from pkg import name` counts
    as importing pkg.name when that is a module, else pkg."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = module.split(".") if is_pkg else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if sub in MODULES else base))
    return found


def own(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def test_every_module_has_a_layer():
    assert len(MODULES) > 20 and {"porter.cli", "porter.layout", "converters.minimax_m3", "runtime.loader"} <= set(MODULES)
    for m in MODULES:
        layer(m)


def test_layer_table_examples():
    """The rule's table itself, so a slip in `layer` cannot hollow out the check below."""
    assert layer("porter.cli") > layer("porter.verification") == layer("porter.conversion") > layer("runtime.loader")
    assert layer("runtime.models.minimax_m3") > layer("converters.minimax_m3") > layer("porter.layout")
    assert layer("porter.source") == layer("porter.manifest") == layer("porter.mxfp8") == FORMAT


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layers(module):
    mine = layer(module)
    bad = []
    for line, name in imports(module, MODULES[module]):
        if not own(name):
            continue
        target = name if name in MODULES else name.rsplit(".", 1)[0]
        theirs = layer(target)
        if theirs > mine:
            bad.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {LAYER_NAMES[mine]} module {module} imports "
                       f"{LAYER_NAMES[theirs]} module {target}")
        elif mine == ENTRY and theirs == ENTRY and entry_of(target) != entry_of(module):
            bad.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {module} imports its sibling {target}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_oracle_no_pickle_flashinfer_only_in_its_backend(module):
    bad = []
    for line, name in imports(module, MODULES[module]):
        top = name.split(".")[0]
        if top == "transformers":
            bad.append(f"{module}:{line}: imports transformers (a test-only oracle)")
        if top in ("pickle", "dill", "cloudpickle"):
            bad.append(f"{module}:{line}: imports {top} (porter never unpickles)")
        if top == "flashinfer" and module not in FLASHINFER_MODULES:
            bad.append(f"{module}:{line}: imports flashinfer outside the TRT-LLM backend")
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
            bad.append(f"{module}:{node.lineno}: torch.load unpickles")
        if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
            bad.append(f"{module}:{node.lineno}: trust_remote_code")
    assert not bad, "\n".join(bad)


def test_the_check_catches_a_violation(tmp_path):
    """A format module importing a converter is reported (the check is not vacuous)."""
    f = tmp_path / "layout.py"
    f.write_text("import torch\n\ndef f():\n    from converters.minimax_m3 import TextConfig\n")
    found = [n for _, n in imports("porter.layout", f) if own(n)]
    assert found == ["converters.minimax_m3"] and layer("converters.minimax_m3") > layer("porter.layout")


def _main_guard(node) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


@pytest.mark.parametrize("path", sorted(p for d in ("porter", "converters", "runtime", "examples", "benchmarks", "tests")
                                        for p in (ROOT / d).rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_main_block_last_and_one_name_for_tiny_checkpoint(path):
    """Nothing is defined after `if __name__ == "__main__":` (a script run would not see it), and the
    tiny checkpoint module is imported as `tiny_checkpoint` only (two names = two module objects)."""
    tree = ast.parse(path.read_text(), str(path))
    body = tree.body
    guards = [i for i, n in enumerate(body) if _main_guard(n)]
    late = [n for i, n in enumerate(body) if guards and i > guards[0] and isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert not late, f"{path.name}: {[n.name for n in late]} defined after the __main__ block"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "examples.tiny_checkpoint":
            pytest.fail(f"{path.name}:{node.lineno}: import tiny_checkpoint, not examples.tiny_checkpoint")


LAYOUT_NAMES = {"scale_name", "is_scale_name", "layer_of", "OutTensor", "ignored_layers"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_artifact_naming_comes_from_porter_layout(module):
    """Artifact naming has one home, porter/layout.py: nobody takes it from an architecture's converter."""
    tree = ast.parse(MODULES[module].read_text())
    bad = [f"{module}:{n.lineno}: imports {sorted(LAYOUT_NAMES & {a.name for a in n.names})} from {n.module}"
           for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("converters")
           and LAYOUT_NAMES & {a.name for a in n.names}]
    assert not bad, "\n".join(bad)


STANDALONE_FILES = sorted([*(p for d in ("porter", "converters", "runtime", "examples", "benchmarks", "tests")
                             for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts),
                           *(ROOT / "docs").glob("*.md"), ROOT / "README.md"])


@pytest.mark.parametrize("path", STANDALONE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_stands_alone(path):
    """Code and docs point to docs/ or to upstream sources, never to files outside the repository or to
    this project's issue numbers (neither exists for someone who clones porter)."""
    import re
    text = path.read_text()
    this_file = Path(__file__).resolve() == path.resolve()
    for pattern in (r"\.\./shared/", r"/work/shared", r"\bissues? #\d+", r"\(#\d+\)"):
        hits = [] if this_file else re.findall(pattern, text)
        assert not hits, f"{path.relative_to(ROOT)}: {hits[:3]}"
