"""The conformance kit's runner: one op case, on a candidate and on the reference backend.

Modelled on ggml's ``test-backend-ops``. Each :class:`Case` (the table is
:mod:`infer.testing.cases`) draws op calls with a hypothesis strategy
(:mod:`infer.testing.strategies`): shapes, dtypes, parameters, and a seed
from which numpy draws the values. For every drawn call, :func:`check_case`

1. uploads the inputs to the candidate in the dtype under test (the
   candidate's ``compute_dtype``) and reads back what it really holds;
2. gives those exact values to the reference backend (:data:`REFERENCE`,
   ``backends/reference.py``: the contract in plain numpy) in float32, so both sides
   start from the same (already rounded) inputs;
3. runs the op on both, and compares: output dtype and shape exactly,
   integer results exactly, float results by NMSE (below), with NaN and
   infinity positions required to match;
4. checks that the candidate left its inputs unmodified (except the
   arrays an op may write, e.g. ``scatter_rows``'s ``dst``).

A candidate that raises :class:`~infer.errors.UnsupportedOpError` for an op
or dtype is reported *unsupported*, apart from *wrong*; any other exception
is wrong. Results come back as :class:`CaseResult`; the pytest layer turns
them into skips and failures.

Float error is the normalised mean squared error, as in ggml::

    NMSE = sum((candidate - reference)**2) / sum(reference**2)

Tolerances, per dtype under test (:data:`TOLERANCES`). With unit roundoff
``u`` (half an ulp at 1: 2**-24 for float32, 2**-11 for float16, 2**-8 for
bfloat16), one correctly rounded result has a relative error of at most
``u``, so its NMSE is at most ``u**2`` (``u**2 / 3`` on average). A correct
op rounds a few times (the inputs are shared, but intermediates, e.g.
attention probabilities or a norm before its weight, may be rounded in the
dtype), and library functions (exp, tanh, erf) differ by an ulp or two. So
the 16-bit bounds are ``(8 u)**2``: an rms error of 8 roundings. float32
is looser in units of ``u`` because the reference itself computes in float32:
libraries legitimately reorder long sums (BLAS blocking, pairwise vs
sequential reductions), and e.g. ``layer_norm`` of values offset by -50
loses ~6 bits to cancellation on both sides.

=========  =========  ==========
dtype      NMSE       ``(k u)²``
=========  =========  ==========
float32    1e-9       k ~ 530
float16    1.5e-5     k ~ 8
bfloat16   1e-3       k ~ 8
=========  =========  ==========

(The worst NMSE numpy, torch and MLX reach, well inside these, and the
argument at length: docs/conformance.md.)

Real mistakes give NMSE from 1e-3 to 1 (a wrong rope pair, a mask off by
one, a dropped bias, eps outside the square root on small inputs), far
above the float32 and float16 bounds; bfloat16 can hide the smallest of
them, which is why the kit runs float32 too. Integer results (argmax,
integer arithmetic, casts to int, shapes, dtypes) must match exactly.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from infer.errors import BackendUnavailableError, UnsupportedOpError
from infer.ops import Backend, is_float_dtype
from infer.testing.calls import FLOAT, INDEX, SAME, Call, Case, Host, In, Mismatch  # importable from here too

#: Largest NMSE accepted for a float result, by the dtype under test.
TOLERANCES: dict[str, float] = {"float32": 1e-9, "float16": 1.5e-5, "bfloat16": 1e-3}

DEFAULT_EXAMPLES = 25

#: The reference backend, by its registry name: the kit reaches it through the
#: plugin registry, as any caller would, and imports no backend module.
REFERENCE = "reference/cpu"


def reference_backend() -> Backend:
    """A new instance of the reference backend (:data:`REFERENCE`), in float32."""
    from infer.plugins import get_registry

    spec = get_registry().backends.get(REFERENCE)
    if spec is None:
        raise BackendUnavailableError(
            f"the conformance kit's reference backend {REFERENCE} is not registered (is infer installed "
            f"with its entry points?); registered: {', '.join(sorted(get_registry().backends)) or 'none'}")
    return spec.factory("float32")


@dataclass
class CaseResult:
    """How a backend did on one case."""

    case: str
    status: str  # "ok", "unsupported" or "wrong"
    detail: str = ""
    examples: int = 0
    unsupported_examples: int = 0
    worst_nmse: float = 0.0


class _Unsupported(Exception):
    pass


# -- running one call ------------------------------------------------------------------


def _upload(ops: Backend, value: Any, dtype: str, source: Callable[[In], np.ndarray],
            uploaded: list[tuple[In, Any]]) -> Any:
    if isinstance(value, In):
        host = source(value)
        target = (dtype if value.dtype == "float" else value.dtype)
        if value.weight:
            if ops.compute_dtype != target:
                raise ValueError("weights are uploaded in the compute dtype")
            array = ops.prepare_weight(host)
        else:
            array = ops.from_numpy(host, target)
        uploaded.append((value, array))
        return array
    if isinstance(value, list):
        return [_upload(ops, v, dtype, source, uploaded) for v in value]
    if isinstance(value, tuple):
        return tuple(_upload(ops, v, dtype, source, uploaded) for v in value)
    return value


def _held(value: Any, held: dict[int, np.ndarray]) -> Any:
    """The call's arguments with each :class:`In` replaced by the values the candidate holds."""
    if isinstance(value, In):
        return held[id(value)]
    if isinstance(value, (list, tuple)):
        return type(value)(_held(v, held) for v in value)
    return value


