"""Modules that moved when the core was grouped (infer/_moved.py) still
import under their 0.1 names: a plugin written against ``infer.hookspecs``
keeps working, told where the module went."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

from infer import _moved


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_path_is_the_module_at_its_new_place(old: str) -> None:
    if importlib.util.find_spec(_moved.MOVED[old]) is None:  # the C kernels, where no compiler built them
        pytest.skip(f"{_moved.MOVED[old]} is not built here")
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {_moved.MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(_moved.MOVED[old])


def test_from_imports_of_old_paths_give_the_same_objects() -> None:
    sys.modules.pop("infer.hookspecs", None)
    sys.modules.pop("infer.registry", None)
    with pytest.warns(DeprecationWarning):
        from infer.hookspecs import hookimpl
        from infer.registry import BackendSpec
    from infer.plugins import hookspecs, registry

    assert hookimpl is hookspecs.hookimpl and BackendSpec is registry.BackendSpec


def test_the_packages_that_replaced_modules_export_what_they_did() -> None:
    import infer.engine
    import infer.plugins

    assert infer.engine.Engine.__module__ == "infer.engine.runner"
    assert callable(infer.plugins.get_registry) and callable(infer.plugins.reload_plugins)


def test_a_name_that_never_existed_still_fails() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("infer.no_such_module")
