"""The layering rule of docs/architecture.md, checked on the imports of every module (parsed, not run).

    cli          porter.cli, porter (the package's API)
      > commands porter/commands/: convert | verify | inspect      (siblings: none imports another)
      > runtime | engine                                           (siblings: runtime/, porter/engine/)
      > converters                                                 (the registry; one package per architecture)
      > source   porter/source/: open_source, local folders, the Hugging Face Hub
      > format   porter/format/: MXFP8, safetensors, the artifact's names, manifest and digests
      > base     porter.errors, porter.version, porter.cores, porter.devices, porter.cache (leaves)

A module may import its own layer or any layer below, never one above, nor a sibling's. Imports inside
functions count. The import graph has no cycle (a cycle hides behind an import inside a function).
Also: transformers (a test-only oracle) is never imported outside tests, flashinfer only by the TRT-LLM
backend, and nothing unpickles.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("porter", "converters", "runtime")

CLI, COMMANDS, ENGINE, CONVERTERS, SOURCE, FORMAT, BASE = 6, 5, 4, 3, 2, 1, 0
LAYER_NAMES = {
    CLI: "cli",
    COMMANDS: "commands",
    ENGINE: "runtime|engine",
    CONVERTERS: "converters",
    SOURCE: "source",
    FORMAT: "format",
    BASE: "base",
}
# packages whose members are siblings: a module of one never imports a module of another at the same layer
SIBLINGS = {
    COMMANDS: ("porter.commands.convert", "porter.commands.verify", "porter.commands.inspect"),
    ENGINE: ("runtime", "porter.engine"),
}
BASE_MODULES = {
    "porter.errors",
    "porter.version",
    "porter.cores",
    "porter.devices",
    "porter.cache",
}  # import nothing of porter's
FLASHINFER_MODULES = {"runtime.moe.flashinfer_trtllm"}


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def sibling_of(module: str, layer_: int):
    """The sibling package a module belongs to at its layer (None: the layer has no siblings, or a shared
    module such as the porter.commands package itself)."""
    return next((p for p in SIBLINGS.get(layer_, ()) if under(module, p)), None)


def layer(module: str) -> int:
    if module in ("porter", "porter.cli", "porter.cli_options", "porter.__main__"):
        return CLI
    if module in BASE_MODULES:
        return BASE
    for package, level in (
        ("porter.commands", COMMANDS),
        ("porter.engine", ENGINE),
        ("runtime", ENGINE),
        ("converters", CONVERTERS),
        ("porter.source", SOURCE),
        ("porter.format", FORMAT),
    ):
        if under(module, package):
            return level
    raise KeyError(f"{module}: no layer; put it in a layer's folder or add it to tests/test_layers.py")


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
    named = {
        "porter.cli",
        "porter.format.layout",
        "porter.source.hub",
        "porter.commands.inspect",
        "converters.minimax_m3",
        "runtime.loader",
    }
    assert len(MODULES) > 20 and named <= set(MODULES)
    for m in MODULES:
        layer(m)


def test_layer_table_examples():
    """The rule's table itself, so a slip in `layer` cannot hollow out the check below."""
    assert (
        layer("porter.cli")
        > layer("porter.commands.verify")
        == layer("porter.commands.convert")
        == layer("porter.commands.verify.exact")
        > layer("runtime.loader")
        == layer("porter.engine.run")
    )
    assert (
        layer("runtime.models.minimax_m3")
        > layer("converters.minimax_m3")
        > layer("porter.source.hub")
        == layer("porter.source")
        > layer("porter.format.layout")
        > layer("porter.errors")
    )
    assert (
        layer("porter.format.manifest")
        == layer("porter.format.mxfp8")
        == layer("porter.format.prequantized")
        == FORMAT
    )
    assert sibling_of("porter.commands.verify.plot", COMMANDS) == "porter.commands.verify"
    assert sibling_of("runtime.moe", ENGINE) == "runtime" != sibling_of("porter.engine.run", ENGINE)
    with pytest.raises(KeyError):
        layer("porter.somewhere_new")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layers(module):
    mine = layer(module)
    bad = []
    for line, name in imports(module, MODULES[module]):
        if not own(name):
            continue
        target = resolve(name)
        theirs = layer(target)
        where = f"{MODULES[module].relative_to(ROOT)}:{line}: "
        if theirs > mine:
            bad.append(
                f"{where}{LAYER_NAMES[mine]} module {module} imports {LAYER_NAMES[theirs]} module {target}"
            )
        elif theirs == mine and sibling_of(target, mine) not in (None, sibling_of(module, mine)):
            bad.append(f"{where}{module} imports its sibling {target}")
    assert not bad, "\n".join(bad)


