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
    ``down_proj`` (``[hidden, intermediate]``); ``activation`` is an op name.
    gate and up are stacked into one ``gate_up_proj`` where they are stored
    alike (see :mod:`.projections`); then :attr:`gate_proj` and
    :attr:`up_proj` are None."""

    def __init__(self, prefix: str, hidden: int, intermediate: int, activation: str,
                 w: WeightLoader, ops: Backend) -> None:
        self.ops = ops
        parts = [(prefix + "gate_proj.weight", (intermediate, hidden)), (prefix + "up_proj.weight", (intermediate, hidden))]
        self.gate_up_proj = w.get_stacked(prefix + "gate_up_proj.weight", parts)
        self.gate_proj = self.up_proj = None
        if self.gate_up_proj is None:
            self.gate_proj, self.up_proj = (w.get(name, shape) for name, shape in parts)
        self.down_proj = w.get(prefix + "down_proj.weight", (hidden, intermediate))
        self.activation = activation

    def weights(self) -> dict[str, Array]:
        """The matrices by name, for :func:`gated_mlp`."""
        if self.gate_up_proj is not None:
            return {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj}
        return {"gate_proj": self.gate_proj, "up_proj": self.up_proj, "down_proj": self.down_proj}

    def __call__(self, x: Array) -> Array:
        return gated_mlp(self.ops, self.activation, x, self.weights())


def gated_mlp(ops: Backend, activation: str, x: Array, w: dict[str, Array]) -> Array:
    """The block as a pure function of its input and weights (capturable in
    a compiled graph)."""
    if "gate_up_proj" in w:
        y = ops.linear(x, w["gate_up_proj"])
        n = ops.shape(y)[-1] // 2
        gate, up = ops.slice(y, -1, 0, n), ops.slice(y, -1, n, 2 * n)
    else:
        gate, up = ops.linear(x, w["gate_proj"]), ops.linear(x, w["up_proj"])
    if activation == "silu":
        h = ops.swiglu(gate, up)
    else:
        h = ops.mul(getattr(ops, activation)(gate), up)
    return ops.linear(h, w["down_proj"])
