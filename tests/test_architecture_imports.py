"""Architecture files are written only against the op contract (docs/design.md, rule 2).

Every ``.py`` file of ``infer.architectures`` is parsed with :mod:`ast` (never
imported) and may not import numpy, torch, mlx or jax, a backend or a format,
whether by an import statement, a relative import that climbs out of the package,
or a string passed to ``importlib.import_module``/``__import__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import infer.architectures
import pytest

PACKAGE = "infer.architectures"

# Top-level names no architecture may import, and dotted prefixes.
FORBIDDEN_TOP = ("numpy", "torch", "mlx", "jax", "jaxlib", "backends", "formats")
FORBIDDEN_PREFIXES = ("infer.backends", "infer.formats")
IMPORT_FUNCTIONS = ("import_module", "__import__")


def forbidden(module: str) -> bool:
    top = module.split(".")[0]
    return top in FORBIDDEN_TOP or any(
        module == p or module.startswith(p + ".") for p in FORBIDDEN_PREFIXES
    )


def resolve_relative(level: int, module: str | None, package: str = PACKAGE) -> str:
    """Absolute name of ``from <level dots><module> import ...`` inside ``package``."""
    parts = package.split(".")
    if level - 1 > len(parts) - 1:
        return "." * level + (module or "")  # climbs above the top-level package
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def violations(source: str, filename: str, package: str = PACKAGE) -> list[str]:
    """Every forbidden import in ``source``, as ``"file:line: what"``."""
    found: list[str] = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if forbidden(alias.name):
                    report(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                base = resolve_relative(node.level, node.module, package)
            # ``from infer import backends`` names the module in the alias.
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for name in candidates:
                if name and forbidden(name):
                    dots = "." * node.level
                    names = ", ".join(alias.name for alias in node.names)
                    report(node, f"from {dots}{node.module or ''} import {names} (-> {name})")
                    break
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called not in IMPORT_FUNCTIONS or not node.args:
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if forbidden(arg.value):
                    report(node, f"{called}({arg.value!r})")
            else:
                # A computed module name cannot be checked, so it is not allowed either.
                report(node, f"{called}(<computed name: {ast.unparse(arg)}>)")
    return found


def architecture_files() -> list[Path]:
    files = sorted(
        path for folder in infer.architectures.__path__ for path in Path(folder).rglob("*.py")
    )
    return files


def test_architecture_package_is_found():
    names = {p.name for p in architecture_files()}
    # Guards against the check below passing vacuously on an empty list.
    assert {"__init__.py", "llama.py", "rope.py"} <= names


@pytest.mark.parametrize("path", architecture_files(), ids=lambda p: p.name)
def test_architecture_file_imports_no_backend_framework_or_format(path):
    problems = violations(path.read_text(encoding="utf-8"), str(path))
    assert not problems, "architecture files must use only the op contract:\n" + "\n".join(problems)


# -- the checker itself ---------------------------------------------------------------------


BAD_SNIPPETS = {
    "import numpy as np": "import numpy",
    "import torch.nn.functional as F": "import torch.nn.functional",
    "import os, mlx.core as mx": "import mlx.core",
    "from jax import numpy as jnp": "from jax import numpy",
    "from numpy.linalg import norm": "from numpy.linalg import norm",
    "from infer.backends.numpy import NumpyBackend": "infer.backends.numpy",
    "from infer import backends": "-> infer.backends",
    "from infer import ops, formats": "-> infer.formats",
    "import infer.formats.huggingface": "import infer.formats.huggingface",
    "from ..backends import numpy": "-> infer.backends",
    "from .. import formats": "-> infer.formats",
    "import backends.numpy": "import backends.numpy",
    "from formats import huggingface": "from formats import huggingface",
    "import importlib\nm = importlib.import_module('torch')": "import_module('torch')",
    "from importlib import import_module\nm = import_module('infer.backends.numpy')":
        "import_module('infer.backends.numpy')",
    "np = __import__('numpy')": "__import__('numpy')",
    "name = 'torch'\nm = __import__(name)": "computed name: name",
    "def f():\n    import jax\n    return jax": "import jax",
}


@pytest.mark.parametrize("source, expected", BAD_SNIPPETS.items(), ids=list(BAD_SNIPPETS))
def test_checker_flags_each_forbidden_import(source, expected, tmp_path):
    bad = tmp_path / "badarch.py"
    bad.write_text("from __future__ import annotations\n" + source + "\n")
    problems = violations(bad.read_text(), str(bad))
    assert len(problems) == 1, problems
    assert str(bad) in problems[0] and expected in problems[0]


def test_checker_reports_line_numbers_of_a_synthetic_bad_file(tmp_path):
    bad = tmp_path / "mixed.py"
    bad.write_text("from infer.ops import Backend\nimport numpy\nfrom .rope import RotaryEmbedding\n"
                   "import torch\n")
    assert violations(bad.read_text(), str(bad)) == [f"{bad}:2: import numpy", f"{bad}:4: import torch"]


@pytest.mark.parametrize("source", [
    "from infer.ops import Array, Backend",
    "from infer.kv.attention import AttentionContext",
    "from infer.architecture import host_array",
    "from .rope import RotaryEmbedding",
    "from . import rope",
    "import math, struct",
    "from dataclasses import dataclass",
    "import numpy_financial_helpers_not_numpy",  # only the exact top-level name is banned
    "x = getattr(ops, 'silu')",
])
def test_checker_allows_the_op_contract_and_the_standard_library(source):
    assert violations(source, "goodarch.py") == []
