"""The CPU backend's captured decode step (numpy's and torch/cpu's): the step's ops recorded once as a
program of C kernel calls, then run by one C call per token.

numpy has no compiler, and a decode step is some 800 op calls from Python,
each of them interpreter time around kernels that take about as long
(docs/performance.md, "The recorded decode step"). So, for a step with
static shapes (:mod:`infer.engine.capture`), :meth:`NumpyBackend.compile
<infer.backends.numpy.NumpyBackend.compile>` gives a :class:`PlannedStep`:

* **Trace.** On the first call for an input signature (shapes and dtypes) the
  function runs once through the backend's ops while a :class:`Recorder`
  stands in for them on the backend instance. Each op whose inputs depend on
  the step's inputs becomes a step of the program (``backends/cpu/plan.c``): the
  same C functions the eager op calls (the quantized and float32 products,
  the norms, rope, attention), or a strided elementwise loop, writing into a
  buffer the plan owns. The step runs at once, so the trace computes the real
  values, and they are checked against the eager op's (a wrong step would
  fail here, once, not silently later). Ops on constants only (weights, the
  rope frequencies) are computed once, as they are. Views (reshape, slice,
  transpose) cost nothing: they are the same memory.
* **Replay.** Every later call hands the program its inputs (the token id,
  the position, the KV cache buffers, whose addresses are resolved at each
  call) and runs it in one C call without the GIL: no Python per op, no
  allocation per op. What depends on data (the position written, the keys
  attended over, the token's embedding row) is read inside the program and
  bounds-checked there.

What cannot be one program stays eager, with the reason (the capture's
:attr:`~infer.engine.capture.CapturedDecode.reason`): an op that reads a value
back on the host (mixture-of-experts routing), an op the program has no step
for (interleaved rope, paged attention), weights kept in GGUF blocks. The values
differ from the eager step's only where the program calls the C library's
``expf``/``tanhf``/``sinf``/``cosf`` where numpy calls its own SIMD versions
(the silu, gelu and rope-table steps; a few ulp); every product, norm, rope
and attention step is the eager op's own code, bit for bit.

The traced function must compute only through the backend's ops, as the op
contract asks of architectures. Values that depend on the inputs are handed to
it as :class:`Traced` arrays (torch/cpu: a guarded tensor subclass), on which
numpy's or torch's own arithmetic, copies, in-place writes and host reads
raise :class:`NotCapturable` rather than be frozen into the program; the one
hole left is ``np.asarray(x)``, which strips the subclass without asking.
Ops on constants only are folded once per program: weights changed in place
after the first step would keep their old derived values (there is no such
API). A program points at the weights' memory and keeps those arrays alive.

The recorder replaces the backend instance's op methods while it traces, so a
backend must not be used from another thread during a trace (the engine runs
one forward at a time); replays of one step are serialized by a lock, since a
program's buffers are its own.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
from infer.backends.cpu.record import (  # noqa: F401 - the recorder's names, re-exported for callers and tests
    BINARY_KINDS,
    UNARY_KINDS,
    HostArrays,
    NotCapturable,
    Recorder,
    Traced,
    _addr,
)

from infer.ops import Backend

log = logging.getLogger(__name__)


def flatten(tree: Any, leaves: list[np.ndarray], originals: list[Any], arrays: HostArrays | None = None) -> Any:
    """The structure of ``tree`` with its arrays moved to ``leaves`` (as numpy
    arrays; ``originals`` gets them as given) and their shapes and dtypes in
    the structure: a hashable signature."""
    if isinstance(tree, np.ndarray) or (arrays is not None and arrays.is_array(tree)):
        host = tree if isinstance(tree, np.ndarray) else arrays.to_host(tree)  # type: ignore[union-attr]
        return _leaf(tree, host, leaves, originals)
    if isinstance(tree, (list, tuple)):
        parts = []
        for v in tree:  # arrays inline: a decode step passes two lists of one per layer
            if type(v) is np.ndarray or (arrays is not None and arrays.is_array(v)):
                host = v if type(v) is np.ndarray else arrays.to_host(v)  # type: ignore[union-attr]
                parts.append(_leaf(v, host, leaves, originals))
            else:
                parts.append(flatten(v, leaves, originals, arrays))
        return (type(tree).__name__, tuple(parts))
    if isinstance(tree, dict):
        return ("d", tuple((k, flatten(v, leaves, originals, arrays)) for k, v in tree.items()))
    return ("v", tree)


def _leaf(value: Any, host: np.ndarray, leaves: list[np.ndarray], originals: list[Any]) -> tuple[Any, ...]:
    """:func:`flatten` of one array ``value`` whose numpy form is ``host``."""
    leaves.append(host)
    originals.append(value)
    return ("a", host.shape, host.dtype, host.flags.c_contiguous and host.flags.writeable)


class Plan:
    """One recorded program, and how to build the function's result from a call's inputs."""

    def __init__(self, recorder: Recorder, result: Any, arrays: HostArrays | None = None) -> None:
        self.kernels = recorder.kernels
        self.sizes = recorder.sizes
        self.keep = recorder.keep
        self.arrays = arrays
        inputs = {(_addr(a), a.shape, a.strides): i for i, a in enumerate(recorder.inputs)}

        def spec(tree: Any) -> Any:
            host = None
            if type(tree) is Traced:
                host = tree.view(np.ndarray)
            elif arrays is not None and arrays.is_array(tree):
                host = arrays.to_host(tree)
            if host is not None:
                key = (_addr(host), host.shape, host.strides)
                if key in inputs:
                    return ("input", inputs[key])
                where = recorder._base(key[0]) if host.size else None
                if where is not None and where[0] >= 0:
                    raise NotCapturable("the step returns a view of its inputs")
                if where is not None:
                    return ("buffer", host)
                if type(tree) is Traced or (arrays is not None and arrays.traced(tree)):
                    raise NotCapturable("the step returns a value computed outside the backend's ops")
                return ("constant", tree)
            if isinstance(tree, (list, tuple)):
                return (type(tree), [spec(v) for v in tree])
            if isinstance(tree, dict):
                return (dict, {k: spec(v) for k, v in tree.items()})
            return ("constant", tree)

        try:
            self.result = spec(result)
        finally:  # a nested function calling itself is a cycle through its cell, which held the call's inputs
            spec = None  # type: ignore[assignment]
        self.code, self.floats, self.marks = recorder.program(_buffers(self.result))
        self.steps = len(self.marks)

    def __call__(self, leaves: tuple[np.ndarray, ...], originals: list[Any]) -> Any:
        """Run the program on a call's inputs; the function's result."""
        self.kernels.run_plan(self.code, self.floats, leaves, self.sizes)
        return self.result_for(originals)

    def result_for(self, originals: list[Any]) -> Any:
        """The function's result after the program ran on the inputs ``originals``."""
        return _build(self.result, originals, self.arrays)


