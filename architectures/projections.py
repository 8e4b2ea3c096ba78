"""Projections that share their input, stacked into one matrix at load.

q, k and v read the same normed hidden state, as do an MLP's gate and up
projections. Stacked by rows into one weight (``qkv_proj``, ``gate_up_proj``)
they cost one product per token instead of three (or two), and the outputs
are column slices of its result: the same numbers (every output element is
still its own row's dot product), fewer op calls. The loader stacks them only
when they are stored alike (:meth:`~infer.architecture.WeightLoader.get_stacked`):
a GGUF file may keep v in another quantized type than q and k, and then the
three stay separate. Pieces read whichever form the weights dict holds.
"""

from __future__ import annotations

from infer.architecture import WeightLoader
from infer.ops import Array, Backend


def load_qkv(w: WeightLoader, prefix: str, nh: int, nkv: int, hd: int, d: int, bias: bool | None = None) -> dict[str, Array]:
    """``{prefix}{q,k,v}_proj`` as ``{"qkv_proj": ...}`` where they stack,
    else ``{"q_proj", "k_proj", "v_proj"}``; biases alike (``bias`` None:
    where the checkpoint has them)."""
    parts = [(prefix + f"{n}_proj.weight", (rows, d)) for n, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd))]
    out: dict[str, Array] = {}
    stacked = w.get_stacked(prefix + "qkv_proj.weight", parts)
    if stacked is not None:
        out["qkv_proj"] = stacked
    else:
        for (name, shape), key in zip(parts, ("q_proj", "k_proj", "v_proj")):
            out[key] = w.get(name, shape)
    has_bias = w.has(prefix + "q_proj.bias") if bias is None else bias
    if has_bias:
        biases = [w.get(prefix + f"{n}_proj.bias", (rows,)) for n, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd))]
        if stacked is not None:
            out["qkv_proj.bias"] = w.backend.concat(biases, axis=0)
        else:
            out.update({"q_proj.bias": biases[0], "k_proj.bias": biases[1], "v_proj.bias": biases[2]})
    return out


def qkv(ops: Backend, x: Array, w: dict[str, Array], nh: int, nkv: int, hd: int) -> tuple[Array, Array, Array]:
    """q ``[t, nh, hd]``, k and v ``[t, nkv, hd]`` from whichever form ``w`` holds."""
    t = ops.shape(x)[0]
    if "qkv_proj" in w:
        y = ops.linear(x, w["qkv_proj"], w.get("qkv_proj.bias"))
        q, kv = nh * hd, nkv * hd
        return (ops.reshape(ops.slice(y, 1, 0, q), (t, nh, hd)),
                ops.reshape(ops.slice(y, 1, q, q + kv), (t, nkv, hd)),
                ops.reshape(ops.slice(y, 1, q + kv, q + 2 * kv), (t, nkv, hd)))
    return (ops.reshape(ops.linear(x, w["q_proj"], w.get("q_proj.bias")), (t, nh, hd)),
            ops.reshape(ops.linear(x, w["k_proj"], w.get("k_proj.bias")), (t, nkv, hd)),
            ops.reshape(ops.linear(x, w["v_proj"], w.get("v_proj.bias")), (t, nkv, hd)))