def resolve(name: str) -> str:
    """The module an import names: itself, or the module holding the imported attribute."""
    return name if name in MODULES else name.rsplit(".", 1)[0]


def import_graph(mods: dict) -> dict:
    """module -> the modules of porter's packages it imports (at any depth, inside functions too)."""
    return {
        m: {resolve(n) for _, n in imports(m, path) if own(n) and resolve(n) != m} for m, path in mods.items()
    }


def loops(graph: dict) -> list[set]:
    """Every strongly connected component of two or more modules (Tarjan): the modules of one import loop."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.add(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(scc)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycles(graph: dict) -> list[list[str]]:
    """One cycle through each import loop."""
    return [cycle_through(graph, scc) for scc in loops(graph)]


def cycle_through(graph: dict, scc: set) -> list[str]:
    """One cycle inside a strongly connected component: from its smallest module back to it (BFS)."""
    start = min(scc)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & scc):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(scc)


def test_no_import_cycles():
    """No two modules import each other, directly or around a longer loop (imports inside functions count:
    an import moved into a function to break a cycle still names the cycle)."""
    graph = import_graph(MODULES)
    found = [
        f"{' -> '.join(cycle_through(graph, scc))}   (the loop's modules: {', '.join(sorted(scc))})"
        for scc in loops(graph)
    ]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_cycle_check_finds_cycles(tmp_path):
    """The check is not vacuous: a two-module cycle hidden in a function and a three-module loop are found,
    a diamond is not."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) == []
    (tmp_path / "mxfp8.py").write_text(
        "from porter.errors import PorterError\n\ndef f():\n    from porter.format import mxfp8_native\n"
    )
    (tmp_path / "mxfp8_native.py").write_text("from porter.format.mxfp8 import BLOCK\n")
    quant, native = "porter.format.mxfp8", "porter.format.mxfp8_native"
    files = {quant: tmp_path / "mxfp8.py", native: tmp_path / "mxfp8_native.py"}
    assert cycles(import_graph(files)) == [[quant, native, quant]]


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
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
        ):
            bad.append(f"{module}:{node.lineno}: torch.load unpickles")
        if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
            bad.append(f"{module}:{node.lineno}: trust_remote_code")
    assert not bad, "\n".join(bad)


def test_the_check_catches_a_violation(tmp_path):
    """A format module importing a converter is reported (the check is not vacuous)."""
    f = tmp_path / "layout.py"
    f.write_text("import torch\n\ndef f():\n    from converters.minimax_m3 import TextConfig\n")
    found = [n for _, n in imports("porter.format.layout", f) if own(n)]
    assert found == ["converters.minimax_m3"]
    assert layer("converters.minimax_m3") > layer("porter.format.layout")


def _main_guard(node) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


