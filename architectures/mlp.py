"""The feed-forward blocks: gated (llama, gemma, deepseek and most others) and plain (GPT-2).

``down_proj(act(gate_proj(x)) * up_proj(x))`` (Shazeer 2020, "GLU Variants
Improve Transformer"): SwiGLU when ``act`` is silu (through the fusable
``swiglu`` op), GeGLU when it is gelu or its tanh approximation. The plain
one is ``down(act(up(x)))`` (Radford et al. 2019, GPT-2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from infer.architecture import WeightLoader
from infer.ops import Array, Backend


class GatedMLP:
    """Weights ``{prefix}gate_proj``, ``up_proj`` (``[intermediate, hidden]``) and
    ``down_proj`` (``[hidden, intermediate]``), with biases where the checkpoint
    has them (Granite's and SmolLM3's ``mlp_bias``); ``activation`` is an op
    name. gate and up are stacked into one ``gate_up_proj`` where they are
    stored alike (see :mod:`.projections`); a checkpoint that stores them
    stacked already (Phi-3's ``gate_up_proj``, gate rows first) is read as it
    is. ``names`` renames the three for checkpoints that call them otherwise
    (Mixtral's experts: ``w1``, ``w3``, ``w2``). ``gate_multiplier`` and
    ``down_multiplier`` scale the gate projection before the activation and
    the output (Falcon-H1's ``mlp_multipliers``):
    ``down_mult * down_proj(act(gate_mult * gate_proj(x)) * up_proj(x))``."""

    def __init__(self, ops: Backend, hidden: int, intermediate: int, activation: str, *,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 gate_multiplier: float = 1.0, down_multiplier: float = 1.0) -> None:
        self.ops, self.hidden, self.intermediate, self.activation = ops, hidden, intermediate, activation
        self.names = names
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier

    def load(self, w: WeightLoader, prefix: str) -> dict[str, Array]:
        """``{"gate_up_proj" or "gate_proj", "up_proj", "down_proj"}``, and their ``.bias``."""
        d, n = self.hidden, self.intermediate
        gate, up, down = (prefix + name for name in self.names)
        out: dict[str, Array] = {}
        if w.has(prefix + "gate_up_proj.weight"):  # stored stacked (Phi-3)
            out["gate_up_proj"] = w.get(prefix + "gate_up_proj.weight", (2 * n, d))
        else:
            parts = [(gate + ".weight", (n, d)), (up + ".weight", (n, d))]
            stacked = w.get_stacked(prefix + "gate_up_proj.weight", parts)
            if stacked is not None:
                out["gate_up_proj"] = stacked
                if w.has(gate + ".bias"):
                    biases = [w.get(gate + ".bias", (n,)), w.get(up + ".bias", (n,))]
                    out["gate_up_proj.bias"] = w.backend.concat(biases, 0)
            else:
                for key, name in (("gate_proj", gate), ("up_proj", up)):
                    out[key] = w.get(name + ".weight", (n, d))
                    if w.has(name + ".bias"):
                        out[key + ".bias"] = w.get(name + ".bias", (n,))
        out["down_proj"] = w.get(down + ".weight", (d, n))
        if w.has(down + ".bias"):
            out["down_proj.bias"] = w.get(down + ".bias", (d,))
        return out

    def __call__(self, x: Array, w: dict[str, Any]) -> Array:
        return self._forward(x, w, lambda rows, name: self.ops.linear(rows, w[name], w.get(name + ".bias")))

    def by_id(self, x: Array, experts: list[dict[str, Any]], ids: Array) -> Array:
        """Rows of several MLPs of this shape (a mixture's experts, without
        biases): row ``i`` through the weights ``experts[ids[i]]``, each
        projection one :meth:`~infer.ops.Backend.expert_linear`."""
        ops = self.ops
        return self._forward(x, experts[0], lambda rows, name: ops.expert_linear(rows, [e[name] for e in experts], ids))

    def _forward(self, x: Array, w: dict[str, Any], product: Callable[[Array, str], Array]) -> Array:
        """The block with ``product(rows, name)`` computing each projection (``w`` says which are stored)."""
        ops = self.ops
        if "gate_up_proj" in w:
            y = product(x, "gate_up_proj")
            n = ops.shape(y)[-1] // 2
            gate, up = ops.slice(y, -1, 0, n), ops.slice(y, -1, n, 2 * n)
        else:
            gate = product(x, "gate_proj")
            up = product(x, "up_proj")
        if self.gate_multiplier != 1.0:
            gate = ops.mul(gate, self.gate_multiplier)
        if self.activation == "silu":
            h = ops.swiglu(gate, up)
        else:
            h = ops.mul(getattr(ops, self.activation)(gate), up)
        out = product(h, "down_proj")
        return out if self.down_multiplier == 1.0 else ops.mul(out, self.down_multiplier)


class MLP:
    """``down_proj(act(up_proj(x)))`` with biases; the architecture puts the
    weights under ``up_proj``, ``down_proj`` (and ``.bias``) in the dict."""


    def __init__(self, ops: Backend, activation: str) -> None:
        self.ops, self.activation = ops, activation

    def __call__(self, x: Array, w: dict[str, Any]) -> Array:
        ops = self.ops
        h = getattr(ops, self.activation)(ops.linear(x, w["up_proj"], w.get("up_proj.bias")))
        return ops.linear(h, w["down_proj"], w.get("down_proj.bias"))
