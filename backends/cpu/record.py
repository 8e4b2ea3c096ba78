"""Recording the CPU backend's captured decode step: the recorder that
stands in for the backend's ops while the step runs once, and turns each op
on values that depend on the step's inputs into a step of a program for
``backends/cpu/plan.c`` (run and checked as it is recorded). What a program is,
how it is replayed and what it cannot hold: :mod:`infer.backends.cpu.plan`.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from infer.errors import CaptureError
from infer.ops import OPTIONAL_OPS, REQUIRED_OPS, AdaptedWeight, AdapterRows, AttentionBatch, Backend, PackedWeight

log = logging.getLogger(__name__)

from infer.backends.cpu.kernels import BUILT, KV_Q8_0, cache_line_array

#: The opcodes by name, from the C runner's own table (backends/cpu/plan.c), so
#: the two never disagree (tests/test_plan_table.py checks the kinds below
#: too); without the extension there are no programs. The extension as built:
#: whether programs run is the numpy backend's choice (INFER_NUMPY_KERNELS).
OPCODES: dict[str, int] = BUILT.opcodes() if BUILT is not None and hasattr(BUILT, "opcodes") else {}
GEMV, GEMV_F32, RMS, ROPE, GATHER, DEQUANT_ROWS, COPY, UNARY, BINARY, REDUCE, LAYERNORM, SCATTER_ROWS, ATTENTION = (
    OPCODES.get(name, -1) for name in ("GEMV", "GEMV_F32", "RMS", "ROPE", "GATHER", "DEQUANT_ROWS", "COPY", "UNARY",
                                       "BINARY", "REDUCE", "LAYERNORM", "SCATTER_ROWS", "ATTENTION"))
CONV1D, GDR, SSD = (OPCODES.get(name, -1) for name in ("CONV1D", "GDR", "SSD"))
TOPK, EXPERT_GEMV = (OPCODES.get(name, -1) for name in ("TOPK", "EXPERT_GEMV"))
LORA = OPCODES.get("LORA", -1)
# Kinds: the enums below the opcodes in backends/cpu/plan.c, in order.
UNARY_KINDS = {"cast": 0, "neg": 1, "exp": 2, "sqrt": 3, "tanh": 4, "cos": 5, "sin": 6, "silu": 7,
               "gelu_tanh": 8, "gelu": 9, "softplus": 10}
BINARY_KINDS = {"add": 0, "sub": 1, "mul": 2, "div": 3}
MAX, ARGMAX, SUM = 0, 1, 2
MAX_DIMS = 8
NULL = (-1, 0)

#: Ops the recorder passes through untouched: they create constants or only
#: read shapes, so they are the same in a trace as eagerly.
PASS_THROUGH = frozenset({"from_numpy", "shape", "dtype", "zeros", "arange", "prepare_weight", "compile",
                          "synchronize"})


#: Ops a program never holds: collectives (their defaults, for a group of one,
#: are the identity; a program would silently drop the other ranks' shares).
REFUSED = frozenset({"all_reduce", "all_gather", "broadcast"})


class _StateUpdate(NamedTuple):
    """A recurrent op's state gathered from a pool and scattered back (Recorder._in_place)."""

    gather: int  # the steps: the gather, the op, the scatter
    op: int
    scatter: int
    pool: int  # the pool's input index
    rows: tuple[int, int]  # the slots' operand (int32 [sequences])
    capacity: int  # the pool's rows
    copy: tuple[int, int]  # the gathered copy's addresses [lo, hi)
    new: tuple[int, int]  # the op's new state's
    at: tuple[int, int, int, int]  # the op's operands state, last and slots, and its int capacity


class NotCapturable(CaptureError):
    """The step cannot be one program; the message says which op and why."""


class Traced(np.ndarray):
    """An array whose values depend on the step's inputs, as the traced
    function sees it: numpy arithmetic on it outside the backend's ops, or
    reading it on the host, would not be recorded, so it raises instead."""

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise NotCapturable(f"numpy's {ufunc.__name__} on a traced array, outside the backend's ops")

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        raise NotCapturable(f"numpy.{func.__name__} on a traced array, outside the backend's ops")

    def _host(self, *args: Any) -> Any:
        raise NotCapturable("a traced value read on the host inside the step")

    def _outside(self, *args: Any, **kwargs: Any) -> Any:
        raise NotCapturable("a traced array copied or written outside the backend's ops")

    # Copies and in-place writes would not be recorded: a copy would be frozen
    # at its trace-time value, a write lost at the next replay.
    __setitem__ = copy = astype = flatten = ravel = fill = put = sort = resize = itemset = _outside  # type: ignore[assignment]

    def __getitem__(self, key: Any) -> Any:
        out = super().__getitem__(key)
        if not isinstance(out, np.ndarray):  # one element, as a numpy scalar: its value on the host
            self._host()
        return out

    __bool__ = __int__ = __float__ = __index__ = item = tolist = tobytes = _host  # type: ignore[assignment]


def _plain(x: Any) -> Any:
    return x.view(np.ndarray) if type(x) is Traced else x


def _addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _f32(x: Any) -> bool:
    return isinstance(x, np.ndarray) and x.dtype == np.float32


class HostArrays(Protocol):
    """How a backend whose arrays share memory with numpy arrays (torch on the
    CPU) lends them to the recorder: zero-copy both ways."""

    def is_array(self, x: Any) -> bool:
        """Whether ``x`` is one of the backend's arrays."""
        ...

    def to_host(self, x: Any) -> np.ndarray:
        """A numpy array on ``x``'s memory."""
        ...

    def from_host(self, a: np.ndarray) -> Any:
        """One of the backend's arrays on ``a``'s memory."""
        ...

    def guard(self, x: Any) -> Any:
        """``x`` as the traced function sees a value that depends on the
        step's inputs: the same memory, computing on it outside the
        backend's ops raises :class:`NotCapturable` (numpy's :class:`Traced`)."""
        ...

    def traced(self, x: Any) -> bool:
        """Whether ``x`` is such a guarded array."""
        ...

    def weight(self, w: PackedWeight) -> Any:
        """The numpy backend's form of a prepared weight (a
        :class:`~infer.ops.PackedWeight` with its kernel arguments), or
        ``w`` where there is none (the recorder then refuses it)."""
        ...