@pytest.mark.parametrize(
    "path",
    sorted(
        p
        for d in ("porter", "converters", "runtime", "examples", "benchmarks", "tests")
        for p in (ROOT / d).rglob("*.py")
    ),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_main_block_last_and_one_name_for_tiny_checkpoint(path):
    """Nothing is defined after `if __name__ == "__main__":` (a script run would not see it), and the
    tiny checkpoint module is imported as `tiny_checkpoint` only (two names = two module objects)."""
    tree = ast.parse(path.read_text(), str(path))
    body = tree.body
    guards = [i for i, n in enumerate(body) if _main_guard(n)]
    late = [
        n
        for i, n in enumerate(body)
        if guards and i > guards[0] and isinstance(n, (ast.FunctionDef, ast.ClassDef))
    ]
    assert not late, f"{path.name}: {[n.name for n in late]} defined after the __main__ block"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "examples.tiny_checkpoint":
            pytest.fail(f"{path.name}:{node.lineno}: import tiny_checkpoint, not examples.tiny_checkpoint")


LAYOUT_NAMES = {"scale_name", "is_scale_name", "layer_of", "OutTensor", "ignored_layers"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_artifact_naming_comes_from_porter_layout(module):
    """Artifact naming has one home, porter/format/layout.py: nobody takes it from an architecture's
    converter."""
    tree = ast.parse(MODULES[module].read_text())
    bad = [
        f"{module}:{n.lineno}: imports {sorted(LAYOUT_NAMES & {a.name for a in n.names})} from {n.module}"
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        and (n.module or "").startswith("converters")
        and LAYOUT_NAMES & {a.name for a in n.names}
    ]
    assert not bad, "\n".join(bad)


STANDALONE_FILES = sorted(
    [
        *(
            p
            for d in ("porter", "converters", "runtime", "examples", "benchmarks", "tests")
            for p in (ROOT / d).rglob("*.py")
            if ".venv" not in p.parts
        ),
        *(ROOT / "docs").glob("*.md"),
        ROOT / "README.md",
    ]
)


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


# Family knowledge lives in converters/<family>/ and runtime/models/; elsewhere a family's name is allowed
# only where it must remain, each with its reason: (file, a regex of the allowed text, why).
FAMILY_NAME = re.compile(r"minimax|(?<![\w.])m[1-9](?![\w])|gpt[-_ ]?oss", re.IGNORECASE)
FAMILY_NAME_ALLOWED = [
    (
        "converters/__init__.py",
        r"minimax[-\w]*",
        "the registry: config.json model_type -> converter package, by name",
    ),
    (
        "converters/__init__.py",
        r"gpt[-_ ]?oss",
        "the registry: config.json model_type -> converter package, by name",
    ),
    (
        "runtime/moe/flashinfer_trtllm.py",
        "MiniMax2",
        "FlashInfer's own RoutingMethodType member that the contract's sigmoid + bias routing maps to",
    ),
    (
        "porter/commands/verify/inputs.py",
        "MiniMax-M3 is a mixture",
        "the text of verify's default prompt: changing it changes the documented verify figures",
    ),
    (
        "runtime/kernels/gemv.py",
        "MiniMax-M3's decode shapes",
        "names the shapes a measured tile sweep was made at (docs/performance.md)",
    ),
    (
        "runtime/moe/triton/kernels.py",
        "MiniMax-M3",
        "a bound worked out for one family's measured parameters, beside the general rule",
    ),
    (
        "runtime/moe/triton/prepare.py",
        "MiniMax-M3",
        "a measured per-layer figure of one family, beside the general rule",
    ),
]


def family_name_files() -> list[Path]:
    out = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")) + sorted((ROOT / pkg).rglob("*.c")):
            rel = f.relative_to(ROOT).as_posix()
            if rel.startswith("runtime/models/") or (
                rel.startswith("converters/") and rel.count("/") > 1  # converters/<family>/...
            ):
                continue
            out.append(f)
    return out


@pytest.mark.parametrize("path", family_name_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_family_names_outside_their_homes(path):
    """One architecture = one plug-in: no module outside converters/<family>/ and runtime/models/ names a
    model family (MiniMax, M2/M3, gpt-oss), in code, strings or comments, except the allow-listed texts."""
    rel = path.relative_to(ROOT).as_posix()
    allowed = [text for f, text, _ in FAMILY_NAME_ALLOWED if f == rel]
    bad = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        rest = line
        for text in allowed:
            rest = re.sub(text, "", rest, flags=re.IGNORECASE)
        if FAMILY_NAME.search(rest):
            bad.append(f"{rel}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_family_name_check_finds_names():
    """The pattern is not vacuous, and not so broad that it flags ordinary words."""
    for text in ("MiniMaxM3", "minimax_m2", "an M3 layer", "gpt-oss", "GptOss", "gpt_oss"):
        assert FAMILY_NAME.search(text), text
    for text in ("mxfp8", "bf16", "x.m2", "sm90", "m_tile", "PM3"):
        assert not FAMILY_NAME.search(text), text
    assert {f for f, _, _ in FAMILY_NAME_ALLOWED} <= {
        p.relative_to(ROOT).as_posix() for p in family_name_files()
    }
