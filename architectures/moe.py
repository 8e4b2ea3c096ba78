"""Mixture of experts: DeepSeek's routing, and the softmax top-k router of Mixtral and Qwen3-MoE.

**Softmax top-k** (:class:`SparseMoE`; Jiang et al. 2024, "Mixtral of
Experts", section 2.1): the router's logits ``x @ gate.T`` go through a
float32 softmax over all experts, the ``top_k`` best are chosen, and their
probabilities are the gate weights, divided by their sum when
``norm_topk_prob`` (always for Mixtral: then they are exactly the softmax of
the top-k logits; Qwen3-MoE says in its config). No shared experts.

**DeepSeek** (DeepSeek-V3 report, section 2.1.2):

Each token is sent to ``top_k`` of ``num_experts`` routed experts (gated MLPs)
chosen by a router, and always to the shared experts. The router of
DeepSeek-V3 (``topk_method`` ``noaux_tc``):

* affinities ``s = sigmoid(x @ gate.T)`` (eq. 15), computed in float32;
* experts are *chosen* on ``s + e_score_correction_bias`` (the bias is the
  auxiliary-loss-free load balancing term, eq. 16: it steers the choice but
  never the weights);
* group-limited routing: the experts form ``n_group`` groups, each scored by
  the sum of its two best biased affinities; only the ``topk_group`` best
  groups stay eligible (the node-limited routing of section 2.1.2, as the
  released inference code computes it);
* the gate weights are the *unbiased* affinities of the chosen experts,
  divided by their sum when ``norm_topk_prob`` (eq. 13), times
  ``routed_scaling_factor``.

Dispatch (:func:`mix_experts`, the same for any router that picks top-k
experts per token): the chosen expert ids come to the host (one small
transfer per layer) and each expert runs on the rows routed to it
(``take``); the outputs are put back in (token, slot) order with one more
``take``, weighted and summed over the slots. Only ops of the contract, so
every backend runs it. The softmax router's dispatch (:func:`mix_routed`)
keeps the ids as data instead: each token's row once per slot, each
projection one :meth:`~infer.ops.Backend.expert_linear` (whose default groups
the rows by expert exactly as :func:`mix_experts` does, so the products are
the same), so the whole layer runs inside a captured step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from infer.architecture import WeightLoader, host_array
from infer.ops import Array, Backend

from .mlp import GatedMLP


def sigmoid(ops: Backend, x: Array) -> Array:
    """``1 / (1 + exp(-x))``, written as ``(1 + tanh(x / 2)) / 2`` (no overflow)."""
    return ops.mul(ops.add(ops.tanh(ops.mul(x, 0.5)), 1.0), 0.5)


def _ints(ops: Backend, values: list[int]) -> Array:
    return ops.from_numpy(host_array(values, "int32"))


class DeepseekMoE:
    """Router ``{prefix}gate.weight`` (``[experts, hidden]``) with, when present,
    ``{prefix}gate.e_score_correction_bias`` (``[experts]``); routed experts
    ``{prefix}experts.{i}.*`` and the shared experts ``{prefix}shared_experts.*``
    (one gated MLP ``n_shared`` times as wide)."""


    def __init__(self, ops: Backend, hidden: int, intermediate: int, num_experts: int, n_shared: int, top_k: int, *,
                 n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
                 activation: str = "silu") -> None:
        self.ops, self.hidden, self.num_experts, self.top_k = ops, hidden, num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, routed_scaling_factor
        self.expert = GatedMLP(ops, hidden, intermediate, activation)
        self.shared = GatedMLP(ops, hidden, intermediate * n_shared, activation) if n_shared else None

    def load(self, w: WeightLoader, prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {"gate": w.get(prefix + "gate.weight", (self.num_experts, self.hidden))}
        bias = prefix + "gate.e_score_correction_bias"
        if w.has(bias):
            out["gate.e_score_correction_bias"] = w.get(bias, (self.num_experts,))
        out["experts"] = [self.expert.load(w, f"{prefix}experts.{i}.") for i in range(self.num_experts)]
        if self.shared is not None:
            out["shared_experts"] = self.shared.load(w, prefix + "shared_experts.")
        return out

    def route(self, x: Array, w: dict[str, Any]) -> tuple[Array, list[list[int]]]:
        """Gate weights ``[tokens, top_k]`` and the chosen expert ids per token (host lists)."""
        ops = self.ops
        t, e = ops.shape(x)[0], self.num_experts
        scores = sigmoid(ops, ops.astype(ops.linear(x, w["gate"]), "float32"))  # [tokens, experts]
        bias = w.get("gate.e_score_correction_bias")
        choice = scores if bias is None else ops.add(scores, ops.astype(bias, "float32"))
        if self.n_group > 1 and self.topk_group < self.n_group:
            grouped = ops.reshape(choice, (t, self.n_group, e // self.n_group))
            group_scores = ops.sum(ops.topk(grouped, 2)[0], axis=-1)  # [tokens, groups]
            _, best = ops.topk(group_scores, self.topk_group)
            keep = [set(row) for row in ops.to_numpy(best).tolist()]
            mask = [0.0 if g in keep[i] else float("-inf") for i in range(t) for g in range(self.n_group)]
            masked = ops.add(grouped, ops.reshape(ops.from_numpy(host_array(mask), "float32"), (t, self.n_group, 1)))
            choice = ops.reshape(masked, (t, e))
        _, chosen = ops.topk(choice, self.top_k)
        ids = ops.to_numpy(chosen).tolist()
        flat = [i * e + int(j) for i, row in enumerate(ids) for j in row]
        weights = ops.reshape(ops.take(ops.reshape(scores, (t * e,)), _ints(ops, flat), axis=0), (t, self.top_k))
        if self.norm_topk_prob:
            weights = ops.div(weights, ops.add(ops.sum(weights, axis=-1, keepdims=True), 1e-20))
        return ops.mul(weights, self.scaling), [[int(j) for j in row] for row in ids]

    def __call__(self, x: Array, w: dict[str, Any]) -> Array:
        weights, ids = self.route(x, w)
        out = mix_experts(self.ops, x, weights, ids, lambda e, rows: self.expert(rows, w["experts"][e]))
        return out if self.shared is None else self.ops.add(out, self.shared(x, w["shared_experts"]))


class SparseMoE:
    """Router ``{prefix}{router}.weight`` (``[experts, hidden]``) and experts
    ``{prefix}{experts}.{i}.*`` (gated MLPs, their projections named by
    ``names``), routed by the softmax top-k rule (module docstring)."""


    def __init__(self, ops: Backend, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                 norm_topk_prob: bool, activation: str = "silu", router: str = "gate", experts: str = "experts",
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        self.ops, self.hidden, self.num_experts, self.top_k = ops, hidden, num_experts, top_k
        self.norm_topk_prob, self.router, self.experts = norm_topk_prob, router, experts
        self.expert = GatedMLP(ops, hidden, intermediate, activation, names=names)

    def load(self, w: WeightLoader, prefix: str) -> dict[str, Any]:
        return {"gate": w.get(f"{prefix}{self.router}.weight", (self.num_experts, self.hidden)),
                "experts": [self.expert.load(w, f"{prefix}{self.experts}.{i}.") for i in range(self.num_experts)]}

    def route(self, x: Array, w: dict[str, Any]) -> tuple[Array, Array]:
        """Gate weights ``[tokens, top_k]`` and the chosen expert ids
        ``[tokens, top_k]`` (data: not read on the host)."""
        ops = self.ops
        probs = ops.softmax(ops.astype(ops.linear(x, w["gate"]), "float32"), axis=-1)  # [tokens, experts]
        weights, chosen = ops.topk(probs, self.top_k)
        if self.norm_topk_prob:
            weights = ops.div(weights, ops.sum(weights, axis=-1, keepdims=True))
        return weights, chosen

    def __call__(self, x: Array, w: dict[str, Any]) -> Array:
        weights, chosen = self.route(x, w)
        return mix_routed(self.ops, x, weights, chosen, self.expert, w["experts"])


def mix_routed(ops: Backend, x: Array, weights: Array, chosen: Array, mlp: GatedMLP,
               experts: list[dict[str, Any]]) -> Array:
    """:func:`mix_experts` with the chosen ids ``[tokens, top_k]`` as data:
    token ``t``'s row once per slot, each through the expert of that slot
    (:meth:`~.mlp.GatedMLP.by_id`), weighted and summed over the slots in
    slot order. Experts with biases go through :func:`mix_experts`."""
    if any(name.endswith(".bias") for name in experts[0]):
        ids = [[int(j) for j in row] for row in ops.to_numpy(chosen).tolist()]
        return mix_experts(ops, x, weights, ids, lambda e, rows: mlp(rows, experts[e]))
    t, d = ops.shape(x)
    k = ops.shape(chosen)[-1]
    rows = x if k == 1 else ops.take(x, _ints(ops, [i for i in range(t) for _ in range(k)]), axis=0)  # [t * k, d]
    y = ops.reshape(mlp.by_id(rows, experts, ops.reshape(chosen, (t * k,))), (t, k, d))  # [tokens, slots, hidden]
    weights = ops.reshape(ops.astype(weights, ops.dtype(y)), (t, k, 1))
    return ops.sum(ops.mul(y, weights), axis=1)


def mix_experts(ops: Backend, x: Array, weights: Array, ids: list[list[int]],
                expert: Callable[[int, Array], Array]) -> Array:
    """``sum_slot weights[t, slot] * expert(ids[t][slot], x[t])`` for every
    token ``t`` of ``x`` ``[tokens, hidden]``: each chosen expert runs once,
    on the rows routed to it (module docstring)."""
    t, d = ops.shape(x)
    k = len(ids[0])
    routed: dict[int, list[int]] = {}  # expert -> flat (token * k + slot) indices routed to it
    for i, row in enumerate(ids):
        for slot, e in enumerate(row):
            routed.setdefault(e, []).append(i * k + slot)
    outputs, where = [], [0] * (t * k)  # where[token * k + slot]: its row among the outputs
    n = 0
    for e in sorted(routed):
        flat = routed[e]
        outputs.append(expert(e, ops.take(x, _ints(ops, [f // k for f in flat]), axis=0)))
        for f in flat:
            where[f] = n
            n += 1
    y = ops.concat(outputs, 0) if len(outputs) > 1 else outputs[0]
    y = ops.reshape(ops.take(y, _ints(ops, where), axis=0), (t, k, d))  # [tokens, slots, hidden]
    weights = ops.reshape(ops.astype(weights, ops.dtype(y)), (t, k, 1))
    return ops.sum(ops.mul(y, weights), axis=1)
