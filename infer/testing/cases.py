"""The conformance kit's op cases: every required op and every optional op.

A declarative table: each :class:`~infer.testing.calls.Case` names the
op, the strategy that draws its calls (:mod:`infer.testing.strategies`),
how to call it when that is more than ``op(*args, **kwargs)``, and which
dtype its result must have.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from infer.testing import missing_hypothesis

try:
    from hypothesis import strategies as st
except ImportError as exc:  # not a dependency of infer
    raise missing_hypothesis(exc) from exc

from infer.errors import UnsupportedOpError
from infer.ops import KV_BLOCK_DTYPES, AdaptedWeight, AdapterRows, AttentionBatch, QuantizedTensor, kv_pool_width
from infer.quantize import q8_error_bound, q8_weight_sums
from infer.testing.calls import INDEX, SAME, Call, Case, Host, Mismatch
from infer.testing.strategies import (
    GGUF_LINEAR_TYPES,
    QUANTIZED_FORMAT,
    arange_calls,
    array_of_kind,
    astype_calls,
    attention_calls,
    binary_calls,
    causal_conv1d_calls,
    clip_calls,
    compile_calls,
    concat_calls,
    embedding_calls,
    expert_linear_calls,
    from_numpy_calls,
    fused_add_rms_norm_calls,
    gated_delta_rule_calls,
    gguf_linear_calls,
    layer_norm_calls,
    linear_calls,
    lora_linear_calls,
    matmul_calls,
    quantized_weight_calls,
    reduce_calls,
    reshape_calls,
    rms_norm_calls,
    rope_calls,
    q8_0_write_calls,
    scatter_rows_calls,
    slice_calls,
    softcap_calls,
    softmax_calls,
    sqrt_calls,
    ssd_calls,
    swiglu_calls,
    take_calls,
    topk_calls,
    transpose_calls,
    unary,
    zeros_calls,
)


def _attention(with_host: bool, pool_dtype: str | None = None, spans: bool = False) -> Any:
    """``run`` hook of the attention cases: the description built on the
    backend from the uploaded arrays, with or without its host copy.
    ``pool_dtype``: the pools are stored in that narrower ``kv_dtype``, which
    a backend that does not list it in :attr:`~infer.ops.Backend.kv_dtypes`
    need not take. ``spans``: the batch carries bidirectional spans
    (:attr:`~infer.ops.AttentionBatch.spans`), which a backend with a native
    ``attention`` must list as ``attention_spans`` to be given them (the
    attention context gives the others' span batches to the contract's default)."""
    def run(ops: Any, call: Call, args: Any, kwargs: Any) -> Any:
        if pool_dtype is not None and pool_dtype not in ops.kv_dtypes:
            raise UnsupportedOpError(f"{ops.name} stores no keys and values in {pool_dtype} (kv_dtypes)")
        if spans and ops.supports("attention") and not ops.supports("attention_spans"):
            raise UnsupportedOpError(f"{ops.name}'s attention reads no bidirectional spans (attention_spans)")
        q, k_pool, v_pool, query_start, seq_lens, tables = args
        if pool_dtype in KV_BLOCK_DTYPES:  # float pools, written into blocks by the backend's own KV write
            k_pool, v_pool = (_block_pool(ops, pool_dtype, x) for x in (k_pool, v_pool))
        i = call.info
        rows = i.get("spans") if spans else None
        host = AttentionBatch(i["host"]["query_start"], i["host"]["seq_lens"], i["host"]["block_tables"],
                              i["block_size"], i["max_query"], spans=rows) if with_host else None
        batch = AttentionBatch(query_start, seq_lens, tables, i["block_size"], i["max_query"], host,
                               spans=None if rows is None else ops.from_numpy(rows))
        return ops.attention(q, k_pool, v_pool, batch, **kwargs)
    return run


def _block_pool(ops: Any, kv_dtype: str, rows: Any) -> Any:
    """A pool of ``kv_dtype`` blocks (:data:`~infer.ops.KV_BLOCK_DTYPES`)
    holding float ``rows`` ``[n, heads, d]``, written by :meth:`scatter_rows`."""
    n, heads, width = ops.shape(rows)
    width, dtype = kv_pool_width(kv_dtype, width)
    return ops.scatter_rows(ops.zeros((n, heads, width), dtype), ops.arange(0, n, "int32"), rows)


def _q8_0_write(ops: Any, call: Call, at: Any, src: Any) -> Any:
    """``scatter_rows`` of float rows into a q8_0 pool: its bytes (compared exactly)."""
    if "q8_0" not in ops.kv_dtypes:
        raise UnsupportedOpError(f"{ops.name} stores no keys and values in q8_0 (kv_dtypes)")
    rows, heads, width = call.info["shape"]
    pool = ops.zeros((rows, heads, kv_pool_width("q8_0", width)[0]), "uint8")
    return ops.scatter_rows(pool, at, src)


def _run(fn: Any) -> Any:
    """``run`` hook from ``fn(ops, call, *args)``."""
    return lambda ops, call, args, kwargs: fn(ops, call, *args)


def _from_numpy(ops: Any, call: Call) -> Any:
    host = call.info["host"].copy()
    x = ops.from_numpy(host, call.info["dtype"])
    host[...] = 7  # the caller reuses its buffer: the backend array must not change
    return x


def _to_numpy(ops: Any, call: Call, x: Any) -> Host:
    h = ops.to_numpy(x)
    if not isinstance(h, np.ndarray):
        raise Mismatch(f"to_numpy returned {type(h).__name__}, not a numpy array")
    kept = h.copy()
    if h.flags.writeable:
        h[...] = 0  # must not write through to the backend array (checked after the call)
    return Host(kept)


def _check_dtype(ops: Any, call: Call, x: Any) -> str:
    want = ops.compute_dtype if call.info["kind"] == "float" else call.info["kind"]
    got = ops.dtype(x)
    return "ok" if got == want else f"dtype() said {got!r} for an array uploaded as {want!r}"


def _arange(ops: Any, call: Call) -> Any:
    i = call.info
    return ops.arange(i["start"], i["stop"]) if i["dtype"] is None else ops.arange(i["start"], i["stop"], i["dtype"])


class _Stored(QuantizedTensor):
    """A "quantized" weight that is float32 inside: prepare_weight must
    dequantize what it does not compute on natively."""

    qtype = "F32_CONFORMANCE"

    def __init__(self, value: np.ndarray) -> None:
        self.value, self.shape = value, tuple(value.shape)

    def dequantize(self) -> np.ndarray:
        return self.value.copy()


def _compiled_block(ops: Any, call: Call, x: Any, w: Any, norm: Any) -> Any:
    """A layer-like piece compiled once per backend (one per dtype): the
    shapes the strategy draws are few, so a compiling backend compiles a
    handful of graphs, not one per example."""
    key = ("compile-case", id(ops))
    fn = _COMPILED.get(key)
    if fn is None:
        def block(x: Any, w: Any, norm: Any) -> Any:
            h = ops.rms_norm(x, norm, 1e-6)
            return ops.swiglu(ops.linear(h, w), ops.linear(h, w)), ops.add(x, h)
        fn = _COMPILED[key] = ops.compile(block)
    return fn(x, w, norm)


_COMPILED: dict[Any, Any] = {}
def _quantized_linear(ops: Any, call: Call, x: Any, bias: Any) -> Any:
    """``linear`` of a random GGUF matrix as the backend prepares it, with
    quantized compute asked for (``quantize`` set to the backend's first
    on-load scheme, if it has one) so that native kernels are what runs. The
    weight's values are exact on every backend; only the accumulation order
    (and the dtype under test for ``x``) differ from numpy's
    dequantize-then-BLAS, so the ordinary per-dtype tolerances apply."""
    i = call.info
    tensor = _quantized_format().random_tensor(i["qtype"], i["shape"], i["seed"])
    scheme = min(ops.quantize_schemes) if ops.quantize_schemes else None
    quantizing = ops.configure(dataclasses.replace(ops.settings, quantize=scheme))  # ``ops`` itself unchanged
    weight = quantizing.prepare_weight(tensor, name="model.layers.0.mlp.up_proj.weight")
    return ops.linear(x, weight, bias)


def _adapted_linear(ops: Any, call: Call, x: Any, w: Any, bias: Any, a: Any, b: Any, slots: Any,
                    scales: Any) -> Any:
    """``linear`` of an :class:`~infer.ops.AdaptedWeight`: the backend's
    ``linear`` must hand it to ``adapted_linear`` (as a ``PackedWeight`` to
    ``quantized_linear``)."""
    rows = AdapterRows()
    weight = AdaptedWeight(w, call.args[1].value.shape, rows)
    weight.a, weight.b = a, b
    rows.slots, rows.scales = slots, scales
    return ops.linear(x, weight, bias)


def _lora_linear_quantized(ops: Any, call: Call, x: Any, w: Any, bias: Any, a: Any, b: Any, slots: Any,
                           scales: Any) -> Any:
    """``lora_linear`` on a random GGUF base matrix as the backend prepares it
    (kept quantized where the backend can: the base product is
    ``quantized_linear``'s)."""
    i = call.info
    tensor = _quantized_format().random_tensor(i["qtype"], i["shape"], i["seed"])
    scheme = min(ops.quantize_schemes) if ops.quantize_schemes else None
    quantizing = ops.configure(dataclasses.replace(ops.settings, quantize=scheme))
    weight = quantizing.prepare_weight(tensor, name="model.layers.0.mlp.up_proj.weight")
    return ops.lora_linear(x, weight, bias, a, b, slots, scales)


def _quantized_linear_q8act(ops: Any, call: Call, x: Any, bias: Any) -> Any:
    """``linear`` of a random GGUF matrix with ``activations="q8"``, where the
    backend lists it in :attr:`~infer.ops.Backend.activation_schemes`."""
    if "q8" not in ops.activation_schemes:
        raise UnsupportedOpError(f"{ops.name}/{ops.device} has no int8 activations (activation_schemes: "
                                 f"{', '.join(sorted(ops.activation_schemes)) or 'none'})")
    i = call.info
    tensor = _quantized_format().random_tensor(i["qtype"], i["shape"], i["seed"])
    scheme = min(ops.quantize_schemes) if ops.quantize_schemes else None
    q8 = ops.configure(dataclasses.replace(ops.settings, quantize=scheme, activations="q8"))
    return q8.linear(x, q8.prepare_weight(tensor, name="model.layers.0.mlp.up_proj.weight"), bias)


def _q8_bound(call: Call, x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """:func:`infer.quantize.q8_error_bound` of the call's x and weight."""
    i = call.info
    w = _quantized_format().random_tensor(i["qtype"], i["shape"], i["seed"]).dequantize()
    return q8_error_bound(x, q8_weight_sums(w))


def _quantized_format() -> Any:
    """The format whose quantized types the ``quantized_linear`` cases draw
    (:data:`~infer.testing.strategies.QUANTIZED_FORMAT`), from the registry."""
    from infer.plugins import get_registry

    spec = get_registry().formats.get(QUANTIZED_FORMAT)
    if spec is None or spec.random_tensor is None:
        raise RuntimeError(f"the conformance kit needs the {QUANTIZED_FORMAT!r} format's random_tensor for its "
                           f"quantized_linear cases; registered formats: {', '.join(sorted(get_registry().formats))}")
    return spec


def _bfloat16(call: Call, x: np.ndarray, target: str) -> np.ndarray:
    """A cast to bfloat16, on the host: each value rounded to the nearest
    bfloat16 (ties to even), held in float32. numpy has no bfloat16, so the
    reference backend declines the cast and the kit computes it here."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)).view(np.float32)


def _case(name: str, op: str, inputs: Any, **kw: Any) -> Case:
    return Case(name=name, op=op, inputs=inputs, **kw)


CASES: tuple[Case, ...] = (
    # transfer, creation, casting
    _case("from_numpy-float", "from_numpy", from_numpy_calls("float"), run=_run(_from_numpy),
          out=lambda call, dt: call.info["dtype"] or dt),
    _case("from_numpy-int32", "from_numpy", from_numpy_calls("int32"), run=_run(_from_numpy),
          out=lambda call, dt: "int32"),
    _case("from_numpy-int64", "from_numpy", from_numpy_calls("int64"), run=_run(_from_numpy),
          out=lambda call, dt: "int64"),
    _case("to_numpy", "to_numpy", array_of_kind().map(lambda x: Call((x,))), run=_run(_to_numpy),
          out=lambda call, dt: {"bfloat16": "float32"}.get(SAME(call, dt), SAME(call, dt))),
    *(_case(f"astype-{t}", "astype", astype_calls(t), out=lambda call, dt: call.args[1],
            expect=_bfloat16 if t == "bfloat16" else None)
      for t in ("float32", "bfloat16", "float16", "int32", "int64")),
    _case("shape", "shape", array_of_kind().map(lambda x: Call((x,)))),
    _case("dtype", "dtype", array_of_kind().map(lambda x: Call((x,), info={"kind": x.dtype})),
          run=_run(_check_dtype)),
    _case("zeros", "zeros", zeros_calls(), run=_run(lambda ops, call: ops.zeros(call.info["shape"], call.info["dtype"])),
          out=lambda call, dt: call.info["dtype"] or dt),
    _case("arange", "arange", arange_calls(), run=_run(_arange), out=lambda call, dt: call.info["dtype"] or "int32"),
    # linear algebra
    _case("matmul", "matmul", matmul_calls()),
    _case("linear", "linear", linear_calls(bias=False)),
    _case("linear-bias", "linear", linear_calls(bias=True)),
    # elementwise
    *(_case(op, op, binary_calls(op)) for op in ("add", "sub", "mul", "div")),
    *(_case(f"{op}-int", op, binary_calls(op, ints=True), out=SAME) for op in ("add", "sub", "mul")),
    _case("div-int", "div", binary_calls("div", ints=True), out=lambda call, dt: "float32"),
    _case("exp", "exp", unary(clip=10.0)),
    _case("sqrt", "sqrt", sqrt_calls()),
    _case("tanh", "tanh", unary()),
    _case("cos", "cos", unary(scale=st.sampled_from([1.0, 10.0]))),
    _case("sin", "sin", unary(scale=st.sampled_from([1.0, 10.0]))),
    *(_case(op, op, unary(scale=st.sampled_from([0.1, 1.0, 3.0, 100.0]))) for op in ("silu", "gelu", "gelu_tanh")),
    # reductions
    _case("sum", "sum", reduce_calls()),
    _case("mean", "mean", reduce_calls()),
    _case("max", "max", reduce_calls(ties=True)),
    _case("argmax", "argmax", reduce_calls(keepdims=False, ties=True), out=INDEX),
    _case("softmax", "softmax", softmax_calls()),
    _case("softmax-masked-row", "softmax", softmax_calls(masked_row=True)),
    # normalisation, position, gathers
    _case("rms_norm", "rms_norm", rms_norm_calls()),
    _case("layer_norm", "layer_norm", layer_norm_calls()),
    _case("rope", "rope", rope_calls(partial=False)),
    _case("rope-partial", "rope", rope_calls(partial=True)),
    _case("embedding", "embedding", embedding_calls()),
    _case("embedding-out-of-range", "embedding", embedding_calls(out_of_range=True), raises=True),
    _case("take", "take", take_calls(), out=SAME),
    # shapes
    _case("reshape", "reshape", reshape_calls(), out=SAME),
    _case("transpose", "transpose", transpose_calls(), out=SAME),
    _case("concat", "concat", concat_calls(), out=lambda call, dt: SAME(Call(tuple(call.args[0])), dt)),
    _case("slice", "slice", slice_calls(), out=SAME),
    _case("scatter_rows", "scatter_rows", scatter_rows_calls(), mutates=(0,)),
    # q8_0 pools (kv_dtype="q8_0"), where the backend lists them: the write's blocks exactly, and
    # attention over them (queries quantized per 32 values, integer dot products per block)
    _case("scatter_rows-q8_0", "scatter_rows", q8_0_write_calls(), run=_run(_q8_0_write), out=lambda call, dt: "uint8"),
    *(_case(f"attention-q8_0-pool{suffix}", "attention", attention_calls(sinks=st.booleans(), pool_dtype="q8_0"),
            run=_attention(host, "q8_0"))
      for host, suffix in ((True, ""), (False, "-static"))),
    # optional ops (native or default)
    # attention: every case twice, with the description's host copy (an eager
    # forward) and without (a captured step, where it is data only)
    *(_case(f"attention-{name}{suffix}", "attention", calls, run=_attention(host))
      for name, calls in (
          ("causal", attention_calls(past=st.just(0), group=st.just(1), causal=st.just(True), window=st.none(),
                                     softcap=st.none(), seqs=st.just(1))),
          ("decode", attention_calls(queries=st.just(1), past=st.integers(1, 16), causal=st.just(True),
                                     window=st.none(), softcap=st.none(), seqs=st.integers(1, 4))),
          ("ragged", attention_calls(queries=st.integers(1, 9), seqs=st.integers(2, 4), causal=st.just(True),
                                     window=st.none(), softcap=st.none())),
          ("padding", attention_calls(queries=st.integers(0, 3), seqs=st.integers(2, 4))),
          ("contiguous", attention_calls(block=st.just(None))),
          ("gqa", attention_calls(group=st.integers(2, 4), causal=st.just(True), window=st.none(),
                                  softcap=st.none())),
          ("window", attention_calls(window=st.integers(1, 10), softcap=st.none())),
          ("softcap", attention_calls(softcap=st.floats(5.0, 50.0))),
          ("sinks", attention_calls(sinks=st.just(True))),
          ("non-causal", attention_calls(causal=st.just(False), window=st.none(), softcap=st.none())),
          ("all", attention_calls(sinks=st.booleans())),
      )
      for host, suffix in ((True, ""), (False, "-static"))),
    # bidirectional spans inside causal sequences (Gemma 3's image tokens), with windows and soft-caps
    *(_case(f"attention-spans{suffix}", "attention",
            attention_calls(causal=st.just(True), past=st.integers(0, 6), queries=st.integers(1, 8), spans=True),
            run=_attention(host, spans=True))
      for host, suffix in ((True, ""), (False, "-static"))),
    # float16 pools under any compute dtype (kv_dtype="float16"), where the backend lists them
    *(_case(f"attention-float16-pool{suffix}", "attention", attention_calls(sinks=st.booleans(), pool_dtype="float16"),
            run=_attention(host, "float16"))
      for host, suffix in ((True, ""), (False, "-static"))),
    # optional ops (native or default)
    _case("prepare_weight-quantized", "prepare_weight", quantized_weight_calls(),
          run=_run(lambda ops, call, x: ops.linear(x, ops.prepare_weight(_Stored(call.info["weight"]))))),
    *(_case(f"quantized_linear-{t}", "quantized_linear", gguf_linear_calls(t), run=_run(_quantized_linear))
      for t in ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0", "Q6_K", "MXFP4")),
    # the same products with int8 activations: a separate mode with its own bound
    *(_case(f"quantized_linear-q8act-{t}", "quantized_linear", gguf_linear_calls(t, rows=(1, 12)),
            run=_run(_quantized_linear_q8act), reference_run=_run(_quantized_linear), bound=_q8_bound)
      for t in GGUF_LINEAR_TYPES),
    _case("lora_linear", "lora_linear", lora_linear_calls(bias=False)),
    _case("lora_linear-bias", "lora_linear", lora_linear_calls(bias=True)),
    _case("lora_linear-Q4_0", "lora_linear", lora_linear_calls(bias=False, qtype="Q4_0"),
          run=_run(_lora_linear_quantized)),
    _case("linear-adapted", "lora_linear", lora_linear_calls(bias=True), run=_run(_adapted_linear)),
    _case("expert_linear", "expert_linear", expert_linear_calls()),
    _case("fused_add_rms_norm", "fused_add_rms_norm", fused_add_rms_norm_calls()),
    _case("swiglu", "swiglu", swiglu_calls()),
    _case("softcap", "softcap", softcap_calls()),
    _case("clip", "clip", clip_calls()),
    _case("synchronize", "synchronize", st.just(Call())),
    _case("topk-values", "topk", topk_calls(), run=lambda ops, call, args, kwargs: ops.topk(*args)[0]),
    _case("topk-indices", "topk", topk_calls(), run=lambda ops, call, args, kwargs: ops.topk(*args)[1], out=INDEX),
    _case("compile", "compile", compile_calls(), run=_run(_compiled_block)),
    # recurrent layers' ops: outputs, states after each sequence, states after the checkpoint rows
    _case("causal_conv1d", "causal_conv1d", causal_conv1d_calls()),
    _case("ssd", "ssd", ssd_calls()),
    _case("gated_delta_rule", "gated_delta_rule", gated_delta_rule_calls()),
    _case("softplus", "softplus", unary(scale=st.sampled_from([0.1, 1.0, 3.0, 30.0]))),
    # collectives: in the kit's single process, a group of one (docs/distributed.md tests the rest)
    _case("all_reduce", "all_reduce", unary()),
    _case("all_gather", "all_gather", unary()),
    _case("broadcast", "broadcast", unary()),
)
"""Every case, in the contract's order: required ops, then optional ops."""


def case_named(name: str) -> Case:
    """The case called ``name``."""
    for case in CASES:
        if case.name == name:
            return case
    raise KeyError(f"no conformance case {name!r}; cases: {', '.join(c.name for c in CASES)}")
