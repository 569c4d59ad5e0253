"""The house's rules, read from the source (nothing imported): imports point one way through the
layers, no import cycles, few top-level modules, no giant modules or functions.

Layers, lowest first; a module may import its own layer and those below it:
  base (errors, _compat, _version) <- core <- io (tunables among them) <- formats <- producers
  <- plan <- engine (collective among them) <- views (export, lora) <- verbs (verbs/, verify/,
  hub/, training/, integrations/) <- cli
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

import pytest

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "ckptools")

LAYERS: dict[str, int] = {
    "ckptools": 0,  # the package surface: lazy names only, checked separately
    "ckptools.errors": 0,
    "ckptools._compat": 0,
    "ckptools._version": 0,
    "ckptools.core": 1,
    "ckptools.io": 2,
    "ckptools.formats": 3,
    "ckptools.producers": 4,
    # a family's package holds every floor of what it knows: its planning sits with the
    # planners, its training view with the views
    "ckptools.producers.megatron.plan": 5,
    "ckptools.producers.megatron.moe": 5,
    "ckptools.producers.megatron.mla": 5,
    "ckptools.producers.megatron.mla_shard": 5,
    "ckptools.producers.megatron.converted": 6,
    "ckptools.producers.megatron.writer": 6,
    "ckptools.producers.megatron.training": 7,
    "ckptools.producers.megatron.views": 7,
    "ckptools.plan": 5,
    "ckptools.engine": 6,
    "ckptools.views": 7,  # the checkpoint as the HF model (export) and its LoRA adapter
    # the output protocol every writer runs (stage, shares, seal, checksums, commit), on the
    # engine's collective
    "ckptools.outputs": 7,
    "ckptools.verbs": 8,
    "ckptools.verify": 8,
    "ckptools.hub": 8,
    "ckptools.training": 8,
    "ckptools.integrations": 8,
    "ckptools.cli": 9,
    "ckptools.__main__": 9,
}
MAX_TOP_LEVEL_MODULES = 3
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def _modules() -> dict[str, str]:
    mods = {}
    root = os.path.abspath(PACKAGE)
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()


def _source(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _imports(module: str, path: str) -> Iterator[tuple[str, int]]:
    """(imported ckptools module, line) for every import anywhere in the file, lazy ones too."""
    tree = ast.parse(_source(path))
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            names = []
            for a in node.names:
                sub = f"{base}.{a.name}"
                names.append((sub if sub in MODULES else base, node.lineno))
        else:
            continue
        for name, line in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("ckptools") and name != module:
                yield name, line


def _layer(module: str) -> int:
    best = ""
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    assert best, f"{module} belongs to no layer: add it to LAYERS in {__file__}"
    return LAYERS[best]


GRAPH = {m: sorted(set(_imports(m, p))) for m, p in MODULES.items()}


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        _layer(module)


def test_imports_point_down_the_layers() -> None:
    wrong = [
        f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)}) at line {line}"
        for m, targets in GRAPH.items()
        if m != "ckptools"
        for t, line in targets
        if _layer(t) > _layer(m)
    ]
    assert not wrong, "\n".join(wrong)


def test_package_surface_is_lazy() -> None:
    # `import ckptools` must import no verb: every public name resolves on first use.
    tree = ast.parse(_source(MODULES["ckptools"]))
    type_checking = {
        n.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for n in ast.walk(node)
        if isinstance(n, ast.ImportFrom)
    }
    eager = [
        t
        for t, line in _imports("ckptools", MODULES["ckptools"])
        if t != "ckptools._version" and line not in type_checking
    ]
    assert not eager, eager


def test_no_import_cycles() -> None:
    graph = {m: {t for t, _ in ts} for m, ts in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_few_top_level_modules() -> None:
    top = [
        f
        for f in os.listdir(PACKAGE)
        if f.endswith(".py") and f not in ("__init__.py", "__main__.py", "_version.py")
    ]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, sorted(top)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_and_function_sizes(module: str) -> None:
    source = _source(MODULES[module])
    assert source.count("\n") <= MAX_MODULE_LINES, f"{module}: {source.count(chr(10))} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{module}: {long}"


def _registry_names() -> set[str]:
    """The layout names of the registry: what each family's package declares in its
    ``LAYOUTS`` (``producers/<family>/__init__.py``), read from the source."""
    names: set[str] = set()
    for module, path in MODULES.items():
        if module.startswith("ckptools.producers.") and path.endswith("__init__.py"):
            for node in ast.walk(ast.parse(_source(path))):
                if isinstance(node, ast.Assign) and any(
                    getattr(t, "id", "") == "LAYOUTS" for t in node.targets
                ):
                    names |= {entry[0] for entry in ast.literal_eval(node.value)}
    assert names, "no family package declares LAYOUTS"
    return names


def _strings(node: ast.expr) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {s for e in node.elts for s in _strings(e)}
    return set()


#: attributes whose vocabulary is the manifest's own, not a producer's: the storage format
#: (``"dcp"``, ``"safetensors"``, ``"torch_save"``) and a chunk's encoding
_NOT_PRODUCERS = {"format", "encoding"}


def test_no_producer_name_is_compared_outside_the_producers() -> None:
    """Issue 37: the registry is the only table; outside ``ckptools/producers/`` a verb asks
    the layout (its views, write targets, capabilities) and never compares a producer's name
    (``manifest.layout == "megatron"``, ``to == "megatron"``, ``layout.name == "dcp"``)."""
    names = _registry_names()
    found = []
    for module, path in MODULES.items():
        if module.startswith("ckptools.producers"):
            continue
        for node in ast.walk(ast.parse(_source(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr in _NOT_PRODUCERS for s in sides):
                continue
            compared = set().union(*(_strings(s) for s in sides)) & names
            if compared:
                found.append(f"{module}:{node.lineno}: {sorted(compared)}")
    assert not found, found


def test_megatron_is_named_by_its_package_alone() -> None:
    # issue 37: a family's words, facts, views, writer and pickled classes live in its package
    # (18 files outside it named Megatron before; its pickle allowlist was the last)
    naming = {
        module
        for module, path in MODULES.items()
        if not module.startswith("ckptools.producers") and "megatron" in _source(path).lower()
    }
    assert not naming, sorted(naming)
