"""The jit-compiled kernels of the JAX backend.

Each kernel is one ``jax.jit`` function, so XLA fuses its chain of
elementwise steps (upcast, square, mean, rsqrt, scale, downcast...) into a
single pass instead of one dispatch and one temporary per step. Arguments
that change the traced program (``causal``, ``interleaved``) are static; the
others, Python floats included, are traced, so a model's constant ``eps`` or
``scale`` never triggers a recompilation. A ``None`` argument (no weight, no
window, no soft-cap) is an empty pytree: jit tells it apart from a value by
structure, with no static flag needed.

JAX compiles once per distinct input *shape*. Only the attention kernel sees
a shape that grows while decoding (the key length); :func:`attention`
therefore takes the number of valid keys as a traced argument, and the
backend pads each sequence's key rows to a bucket, so it compiles once per
bucket rather than once per token.

Where the contract leaves precision open these kernels widen to float32 and
round once at the end, which is what makes bfloat16 match the float32
reference within a few roundings.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def _wide(x: jax.Array) -> jax.Array:
    """``x`` in at least float32."""
    return x.astype(jnp.promote_types(x.dtype, F32))


# -- linear algebra ------------------------------------------------------------------


@jax.jit
def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None) -> jax.Array:
    """``x @ weight.T + bias`` without materialising ``weight.T``: the
    contraction reads the ``[out, in]`` weight as stored. Accumulates in
    float32."""
    y = lax.dot_general(x, weight.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=F32)
    if bias is not None:
        y = y + bias.astype(F32)
    return y.astype(x.dtype)


@jax.jit
def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """numpy ``matmul``; float operands accumulate in float32."""
    if jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.matmul(a, b.astype(a.dtype), preferred_element_type=F32).astype(a.dtype)
    return jnp.matmul(a, b)


# -- normalisation, position --------------------------------------------------------------


@jax.jit
def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """Llama's RMSNorm: statistics in float32, normalised value rounded to
    ``x``'s dtype before the weight (the contract's order)."""
    x32 = _wide(x)
    y = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return y if weight is None else y * weight.astype(x.dtype)


@jax.jit
def fused_add_rms_norm(x: jax.Array, residual: jax.Array, weight: jax.Array | None,
                       eps: float) -> tuple[jax.Array, jax.Array]:
    """``h = x + residual``; ``(rms_norm(h), h)`` in one fused pass."""
    h = x + residual.astype(x.dtype)
    return rms_norm(h, weight, eps), h


@jax.jit
def layer_norm(x: jax.Array, weight: jax.Array | None, bias: jax.Array | None, eps: float) -> jax.Array:
    """LayerNorm with the biased variance, statistics in float32."""
    x32 = _wide(x)
    centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    y = (centred * lax.rsqrt(var + eps)).astype(x.dtype)
    if weight is not None:
        y = y * weight.astype(x.dtype)
    if bias is not None:
        y = y + bias.astype(x.dtype)
    return y


@partial(jax.jit, static_argnames=("interleaved",))
def rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """Rotary embedding of the first ``rot = 2 * cos.shape[-1]`` features of
    ``x`` (``[tokens, heads, head_dim]``), computed in float32.

    Half-split pairs ``(x[i], x[i + rot/2])`` (GPT-NeoX, Hugging Face) or
    interleaved pairs ``(x[2i], x[2i+1])`` (RoFormer, GPT-J); each pair
    ``(a, b)`` becomes ``(a cos - b sin, a sin + b cos)``.
    """
    half = cos.shape[-1]
    rot = 2 * half
    c = cos.astype(F32)[:, None, :]  # [tokens, 1, rot/2]: the same angle for every head
    s = sin.astype(F32)[:, None, :]
    xr = x[..., :rot].astype(F32)
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rotated = jnp.stack((a * c - b * s, a * s + b * c), axis=-1).reshape(xr.shape)
    else:
        a, b = xr[..., :half], xr[..., half:]
        rotated = jnp.concatenate((a * c - b * s, a * s + b * c), axis=-1)
    return jnp.concatenate((rotated.astype(x.dtype), x[..., rot:]), axis=-1)


# -- activations ---------------------------------------------------------------------------


@jax.jit
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` in float32, rounded once."""
    return (jax.nn.silu(_wide(gate)) * _wide(up)).astype(gate.dtype)