def _to_host(ops: Backend, out: Any) -> Any:
    """Results as host values: (array, dtype name) pairs, tuples, literals."""
    if isinstance(out, Host):
        return (np.asarray(out.value), str(out.value.dtype))
    if isinstance(out, (tuple, list)):
        return tuple(_to_host(ops, o) for o in out)
    if out is None or type(out) in (str, bool, int, float):  # not numpy scalars: those are arrays
        return out
    return (ops.to_numpy(out), ops.dtype(out))


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    """Normalised mean squared error over the finite entries."""
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    err = float(np.sum((got64 - want64) ** 2))
    norm = float(np.sum(want64 ** 2))
    if norm == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / norm


def _compare(got: Any, want: Any, allowed: str | tuple[str, ...], tol: float, where: str) -> float:
    """Raise :class:`Mismatch` unless ``got`` matches ``want``; return the NMSE."""
    if isinstance(want, tuple) and len(want) == 2 and isinstance(want[0], np.ndarray):
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], np.ndarray)):
            raise Mismatch(f"{where}: expected an array, got {got!r}")
        (g, gdt), (w, _) = got, want
        allowed = (allowed,) if isinstance(allowed, str) else allowed
        if gdt not in allowed:
            raise Mismatch(f"{where}: dtype {gdt}, expected {' or '.join(allowed)}")
        if g.shape != w.shape:
            raise Mismatch(f"{where}: shape {g.shape}, expected {w.shape}")
        if not is_float_dtype(gdt):
            if not np.array_equal(g, w):
                bad = np.argwhere(g != w)[:5].tolist()
                raise Mismatch(f"{where}: integer results differ at {bad}: got {g.ravel()[:8]}, "
                               f"expected {w.ravel()[:8]}")
            return 0.0
        g, w = g.astype(np.float64), w.astype(np.float64)
        for name, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
            if not np.array_equal(test(g), test(w)):
                raise Mismatch(f"{where}: {name} at {np.argwhere(test(g)).tolist()[:5]}, "
                               f"expected at {np.argwhere(test(w)).tolist()[:5]}")
        finite = np.isfinite(w)
        err = nmse(g[finite], w[finite])
        tol = max(tol, TOLERANCES.get(gdt, 0.0))  # e.g. astype to bfloat16 under float32
        if not err <= tol:
            worst = np.unravel_index(np.argmax(np.where(finite, np.abs(g - w), -1)), w.shape)
            raise Mismatch(f"{where}: NMSE {err:.3g} > {tol:.3g} (largest error at {tuple(map(int, worst))}: "
                           f"got {g[worst]:.6g}, expected {w[worst]:.6g})")
        return err
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            raise Mismatch(f"{where}: got {got!r}, expected a tuple of {len(want)}")
        if all(isinstance(w, int) for w in want):  # a shape
            if not all(type(x) is int for x in got) or got != want:
                raise Mismatch(f"{where}: got {got!r}, expected {want!r} (a tuple of Python ints)")
            return 0.0
        return max((_compare(g, w, allowed, tol, f"{where}[{i}]") for i, (g, w) in enumerate(zip(got, want))),
                   default=0.0)
    if got != want:
        raise Mismatch(f"{where}: got {got!r}, expected {want!r}")
    return 0.0


