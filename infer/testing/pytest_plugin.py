"""pytest plugin of the conformance kit, loaded through the ``pytest11`` entry point.

It adds options and one fixture, and touches nothing else, so it is
harmless in test sessions that do not use it (disable it with
``-p no:infer``):

``--infer-backend NAME[,NAME...]`` (or ``$INFER_CONFORMANCE_BACKENDS``)
    backends to check, as ``infer.load`` names them: ``torch:cpu``,
    ``mlx``, ``mybackend/gpu``. A family name alone means each of its
    registered devices. A named backend that is not registered or not
    available here *fails* (in CI a missing backend must not pass
    silently). Without the option: every available backend except the
    reference the kit compares against (``reference/cpu``).
``--infer-dtype DTYPE[,DTYPE...]`` (or ``$INFER_CONFORMANCE_DTYPES``)
    float dtypes to check; default: each dtype the backend declares in
    ``float_dtypes``.
``--infer-examples N`` (or ``$INFER_CONFORMANCE_EXAMPLES``)
    hypothesis examples per op case (default 25).

The fixture ``infer_backend`` is a backend instance, one per
(backend, dtype) target; any test that uses it is parametrized over the
targets. The kit's own tests are ``infer/testing/test_conformance.py``::

    pytest --pyargs infer.testing --infer-backend mybackend
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pytest

BACKENDS_ENV = "INFER_CONFORMANCE_BACKENDS"
DTYPES_ENV = "INFER_CONFORMANCE_DTYPES"
EXAMPLES_ENV = "INFER_CONFORMANCE_EXAMPLES"
DEFAULT_EXAMPLES = 25


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("infer", "infer backend conformance kit")
    group.addoption(
        "--infer-backend", action="append", default=[], metavar="NAME[,NAME...]",
        help=f"backend(s) the conformance kit checks against the reference backend (env {BACKENDS_ENV}; "
             "default: every available backend except the reference)",
    )
    group.addoption(
        "--infer-dtype", action="append", default=[], metavar="DTYPE[,DTYPE...]",
        help=f"float dtypes to check (env {DTYPES_ENV}; default: every dtype the backend declares)",
    )
    group.addoption(
        "--infer-examples", type=int, default=None, metavar="N",
        help=f"hypothesis examples per op case (env {EXAMPLES_ENV}; default {DEFAULT_EXAMPLES})",
    )


_TARGETS = pytest.StashKey[list]()


@dataclass
class Target:
    """One (backend, dtype) pair to check."""

    key: str
    dtype: str
    #: Why the backend cannot run in ``dtype`` (reported as a skip), or None.
    unsupported: str | None = None
    instance: Any = field(default=None, repr=False)

    @property
    def id(self) -> str:
        return f"{self.key}-{self.dtype}"

    def backend(self) -> Any:
        if self.unsupported is not None:
            pytest.skip(self.unsupported)
        if self.instance is None:
            from infer.plugins import get_registry

            self.instance = get_registry().backends[self.key].factory(self.dtype)
        return self.instance


def _split(values: list[str], env: str) -> list[str]:
    items = [v for value in values for v in value.split(",")]
    if not items and os.environ.get(env):
        items = os.environ[env].split(",")
    return [i.strip() for i in items if i.strip()]


def examples(config: pytest.Config) -> int:
    """Hypothesis examples per op case for this session."""
    value = config.getoption("--infer-examples")
    if value is None:
        value = int(os.environ.get(EXAMPLES_ENV) or DEFAULT_EXAMPLES)
    return max(1, value)


def _targets(config: pytest.Config) -> list[Target]:
    from infer.plugins import get_registry
    from infer.plugins.registry import parse_backend_name
    from infer.plugins.selection import list_backends
    from infer.testing.conformance import REFERENCE

    infos = {i.key: i for i in list_backends()}
    requested = _split(config.getoption("--infer-backend"), BACKENDS_ENV)
    dtypes = _split(config.getoption("--infer-dtype"), DTYPES_ENV)
    problems: list[str] = []  # backends named but unusable: one usage error for all
    if requested:
        keys: list[str] = []
        for name in requested:
            family, device = parse_backend_name(name)
            found = [k for k, i in infos.items() if i.name == family and device in (None, i.device)]
            if not found:
                problems.append(f"{name}: no such backend is registered; registered: {', '.join(sorted(infos))}")
            elif device is None:
                # A bare family name means its devices usable here (a CPU-only CI
                # machine checks jax/cpu, not jax/gpu); it is an error only if none is.
                usable = [k for k in found if infos[k].available]
                if not usable:
                    reasons = "; ".join(f"{k}: {infos[k].reason}" for k in found)
                    problems.append(f"{name}: no device of it is available here ({reasons})")
                found = usable
            keys += [k for k in found if k not in keys]
    else:
        keys = [k for k, i in infos.items() if i.available and k != REFERENCE]
    targets: list[Target] = []
    for key in keys:
        if not infos[key].available:
            problems.append(f"{key}: not available here ({infos[key].reason})")
            continue
        try:
            default = get_registry().backends[key].factory(None)
        except Exception as exc:
            problems.append(f"{key}: its factory failed: {type(exc).__name__}: {exc}")
            continue
        for dtype in dtypes or default.float_dtypes:
            target = Target(key, dtype)
            if dtype not in default.float_dtypes:
                target.unsupported = f"{key} does not compute in {dtype} (it declares {', '.join(default.float_dtypes)})"
            elif dtype == default.compute_dtype:
                target.instance = default
            targets.append(target)
    if problems:
        raise pytest.UsageError("infer conformance kit: " + "; ".join(problems))
    return targets


def _session_targets(config: pytest.Config) -> list[Target]:
    targets = config.stash.get(_TARGETS, None)
    if targets is None:
        targets = _targets(config)
        config.stash[_TARGETS] = targets
    return targets


def _require_hypothesis() -> None:
    try:
        import hypothesis  # noqa: F401
    except ImportError as exc:
        from infer.testing import missing_hypothesis

        raise pytest.UsageError(str(missing_hypothesis(exc))) from exc


def pytest_configure(config: pytest.Config) -> None:
    # Backends named explicitly are resolved up front, so a name that is not
    # registered or not usable here, or a missing hypothesis, stops the run
    # with one clear message. (Without the option the kit's test module
    # raises MissingDependencyError, with the same advice, as it is collected.)
    if _split(config.getoption("--infer-backend"), BACKENDS_ENV):
        _require_hypothesis()
        _session_targets(config)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "infer_backend" not in metafunc.fixturenames:
        return
    targets = _session_targets(metafunc.config)
    metafunc.parametrize("infer_backend", targets, ids=[t.id for t in targets], indirect=True)


@pytest.fixture
def infer_backend(request: pytest.FixtureRequest) -> Any:
    """The backend under test (one per --infer-backend target and dtype)."""
    return request.param.backend()


@pytest.fixture
def infer_examples(request: pytest.FixtureRequest) -> int:
    """Hypothesis examples per op case (--infer-examples)."""
    return examples(request.config)
