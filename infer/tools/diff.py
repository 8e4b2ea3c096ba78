"""Divergence tracing: where do two backends start to disagree?

One backend alone is compared with the reference backend (:data:`REFERENCE`,
``backends/reference.py``: the op contract in plain numpy, what the
conformance kit checks every backend against); two are compared with each
other, the first as the reference side. Each backend runs the same prompt through the same architecture code behind a
:class:`TracingBackend`, which records the output of every op call. Because
the code path is identical, the two op sequences line up one to one; the
report gives, per layer and per token, the largest difference of that layer's
attention output, the logits' difference, and the first op whose output
differs by more than a tolerance (normalised to the reference's magnitude).

Against transformers (float32), only what transformers exposes can be
compared: the hidden state after each layer (ours: the residual stream the
next norm receives) and the logits.

With ``activations="q8"`` the second side runs on int8 activations, an
approximate mode, and the report says so: its differences from the exact
first side are expected. What must hold is the mode's bound
(:func:`infer.quantize.q8_error_bound`, docs/conformance.md): every product
on a quantized weight is checked, on its own input, against the exact
product of that same input, so the check does not mix in what earlier
layers' rounding moved.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infer.errors import InferError, UnsafeFormatError
from infer.ops import OPTIONAL_OPS, REQUIRED_OPS, Array, Backend, PackedWeight
from infer.quantize import q8_error_bound, q8_weight_sums

log = logging.getLogger(__name__)

#: What a backend alone is compared with: the conformance kit's reference backend.
REFERENCE = "reference"

_NOT_TRACED = {"from_numpy", "to_numpy", "shape", "dtype", "synchronize", "prepare_weight", "zeros", "arange"}


@dataclass
class OpRecord:
    """One op call: its name, the layer it ran in, and its output(s) on the host."""

    index: int
    op: str
    #: Attention calls completed before it in its forward pass: for the
    #: attention op itself, its layer; for any other op, n means it ran after
    #: layer n-1's attention (and before layer n's).
    layer: int
    outputs: list[np.ndarray]


@dataclass
class Trace:
    records: list[OpRecord] = field(default_factory=list)
    #: layer -> attention output of each forward, in order
    attention_outputs: dict[int, list[np.ndarray]] = field(default_factory=dict)
    hidden_states: list[np.ndarray] = field(default_factory=list)  # residual stream entering each norm
    logits: np.ndarray | None = None
    #: With ``activations="q8"``: per product on a quantized weight, ``(index,
    #: layer, max |y - exact| / bound)`` (:func:`infer.quantize.q8_error_bound`).
    bound_checks: list[tuple[int, int, float]] = field(default_factory=list)


class TracingBackend(Backend):
    """Wraps a backend and records every op's output (slow: diagnostics only)."""

    def __init__(self, inner: Backend) -> None:  # noqa: D107
        self.inner = inner
        self.name, self.device = inner.name, inner.device
        self.native_ops = inner.native_ops
        self.float_dtypes = inner.float_dtypes
        self.compute_dtype = inner.compute_dtype
        self.api_version = inner.api_version
        self.quantize_schemes, self.activation_schemes = inner.quantize_schemes, inner.activation_schemes
        self.kv_dtypes = inner.kv_dtypes
        self.trace = Trace()
        self._attentions = 0
        #: With int8 activations: the same backend with exact ones, for the bound checks.
        self.exact: Backend | None = None
        self._sums: dict[int, tuple[Any, np.ndarray]] = {}

    def configure(self, settings: Any) -> Backend:
        """Configure the wrapped backend and keep tracing it; with
        ``activations`` set, keep an exact twin to check each product's bound."""
        inner = self.inner.configure(settings)
        if inner is not self.inner:
            self.inner = inner
            self.settings = settings
        if settings.activations is not None:
            self.exact = inner.configure(dataclasses.replace(settings, activations=None))
        return self

    def _check_bound(self, x: Any, weight: Any, bias: Any, out: Any) -> None:
        """One product on int8 activations against the exact product of the same input."""
        if self.exact is None or not isinstance(weight, PackedWeight) or weight.rows is None:
            return
        known = self._sums.get(id(weight))
        if known is None or known[0] is not weight:
            known = self._sums[id(weight)] = (weight, q8_weight_sums(weight.rows.dequantize()))
        x_host = self.inner.to_numpy(x).astype(np.float64)
        exact = self.exact.to_numpy(self.exact.linear(x, weight, bias)).astype(np.float64)
        got = self.inner.to_numpy(out).astype(np.float64)
        bound = q8_error_bound(x_host, known[1])
        ratio = float((np.abs(got - exact) / np.maximum(bound, 1e-300)).max(initial=0.0))
        self.trace.bound_checks.append((len(self.trace.records) - 1, self._attentions, ratio))

    def start_forward(self) -> None:
        self._attentions = 0

    def _host(self, value: Any) -> list[np.ndarray]:
        values = value if isinstance(value, tuple) else (value,)
        return [self.inner.to_numpy(v).astype(np.float64, copy=False) for v in values]

    def _call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        out = getattr(self.inner, op)(*args, **kwargs)
        if op not in _NOT_TRACED:
            host = self._host(out)
            self.trace.records.append(OpRecord(len(self.trace.records), op, self._attentions, host))
            if op == "attention":
                self.trace.attention_outputs.setdefault(self._attentions, []).append(host[0])
                self._attentions += 1
            elif op == "fused_add_rms_norm":
                self.trace.hidden_states.append(host[1])
            elif op == "linear":
                self._check_bound(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"), out)
        return out


def _delegate(op: str) -> Callable[..., Any]:
    def method(self: TracingBackend, *args: Any, **kwargs: Any) -> Any:
        return self._call(op, *args, **kwargs)

    method.__name__ = op
    return method


for _op in (*REQUIRED_OPS, *OPTIONAL_OPS):
    setattr(TracingBackend, _op, _delegate(_op))
TracingBackend.__abstractmethods__ = frozenset()


@dataclass
class Divergence:
    """The comparison of two traces."""

    a: str
    b: str
    tolerance: float
    #: ``[layer][token]`` max |a - b| of what is compared per layer (:attr:`what`).
    per_layer: list[list[float]]
    #: ``[token]`` max |a - b| of the logits.
    logits: list[float]
    #: First op over tolerance: (index, op, layer, relative error), or None.
    first: tuple[int, str, int, float] | None
    #: Greedy tokens of each side (prompt's last position and each decode step).
    tokens_a: list[int]
    tokens_b: list[int]
    what: str = "attention output"
    #: The side whose magnitude scales the relative errors.
    reference: str = ""
    #: The approximate mode of side b (``"q8"``: int8 activations), or None.
    activations: str | None = None
    #: With :attr:`activations`: per product on a quantized weight ``(index,
    #: layer, max |Δ| / bound)`` against the exact product of its own input.
    bound_checks: list[tuple[int, int, float]] = field(default_factory=list)

    @property
    def within_bound(self) -> bool:
        """Every checked product within its bound (True without checks)."""
        return all(ratio <= 1.0 for _, _, ratio in self.bound_checks)

    def format(self) -> str:
        """A plain-text report."""
        lines = [f"{self.a} vs {self.b} (tolerance {self.tolerance:g}, relative to max |{self.reference or self.a}|)"]
        if self.activations is not None:
            lines.append(f"approximate: {self.b} runs with activations={self.activations}, so differences from the "
                         f"exact side are expected; each product is held to the mode's bound instead "
                         f"(docs/conformance.md, \"Approximate modes\")")
            worst = max((c[2] for c in self.bound_checks), default=0.0)
            over = [c for c in self.bound_checks if c[2] > 1.0]
            lines.append(f"products on int8 activations: {len(self.bound_checks)} checked, worst |Δ| / bound "
                         f"{worst:.3g}, {len(over)} beyond it"
                         + (f" (first: op #{over[0][0]} after {over[0][1]} attention calls)" if over else ""))
        if self.per_layer:
            lines.append(f"layer  max |Δ| of the {self.what} per token")
            for i, row in enumerate(self.per_layer):
                lines.append(f"{i:5d}  " + " ".join(f"{x:.2e}" for x in row))
        lines.append("logits " + " ".join(f"{x:.2e}" for x in self.logits))
        if self.first is None:
            lines.append("no op output exceeds the tolerance")
        else:
            index, op, layer, err = self.first
            if op in ("attention", "hidden state"):
                where = f"in layer {layer}"
            elif layer == 0:
                where = "in layer 0, before its attention"
            else:
                where = f"after layer {layer - 1}'s attention"
            lines.append(f"first divergence: op #{index} {op} {where}: relative error {err:.3g}")
        same = self.tokens_a == self.tokens_b
        lines.append(f"greedy tokens {'identical' if same else 'differ'}: {self.tokens_a} / {self.tokens_b}")
        return "\n".join(lines)


def _per_token(a: np.ndarray, b: np.ndarray) -> list[float]:
    diff = np.abs(a - b)
    return diff.reshape(diff.shape[0], -1).max(axis=1).tolist() if diff.ndim > 1 else [float(diff.max())]


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    scale = float(np.abs(a).max()) if a.size else 0.0
    return float(np.abs(a - b).max()) / max(scale, 1e-30) if a.size else 0.0


def run_trace(model: Any, prompt_ids: Sequence[int], steps: int) -> tuple[Trace, list[int]]:
    """Prefill ``prompt_ids`` then decode ``steps`` greedy tokens on a model
    built over a :class:`TracingBackend`; returns the trace and the tokens."""
    ops: TracingBackend = model.backend
    engine = model.engine
    seq = engine.new_sequence(len(prompt_ids) + steps + 1)
    logits_rows, tokens = [], []
    ops.start_forward()
    logits = engine.forward(seq, list(prompt_ids), all_logits=True)
    for _ in range(steps + 1):
        host = ops.inner.to_numpy(logits).astype(np.float64)
        logits_rows.append(host)
        tokens.append(int(np.argmax(host[-1])))
        if len(tokens) > steps:
            break
        ops.start_forward()
        logits = engine.forward(seq, [tokens[-1]], all_logits=True)
    ops.trace.logits = np.concatenate(logits_rows)
    return ops.trace, tokens


def compare(a: tuple[str, Trace, list[int]], b: tuple[str, Trace, list[int]], tolerance: float) -> Divergence:
    """Compare two traces of the same prompt (see the module docstring)."""
    (name_a, ta, tok_a), (name_b, tb, tok_b) = a, b
    per_layer = [
        [d for x, y in zip(ta.attention_outputs[layer], tb.attention_outputs.get(layer, [])) for d in _per_token(x, y)]
        for layer in sorted(ta.attention_outputs)
    ]
    first = None
    for ra, rb in zip(ta.records, tb.records):
        err = max(_relative(x, y) for x, y in zip(ra.outputs, rb.outputs))
        if err > tolerance:
            first = (ra.index, ra.op, ra.layer, err)
            break
    assert ta.logits is not None and tb.logits is not None
    return Divergence(name_a, name_b, tolerance, per_layer, _per_token(ta.logits, tb.logits), first, tok_a, tok_b)


def trace_backend(reference: Any, backend: str, prompt_ids: Sequence[int], steps: int,
                  dtype: str | None = None, activations: str | None = None,
                  quantize: str | None = None) -> tuple[str, Trace, list[int]]:
    """Load ``reference`` on ``backend`` behind a tracer and run it."""
    import infer
    from infer.plugins.selection import select_backend

    tracer = TracingBackend(select_backend(backend, dtype))
    model = infer.load(reference, backend=tracer, activations=activations, quantize=quantize)
    trace, tokens = run_trace(model, prompt_ids, steps)
    label = f"{tracer.name}/{tracer.device}" + (f" activations={activations}" if activations else "")
    return label, trace, tokens


def trace_transformers(path: Any, prompt_ids: Sequence[int], steps: int) -> tuple[str, Trace, list[int]]:
    """transformers float32 on the same prompt: the hidden state after each
    layer and the logits (greedy decoding, full forward per step)."""
    import torch
    from transformers import AutoModelForCausalLM

    from infer.loading import resolve

    path = resolve(path)
    # Never pickle (torch.load) and never the folder's own Python code: the
    # reference reads what infer reads, safetensors or GGUF.
    kwargs: dict[str, Any] = {"dtype": torch.float32, "trust_remote_code": False}
    if path.is_file():
        kwargs["gguf_file"] = path.name
        path = path.parent
    else:
        if not any(path.glob("*.safetensors")):
            raise UnsafeFormatError(
                f"{path} has no .safetensors weights; the transformers reference loads only safetensors "
                "or GGUF, never pickled weights (.bin, .pt), which can run code when loaded")
        kwargs["use_safetensors"] = True
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()
    ids = list(prompt_ids)
    trace, tokens, rows = Trace(), [], []
    with torch.no_grad():
        for step in range(steps + 1):
            out = model(torch.tensor([ids]), output_hidden_states=True)
            logits = out.logits[0].double().numpy()
            rows.append(logits if step == 0 else logits[-1:])
            if step == 0:
                # hidden_states[1..L-1]: after layers 0..L-2 (the last is after the final norm).
                trace.hidden_states = [h[0].double().numpy() for h in out.hidden_states[1:-1]]
            tokens.append(int(np.argmax(logits[-1])))
            ids.append(tokens[-1])
    trace.logits = np.concatenate(rows)
    return "transformers/float32", trace, tokens[: steps + 1]


def compare_hidden(ours: tuple[str, Trace, list[int]], theirs: tuple[str, Trace, list[int]],
                   tolerance: float, prompt_len: int) -> Divergence:
    """Compare our residual stream with transformers' hidden states (prefill
    rows only) and the logits of every step."""
    (name_a, ta, tok_a), (name_b, tb, tok_b) = ours, theirs
    # Our fused_add_rms_norm calls alternate (pre-attention, pre-MLP) per layer;
    # the pre-attention one of layer L+1 receives the hidden state after layer L.
    entering = [h[:prompt_len] for h in ta.hidden_states[1::2]]
    rows, first = [], None
    for layer, (x, y) in enumerate(zip(entering, tb.hidden_states)):
        rows.append(_per_token(x, y))
        err = _relative(y, x)
        if first is None and err > tolerance:
            first = (layer, "hidden state", layer, err)
    assert ta.logits is not None and tb.logits is not None
    return Divergence(name_a, name_b, tolerance, rows, _per_token(ta.logits, tb.logits), first, tok_a, tok_b,
                      what="hidden state after the layer (prompt tokens)", reference=name_b)


def diff(reference: Any, backends: Sequence[str], prompt_ids: Sequence[int], *, steps: int = 4,
         tolerance: float = 1e-3, dtype: str | None = None, activations: str | None = None,
         quantize: str | None = None) -> Divergence:
    """Run ``prompt_ids`` of the model ``reference`` (a path or alias) on two
    backends (or a backend and ``"transformers"``) and compare them layer by
    layer and token by token; one backend alone is compared with the
    reference backend (:data:`REFERENCE`), which runs first. ``activations``
    (``"q8"``) runs the second side in that approximate mode, the first
    exact, and checks each of its products against the mode's bound;
    ``quantize`` quantizes float weights on load, on both sides."""
    if len(backends) == 1:
        backends = [REFERENCE, backends[0]]
    if len(backends) != 2:
        raise InferError(f"diff compares one backend with the reference backend, or two backends; got "
                         f"{len(backends)}: {', '.join(backends) or 'none'}")
    if activations is not None and "transformers" in backends:
        raise InferError("diff --activations compares infer's exact run with its approximate one: name infer "
                         "backends only, not transformers")
    runs = []
    for side, name in enumerate(backends):
        if name == "transformers":
            runs.append(trace_transformers(reference, prompt_ids, steps))
        else:
            runs.append(trace_backend(reference, name, prompt_ids, steps, dtype, activations if side else None,
                                      quantize))
    if backends[1] == "transformers" or backends[0] == "transformers":
        ours, theirs = (runs[0], runs[1]) if backends[1] == "transformers" else (runs[1], runs[0])
        return compare_hidden(ours, theirs, tolerance, len(prompt_ids))
    result = compare(runs[0], runs[1], tolerance)
    if activations is not None:
        result.activations, result.bound_checks = activations, runs[1][1].bound_checks
    return result


__all__ = ["REFERENCE", "Divergence", "TracingBackend", "compare", "diff", "run_trace", "Array"]
