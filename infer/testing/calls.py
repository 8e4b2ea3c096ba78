"""What a conformance case is made of: the calls it draws and what it expects.

A :class:`Case` names an op, a hypothesis strategy drawing :class:`Call`
objects (whose :class:`In` arguments become backend arrays), how to run the
op when that is more than ``op(*args, **kwargs)``, and the dtype its result
must have (:func:`FLOAT`, :func:`SAME`, :func:`INDEX`). The table of cases
is :mod:`infer.testing.cases`, the strategies :mod:`infer.testing.strategies`,
the runner :mod:`infer.testing.conformance`; all three import this module,
and it imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infer.ops import Backend


@dataclass(frozen=True)
class In:
    """A host array the kit uploads as an op input.

    ``dtype`` "float" means the dtype under test; otherwise a contract dtype
    name. ``weight`` uploads through :meth:`~infer.ops.Backend.prepare_weight`
    (what :meth:`linear` and :meth:`embedding` expect) instead of
    :meth:`~infer.ops.Backend.from_numpy`.
    """

    value: np.ndarray
    dtype: str = "float"
    weight: bool = False

    def __repr__(self) -> str:  # short, for the kit's own messages
        return f"In({self.dtype}{list(self.value.shape)}{', weight' if self.weight else ''})"


@dataclass(frozen=True)
class Call:
    """One drawn op call: positional and keyword arguments, where every
    :class:`In` (also inside lists) becomes a backend array."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: Free-form facts about the call, for ``run`` and ``out`` functions.
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Host:
    """A result that already is a host array (what ``to_numpy`` returns)."""

    value: np.ndarray


Run = Callable[[Backend, Call, tuple, dict], Any]
Expect = Callable[..., np.ndarray]
Bound = Callable[..., np.ndarray]
OutDtype = Callable[[Call, str], "str | tuple[str, ...]"]


def FLOAT(call: Call, dtype: str) -> str:  # noqa: N802 - used like a constant
    """The result has the dtype under test."""
    return dtype


def SAME(call: Call, dtype: str) -> str:  # noqa: N802
    """The result has the dtype of the first array input."""
    first = next(a for a in leaves(call.args) if isinstance(a, In))
    return dtype if first.dtype == "float" else first.dtype


def INDEX(call: Call, dtype: str) -> tuple[str, ...]:  # noqa: N802
    """An integer index result (argmax): int64 or int32."""
    return ("int64", "int32")


@dataclass(frozen=True)
class Case:
    """One declarative op case.

    ``inputs`` is a hypothesis strategy of :class:`Call`; ``run`` calls the
    op (default: ``getattr(backend, op)(*args, **kwargs)``); ``out`` gives
    the dtype(s) the candidate's float or integer results must have;
    ``mutates`` lists positional arguments the op may modify; ``raises``
    marks a call that must raise (any exception but UnsupportedOpError);
    ``expect``, where given, computes the expected result on the host,
    ``expect(call, *args)`` with the inputs' values, instead of the reference
    backend (for a result it cannot hold: numpy has no bfloat16).

    An approximate mode's case (e.g. ``activations="q8"``) sets ``bound``:
    ``bound(call, *args)`` gives, per element of the result, how far the
    candidate may be from the reference's exact result, and that replaces the
    dtype's NMSE bound; ``reference_run`` is how the reference computes the
    exact result (default: ``run``), ``run`` how the candidate runs the mode,
    raising :class:`~infer.errors.UnsupportedOpError` where it has none.
    """

    name: str
    op: str
    inputs: Any
    run: Run | None = None
    out: OutDtype = FLOAT
    mutates: tuple[int, ...] = ()
    raises: bool = False
    doc: str = ""
    expect: Expect | None = None
    bound: Bound | None = None
    reference_run: Run | None = None


class Mismatch(AssertionError):
    """The candidate's result differs from the reference backend's beyond tolerance."""


def leaves(args: Sequence[Any]) -> list[Any]:
    """The arguments with lists and tuples flattened."""
    out: list[Any] = []
    for a in args:
        out.extend(leaves(a) if isinstance(a, (list, tuple)) else [a])
    return out


__all__ = ["In", "Call", "Host", "Run", "Expect", "Bound", "OutDtype", "FLOAT", "SAME", "INDEX", "Case", "Mismatch", "leaves"]
