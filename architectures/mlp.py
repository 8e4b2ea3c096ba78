"""The gated feed-forward block shared by the llama and gemma families.

``down_proj(act(gate_proj(x)) * up_proj(x))`` (Shazeer 2020, "GLU Variants
Improve Transformer"): SwiGLU when ``act`` is silu (through the fusable
``swiglu`` op), GeGLU when it is gelu or its tanh approximation.
"""

from __future__ import annotations

from infer.architecture import WeightLoader
from infer.ops import Array, Backend


class GatedMLP:
    """Weights ``{prefix}gate_proj``, ``up_proj`` (``[intermediate, hidden]``) and
    ``down_proj`` (``[hidden, intermediate]``); ``activation`` is an op name."""

    def __init__(self, prefix: str, hidden: int, intermediate: int, activation: str,
                 w: WeightLoader, ops: Backend) -> None:
        self.ops = ops
        self.gate_proj = w.get(prefix + "gate_proj.weight", (intermediate, hidden))
        self.up_proj = w.get(prefix + "up_proj.weight", (intermediate, hidden))
        self.down_proj = w.get(prefix + "down_proj.weight", (hidden, intermediate))
        self.activation = activation

    def __call__(self, x: Array) -> Array:
        ops = self.ops
        gate, up = ops.linear(x, self.gate_proj), ops.linear(x, self.up_proj)
        if self.activation == "silu":
            h = ops.swiglu(gate, up)
        else:
            h = ops.mul(getattr(ops, self.activation)(gate), up)
        return ops.linear(h, self.down_proj)