def _invoke(case: Case, ops: Backend, call: Call, args: tuple, kwargs: dict, reference: bool = False) -> Any:
    run = case.reference_run or case.run if reference else case.run
    if run is not None:
        return run(ops, call, args, kwargs)
    return getattr(ops, case.op)(*args, **kwargs)


def _within_bound(got: Any, want: Any, bound: np.ndarray, allowed: str | tuple[str, ...], where: str) -> float:
    """An approximate mode's result against the reference's exact one: dtype
    and shape exactly, every element within its ``bound``; returns the NMSE
    (reported, not judged)."""
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], np.ndarray)):
        raise Mismatch(f"{where}: expected an array, got {got!r}")
    (g, gdt), (w, _) = got, want
    allowed = (allowed,) if isinstance(allowed, str) else allowed
    if gdt not in allowed:
        raise Mismatch(f"{where}: dtype {gdt}, expected {' or '.join(allowed)}")
    if g.shape != w.shape:
        raise Mismatch(f"{where}: shape {g.shape}, expected {w.shape}")
    g, w = g.astype(np.float64), w.astype(np.float64)
    over = ~(np.abs(g - w) <= bound)  # NaN is over too
    if over.any():
        worst = tuple(int(i) for i in np.argwhere(over)[0])
        raise Mismatch(f"{where}: {int(over.sum())} of {over.size} values beyond the mode's bound (first at {worst}: "
                       f"got {g[worst]:.6g}, exact {w[worst]:.6g}, bound {bound[worst]:.3g})")
    return nmse(g, w)


def run_call(case: Case, candidate: Backend, reference: Backend, call: Call) -> float:
    """Check one call; returns its NMSE, raises :class:`Mismatch` or
    :class:`_Unsupported`."""
    dtype = candidate.compute_dtype
    uploaded: list[tuple[In, Any]] = []
    try:
        args = _upload(candidate, call.args, dtype, lambda i: i.value, uploaded)
        kwargs = {k: _upload(candidate, v, dtype, lambda i: i.value, uploaded) for k, v in call.kwargs.items()}
        # What the candidate really holds. A prepared weight may be the
        # backend's own object, so its values are those from_numpy gives.
        held = {id(spec): np.array(candidate.to_numpy(candidate.from_numpy(spec.value, dtype) if spec.weight else arr),
                                   copy=True) for spec, arr in uploaded}
    except UnsupportedOpError as exc:
        raise _Unsupported(str(exc)) from None
    except Exception as exc:
        raise Mismatch(f"uploading the inputs of {case.op} raised {type(exc).__name__}: {exc}") from exc
    # The reference starts from exactly the values the candidate holds.
    ref_uploads: list[tuple[In, Any]] = []
    widen = lambda i: held[id(i)]  # noqa: E731
    ref_args = _upload(reference, call.args, "float32", widen, ref_uploads)
    ref_kwargs = {k: _upload(reference, v, "float32", widen, ref_uploads) for k, v in call.kwargs.items()}
    if case.raises:
        try:
            _invoke(case, candidate, call, args, kwargs)
        except UnsupportedOpError as exc:
            raise _Unsupported(str(exc)) from None
        except Exception:
            return 0.0
        raise Mismatch(f"{case.op} returned instead of raising an error")
    try:
        got = _invoke(case, candidate, call, args, kwargs)
    except UnsupportedOpError as exc:
        raise _Unsupported(str(exc)) from None
    except Exception as exc:
        raise Mismatch(f"{case.op} raised {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}") from exc
    try:  # reading the result back is no place to claim "unsupported"
        got_host = _to_host(candidate, got)
    except Exception as exc:
        raise Mismatch(f"reading back the result of {case.op} raised {type(exc).__name__}: {exc}") from exc
    if case.expect is not None:
        want = _to_host(reference, Host(case.expect(call, *_held(call.args, held))))
    else:
        want = _to_host(reference, _invoke(case, reference, call, ref_args, ref_kwargs, reference=True))
    if case.bound is not None:
        bound = np.asarray(case.bound(call, *_held(call.args, held)), np.float64)
        err = _within_bound(got_host, want, bound, case.out(call, dtype), case.op)
    else:
        err = _compare(got_host, want, case.out(call, dtype), TOLERANCES[dtype], case.op)
    mutable = {id(a) for i, a in enumerate(call.args) if i in case.mutates and isinstance(a, In)}
    for n, (spec, arr) in enumerate(uploaded):
        if id(spec) in mutable or spec.weight:
            continue
        if not np.array_equal(candidate.to_numpy(arr), held[id(spec)], equal_nan=True):
            raise Mismatch(f"{case.op} modified its input #{n} ({spec!r})")
    return err


