"""Choosing a backend: explicit ``backend=`` > ``INFER_BACKEND`` > best score.

Candidates are probed best possible score first, until the rest cannot win
(:attr:`~infer.plugins.registry.BackendSpec.score_ceiling`); the choice and
the reason each other candidate was not taken are logged, in the manner of
vLLM's attention selector.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from infer.errors import BackendError, BackendUnavailableError
from infer.ops import API_VERSION, Backend
from infer.plugins.discovery import get_registry
from infer.plugins.registry import BackendSpec, Probe, describe, parse_backend_name

log = logging.getLogger(__name__)

BACKEND_ENV = "INFER_BACKEND"


@dataclass(frozen=True)
class BackendInfo:
    """One backend/device pair as seen from here."""

    name: str
    device: str
    available: bool
    score: int
    reason: str | None
    native_ops: tuple[str, ...]
    plugin: str
    description: str

    @property
    def key(self) -> str:
        return f"{self.name}/{self.device}"


def _probe(spec: BackendSpec) -> Probe:
    try:
        probe = spec.probe()
    except Exception as exc:  # the contract says probes never raise; still, never fatal
        return Probe(0, f"probe raised {type(exc).__name__}: {exc}")
    if not isinstance(probe, Probe):
        return Probe(0, f"probe returned {probe!r}, not a Probe")
    return probe


def _info(spec: BackendSpec, probe: Probe) -> BackendInfo:
    return BackendInfo(
        name=spec.name, device=spec.device, available=probe.score > 0,
        score=probe.score, reason=probe.reason, native_ops=tuple(probe.native_ops),
        plugin=spec.plugin, description=spec.description,
    )


def _best_first(infos: list[BackendInfo]) -> list[BackendInfo]:
    return sorted(infos, key=lambda i: (-i.score, i.key))


def list_backends() -> list[BackendInfo]:
    """Every registered backend/device pair, available or with the reason it
    is not, best first. Probes every one (and so imports every framework
    installed); choosing a backend probes only those that could win."""
    return _best_first([_info(spec, _probe(spec)) for spec in get_registry().backends.values()])


def _probed_until_decided(specs: list[BackendSpec]) -> list[BackendInfo]:
    """``specs`` probed best :attr:`~BackendSpec.score_ceiling` first, stopping
    once an available one scores above every ceiling left (those are left
    out, unprobed): the choice is the one probing them all would make."""
    def ceiling(spec: BackendSpec) -> float:
        return math.inf if spec.score_ceiling is None else spec.score_ceiling

    infos: list[BackendInfo] = []
    best: BackendInfo | None = None
    for spec in sorted(specs, key=lambda s: (-ceiling(s), s.key)):
        if best is not None and ceiling(spec) < best.score:
            log.debug("backend %s not probed: it scores at most %d, below %s (%d)",
                      spec.key, spec.score_ceiling, best.key, best.score)
            continue
        info = _info(spec, _probe(spec))
        infos.append(info)
        if info.available and (best is None or info.score > best.score):
            best = info
    return _best_first(infos)


def _candidates(request: str | None) -> tuple[list[BackendInfo], str]:
    specs = list(get_registry().backends.values())
    if request is None:
        return _probed_until_decided(specs), "highest score"
    family, device = parse_backend_name(request)
    matching = [s for s in specs if s.name == family and (device is None or s.device == device)]
    if not matching:
        raise BackendUnavailableError(
            f"no backend named {request!r} is registered; registered: "
            f"{describe(sorted(s.key for s in specs))}"
        )
    return _probed_until_decided(matching), f"requested {request!r}"


def select_backend(backend: str | Backend | None = None, dtype: str | None = None) -> Backend:
    """Build the backend to run on.

    ``backend`` is a :class:`Backend` instance (used as is), a name such as
    ``"numpy"``, ``"torch"`` or ``"torch:cuda"``, or None to use
    ``$INFER_BACKEND`` or else the available backend with the highest score.
    """
    if isinstance(backend, Backend):
        if dtype is not None and dtype != backend.compute_dtype:
            raise BackendError(
                f"dtype {dtype!r} asked for, but the given backend instance computes in "
                f"{backend.compute_dtype!r}: build the backend with that dtype instead"
            )
        log.info("backend %s/%s given as an instance", backend.name, backend.device)
        return _checked(backend, f"{backend.name}/{backend.device}")
    request = backend if backend is not None else (os.environ.get(BACKEND_ENV) or None)
    if backend is None and request is not None:
        log.info("backend %r requested through %s", request, BACKEND_ENV)
    candidates, why = _candidates(request)
    available = [c for c in candidates if c.available]
    for c in candidates:
        if not c.available:
            log.info("backend %s not usable: %s", c.key, c.reason)
    if not available:
        reasons = "; ".join(f"{c.key}: {c.reason}" for c in candidates) or "none registered"
        raise BackendUnavailableError(f"no usable backend ({why}): {reasons}")
    chosen = available[0]
    for other in available[1:]:
        log.info("backend %s (score %d) not chosen: %s (score %d) ranks higher",
                 other.key, other.score, chosen.key, chosen.score)
    log.info("backend %s chosen (%s)", chosen.key, why)
    spec = get_registry().backends[chosen.key]
    try:
        instance = spec.factory(dtype)
    except BackendError:
        raise
    except Exception as exc:
        raise BackendUnavailableError(
            f"backend {chosen.key} failed to start: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(instance, Backend):
        raise BackendUnavailableError(
            f"backend {chosen.key}'s factory returned {type(instance).__name__}, not a Backend"
        )
    return _checked(instance, chosen.key)


def _checked(backend: Backend, key: str) -> Backend:
    """Refuse a backend class written for another major version of the op contract."""
    if tuple(backend.api_version)[0] != API_VERSION[0]:
        raise BackendUnavailableError(
            f"backend {key} implements op contract {tuple(backend.api_version)}, infer needs "
            f"{API_VERSION[0]}.x: the backend plugin must be updated"
        )
    return backend
