"""The gated feed-forward block shared by the llama, gemma and deepseek families.

``down_proj(act(gate_proj(x)) * up_proj(x))`` (Shazeer 2020, "GLU Variants
Improve Transformer"): SwiGLU when ``act`` is silu (through the fusable
``swiglu`` op), GeGLU when it is gelu or its tanh approximation.
"""

from __future__ import annotations

from typing import Any

from infer.architecture import WeightLoader
from infer.ops import Array, Backend


class GatedMLP:
    """Weights ``{prefix}gate_proj``, ``up_proj`` (``[intermediate, hidden]``) and
    ``down_proj`` (``[hidden, intermediate]``); ``activation`` is an op name.
    gate and up are stacked into one ``gate_up_proj`` where they are stored
    alike (see :mod:`.projections`)."""

    capturable = True

    def __init__(self, ops: Backend, hidden: int, intermediate: int, activation: str) -> None:
        self.ops, self.hidden, self.intermediate, self.activation = ops, hidden, intermediate, activation

    def load(self, w: WeightLoader, prefix: str) -> dict[str, Array]:
        """``{"gate_up_proj" or "gate_proj", "up_proj", "down_proj"}``."""
        d, n = self.hidden, self.intermediate
        parts = [(prefix + "gate_proj.weight", (n, d)), (prefix + "up_proj.weight", (n, d))]
        stacked = w.get_stacked(prefix + "gate_up_proj.weight", parts)
        if stacked is not None:
            out = {"gate_up_proj": stacked}
        else:
            out = {"gate_proj": w.get(*parts[0]), "up_proj": w.get(*parts[1])}
        out["down_proj"] = w.get(prefix + "down_proj.weight", (d, n))
        return out

    def __call__(self, x: Array, w: dict[str, Any]) -> Array:
        ops = self.ops
        if "gate_up_proj" in w:
            y = ops.linear(x, w["gate_up_proj"])
            n = ops.shape(y)[-1] // 2
            gate, up = ops.slice(y, -1, 0, n), ops.slice(y, -1, n, 2 * n)
        else:
            gate, up = ops.linear(x, w["gate_proj"]), ops.linear(x, w["up_proj"])
        if self.activation == "silu":
            h = ops.swiglu(gate, up)
        else:
            h = ops.mul(getattr(ops, self.activation)(gate), up)
        return ops.linear(h, w["down_proj"])
