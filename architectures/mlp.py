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

    def weights(self) -> dict[str, Array]:
        """The three matrices by name, for :func:`gated_mlp`."""
        return {"gate_proj": self.gate_proj, "up_proj": self.up_proj, "down_proj": self.down_proj}

    def __call__(self, x: Array) -> Array:
        return gated_mlp(self.ops, self.activation, x, self.weights())


def gated_mlp(ops: Backend, activation: str, x: Array, w: dict[str, Array]) -> Array:
    """The block as a pure function of its input and weights (capturable in
    a compiled graph)."""
    gate, up = ops.linear(x, w["gate_proj"]), ops.linear(x, w["up_proj"])
    if activation == "silu":
        h = ops.swiglu(gate, up)
    else:
        h = ops.mul(getattr(ops, activation)(gate), up)
    return ops.linear(h, w["down_proj"])