# -- running a case with hypothesis ------------------------------------------------------


def check_case(
    case: Case,
    candidate: Backend,
    *,
    max_examples: int = DEFAULT_EXAMPLES,
    reference: Backend | None = None,
) -> CaseResult:
    """Run ``case`` on ``candidate`` (in its compute dtype) against the
    reference backend (:func:`reference_backend`, unless ``reference`` is given).

    Deterministic (hypothesis derandomized, no example database), so a CI
    run repeats exactly. ``unsupported`` means every drawn call raised
    :class:`~infer.errors.UnsupportedOpError`; calls that did run must all
    be right.
    """
    from hypothesis import HealthCheck, given, reject, settings

    if reference is None:
        reference = reference_backend()
    result = CaseResult(case.name, "ok")
    reasons: list[str] = []

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(call=case.inputs)
    def run(call: Call) -> None:
        try:
            err = run_call(case, candidate, reference, call)
        except _Unsupported as exc:
            result.unsupported_examples += 1
            reasons.append(str(exc))
            reject()
        result.examples += 1
        result.worst_nmse = max(result.worst_nmse, err)

    from hypothesis.errors import Unsatisfiable

    try:
        run()
    except Unsatisfiable:
        if result.examples == 0 and reasons:
            return CaseResult(case.name, "unsupported", reasons[0], 0, result.unsupported_examples)
        raise
    except Exception as exc:  # Mismatch, or hypothesis' group of distinct failures
        result.status, result.detail = "wrong", _describe(exc)
        return result
    if result.examples == 0 and reasons:
        return CaseResult(case.name, "unsupported", reasons[0], 0, result.unsupported_examples)
    if reasons:
        result.detail = f"{len(reasons)} drawn calls unsupported, e.g.: {reasons[0]}"
    return result


def _describe(exc: BaseException) -> str:
    """The failure's message with hypothesis' notes (the failing call)."""
    group = getattr(exc, "exceptions", None)  # an ExceptionGroup (a backport on Python 3.10)
    if isinstance(group, tuple):
        return f"{len(group)} distinct failures:\n\n" + "\n\n".join(_describe(e) for e in group)
    text = str(exc) if isinstance(exc, Mismatch) else f"{type(exc).__name__}: {exc}"
    return "\n".join([text, *getattr(exc, "__notes__", ())]).strip()


def check_backend(candidate: Backend, cases: Sequence[Case] | None = None, **kwargs: Any) -> list[CaseResult]:
    """Every case (default: all of :data:`infer.testing.cases.CASES`) on ``candidate``."""
    from infer.testing.cases import CASES

    return [check_case(c, candidate, **kwargs) for c in (CASES if cases is None else cases)]


__all__ = [
    "TOLERANCES", "In", "Call", "Host", "Case", "CaseResult", "Mismatch", "FLOAT", "SAME", "INDEX",
    "REFERENCE", "reference_backend", "nmse", "run_call", "check_case", "check_backend",
]