@jax.jit
def softcap(x: jax.Array, cap: float) -> jax.Array:
    """``cap * tanh(x / cap)`` in float32, rounded once."""
    return (jnp.tanh(_wide(x) / cap) * cap).astype(x.dtype)


@partial(jax.jit, static_argnames=("axis",))
def softmax(x: jax.Array, axis: int) -> jax.Array:
    """Softmax in float32. A row of only ``-inf`` gives NaN (its max is
    ``-inf`` and ``-inf - -inf`` is NaN), as the contract asks."""
    return jax.nn.softmax(_wide(x), axis=axis).astype(x.dtype)


# -- the KV cache --------------------------------------------------------------------------


@partial(jax.jit, static_argnames=("size", "axis"))
def slice_axis(x: jax.Array, start: jax.Array, size: int, axis: int) -> jax.Array:
    """``size`` entries from ``start`` along ``axis``. ``start`` is traced, so
    reading a sliding window of the KV cache (same size, moving start) reuses
    one program. ``dynamic_slice`` would clamp a start that does not fit; the
    backend passes only starts that do."""
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


@partial(jax.jit, donate_argnums=0)
def scatter_rows(dst: jax.Array, rows: jax.Array, src: jax.Array) -> jax.Array:
    """``dst`` with row ``rows[i]`` replaced by ``src[i]``.

    ``dst`` is donated: XLA writes into its buffer instead of copying the
    whole cache, and the caller's ``dst`` is deleted (the contract says to
    use the returned array). The rows are traced, so a decode step reuses one
    compiled program for every position; the backend checks their range first
    (XLA would drop rows outside ``dst``).
    """
    return dst.at[rows].set(src.astype(dst.dtype))


# -- attention -------------------------------------------------------------------------------


@partial(jax.jit, static_argnames=("causal",))
def attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, rows: jax.Array, length: jax.Array,
              scale: jax.Array, causal: bool, window: jax.Array | None, softcap: jax.Array | None,
              sinks: jax.Array | None) -> jax.Array:
    """Grouped-query attention of one sequence over the pool rows ``rows``
    (``[keys]``, its key positions in order; entries at ``j >= length`` are
    padding).

    q: ``[tq, hq, dk]``; pools: ``[rows, hkv, d]``. Query ``i`` sits at
    position ``length - tq + i`` (its sequence's last positions); causal: it
    sees keys ``j <= p``; window: only ``|p - j| < window``; sinks (``[hq]``)
    join each softmax's denominator. Scores, soft-cap, softmax and the
    weighted sum run in float32; the result is rounded once.
    """
    k, v = jnp.take(k_pool, rows, axis=0), jnp.take(v_pool, rows, axis=0)
    tq, hq, dk = q.shape
    tk, hkv, dv = v.shape
    group = hq // hkv
    # Query head h reads kv head h // group: view q as [tq, hkv, group, dk]
    # and contract per kv head, so keys are never repeated in memory.
    qg = q.reshape(tq, hkv, group, dk)
    scores = jnp.einsum("qhgd,khd->hgqk", qg, k.astype(q.dtype), preferred_element_type=F32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    pos = length - tq + lax.broadcasted_iota(jnp.int32, (tq, tk), 0)
    key = lax.broadcasted_iota(jnp.int32, (tq, tk), 1)
    visible = key < length
    if causal:
        visible &= key <= pos
    if window is not None:
        visible &= jnp.abs(pos - key) < window
    scores = jnp.where(visible, scores, -jnp.inf)
    if sinks is not None:  # one more logit per head, with no value
        sink = jnp.broadcast_to(sinks.astype(F32).reshape(hkv, group, 1, 1), (hkv, group, tq, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :tk]
    else:
        probs = jax.nn.softmax(scores, axis=-1)  # [hkv, group, tq, tk]; no row is all -inf
    out = jnp.einsum("hgqk,khd->qhgd", probs, v.astype(F32))
    return out.reshape(tq, hq, dv).astype(q.dtype)
