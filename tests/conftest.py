"""Fixtures shared by the test files.

``backend`` and ``model``: a module that lists ``BACKENDS`` (backend names)
gets its tests that take ``backend`` run once per name, each skipped where
its framework (or device) is missing (:func:`reference.backend_params`). A
module that also lists ``VARIANTS`` (tiny model variants) gets ``model``:
that variant loaded on that backend, once per test process
(:func:`reference.load_tiny`; tests must leave its engine as they found it).
A test parametrizing ``backend`` itself, or a module defining its own
``model``, keeps its own.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings
from reference import backend_params, load_tiny

# CI (CI=true) runs every property test on hypothesis' derandomized examples, the same on
# every run, so that a submission's CI result is the code's and not a new example's; runs
# elsewhere explore new examples (and keep the failing ones in .hypothesis/).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def _parametrized_by_hand(metafunc: pytest.Metafunc, name: str) -> bool:
    return any(name in (m.args[0] if isinstance(m.args[0], (list, tuple)) else m.args[0].replace(" ", "").split(","))
               for m in metafunc.definition.iter_markers("parametrize"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    module = metafunc.module
    if "backend" in metafunc.fixturenames and hasattr(module, "BACKENDS") and not _parametrized_by_hand(
            metafunc, "backend"):
        metafunc.parametrize("backend", backend_params(*module.BACKENDS))
    if "tiny_variant" in metafunc.fixturenames and hasattr(module, "VARIANTS"):
        metafunc.parametrize("tiny_variant", module.VARIANTS)


@pytest.fixture
def model(tiny_variant: str, backend: str):  # type: ignore[no-untyped-def]
    """The module's tiny variant on the module's backend (see the docstring above)."""
    return load_tiny(tiny_variant, backend)
