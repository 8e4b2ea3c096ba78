"""Import paths from before the core was grouped into ``infer.kv``,
``infer.engine``, ``infer.plugins`` and ``infer.tools`` (docs/design.md,
"Layout"), and before the CPU kernels got their package, ``infer.backends.cpu``.

Plugins and scripts written against 0.1 import ``infer.hookspecs``,
``infer.registry``, ``infer.attention`` and the like. Those names still
import, as the very module at its new place (``infer.hookspecs is
infer.plugins.hookspecs``), with a :class:`DeprecationWarning` naming the new
path. ``infer.engine`` and ``infer.plugins`` became packages that export what
the old modules did, so they need no entry here.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: Old module name -> where it lives now.
MOVED: dict[str, str] = {
    "infer.attention": "infer.kv.attention",
    "infer.cache": "infer.kv.cache",
    "infer.paged_cache": "infer.kv.paged",
    "infer.paging": "infer.kv.blocks",
    "infer.kv_budget": "infer.engine.budget",
    "infer.generate": "infer.engine.generate",
    "infer.batching": "infer.engine.batch",
    "infer.speculative": "infer.engine.speculative",
    "infer.sampling": "infer.engine.sampling",
    "infer.hookspecs": "infer.plugins.hookspecs",
    "infer.registry": "infer.plugins.registry",
    "infer.selection": "infer.plugins.selection",
    "infer.cli": "infer.tools.cli",
    "infer.diff": "infer.tools.diff",
    "infer.bench": "infer.tools.bench",
    "infer.bench_machine": "infer.tools.bench_machine",
    "infer.bench_report": "infer.tools.bench_report",
    "infer.bench_worker": "infer.tools.bench_worker",
    # The CPU kernels and what drives them, gathered into infer.backends.cpu
    # (docs/design.md, "The CPU package").
    "infer.backends.kernels": "infer.backends.cpu.kernels",
    "infer.backends.numpy_record": "infer.backends.cpu.record",
    "infer.backends.numpy_plan": "infer.backends.cpu.plan",
    "infer.backends.numpy_recurrent": "infer.backends.cpu.recurrent",
    "infer.backends.numpy_mxfp4": "infer.backends.cpu.mxfp4",
    "infer.backends._affine": "infer.backends.cpu._kernels",
}


# Plain classes rather than importlib.abc's: importing importlib.abc imports importlib.resources
# and tempfile with it, about 10 ms of every process's start. The import system needs only the methods.
class _Alias:
    """Loads an old name as the module at its new place."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; import it from there", DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module at the new place is already executed


class _MovedFinder:
    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(name)
        return None if new is None else importlib.machinery.ModuleSpec(name, _Alias(new))


def install() -> None:
    """Let the old names import (idempotent)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