def _buffers(s: Any) -> list[np.ndarray]:
    """The plan buffers a result's spec (:class:`Plan`) returns."""
    kind, value = s
    if kind == "buffer":
        return [value]
    if kind in ("input", "constant"):
        return []
    return [b for v in (value.values() if kind is dict else value) for b in _buffers(v)]


def _build(s: Any, originals: list[Any], arrays: HostArrays | None) -> Any:
    """A result from its spec (:class:`Plan`). A plain recursive function: a
    nested one that calls itself is a reference cycle, and it held each
    step's inputs, a sequence's whole KV cache among them, until Python's
    cycle collector ran (docs/performance.md, "Long prompts in chunks")."""
    kind, value = s
    if kind == "input":
        return originals[value]
    if kind == "buffer":  # a copy: the next call overwrites the plan's own
        return value.copy() if arrays is None else arrays.from_host(value.copy())
    if kind == "constant":
        return value
    if kind is dict:
        return {k: _build(v, originals, arrays) for k, v in value.items()}
    return kind([originals[v[1]] if v[0] == "input" else _build(v, originals, arrays) for v in value])


class PlannedStep:
    """``fn`` as recorded programs, one per input signature: the numpy
    backend's :meth:`~infer.ops.Backend.compile` with ``static=True``, and
    torch's on the CPU (``target`` the backend ``fn`` calls, ``arrays`` how
    its arrays are numpy's; ``ops`` is then a numpy backend of its own, which
    records and checks). ``kernels`` is the C extension that runs programs,
    ``governor`` the numpy backend's thread governor (or None)."""

    #: Programs kept (signatures past it evict the least recently used).
    MAX_PLANS = 8
    #: The recurrent ops are program steps reading their batch from the inputs
    #: (record.py), so the engine may capture steps with recurrent state here
    #: (:class:`infer.engine.capture.CapturedBatchDecode` asks).
    captures_recurrent = True

    def __init__(self, ops: Backend, fn: Callable[..., Any], *, kernels: Any, governor: Any = None,
                 target: Backend | None = None, arrays: HostArrays | None = None) -> None:
        self.ops, self.fn, self.target, self.arrays = ops, fn, target, arrays
        self.kernels, self.governor = kernels, governor
        self._plans: OrderedDict[Any, Plan] = OrderedDict()
        # A program's buffers are its own: two threads replaying it at once
        # (two generations on one model) would write each other's.
        self._lock = threading.Lock()
        self._built = 0

    def graphs(self) -> int:
        """Programs recorded so far (one per input signature; growing with every call would mean re-tracing)."""
        return self._built

    def __call__(self, *args: Any) -> Any:
        with self._lock:
            return self._call(args)

    def _call(self, args: tuple[Any, ...]) -> Any:
        leaves: list[np.ndarray] = []
        originals: list[Any] = []
        key = flatten(args, leaves, originals, self.arrays)
        plan = self._plans.get(key)
        if plan is None:
            recorder = Recorder(self.ops, leaves, self.kernels)
            result = recorder.record(self.fn, args, self.target, self.arrays)
            plan = Plan(recorder, result, self.arrays)
            self._plans[key] = plan
            self._built += 1
            if len(self._plans) > self.MAX_PLANS:
                self._plans.popitem(last=False)
            log.debug("recorded a decode step of %d kernel calls (%d int64 words)", plan.steps, plan.code.size)
            return plan.result_for(originals)  # the trace ran the program once already
        self._plans.move_to_end(key)
        if self.governor is not None:
            self.governor.check()
        return plan(tuple(leaves), originals)