class Recorder:
    """Records one call of a function through the backend's ops as a program
    (see the module docstring). Methods named after ops stand in for the
    backend's while :meth:`record` runs."""

    def __init__(self, ops: Backend, leaves: list[np.ndarray], kernels: Any) -> None:
        self.ops, self.cls, self.kernels = ops, type(ops), kernels
        for i, a in enumerate(leaves):
            if not (type(a) is np.ndarray and a.flags.c_contiguous and a.flags.writeable and a.size):
                raise NotCapturable(f"input {i} is not a non-empty, C-contiguous, writable numpy array")
        spans = sorted((_addr(a), _addr(a) + a.nbytes) for a in leaves)
        if any(end > start for (_, end), (start, _) in zip(spans, spans[1:])):
            raise NotCapturable("two inputs share memory: a program resolves each input on its own")
        self.inputs = tuple(leaves)
        self.sizes = np.array([a.nbytes for a in leaves], np.int64)
        self._starts: list[int] = []  # sorted region starts, and their (end, base) by start
        self._regions: dict[int, tuple[int, int]] = {}
        for i, a in enumerate(leaves):
            self._region(_addr(a), a.nbytes, i)
        #: The steps as recorded: (opcode, operands as (base, offset), ints, floats); :meth:`program` lays them out.
        self.steps: list[tuple[int, list[tuple[int, int]], list[int], list[float]]] = []
        self.keep: list[Any] = []  # everything the program points at, alive as long as it is
        # A recurrent op's state gathered from a pool's rows (ctx.state) and its new state scattered
        # back to them (ctx.set_state), to be read and written in place (:meth:`_in_place`): gathered
        # copies by address -> (step, pool input, rows operand, bytes); the ops' new states by address
        # -> (step, gathered copy's address, operand positions); and the updates found.
        self._gathers: dict[int, tuple[int, int, tuple[int, int], int]] = {}
        self._updates: dict[int, tuple[int, int, tuple[int, int, int, int]]] = {}
        self._in_pool: list[_StateUpdate] = []

    # -- memory ------------------------------------------------------------

    def _region(self, start: int, nbytes: int, base: int) -> None:
        bisect.insort(self._starts, start)
        self._regions[start] = (start + nbytes, base)

    def _base(self, addr: int) -> tuple[int, int] | None:
        """(input index, byte offset) or (-1, address) for memory of the step's inputs or the plan's buffers."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        start = self._starts[i]
        end, base = self._regions[start]
        if addr >= end:
            return None
        return (base, addr - start) if base >= 0 else (-1, addr)

    def buffer(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A new array the plan owns (its steps write it), on a cache line's start."""
        out = cache_line_array(shape, dtype)
        if not out.size:
            raise NotCapturable(f"an empty intermediate {shape}")
        self._region(_addr(out), out.nbytes, -1)
        self.keep.append(out)
        return out

    def operand(self, x: Any) -> tuple[int, int]:
        """How the program points at ``x``: into an input or a plan buffer, or at a constant kept alive."""
        if x is None:
            return NULL
        x = _plain(x)
        if not isinstance(x, np.ndarray):
            raise NotCapturable(f"an operand of type {type(x).__name__}")
        where = self._base(_addr(x))
        if where is not None:
            return where
        self.keep.append(x)
        return (-1, _addr(x))

    def in_step(self, a: np.ndarray) -> bool:
        """Whether ``a`` lies in the step's memory (an input's or a plan buffer's)."""
        return self._base(_addr(a)) is not None

    def dynamic(self, x: Any) -> bool:
        if type(x) is Traced:
            if not self.in_step(x):
                raise NotCapturable("a traced array outside the step's memory (copied outside the backend's ops)")
            return True
        if isinstance(x, (list, tuple)):
            return any(self.dynamic(v) for v in x)
        return False

    # -- steps -------------------------------------------------------------

    def emit(self, op: int, ptrs: Sequence[Any], ints: Sequence[int] = (), floats: Sequence[float] = ()) -> None:
        """Append one step and run it now, on the call's inputs."""
        operands = [self.operand(p) for p in ptrs]
        ints, floats = [int(i) for i in ints], [float(f) for f in floats]
        step = [op, *(v for pair in operands for v in pair), *ints]
        self.kernels.run_plan(np.asarray(step, np.int64), np.asarray(floats, np.float64), self.inputs, self.sizes)
        self.steps.append((op, operands, ints, floats))

    def program(self, returned: Sequence[np.ndarray] = ()) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
        """The steps laid out for ``run_plan``: the code (int64), the floats,
        and where each step starts in them with its opcode (for profiles);
        the recurrent state updates made in place where they can be
        (:meth:`_in_place`; ``returned``: the plan buffers the step returns)."""
        steps = self._in_place(returned)
        code: list[int] = []
        floats: list[float] = []
        marks = []
        for op, operands, ints, fl in steps:
            marks.append((len(code), len(floats), op))
            code.append(op)
            for pair in operands:
                code.extend(pair)
            code.extend(ints)
            floats.extend(fl)
        return np.asarray(code, np.int64), np.asarray(floats, np.float64), marks

    def _in_place(self, returned: Sequence[np.ndarray]) -> list[tuple[int, list[tuple[int, int]], list[int], list[float]]]:
        """The steps, with each recurrent op whose state was gathered from a
        pool's rows (``ctx.state``) and whose new state was scattered back to
        the same rows (``ctx.set_state``) reading and writing those rows in
        place instead (its ``slots`` operand, backends/cpu/plan.c): at
        Qwen3.5's shape a decode step had copied each DeltaNet layer's 1 MiB
        state twice besides reading and writing it once. Only where no other
        step reads the gathered copy or the new state, none but the op
        touches the pool between the gather and the scatter, and the step
        returns neither (``returned``: the plan buffers it returns)."""
        steps = [(op, list(operands), list(ints), fl) for op, operands, ints, fl in self.steps]
        dropped: set[int] = set()
        freed: list[tuple[int, int]] = []
        out = [(_addr(a), _addr(a) + a.nbytes) for a in returned]

        def reads(k: int, span: tuple[int, int]) -> bool:
            return any(base == -1 and span[0] <= at < span[1] for base, at in steps[k][1])

        for u in self._in_pool:
            if any(lo < u.new[1] and u.new[0] < hi or lo < u.copy[1] and u.copy[0] < hi for lo, hi in out):
                continue
            if any(reads(k, u.copy) for k in range(len(steps)) if k not in (u.gather, u.op)) or \
                    any(reads(k, u.new) for k in range(len(steps)) if k not in (u.op, u.scatter)):
                continue
            between = (k for k in range(u.gather + 1, u.scatter) if k != u.op)
            if any(base == u.pool for k in between for base, _ in steps[k][1]) or \
                    any(base == u.pool for base, _ in steps[u.op][1]):
                continue
            state_at, last_at, slots_at, capacity_at = u.at
            operands = steps[u.op][1]
            operands[state_at] = operands[last_at] = (u.pool, 0)
            operands[slots_at] = u.rows
            steps[u.op][2][capacity_at] = u.capacity
            dropped |= {u.gather, u.scatter}
            freed += [u.copy, u.new]
        kept = [step for k, step in enumerate(steps) if k not in dropped]
        self._release(freed, kept)
        return kept

    def _release(self, spans: list[tuple[int, int]], steps: list[Any]) -> None:
        """Let go of the plan buffers at ``spans`` (a gathered state copy and
        the op's new state, which :meth:`_in_place` made unused) where no
        step of ``steps`` points into them: the recording ran the steps, so
        their pages are resident, a state's size each (at Qwen3.5's shape
        1 MiB per DeltaNet layer, twice: 36 MB held by each of the decode
        step's two programs; docs/performance.md, "Hybrid memory")."""
        used = [at for _, operands, _, _ in steps for base, at in operands if base == -1]
        spans = [span for span in spans if not any(span[0] <= at < span[1] for at in used)]
        if spans:
            self.keep[:] = [a for a in self.keep if not (type(a) is np.ndarray and (_addr(a), _addr(a) + a.nbytes)
                                                          in spans)]

    def _gathered(self, src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
        """Note a gather of whole rows of an input (a state pool) by int32 slots: :meth:`_in_place`."""
        base, offset = self.operand(src)
        if base >= 0 and offset == 0 and src.nbytes == self.sizes[base] and idx.dtype == np.int32:
            self._gathers[_addr(out)] = (len(self.steps) - 1, base, self.operand(idx), out.nbytes)

    def _updated(self, state: np.ndarray, last: np.ndarray, at: tuple[int, int, int, int]) -> None:
        """Note a recurrent op (the last step) whose state is a gathered copy: :meth:`_in_place`."""
        gathered = self._gathers.get(_addr(state))
        if gathered is not None and state.nbytes == gathered[3] == last.nbytes:
            self._updates[_addr(last)] = (len(self.steps) - 1, _addr(state), at)

    def _scattered(self, dst: np.ndarray, rows: np.ndarray, src: np.ndarray) -> None:
        """Note a scatter (the last step) of a recurrent op's new state: in place where it goes back
        to the rows its state came from (:meth:`_in_place`)."""
        update = self._updates.get(_addr(src))
        if update is None:
            return
        op, copy, at = update
        gather, pool, slots, nbytes = self._gathers[copy]
        if self.operand(dst) == (pool, 0) and self.operand(rows) == slots and src.dtype == dst.dtype:
            self._in_pool.append(_StateUpdate(gather, op, len(self.steps) - 1, pool, slots, dst.shape[0],
                                              (copy, copy + nbytes), (_addr(src), _addr(src) + nbytes), at))

    def check(self, name: str, got: np.ndarray, want: Any) -> None:
        """The step's result against the eager op's (rounding aside: libm vs numpy's transcendentals)."""
        want = np.asarray(want)
        got = np.asarray(_plain(got))
        if got.shape != want.shape or got.dtype != want.dtype:
            raise NotCapturable(f"{name}: the step gives {got.dtype}{list(got.shape)}, "
                                f"the op {want.dtype}{list(want.shape)}")
        if got.dtype.kind != "f":
            ok = np.array_equal(got, want)
        else:
            scale = float(np.max(np.abs(want), initial=0.0, where=np.isfinite(want)))
            ok = np.allclose(got, want, rtol=1e-5, atol=1e-6 * max(1.0, scale), equal_nan=True)
        if not ok:
            raise NotCapturable(f"{name}: the step's values differ from the eager op's")

    def wrap(self, x: np.ndarray) -> Traced:
        return x.view(Traced)

    def contiguous(self, x: Any) -> np.ndarray:
        """``x`` (plain) if C-contiguous, else a copy step into a new buffer."""
        x = _plain(x)
        if x.flags.c_contiguous:
            return x
        out = self.buffer(x.shape, x.dtype)
        self.copy(x, out)
        return out

    def copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """A step copying ``src`` into ``dst`` (same shape, any strides)."""
        src, dst = _plain(src), _plain(dst)
        if src.shape != dst.shape or src.dtype != dst.dtype or src.ndim > MAX_DIMS:
            raise NotCapturable(f"copy of {src.dtype}{list(src.shape)} into {dst.dtype}{list(dst.shape)}")
        if not dst.flags.c_contiguous:
            raise NotCapturable("a copy into a strided destination")
        self.emit(COPY, [src, dst], [src.itemsize, src.ndim, *src.shape, *src.strides])

    def eager(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The backend's own op on plain arrays (constants, or the trace's values for :meth:`check`)."""
        plain_kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
        return getattr(self.cls, name)(self.ops, *(_unwrap(a) for a in args), **plain_kwargs)

    # -- elementwise -----------------------------------------------------------

    def _unary(self, kind: str, x: Any) -> Any:
        x = _plain(x)
        if x.dtype != np.float32 and kind != "cast":
            raise NotCapturable(f"{kind} of {x.dtype}")
        if x.ndim > MAX_DIMS:
            raise NotCapturable(f"{kind} of {x.ndim} dimensions")
        out = self.buffer(x.shape, np.float32)
        self.emit(UNARY, [x, out], [UNARY_KINDS[kind], x.ndim, *x.shape, *x.strides])
        return out

    def _binary(self, name: str, a: Any, b: Any) -> Traced:
        want = np.asarray(self.eager(name, a, b))
        dtype = want.dtype
        if dtype not in (np.float32, np.int32) or (dtype == np.int32 and name == "div") or want.ndim > MAX_DIMS:
            raise NotCapturable(f"{name} giving {dtype}{list(want.shape)}")
        operands = []
        for v in (a, b):
            v = _plain(v)
            if not isinstance(v, np.ndarray):
                v = np.array(v, dtype)  # a Python scalar, as numpy's weak promotion casts it
            if v.dtype != dtype:
                raise NotCapturable(f"{name} of {v.dtype} with a {dtype} result")
            operands.append(np.broadcast_to(v, want.shape))
        out = self.buffer(want.shape, dtype)
        pa, pb = operands
        self.emit(BINARY, [pa, pb, out], [BINARY_KINDS[name], int(dtype == np.int32), want.ndim, *want.shape,
                                          *pa.strides, *pb.strides])
        self.check(name, out, want)
        return self.wrap(out)

    def add(self, a: Any, b: Any) -> Any:
        return self._binary("add", a, b)

    def sub(self, a: Any, b: Any) -> Any:
        return self._binary("sub", a, b)

    def mul(self, a: Any, b: Any) -> Any:
        return self._binary("mul", a, b)

    def div(self, a: Any, b: Any) -> Any:
        return self._binary("div", a, b)

    def _transcendental(self, name: str, x: Any) -> Traced:
        out = self._unary(name, x)
        self.check(name, out, self.eager(name, x))
        return self.wrap(out)

    def exp(self, x: Any) -> Any:
        return self._transcendental("exp", x)

    def sqrt(self, x: Any) -> Any:
        return self._transcendental("sqrt", x)

    def tanh(self, x: Any) -> Any:
        return self._transcendental("tanh", x)

    def cos(self, x: Any) -> Any:
        return self._transcendental("cos", x)

    def sin(self, x: Any) -> Any:
        return self._transcendental("sin", x)

    def silu(self, x: Any) -> Any:
        return self._transcendental("silu", x)

    def gelu(self, x: Any) -> Any:
        return self._transcendental("gelu", x)

    def gelu_tanh(self, x: Any) -> Any:
        return self._transcendental("gelu_tanh", x)

    def softplus(self, x: Any) -> Any:
        return self._transcendental("softplus", x)

    def swiglu(self, gate: Any, up: Any) -> Any:
        return self._binary("mul", self.silu(gate), up)

    def astype(self, x: Any, dtype: str) -> Any:
        target = self.ops._np_dtype(dtype)  # type: ignore[attr-defined]
        if x.dtype == target:
            return x
        if x.dtype == np.int32 and target == np.float32:
            out = self._unary("cast", x)
            self.check("astype", out, _plain(x).astype(np.float32))
            return self.wrap(out)
        raise NotCapturable(f"astype {x.dtype} -> {target}")

    # -- reductions -------------------------------------------------------------

    def _reduce(self, name: str, x: Any, axis: int, keepdims: bool = False) -> Traced:
        x = _plain(x)
        if axis not in (-1, x.ndim - 1) or x.dtype != np.float32 or not x.size:
            raise NotCapturable(f"{name} over axis {axis} of {x.dtype}{list(x.shape)}")
        want = np.asarray(self.eager(name, x, axis, keepdims) if name == "max" else self.eager(name, x, axis))
        if want.dtype not in (np.float32, np.int64):
            raise NotCapturable(f"{name} giving {want.dtype}")
        x = self.contiguous(x)
        out = self.buffer(want.shape or (1,), want.dtype)
        self.emit(REDUCE, [x, out], [MAX if name == "max" else ARGMAX, x.size // x.shape[-1], x.shape[-1]])
        out = out.reshape(want.shape)
        self.check(name, out, want)
        return self.wrap(out)

    def max(self, x: Any, axis: int = -1, keepdims: bool = False) -> Any:
        return self._reduce("max", x, axis, keepdims)

    def argmax(self, x: Any, axis: int = -1) -> Any:
        return self._reduce("argmax", x, axis)

    # -- mixture-of-experts routing: softmax, the sum that renormalises, top-k, the experts' products --------

    def sum(self, x: Any, axis: int = -1, keepdims: bool = False) -> Any:
        xp = _plain(x)
        if not (_f32(xp) and xp.size and -xp.ndim <= axis < xp.ndim):
            raise NotCapturable(f"sum over axis {axis} of {getattr(xp, 'dtype', '?')}{list(getattr(xp, 'shape', ()))}")
        axis %= xp.ndim
        want = np.asarray(self.eager("sum", xp, axis, keepdims))
        if axis == xp.ndim - 1 and TOPK >= 0:  # numpy's pairwise sum of each row (plan.c's, built with TOPK)
            xc = self.contiguous(xp)
            out = self.buffer(want.shape or (1,), np.float32)
            self.emit(REDUCE, [xc, out], [SUM, xc.size // xc.shape[-1], xc.shape[-1]])
            out = out.reshape(want.shape)
        elif axis != xp.ndim - 1:  # numpy adds the slices along an outer axis one after another: so do the steps
            part = lambda i: self.wrap(xp[(slice(None),) * axis + (i,)])  # noqa: E731 - a view, no copy
            acc = self.wrap(self.buffer_copy(xp[(slice(None),) * axis + (0,)]))
            for i in range(1, xp.shape[axis]):
                acc = self._binary("add", acc, part(i))
            out = _plain(acc).reshape(want.shape)
        else:
            raise NotCapturable("sum: the kernels have no step for it")
        self.check("sum", out, want)
        return self.wrap(out)

    def buffer_copy(self, x: np.ndarray) -> np.ndarray:
        """A copy step of ``x`` into a new buffer."""
        out = self.buffer(x.shape, x.dtype)
        self.copy(x, out)
        return out

    def softmax(self, x: Any, axis: int = -1) -> Any:
        xp = _plain(x)
        if not (_f32(xp) and xp.ndim and axis in (-1, xp.ndim - 1)):
            raise NotCapturable(f"softmax over axis {axis} of {getattr(xp, 'dtype', '?')}")
        # The numpy backend's steps: exp(x - max) / sum, with its max and its pairwise sum.
        e = self.exp(self.sub(x, self.max(x, -1, keepdims=True)))
        out = self.div(e, self.sum(e, -1, keepdims=True))
        self.check("softmax", out, self.eager("softmax", xp, axis))
        return out

    def topk(self, x: Any, k: int) -> Any:
        xp = _plain(x)
        if not (TOPK >= 0 and _f32(xp) and xp.ndim and 0 < k <= xp.shape[-1]):
            raise NotCapturable(f"topk of {getattr(xp, 'dtype', '?')}{list(getattr(xp, 'shape', ()))}")
        xc = self.contiguous(xp)
        rows, n = xc.size // xc.shape[-1], xc.shape[-1]
        values, ids = self.buffer((*xp.shape[:-1], k), np.float32), self.buffer((*xp.shape[:-1], k), np.int32)
        self.emit(TOPK, [xc, values, ids], [rows, n, k])
        want_values, want_ids = self.eager("topk", xp, k)
        self.check("topk", values, want_values)
        self.check("topk", ids, np.asarray(want_ids).astype(np.int32))
        return self.wrap(values), self.wrap(ids)

    # -- views and copies ---------------------------------------------------------

    def reshape(self, x: Any, shape: Any) -> Any:
        view = _plain(x).view()
        try:
            view.shape = tuple(shape)
        except AttributeError:  # not expressible as a view: numpy would copy
            view = self.contiguous(x).reshape(tuple(shape))
        return self.wrap(view)

    def transpose(self, x: Any, axes: Any) -> Any:
        return self.wrap(np.transpose(_plain(x), tuple(axes)))

    def slice(self, x: Any, axis: int, start: int, stop: int) -> Any:
        return self.wrap(self.eager("slice", x, axis, start, stop))

    def concat(self, xs: Any, axis: int = 0) -> Any:
        parts = [_plain(x) for x in xs]
        want_shape = np.concatenate([np.empty(p.shape, p.dtype) for p in parts], axis=axis).shape
        out = self.buffer(want_shape, np.result_type(*parts))
        at = 0
        for p in parts:
            if p.dtype != out.dtype:
                raise NotCapturable(f"concat of {p.dtype} into {out.dtype}")
            n = p.shape[axis]
            dst = np.moveaxis(out, axis, 0)[at:at + n]
            if not dst.flags.c_contiguous:
                raise NotCapturable(f"concat along axis {axis} of {len(parts)} arrays")
            self.copy(np.moveaxis(p, axis, 0), dst)
            at += n
        return self.wrap(out)

    def scatter_rows(self, dst: Any, rows: Any, src: Any) -> Any:
        d, s, at = _plain(dst), _plain(src), _plain(rows)
        # Float32 rows into a pool of q8_0 blocks (kv_dtype="q8_0"): 32 values to 34 bytes, quantized.
        q8 = (d.dtype == np.uint8 and s.dtype == np.float32 and s.ndim == d.ndim and s.shape[1:-1] == d.shape[1:-1]
              and s.shape[-1] % 32 == 0 and d.shape[-1] == s.shape[-1] // 32 * 34)
        if not (type(dst) is Traced and d.flags.c_contiguous and s.ndim == d.ndim and (q8 or s.shape[1:] == d.shape[1:])
                and (q8 or s.dtype == d.dtype or (s.dtype == np.float32 and d.dtype == np.float16))
                and at.dtype == np.int32 and at.ndim == 1 and at.size == s.shape[0]):
            raise NotCapturable(f"scatter_rows of {s.dtype}{list(s.shape)} into {d.dtype}{list(d.shape)}")
        s = self.contiguous(s)
        # Float32 rows into a float16 pool (kv_dtype) are rounded as numpy's assignment rounds them.
        self.emit(SCATTER_ROWS, [d, at, s], [s.shape[0], d[0].nbytes, d.shape[0], 2 if q8 else int(s.dtype != d.dtype)])
        self._scattered(d, at, s)
        return dst

    def to_numpy(self, x: Any) -> Any:
        if self.dynamic(x):
            raise NotCapturable("to_numpy: the step reads a value back to the host")
        return self.eager("to_numpy", x)

    # -- the layer's kernels -------------------------------------------------------

    def linear(self, x: Any, weight: Any, bias: Any = None) -> Any:
        if type(weight) is AdaptedWeight:
            if weight.rows.slots is None or weight.a is None:  # no row of the step uses an adapter here
                return self.linear(x, weight.base, bias)
            xp = _plain(x)
            x2 = self.reshape(x, (-1, xp.shape[-1])) if xp.ndim != 2 else x
            y = self.lora_linear(x2, weight.base, bias, weight.a, weight.b, weight.rows.slots, weight.rows.scales)
            return y if xp.ndim == 2 else self.reshape(y, (*xp.shape[:-1], weight.shape[0]))
        xp = _plain(x)
        if self.dynamic(weight) or not _f32(xp):
            raise NotCapturable(f"linear of {getattr(xp, 'dtype', type(xp))} with a traced weight")
        k = xp.shape[-1]
        m = xp.size // k if k else 0
        if not 0 < m <= self.ops.KERNEL_ROWS:  # type: ignore[attr-defined]
            raise NotCapturable(f"linear of {m} rows (the step's kernels take up to the kernel rows)")
        x2 = self.contiguous(xp).reshape(m, k)
        if type(weight) is PackedWeight and weight.kernel is not None:
            bits, codes, scales, biases, wk, n, group, half, factor = weight.kernel[:9]
            if wk != k:
                raise NotCapturable(f"linear: x has {k} columns, the weight {wk}")
            out = self.buffer((m, n), np.float32)
            if getattr(self.ops, "activations", None) == "q8":  # the eager product's own (kernels.Q8_FLAG)
                bits |= self.kernels.Q8_FLAG
            self.emit(GEMV, [x2, codes, scales, biases, out], [bits, m, k, n, group, int(half)], [factor])
        elif type(weight) is np.ndarray and _f32(weight) and weight.ndim == 2 and weight.flags.c_contiguous:
            n = weight.shape[0]
            if weight.shape[1] != k:
                raise NotCapturable(f"linear: x has {k} columns, the weight {weight.shape[1]}")
            out = self.buffer((m, n), np.float32)
            self.emit(GEMV_F32, [x2, weight, out], [m, k, n])
        else:
            raise NotCapturable(f"linear on {weight!r:.80}: no kernel computes it in the step")
        y = out.reshape(*xp.shape[:-1], n)
        self.check("linear", y, self.eager("linear", xp, weight))
        y = self.wrap(y)
        return y if bias is None else self.add(y, bias)

    def quantized_linear(self, x: Any, weight: Any, bias: Any = None) -> Any:
        return self.linear(x, weight, bias)

    def expert_linear(self, x: Any, weights: Any, ids: Any) -> Any:
        xp, ip = _plain(x), _plain(ids)
        if not (EXPERT_GEMV >= 0 and _f32(xp) and xp.ndim == 2 and isinstance(ip, np.ndarray) and ip.dtype == np.int32
                and ip.shape == xp.shape[:1] and len(weights) and not self.dynamic(list(weights))):
            raise NotCapturable(f"expert_linear of {getattr(xp, 'dtype', '?')}{list(getattr(xp, 'shape', ()))} "
                                f"by {getattr(ip, 'dtype', '?')} ids")
        m, k = xp.shape
        # The experts' weights as one table of addresses (kept alive with the program), all of one form.
        if all(type(w) is PackedWeight and w.kernel is not None for w in weights):
            forms = {tuple(w.kernel[i] for i in (0, 4, 5, 6, 7, 8)) for w in weights}
            if len(forms) != 1:
                raise NotCapturable("expert_linear over experts of different forms")
            bits, wk, n, group, half, factor = forms.pop()
            table = np.array([[_addr(w.kernel[1]), _addr(w.kernel[2]), 0 if w.kernel[3] is None else _addr(w.kernel[3])]
                              for w in weights], np.int64)
            self.keep.append([w.kernel for w in weights])
            if getattr(self.ops, "activations", None) == "q8":  # the eager product's own (kernels.Q8_FLAG)
                bits |= self.kernels.Q8_FLAG
        elif all(type(w) is np.ndarray and _f32(w) and w.ndim == 2 and w.flags.c_contiguous
                 and w.shape == weights[0].shape for w in weights):
            bits, (n, wk), group, half, factor = -1, weights[0].shape, 0, 0, 0.0
            table = np.array([[_addr(w)] for w in weights], np.int64)
            self.keep.append(list(weights))
        else:
            raise NotCapturable(f"expert_linear on {weights[0]!r:.80}: no kernel computes it in the step")
        if wk != k:
            raise NotCapturable(f"expert_linear: x has {k} columns, the weights {wk}")
        out = self.buffer((m, n), np.float32)
        self.emit(EXPERT_GEMV, [self.contiguous(xp), self.contiguous(ip), table, out],
                  [len(weights), bits, m, k, n, group, int(half)], [factor])
        self.check("expert_linear", out, self.eager("expert_linear", xp, list(weights), ip))
        return self.wrap(out)

    def lora_linear(self, x: Any, weight: Any, bias: Any, a: Any, b: Any, slots: Any, scales: Any) -> Any:
        """The base product's step, then one step adding each row's adapter term (OP_LORA), the rows'
        slots and scales and the stacked pools read from the step's inputs: a program serves every mix
        of adapters and the base model, and pools rebuilt (an adapter loaded) are read where they are now."""
        xp, ap, bp, sl, sc = (_plain(v) for v in (x, a, b, slots, scales))
        if LORA < 0 or not (self.dynamic(a) and self.dynamic(b)):
            raise NotCapturable("lora_linear: the adapter pools are not the step's inputs (or the kernels have "
                                "no step for it)")
        if not (_f32(xp) and xp.ndim == 2 and _f32(ap) and _f32(bp) and ap.ndim == bp.ndim == 3
                and ap.flags.c_contiguous and bp.flags.c_contiguous and ap.shape[0] == bp.shape[0]
                and ap.shape[1] == bp.shape[2] and ap.shape[2] == xp.shape[1]
                and isinstance(sl, np.ndarray) and sl.dtype == np.int32 and sl.shape == xp.shape[:1]
                and _f32(sc) and sc.shape == xp.shape[:1]):
            raise NotCapturable(f"lora_linear of x {getattr(xp, 'dtype', '?')}{list(getattr(xp, 'shape', ()))} "
                                f"with pools {list(getattr(ap, 'shape', ()))}, {list(getattr(bp, 'shape', ()))}")
        y = self.contiguous(self.linear(x, weight, bias))
        (t, k), (slot_count, rank, _), n = xp.shape, ap.shape, bp.shape[1]
        out = self.buffer((t, n), np.float32)
        scratch = [self.buffer((t, k), np.float32), self.buffer((t, rank), np.float32), self.buffer((t, n), np.float32)]
        self.emit(LORA, [self.contiguous(xp), y, ap, bp, self.contiguous(sl), self.contiguous(sc), out, *scratch],
                  [t, k, n, rank, slot_count])
        self.check("lora_linear", out, self.eager("lora_linear", xp, weight, bias, ap, bp, sl, sc))
        return self.wrap(out)

    def _norm_ok(self, x: np.ndarray, weight: Any) -> bool:
        return (_f32(x) and x.ndim >= 1 and x.size > 0 and not self.dynamic(weight)
                and (weight is None or (_f32(weight) and weight.shape == x.shape[-1:] and weight.flags.c_contiguous)))

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        xp = _plain(x)
        if not self._norm_ok(xp, weight):
            raise NotCapturable(f"rms_norm of {xp.dtype}{list(xp.shape)}")
        xc = self.contiguous(xp)
        out = self.buffer(xp.shape, np.float32)
        self.emit(RMS, [xc, weight, out, None, None], [xc.size // xc.shape[-1], xc.shape[-1]], [eps])
        self.check("rms_norm", out, self.eager("rms_norm", xp, weight, eps))
        return self.wrap(out)

    def fused_add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float) -> Any:
        xp, rp = _plain(x), _plain(residual)
        if not (self._norm_ok(xp, weight) and _f32(rp) and rp.shape == xp.shape):
            raise NotCapturable(f"fused_add_rms_norm of {xp.dtype}{list(xp.shape)}")
        xc, rc = self.contiguous(xp), self.contiguous(rp)
        out, h = self.buffer(xp.shape, np.float32), self.buffer(xp.shape, np.float32)
        self.emit(RMS, [xc, weight, out, rc, h], [xc.size // xc.shape[-1], xc.shape[-1]], [eps])
        want_out, want_h = self.eager("fused_add_rms_norm", xp, rp, weight, eps)
        self.check("fused_add_rms_norm", h, want_h)
        self.check("fused_add_rms_norm", out, want_out)
        return self.wrap(out), self.wrap(h)

    def layer_norm(self, x: Any, weight: Any, bias: Any, eps: float) -> Any:
        xp = _plain(x)
        if not (self._norm_ok(xp, weight) and self._norm_ok(xp, bias)):
            raise NotCapturable(f"layer_norm of {xp.dtype}{list(xp.shape)}")
        xc = self.contiguous(xp)
        out = self.buffer(xp.shape, np.float32)
        self.emit(LAYERNORM, [xc, weight, bias, out], [xc.size // xc.shape[-1], xc.shape[-1]], [eps])
        self.check("layer_norm", out, self.eager("layer_norm", xp, weight, bias, eps))
        return self.wrap(out)

    def rope(self, x: Any, cos: Any, sin: Any, interleaved: bool = False) -> Any:
        xp, c, s = _plain(x), _plain(cos), _plain(sin)
        if not (not interleaved and xp.ndim == 3 and _f32(xp) and _f32(c) and _f32(s) and c.ndim == 2
                and c.shape == s.shape and c.shape[0] == xp.shape[0] and 2 * c.shape[1] <= xp.shape[2]):
            raise NotCapturable(f"rope of {xp.dtype}{list(xp.shape)} (interleaved={interleaved})")
        xc, c, s = self.contiguous(xp), self.contiguous(c), self.contiguous(s)
        out = self.buffer(xp.shape, np.float32)
        self.emit(ROPE, [xc, c, s, out], [*xp.shape, c.shape[1]])
        self.check("rope", out, self.eager("rope", xp, c, s, interleaved))
        return self.wrap(out)

    def embedding(self, table: Any, ids: Any) -> Any:
        idx = _plain(ids)
        if self.dynamic(table) or idx.dtype not in (np.int32, np.int64):
            raise NotCapturable(f"embedding by {getattr(idx, 'dtype', '?')} ids")
        idx = self.contiguous(idx)
        if type(table) is PackedWeight and table.kernel is not None:  # affine codes, or blocks as stored
            bits, codes, scales, biases, k, vocab, group, half, factor = table.kernel[:9]
            out = self.buffer((*idx.shape, k), np.float32)
            self.emit(DEQUANT_ROWS, [codes, scales, biases, idx, out],
                      [idx.size, vocab, bits, k, group, int(half), idx.itemsize], [factor])
        elif type(table) is np.ndarray and table.ndim == 2 and table.flags.c_contiguous:
            out = self.buffer((*idx.shape, table.shape[1]), table.dtype)
            self.emit(GATHER, [table, idx, out], [idx.size, table.shape[0], table[0].nbytes, idx.itemsize, 0])
        else:
            raise NotCapturable(f"embedding of {table!r:.80}")
        self.check("embedding", out, self.eager("embedding", table, idx))
        return self.wrap(out)

    def take(self, x: Any, indices: Any, axis: int = 0) -> Any:
        xp, idx = _plain(x), _plain(indices)
        if axis != 0 or not isinstance(xp, np.ndarray) or xp.ndim < 1 or getattr(idx, "dtype", None) not in (
                np.int32, np.int64):
            raise NotCapturable(f"take along axis {axis}")
        if not self.dynamic(x) and xp.ndim == 2:  # a constant table: an embedding, quantized rows included
            return self.embedding(np.ascontiguousarray(xp), indices)
        src = self.contiguous(xp) if self.dynamic(x) else np.ascontiguousarray(xp)
        idx = self.contiguous(idx)
        out = self.buffer((*idx.shape, *xp.shape[1:]), xp.dtype)
        self.emit(GATHER, [src, idx, out], [idx.size, xp.shape[0], xp[0].nbytes, idx.itemsize, 1])
        self._gathered(src, idx, out)
        self.check("take", out, self.eager("take", xp, idx, 0))
        return self.wrap(out)

    def attention(self, q: Any, k_pool: Any, v_pool: Any, batch: AttentionBatch, *, scale: float,
                  causal: bool = True, window: int | None = None, softcap: float | None = None,
                  sinks: Any = None) -> Any:
        qp, kp, vp = _plain(q), _plain(k_pool), _plain(v_pool)
        qs, lp, tp = (_plain(a) for a in (batch.query_start, batch.seq_lens, batch.block_tables))
        sp = None if sinks is None else _plain(sinks)
        n = tp.shape[0] if tp.ndim == 2 else 0
        half = kp.dtype == vp.dtype == np.float16  # a kv_dtype="float16" pool, read widened
        q8 = kp.dtype == vp.dtype == np.uint8  # q8_0 blocks (kv_dtype="q8_0"): 34 bytes per 32 values
        dk, dv = (qp.shape[2], vp.shape[2] // 34 * 32) if q8 else (kp.shape[2], vp.shape[2])
        if not (n and qp.ndim == kp.ndim == vp.ndim == 3 and _f32(qp) and (half or q8 or (_f32(kp) and _f32(vp)))
                and kp.shape[:2] == vp.shape[:2] and kp.flags.c_contiguous and vp.flags.c_contiguous
                and kp.shape[0] % batch.block_size == 0
                and (not q8 or (dk % 32 == 0 and kp.shape[2] == dk // 32 * 34 and vp.shape[2] % 34 == 0))
                and qp.shape[2] == dk and qp.shape[1] % kp.shape[1] == 0
                and qs.dtype == lp.dtype == tp.dtype == np.int32 and tp.flags.c_contiguous
                and qs.size == n + 1 and lp.size == n
                and (sp is None or (_f32(sp) and sp.size == qp.shape[1]))
                and (softcap is None or softcap > 0) and (window is None or window > 0)):
            raise NotCapturable(f"attention of q {qp.dtype}{list(qp.shape)} over {kp.dtype}{list(kp.shape)}")
        qc, qsc, lc = self.contiguous(qp), self.contiguous(qs), self.contiguous(lp)
        sc = None if sp is None else self.contiguous(sp)
        out = self.buffer((qp.shape[0], qp.shape[1], dv), np.float32)
        block = batch.block_size
        self.emit(ATTENTION, [qc, kp, vp, out, qsc, lc, tp, sc],
                  [qp.shape[0], n, tp.shape[1], block, kp.shape[0] // block, qp.shape[1], kp.shape[1], dk,
                   dv, window or 0, int(causal), KV_Q8_0 if q8 else int(half)], [scale, softcap or 0.0])
        want = self.eager("attention", qp, kp, vp, AttentionBatch(qs, lp, tp, block, batch.max_query), scale=scale,
                          causal=causal, window=window, softcap=softcap, sinks=sp)
        self.check("attention", out, want)
        return self.wrap(out)

    # -- the recurrent layers' ops: their batch (query_start, checkpoint rows) read in the step ----------

    def _batch(self, name: str, query_start: Any, checkpoint_rows: Any) -> tuple[np.ndarray, np.ndarray | None]:
        """The batch arrays as the step reads them (int32, contiguous; no checkpoint rows: None)."""
        qs = _plain(query_start)
        rows = None if checkpoint_rows is None else _plain(checkpoint_rows)
        if (CONV1D < 0 or not isinstance(qs, np.ndarray) or qs.dtype != np.int32 or qs.ndim != 1
                or (rows is not None and (not isinstance(rows, np.ndarray) or rows.dtype != np.int32
                                          or rows.ndim != 1))):
            raise NotCapturable(f"{name}: its batch is not int32 arrays (or the kernels have no step for it)")
        return self.contiguous(qs), None if rows is None or not rows.size else self.contiguous(rows)

    def _outputs(self, *shapes: tuple[int, ...]) -> list[np.ndarray]:
        """The op's outputs: plan buffers, or a constant empty array (no checkpoint rows)."""
        return [self.buffer(s, np.float32) if int(np.prod(s)) else np.empty(s, np.float32) for s in shapes]

    def _traced(self, name: str, outs: list[np.ndarray], want: Any) -> tuple[Any, ...]:
        for got, w in zip(outs, want):
            self.check(name, got, w)
        return tuple(self.wrap(o) if o.size else o for o in outs)

    def causal_conv1d(self, x: Any, window: Any, weight: Any, bias: Any, query_start: Any,
                      checkpoint_rows: Any = None, *, activation: str | None = None) -> Any:
        xp, wp, kp = _plain(x), _plain(window), _plain(weight)
        bp = None if bias is None else _plain(bias)
        if not (_f32(xp) and _f32(wp) and _f32(kp) and (bp is None or _f32(bp)) and xp.ndim == 2 and kp.ndim == 2
                and kp.shape[1] >= 2 and not self.dynamic(weight) and not self.dynamic(bias)
                and activation in (None, "silu")):
            raise NotCapturable(f"causal_conv1d of x {xp.dtype}{list(xp.shape)}, weight {list(kp.shape)}")
        qs, rows = self._batch("causal_conv1d", query_start, checkpoint_rows)
        (total, channels), k, nseq = xp.shape, kp.shape[1], qs.size - 1
        nrows = 0 if rows is None else rows.size
        wt = np.ascontiguousarray(kp.T)
        self.keep.append(wt)
        outs = self._outputs((total, channels), (nseq, k - 1, channels), (nrows, k - 1, channels))
        self.emit(CONV1D, [self.contiguous(xp), self.contiguous(wp), wt, bp, qs, rows, *outs],
                  [nseq, nrows, total, channels, k, int(activation == "silu")])
        return self._traced("causal_conv1d", outs, self.eager("causal_conv1d", xp, wp, kp, bp, qs, rows,
                                                               activation=activation))

    def gated_delta_rule(self, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, query_start: Any,
                         checkpoint_rows: Any = None, *, scale: float | None = None, l2norm_qk: bool = True) -> Any:
        from infer.backends.cpu import kernels

        qp, kp, vp, gp, bp, sp = (_plain(a) for a in (q, k, v, g, beta, state))
        if not (all(_f32(a) for a in (qp, kp, vp, gp, bp, sp)) and qp.ndim == 3 and vp.ndim == 3
                and qp.shape[-1] <= kernels.GDR_MAX_K):
            raise NotCapturable(f"gated_delta_rule of q {qp.dtype}{list(qp.shape)}, state {sp.dtype}{list(sp.shape)}")
        qs, rows = self._batch("gated_delta_rule", query_start, checkpoint_rows)
        (total, hk, dk), (heads, dv), nseq = qp.shape, vp.shape[1:], qs.size - 1
        nrows = 0 if rows is None else rows.size
        outs = self._outputs((total, heads, dv), (nseq, heads, dk, dv), (nrows, heads, dk, dv))
        ins = [self.contiguous(a) for a in (qp, kp, vp, gp, bp, sp)]
        self.emit(GDR, [*ins, qs, rows, *outs, None],
                  [nseq, nrows, total, hk, heads, dk, dv, int(l2norm_qk), kernels.GDR_CHUNKED_ROWS, 0],
                  [dk ** -0.5 if scale is None else scale])
        self._updated(ins[5], outs[1], (5, 9, 11, 9))
        return self._traced("gated_delta_rule", outs, self.eager("gated_delta_rule", qp, kp, vp, gp, bp, sp, qs, rows,
                                                                 scale=scale, l2norm_qk=l2norm_qk))

    def ssd(self, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any, dt_bias: Any, state: Any, query_start: Any,
            checkpoint_rows: Any = None, *, dt_softplus: bool = True, dt_min: float = 0.0,
            dt_max: float = float("inf")) -> Any:
        from infer.backends.cpu import kernels

        xp, tp, ap, bp, cp, sp = (_plain(a) for a in (x, dt, A, B, C, state))
        dp, ep = (None if a is None else _plain(a) for a in (D, dt_bias))
        if not (all(_f32(a) for a in (xp, tp, ap, bp, cp, sp)) and all(a is None or _f32(a) for a in (dp, ep))
                and xp.ndim == 3 and bp.ndim == 3 and bp.shape[-1] <= kernels.SSD_MAX_N):
            raise NotCapturable(f"ssd of x {xp.dtype}{list(xp.shape)}, state {sp.dtype}{list(sp.shape)}")
        qs, rows = self._batch("ssd", query_start, checkpoint_rows)
        (total, heads, head_dim), (groups, size), nseq = xp.shape, bp.shape[1:], qs.size - 1
        nrows = 0 if rows is None else rows.size
        outs = self._outputs((total, heads, head_dim), (nseq, heads, head_dim, size), (nrows, heads, head_dim, size))
        ins = [self.contiguous(a) for a in (xp, tp, ap, bp, cp)]
        state = self.contiguous(sp)
        self.emit(SSD, [*ins, None if dp is None else self.contiguous(dp), None if ep is None else self.contiguous(ep),
                        state, qs, rows, *outs, None],
                  [nseq, nrows, total, heads, head_dim, groups, size, int(dt_softplus), 0],
                  [dt_min, min(dt_max, 3.0e38)])
        self._updated(state, outs[1], (7, 11, 13, 8))
        return self._traced("ssd", outs, self.eager("ssd", xp, tp, ap, bp, cp, dp, ep, sp, qs, rows,
                                                    dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max))

    # -- recording -------------------------------------------------------------------

    def record(self, fn: Callable[..., Any], args: tuple[Any, ...], target: Backend | None = None,
               arrays: HostArrays | None = None) -> Any:
        """Run ``fn(*args)`` (its array leaves traced) with this recorder
        standing in for the ops of ``target`` (default: the numpy backend
        it records with); ``arrays`` maps another backend's arrays to numpy's."""
        # The numpy backend's own ops too: the contract's defaults (softcap, ...) call them.
        backends = [self.ops] if target is None or target is self.ops else [self.ops, target]
        names = [n for n in (*REQUIRED_OPS, *OPTIONAL_OPS) if n not in PASS_THROUGH]
        for name in names:
            op = self._stand_in(name)
            setattr(self.ops, name, op)
            if len(backends) > 1 and hasattr(target, name):
                setattr(target, name, self._foreign(name, op, target, arrays))  # type: ignore[arg-type]
        try:
            return fn(*_traced_args(args, self.inputs, arrays))
        finally:
            for backend in backends:
                for name in names:
                    backend.__dict__.pop(name, None)

    def _foreign(self, name: str, op: Callable[..., Any], target: Backend, arrays: HostArrays) -> Callable[..., Any]:
        """``op`` for ``target``'s arrays: those in the step's memory become
        traced numpy views, results go back as ``target``'s arrays on the
        same memory; an op on constants only is ``target``'s own."""
        real = getattr(type(target), name)

        def to_host(x: Any) -> Any:
            if arrays.is_array(x):
                a = arrays.to_host(x)
                return a.view(Traced) if a.size and self.in_step(a) else a
            if isinstance(x, PackedWeight):
                return arrays.weight(x)
            if type(x) is AdaptedWeight:  # its base, pools and rows as the recorder reads them
                rows = AdapterRows()
                rows.slots, rows.scales = to_host(x.rows.slots), to_host(x.rows.scales)
                host = AdaptedWeight(to_host(x.base), x.shape, rows)
                host.a, host.b = to_host(x.a), to_host(x.b)
                return host
            if isinstance(x, AttentionBatch):
                return AttentionBatch(to_host(x.query_start), to_host(x.seq_lens), to_host(x.block_tables),
                                      x.block_size, x.max_query)
            if isinstance(x, (list, tuple)):
                return type(x)(to_host(v) for v in x)
            return x

        def back(x: Any) -> Any:
            if isinstance(x, np.ndarray):
                host = x.view(np.ndarray)
                return arrays.guard(arrays.from_host(host)) if self.in_step(host) else arrays.from_host(host)
            if isinstance(x, (list, tuple)):
                return type(x)(back(v) for v in x)
            return x

        def stand_in(*args: Any, **kwargs: Any) -> Any:
            host_args = [to_host(a) for a in args]
            host_kwargs = {k: to_host(v) for k, v in kwargs.items()}
            if not (self.dynamic(host_args) or self.dynamic(list(host_kwargs.values()))):
                return real(target, *args, **kwargs)
            return back(op(*host_args, **host_kwargs))

        return stand_in

    def _stand_in(self, name: str) -> Callable[..., Any]:
        own = getattr(type(self), name, None)
        inherited = getattr(self.cls, name, None) is getattr(Backend, name, None)

        def op(*args: Any, **kwargs: Any) -> Any:
            if name in REFUSED:
                raise NotCapturable(f"{name}: a program runs on one process")
            if not (self.dynamic(list(args)) or self.dynamic(list(kwargs.values()))):
                return self.eager(name, *args, **kwargs)  # constants only: computed once, now
            if own is not None:
                return own(self, *args, **kwargs)
            if inherited:  # the contract's default, written with other ops: recorded through them
                return getattr(Backend, name)(self.ops, *args, **kwargs)
            raise NotCapturable(f"{name}: the step has no program step for it")

        return op


def _unwrap(x: Any) -> Any:
    """:func:`_plain` of ``x``, or of each item of a list or tuple."""
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    return _plain(x)


def _traced_args(args: Any, leaves: tuple[np.ndarray, ...], arrays: HostArrays | None) -> Any:
    """``args`` with each array leaf as the traced function sees it (guarded, on the same memory)."""
    it = iter(leaves)

    def build(tree: Any) -> Any:
        if isinstance(tree, np.ndarray):
            return next(it).view(Traced)
        if arrays is not None and arrays.is_array(tree):
            next(it)
            return arrays.guard(tree)
        if isinstance(tree, (list, tuple)):
            return type(tree)(build(v) for v in tree)
        if isinstance(tree, dict):
            return {k: build(v) for k, v in tree.items()}
        return tree

    try:
        return build(args)
    finally:  # a nested function calling itself is a cycle through its cell, which held the call's inputs
        build = None  # type: ignore[assignment]
