"""The import layering of docs/design.md ("Layering"), checked on the source.

Every module of the package — ``infer/``, and ``backends/``, ``formats/`` and
``architectures/``, which are mapped to ``infer.backends.*``,
``infer.formats.*`` and ``infer.architectures.*`` — is parsed with :mod:`ast`,
never imported. Every import in it is an edge of the module graph: at module
level, inside functions, under ``if TYPE_CHECKING:`` (a type-only import still
ties the two modules together), relative imports resolved, and constant names
passed to ``importlib.import_module`` or ``__import__``. On that graph:

(a) no module reaches itself (no cycles; each is reported as a path);
(b) the core imports no plugin module: it reaches backends, formats and
    architectures through the registry;
(c) architectures import only the contract they are written against, and
    each other;
(d) backends and formats import the core contract, not architectures, and not
    each other across families, unless an exception below says why.

The rules are the tables right below, keyed by module prefix: moving a module
(as ``infer.attention`` became ``infer.kv.attention``) changes a row of a table,
never the checker. docs/design.md shows the same tables.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

# -- the rules (docs/design.md, "Layering", mirrors these tables) ------------------------------

#: Which layer a module belongs to: that of its longest matching prefix.
LAYERS: dict[str, str] = {
    "infer": "core",
    "infer.backends": "backend",
    "infer.formats": "format",
    "infer.architectures": "architecture",
}

#: The core modules every plugin builds on: the op contract, the typed errors,
#: the hooks and the specs it registers.
CONTRACT: tuple[str, ...] = ("infer.ops", "infer.errors", "infer.plugins.hookspecs", "infer.plugins.registry")

#: What a module of each layer may import: whole layers by name, single core
#: modules (or subpackages) by prefix.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "core": ("core",),
    "backend": ("backend", *CONTRACT, "infer.oplib", "infer.quantize"),
    "format": ("format", *CONTRACT, "infer.package", "infer.tokenizer", "infer.paths"),
    "architecture": ("architecture", *CONTRACT, "infer.config", "infer.architecture", "infer.kv.attention"),
}

#: Imports the table above forbids that are allowed anyway, each with its
#: reason: ``(importer prefix, imported prefix) -> why``. None today.
EXCEPTIONS: dict[tuple[str, str], str] = {}

IMPORT_FUNCTIONS = ("import_module", "__import__")


# -- the checker ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    """``importer`` imports ``imported`` at ``line`` of ``path``."""

    importer: str
    imported: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}"


Graph = dict[str, list[Edge]]


def find_modules(roots: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Every module under the package folders ``roots`` (dotted name -> folder):
    ``name -> (file, is_package)``. Subfolders with an ``__init__.py`` are
    subpackages; a name found under two roots is kept once."""
    modules: dict[str, tuple[Path, bool]] = {}
    for package, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if any(not (folder / Path(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
                continue  # in a folder that is not a package (data, build output)
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *(parts[:-1] if is_package else parts)])
            modules.setdefault(name, (path, is_package))
    return modules


#: Compiled extension modules (setup.py), imported by their full name: leaves that import
#: nothing of the package, so importing one is no edge to the package holding it.
EXTENSION_MODULES = frozenset({"infer.formats._sentencepiece", "infer.formats._gguf_strings"})


def _owner(name: str, modules: dict[str, tuple[Path, bool]]) -> str | None:
    """The module ``name`` refers to: itself, or its longest prefix that is a
    module (``infer.ops.Backend`` -> ``infer.ops``); None outside the package
    and for a compiled extension module."""
    if name in EXTENSION_MODULES:
        return None
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _absolute(importer: str, is_package: bool, level: int, module: str | None) -> str | None:
    """The absolute module of ``from <level dots><module> import ...`` in ``importer``."""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    if level - 1 >= len(package):
        return None  # climbs above the top-level package
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imported_names(tree: ast.AST, importer: str, is_package: bool, modules: dict[str, tuple[Path, bool]]):
    """(line, dotted name) of everything ``tree`` imports."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module if node.level == 0 else _absolute(importer, is_package, node.level, node.module)
            if base is None:
                yield node.lineno, "." * node.level + (node.module or "")
                continue
            for alias in node.names:
                # ``from infer import backends`` imports the module infer.backends.
                full = f"{base}.{alias.name}"
                yield node.lineno, full if full in modules else base
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if called in IMPORT_FUNCTIONS and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield node.lineno, arg.value


def module_graph(modules: dict[str, tuple[Path, bool]]) -> Graph:
    """Each module's imports of other modules of the package."""
    graph: Graph = {}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: dict[str, Edge] = {}
        for line, imported in _imported_names(tree, name, is_package, modules):
            target = _owner(imported, modules)
            if target is not None and target != name and target not in edges:
                edges[target] = Edge(name, target, str(path), line)
        graph[name] = list(edges.values())
    return graph


def layer_of(module: str, layers: dict[str, str] = LAYERS) -> str | None:
    """The layer of the longest prefix of ``module`` in ``layers``."""
    matches = [p for p in layers if module == p or module.startswith(p + ".")]
    return layers[max(matches, key=len)] if matches else None


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def allowed(importer: str, imported: str, layers: dict[str, str] = LAYERS,
            may_import: dict[str, tuple[str, ...]] = MAY_IMPORT,
            exceptions: dict[tuple[str, str], str] = EXCEPTIONS) -> bool:
    """Whether the rules let ``importer`` import ``imported``."""
    target_layer = layer_of(imported, layers)
    for rule in may_import.get(layer_of(importer, layers) or "", ()):
        if rule in may_import and rule == target_layer:
            return True
        if rule not in may_import and target_layer == layer_of(rule, layers) and _matches(imported, rule):
            return True
    return any(_matches(importer, a) and _matches(imported, b) for a, b in exceptions)


def violations(graph: Graph, layer: str | None = None, **rules) -> list[str]:  # type: ignore[no-untyped-def]
    """Every edge the rules forbid (of importers in ``layer``, or all)."""
    layers = rules.get("layers", LAYERS)
    return [f"{edge} ({layer_of(edge.importer, layers)} -> {layer_of(edge.imported, layers)})"
            for edges in graph.values() for edge in edges
            if (layer is None or layer_of(edge.importer, layers) == layer) and not allowed(
                edge.importer, edge.imported, **rules)]


def cycles(graph: Graph, skip: set[tuple[str, str]] | frozenset[tuple[str, str]] = frozenset()) -> list[list[Edge]]:
    """One cycle (a closed path of edges) per strongly connected group of
    modules, ignoring the edges in ``skip``."""
    succ = {m: [e for e in edges if (e.importer, e.imported) not in skip and e.imported in graph]
            for m, edges in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph is a few hundred modules at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in succ[v]:
            w = e.imported
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return [_path_back(group[0], set(group), succ) for group in groups]


def _path_back(start: str, group: set[str], succ: dict[str, list[Edge]]) -> list[Edge]:
    """The shortest path of edges from ``start`` back to itself inside ``group``."""
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for e in succ[v]:
                if e.imported not in group:
                    continue
                if e.imported == start:
                    path = [e]
                    while path[0].importer != start:
                        path.insert(0, came[path[0].importer])
                    return path
                if e.imported not in came:
                    came[e.imported] = e
                    nxt.append(e.imported)
        frontier = nxt
    raise AssertionError(f"{start} is in a cycle but no path leads back to it")


def describe(cycle: list[Edge]) -> str:
    return " -> ".join([cycle[0].importer] + [e.imported for e in cycle]) + "\n" + "\n".join(
        f"    {e}" for e in cycle)


def package_roots() -> dict[str, Path]:
    """The source folder of each package named in :data:`LAYERS`."""
    roots = {}
    for package in LAYERS:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, f"{package} is not an importable package"
        for folder in spec.submodule_search_locations:
            roots.setdefault(package, Path(folder))
    return roots


@pytest.fixture(scope="module")
def graph() -> Graph:
    return module_graph(find_modules(package_roots()))


# -- the package ---------------------------------------------------------------------------------


def test_the_whole_package_is_parsed(graph: Graph) -> None:
    # Guards every check below against passing on an empty or partial graph.
    expected = {"infer", "infer.ops", "infer.testing.conformance", "infer.backends.numpy", "infer.formats.gguf",
                "infer.architectures.llama"}
    assert expected <= set(graph)
    assert any(e.imported == "infer.ops" for e in graph["infer.architectures.llama"])


def test_no_import_cycles(graph: Graph) -> None:
    found = cycles(graph)
    assert not found, "import cycles (docs/design.md, \"Layering\"):\n" + "\n".join(map(describe, found))


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_each_layer_imports_only_what_it_may(graph: Graph, layer: str) -> None:
    problems = violations(graph, layer)
    assert not problems, (f"{layer} modules may import only {', '.join(MAY_IMPORT[layer])} "
                          "(docs/design.md, \"Layering\"):\n" + "\n".join(problems))


def test_every_rule_names_a_layer_or_an_existing_module(graph: Graph) -> None:
    """A rule left behind by a move (``infer.attention`` after it became
    ``infer.kv.attention``) would silently allow nothing."""
    stale = [rule for rules in MAY_IMPORT.values() for rule in rules
             if rule not in MAY_IMPORT and not any(_matches(m, rule) for m in graph)]
    stale += [f"{a} -> {b}" for a, b in EXCEPTIONS if not any(_matches(m, a) for m in graph)]
    assert not stale, f"rules naming no module: {stale}"


def imports_of_the_numpy_backend(graph: Graph) -> list[str]:
    """The edges from torch's modules, or from the CPU package, to the numpy backend."""
    importers = [m for m in graph if _matches(m, "infer.backends.cpu")
                 or (_matches(m, "infer.backends") and m.rpartition(".")[2].startswith("torch"))]
    return [str(e) for m in importers for e in graph[m] if _matches(e.imported, "infer.backends.numpy")]


def test_torch_and_the_cpu_package_never_import_the_numpy_backend(graph: Graph) -> None:
    """torch/cpu runs the CPU package's kernels and records its step through the
    package's backend class (``infer.backends.cpu``), as the numpy backend does: the
    registered numpy backend is a composition of that package, no library for
    another backend (docs/design.md, "The CPU package")."""
    assert "infer.backends.torch" in graph and "infer.backends.cpu.backend" in graph
    found = imports_of_the_numpy_backend(graph)
    assert not found, "import infer.backends.cpu instead:\n" + "\n".join(found)


def test_an_import_of_the_numpy_backend_inside_torch_is_found(tmp_path: Path) -> None:
    g = tiny_graph(tmp_path, {"infer/backends/torch_cpu.py": "def f():\n    from infer.backends import numpy\n"})
    assert imports_of_the_numpy_backend(g) == [
        f"{tmp_path / 'infer/backends/torch_cpu.py'}:2: infer.backends.torch_cpu imports infer.backends.numpy"]


# -- the checker itself ------------------------------------------------------------------------------

TINY = {  # a package shaped like infer, every import allowed
    "infer/__init__.py": "",
    "infer/ops.py": "import numpy\n",
    "infer/errors.py": "",
    "infer/plugins/__init__.py": "from infer.plugins.registry import Registry\n",
    "infer/plugins/hookspecs.py": "",
    "infer/plugins/registry.py": "from infer.ops import API_VERSION\n",
    "infer/engine/__init__.py": "from infer.engine.runner import Engine\n",
    "infer/engine/runner.py": "from infer.ops import Backend\nfrom ..plugins import registry\n",
    "infer/kv/__init__.py": "",
    "infer/kv/attention.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from infer.ops import Array\n",
    "infer/backends/__init__.py": "",
    "infer/backends/numpy.py": "from infer.ops import Backend\nfrom infer.plugins.registry import BackendSpec\n"
                               "from infer.backends import _affine\n",
    "infer/formats/__init__.py": "",
    "infer/formats/gguf.py": "from . import gguf_quants\nfrom infer.errors import FormatError\n",
    "infer/formats/gguf_quants.py": "import numpy as np\n",
    "infer/architectures/__init__.py": "",
    "infer/architectures/llama.py": "from infer.kv.attention import AttentionContext\nfrom .rope import rope\n",
    "infer/architectures/rope.py": "from infer.ops import Backend\n",
}


def tiny_graph(tmp_path: Path, extra: dict[str, str] | None = None) -> Graph:
    files = dict(TINY)
    for name, line in (extra or {}).items():
        files[name] = files.get(name, "") + line
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return module_graph(find_modules({"infer": tmp_path / "infer"}))


def test_the_checker_passes_a_clean_package(tmp_path: Path) -> None:
    g = tiny_graph(tmp_path)
    assert "infer.backends.numpy" in g and "infer.architectures.rope" in g
    assert {e.imported for e in g["infer.architectures.llama"]} == {"infer.kv.attention", "infer.architectures.rope"}
    assert {e.imported for e in g["infer.kv.attention"]} == {"infer.ops"}  # under TYPE_CHECKING, still an edge
    assert {e.imported for e in g["infer.engine.runner"]} == {"infer.ops", "infer.plugins.registry"}
    assert cycles(g) == [] and violations(g) == []


FORBIDDEN = {
    "core imports a backend, in a function": (
        "infer/engine/runner.py", "def f():\n    from infer.backends.numpy import NumpyBackend\n", "core -> backend"),
    "core names a backend module as an attribute import": (
        "infer/engine/runner.py", "from infer.backends import numpy\n", "core -> backend"),
    "core imports a format through importlib": (
        "infer/plugins/registry.py", "import importlib\nm = importlib.import_module('infer.formats.gguf')\n",
        "core -> format"),
    "an architecture imports the engine": (
        "infer/architectures/llama.py", "from infer.engine import Engine\n", "architecture -> core"),
    "an architecture imports a format, relatively": (
        "infer/architectures/rope.py", "from ..formats import gguf\n", "architecture -> format"),
    "a backend imports an architecture": (
        "infer/backends/numpy.py", "import infer.architectures.llama\n", "backend -> architecture"),
    "a format imports a backend": (
        "infer/formats/gguf_quants.py", "from infer.backends.numpy import NumpyBackend\n", "format -> backend"),
    "a format imports a core module outside the contract": (
        "infer/formats/gguf.py", "from infer.engine import Engine\n", "format -> core"),
}


@pytest.mark.parametrize("name", list(FORBIDDEN))
def test_the_checker_fails_on_a_forbidden_import(tmp_path: Path, name: str) -> None:
    file, line, what = FORBIDDEN[name]
    problems = violations(tiny_graph(tmp_path, {file: line}))
    assert len(problems) == 1, problems
    assert what in problems[0] and str(tmp_path / file) in problems[0]


def test_the_checker_reports_a_cycle_with_its_path(tmp_path: Path) -> None:
    g = tiny_graph(tmp_path, {"infer/ops.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from infer.engine import Engine\n"})
    (found,) = cycles(g)
    text = describe(found)
    assert text.splitlines()[0] == "infer.engine -> infer.engine.runner -> infer.ops -> infer.engine"
    assert f"{tmp_path / 'infer/ops.py'}:4" in text
    assert cycles(g, skip={("infer.ops", "infer.engine")}) == []


def test_an_exception_allows_exactly_its_import(tmp_path: Path) -> None:
    g = tiny_graph(tmp_path, {"infer/formats/gguf.py": "from infer.backends import numpy\n",
                              "infer/formats/gguf_quants.py": "from infer.backends import numpy\n"})
    assert len(violations(g)) == 2
    only = {("infer.formats.gguf", "infer.backends.numpy"): "a reason"}
    assert [p.split(":")[0] for p in violations(g, exceptions=only)] == [str(tmp_path / "infer/formats/gguf_quants.py")]


def test_the_real_graph_with_one_added_forbidden_import_fails(graph: Graph) -> None:
    g = {m: list(edges) for m, edges in graph.items()}
    g["infer.quantize"].append(Edge("infer.quantize", "infer.formats.gguf_quants", "infer/quantize.py", 1))
    assert violations(g) == violations(graph) + [
        "infer/quantize.py:1: infer.quantize imports infer.formats.gguf_quants (core -> format)"]


def test_a_moved_module_needs_only_a_table_row(tmp_path: Path) -> None:
    """The attention context moved from ``infer.attention`` to
    ``infer.kv.attention``: an architecture still on the old module breaks
    the rule, and renaming one row of the table is all a move takes."""
    g = tiny_graph(tmp_path, {"infer/attention.py": "from infer.ops import Array\n",
                              "infer/architectures/llama.py": "from infer.attention import X\n"})
    assert len(violations(g)) == 1  # not allowed under today's rule
    before = dict(MAY_IMPORT, architecture=tuple("infer.attention" if rule == "infer.kv.attention" else rule
                                                 for rule in MAY_IMPORT["architecture"]))
    assert len(violations(g, may_import=before)) == 1  # now the kv.attention import is the stranger
    both = dict(MAY_IMPORT, architecture=(*MAY_IMPORT["architecture"], "infer.attention"))
    assert violations(g, may_import=both) == []
