"""How a model's weights split across the ranks of a tensor-parallel group.

Megatron-LM's scheme (Shoeybi et al. 2019, "Megatron-LM", section 3), decided
here from each weight's *role*, which its Hugging Face name says, and never by
the architecture:

* **column-parallel** (rows of ``[out, in]`` split): ``q_proj`` by attention
  heads, ``k_proj`` and ``v_proj`` by KV heads, ``gate_proj`` / ``up_proj``
  (Mixtral's ``w1`` / ``w3``) by intermediate units, with their biases. Each
  rank computes its heads' attention and its units' activations alone;
* **row-parallel** (columns split): ``o_proj`` and ``down_proj`` (``w2``),
  returned as a :class:`~infer.ops.ShardedWeight` ``"sum"``: the backend sums
  the ranks' partial products (one ``all_reduce`` per product) and adds the
  bias, held whole, once;
* **vocabulary-parallel**: the output head (``lm_head``, or the tied
  embedding) split by vocabulary rows, a ``ShardedWeight`` ``"concat"``
  whose logits are gathered;
* **replicated**: everything else (embeddings, norms, routers, per-head
  q/k norms, row-parallel biases).

The architecture is built from a *rank-local* config (:func:`local_config`:
heads, KV heads and intermediate sizes divided, ``head_dim`` written out
first), so it asks the loader for local shapes and never knows it is
sharded. KV heads fewer than the ranks are replicated: rank ``r`` keeps the
one KV head its query heads read (``r * kv_heads // ranks``), which needs
``ranks % kv_heads == 0``.

Mixture-of-experts layers shard *each expert's* intermediate dimension (their
``gate_proj``/``up_proj``/``down_proj`` have the roles above), rather than
placing whole experts on ranks: the role table stays one table, every rank
does the same work whatever the router picks, and any number of experts
works; the price is one ``all_reduce`` per expert that has tokens in a
layer (expert parallelism would need one all-to-all, and a change to the
MoE dispatch).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from infer.architecture import WeightLoader
from infer.errors import MissingTensorError, ShapeMismatchError, TensorParallelConfigError
from infer.ops import Array, Backend, QuantizedTensor, ShardedWeight
from infer.package import TensorSource

log = logging.getLogger(__name__)

#: Name suffix -> role, the one table of how weights split (module docstring).
#: A name that ends with none of these is replicated.
ROLES: tuple[tuple[str, str], ...] = (
    ("self_attn.q_proj.weight", "heads"), ("self_attn.q_proj.bias", "heads"),
    ("self_attn.k_proj.weight", "kv_heads"), ("self_attn.k_proj.bias", "kv_heads"),
    ("self_attn.v_proj.weight", "kv_heads"), ("self_attn.v_proj.bias", "kv_heads"),
    ("self_attn.o_proj.weight", "row"),
    ("gate_proj.weight", "column"), ("gate_proj.bias", "column"),
    ("up_proj.weight", "column"), ("up_proj.bias", "column"),
    ("down_proj.weight", "row"),
    (".w1.weight", "column"), (".w3.weight", "column"), (".w2.weight", "row"),
    ("lm_head.weight", "vocab"),
)

#: ``model_type`` values whose math the role table covers, tested at 2 ranks
#: (tests/test_tensor_parallel.py). Others are refused with the reason:
UNSUPPORTED: dict[str, str] = {
    "olmo2": "its q/k norms run over the whole projection of all heads, which no rank holds",
    "deepseek_v3": "its latent attention (kv_a_proj, kv_b_proj) has no roles in the sharding table yet",
    "gpt2": "its fused c_attn / c_fc weights have no roles in the sharding table yet",
    "phi3": "it stores q, k, v (and gate, up) stacked in one tensor each, which the role table does not split yet",
    **dict.fromkeys(("gemma4_text", "gemma4"), "its layers have two head sizes and key/value head counts "
                    "(per_layer_config) and stacked experts, and the plan has one of each"),
    **dict.fromkeys(("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next", "lfm2", "granitemoehybrid", "falcon_h1", "mamba2"),
                    "its recurrent layers (convolution windows, SSM or delta-rule states) have no roles in the "
                    "sharding table yet"),
    "gpt_oss": "its attention sinks (one per query head) and stacked experts (gate_up_proj [experts, hidden, "
               "2 * intermediate], gate and up interleaved) have no roles in the sharding table yet",
    "mamba2": "its Mamba2 mixers (in_proj stacking z, x, B, C, dt; the recurrent state) have no roles in the "
              "sharding table yet",
    "granitemoehybrid": "its Mamba2 mixers (in_proj stacking z, x, B, C, dt; the recurrent state) and stacked "
                        "experts have no roles in the sharding table yet",
}

#: Config keys of intermediate sizes that are divided by the ranks.
INTERMEDIATE_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def role_of(name: str) -> str:
    """The role of weight ``name``: ``heads``, ``kv_heads``, ``column``,
    ``row``, ``vocab`` or ``replicated``."""
    for suffix, role in ROLES:
        if name.endswith(suffix):
            return role
    return "replicated"


@dataclass(frozen=True)
class Shard:
    """Which part of the model a rank holds."""

    rank: int
    ranks: int
    #: The whole model's attention heads, KV heads and head size.
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads // self.ranks if self.kv_heads >= self.ranks else 1

    def kv_head_range(self) -> tuple[int, int]:
        """This rank's KV heads ``[first, stop)`` of the whole model's."""
        if self.kv_heads >= self.ranks:
            n = self.kv_heads // self.ranks
            return self.rank * n, (self.rank + 1) * n
        first = self.rank * self.kv_heads // self.ranks
        return first, first + 1

    def rows(self, role: str, n: int, name: str) -> tuple[int, int]:
        """Rows ``[start, stop)`` of ``n`` that this rank keeps for ``role``
        (``row``: columns); ``vocab`` may end short of a full chunk."""
        r, ranks = self.rank, self.ranks
        if role == "kv_heads":
            if n % self.kv_heads:
                raise ShapeMismatchError(f"tensor {name!r} has {n} rows, not a multiple of {self.kv_heads} KV heads")
            per = n // self.kv_heads
            first, stop = self.kv_head_range()
            return first * per, stop * per
        if role == "vocab":
            chunk = -(-n // ranks)
            return min(n, r * chunk), min(n, (r + 1) * chunk)
        if n % ranks:
            raise TensorParallelConfigError(
                f"tensor {name!r}: {n} {'columns' if role == 'row' else 'rows'} do not split into "
                f"{ranks} equal parts (tensor_parallel={ranks})")
        return r * n // ranks, (r + 1) * n // ranks


def plan(config: dict[str, Any], model_type: str, tensors: TensorSource, ranks: int) -> tuple[Shard, dict[str, Any]]:
    """Check that ``ranks`` can split this model, and return rank 0's
    :class:`Shard` (others differ only in ``rank``) and the rank-local
    config (every rank's is the same).

    ``head_dim`` and the KV heads are read from layer 0's projections when
    the config leaves them to an architecture default (Gemma's 256).

    Raises:
        TensorParallelConfigError: ``ranks`` below 1, a family the table does
            not cover, or heads, KV heads or an intermediate size that
            ``ranks`` does not divide.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise TensorParallelConfigError(f"tensor_parallel must be an integer of at least 1, got {ranks!r}")
    if model_type in UNSUPPORTED:
        raise TensorParallelConfigError(f"tensor_parallel={ranks}: model_type {model_type!r} cannot be sharded: "
                                        f"{UNSUPPORTED[model_type]}")
    heads = config.get("num_attention_heads")
    q_name, k_name = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    if not isinstance(heads, int) or q_name not in tensors.names() or k_name not in tensors.names():
        raise TensorParallelConfigError(
            f"tensor_parallel={ranks}: model_type {model_type!r} has no num_attention_heads or no "
            f"{q_name} / {k_name}, which sharding by heads needs")
    head_dim = config.get("head_dim") or tensors.shape(q_name)[0] // heads
    kv_heads = config.get("num_key_value_heads") or tensors.shape(k_name)[0] // head_dim
    problems = []
    if heads % ranks:
        problems.append(f"num_attention_heads {heads} is not divisible by {ranks}")
    if kv_heads >= ranks and kv_heads % ranks:
        problems.append(f"num_key_value_heads {kv_heads} is not divisible by {ranks}")
    if kv_heads < ranks and ranks % kv_heads:
        problems.append(f"num_key_value_heads {kv_heads} is fewer than {ranks} ranks and does not divide them "
                        "(each rank must need exactly one KV head)")
    local = dict(config, num_attention_heads=heads // ranks, head_dim=head_dim,
                 num_key_value_heads=kv_heads // ranks if kv_heads >= ranks else 1)
    for key in INTERMEDIATE_KEYS:
        size = config.get(key)
        if isinstance(size, int) and size > 0:
            if size % ranks:
                problems.append(f"{key} {size} is not divisible by {ranks}")
            local[key] = size // ranks
    if problems:
        raise TensorParallelConfigError(f"tensor_parallel={ranks} does not fit this {model_type} model: "
                                        + "; ".join(problems))
    return Shard(0, ranks, heads, kv_heads, head_dim), local


def weight_bytes(network: Any, ops: Backend | None = None) -> int:
    """Bytes of the distinct arrays a network (or one weight) holds: walks its
    attributes, each array counted once by its memory (a torch view of a numpy
    array, as torch/cpu keeps GGUF blocks, is the same bytes). ``ops`` is unused."""
    seen: set[object] = set()
    total = 0

    def visit(x: Any, depth: int) -> None:
        nonlocal total
        if depth > 12 or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, (list, tuple)):
            for item in x:
                visit(item, depth + 1)
        elif isinstance(x, dict):
            for item in x.values():
                visit(item, depth + 1)
        elif hasattr(x, "local") and hasattr(x, "combine"):  # a ShardedWeight
            visit(x.local, depth + 1)
        elif type(x).__module__.startswith(("torch", "numpy", "mlx")) and hasattr(x, "nbytes"):
            # A torch view of a numpy array (torch/cpu's GGUF blocks) is the same memory: count it once.
            address = x.data_ptr() if hasattr(x, "data_ptr") else getattr(getattr(x, "ctypes", None), "data", None)
            if address is not None and ("data", address) in seen:
                return
            if address is not None:
                seen.add(("data", address))
            total += int(x.nbytes)
        elif type(x).__module__.startswith("infer."):
            items = list(vars(x).values()) if hasattr(x, "__dict__") else []
            items += [getattr(x, slot, None) for slot in getattr(type(x), "__slots__", ())]  # PackedWeight
            for item in items:
                visit(item, depth + 1)

    visit(network, 0)
    return total


class ShardedWeightLoader(WeightLoader):
    """A :class:`~infer.architecture.WeightLoader` that hands each rank its
    slice of each weight, by role (:data:`ROLES`), read from the file alone:
    rows of a memory-mapped array are a view until copied, and a quantized
    tensor's rows are dequantized by themselves (``dequantize_rows``), so a
    rank never reads the whole model. Row-parallel weights are read a slab of
    rows at a time and their columns kept.

    The shapes the architecture asks for are the rank-local ones; each is
    checked against the slice of the stored tensor.
    """

    def __init__(self, tensors: TensorSource, backend: Backend, shard: Shard,
                 progress: Callable[[int], None] | None = None) -> None:
        super().__init__(tensors, backend, progress)
        self.shard = shard
        #: Bytes of the prepared weights this rank holds, by role.
        self.bytes_by_role: Counter[str] = Counter()
        self._origin: dict[int, str] = {}
        self._parts: list[tuple[str, int]] = []  # (role, host bytes) of the parts being stacked

    def get(self, name: str, shape: tuple[int, ...], *, transform: Callable[[np.ndarray], np.ndarray] | None = None,
            fallback: str | None = None) -> Array:
        stored = self._present(name, fallback)
        role = role_of(stored)
        if role == "replicated":
            return super().get(stored, shape, transform=transform)
        host, full = self._slice(stored, role)
        if transform is not None:
            if isinstance(host, QuantizedTensor):
                host = host.dequantize()
            host = transform(np.asarray(host, dtype=np.float32))
        wanted = full if role == "vocab" else tuple(host.shape)
        if tuple(shape) != wanted:
            raise ShapeMismatchError(
                f"tensor {stored!r} in {self.tensors.location(stored)} has shape {list(full)}, which this rank's "
                f"{role} slice makes {list(host.shape)}; the rank-local config implies {list(shape)}")
        prepared = self._prepare(host, stored, [stored])
        if role == "row":
            return ShardedWeight(prepared, full, "sum")
        if role == "vocab":
            return ShardedWeight(prepared, full, "concat")
        return prepared

    def get_stacked(self, name: str, parts: Sequence[tuple[str, tuple[int, ...]]]) -> Array | None:
        """Each part's slice by its own role, stacked by rows: quantized
        slices stay quantized where the parts share a storage type, and are
        dequantized otherwise."""
        names = [self._present(part, None) for part, _ in parts]
        if any(role_of(n) in ("replicated", "row", "vocab") for n in names):
            return None
        slices = []
        for stored, (_, shape) in zip(names, parts):
            host, full = self._slice(stored, role_of(stored))
            if tuple(host.shape) != tuple(shape):
                raise ShapeMismatchError(
                    f"tensor {stored!r} in {self.tensors.location(stored)} has shape {list(full)}, which this "
                    f"rank's slice makes {list(host.shape)}; the rank-local config implies {list(shape)}")
            slices.append(host)
        if len({tuple(s.shape[1:]) for s in slices}) != 1:
            return None
        stacked: Any = None
        if all(isinstance(s, QuantizedTensor) for s in slices):
            stacked = slices[0].stacked(slices)
        if stacked is None:
            slices = [s.dequantize() if isinstance(s, QuantizedTensor) else s for s in slices]
            if len({s.dtype for s in slices}) != 1:
                return None
            stacked = np.concatenate(slices, axis=0)
        self._parts = [(role_of(n), s.nbytes) for n, s in zip(names, slices)]
        try:
            return self._prepare(stacked, name, names)
        finally:
            self._parts = []

    def shard_head(self, network: Any) -> None:
        """Split the output head by vocabulary where the architecture took it
        from a replicated weight (a tied embedding): the same tensor's rows,
        this rank's chunk of them."""
        head = getattr(network, "lm_head", None)
        if head is None or isinstance(head, ShardedWeight):
            return
        stored = self._origin.get(id(head))
        if stored is None or len(self.tensors.shape(stored)) != 2:
            log.info("the output head does not come from one stored tensor; it stays whole on every rank")
            return
        host, full = self._slice(stored, "vocab")
        local = self.backend.prepare_weight(host, name="lm_head.weight")
        self.bytes_by_role["vocab"] += weight_bytes(local)
        network.lm_head = ShardedWeight(local, full, "concat")

    # -- reading slices

    def _present(self, name: str, fallback: str | None) -> str:
        if self.has(name):
            return name
        if fallback is not None and self.has(fallback):
            return fallback
        raise MissingTensorError(f"tensor {name!r} is missing from {self.tensors.location(name)}"
                                 + (f" (nor is {fallback!r} there)" if fallback else ""))

    def _slice(self, name: str, role: str) -> tuple[Any, tuple[int, ...]]:
        """This rank's slice of ``name`` for ``role`` (a fresh host array, or
        a quantized tensor's rows in their blocks) and the stored tensor's
        whole shape."""
        full = tuple(int(d) for d in self.tensors.shape(name))
        tensor = self.tensors.get(name)
        if role == "row":
            if len(full) != 2:
                raise ShapeMismatchError(f"tensor {name!r} is row-parallel but has shape {list(full)}")
            start, stop = self.shard.rows(role, full[1], name)
            if isinstance(tensor, QuantizedTensor):
                slab = max(1, (64 << 20) // max(1, 4 * full[1]))  # rows per 64 MiB of float32
                host = np.concatenate([tensor.dequantize_rows(np.arange(i, min(full[0], i + slab)))[:, start:stop]
                                       for i in range(0, full[0], slab)], axis=0)
            else:
                host = np.ascontiguousarray(np.asarray(tensor)[:, start:stop])
            return host, full
        start, stop = self.shard.rows(role, full[0], name)
        if isinstance(tensor, QuantizedTensor):
            # Rows of blocks stay blocks (a view of the file) for the backend to
            # keep quantized, as one process would; the head's chunk, padded, is floats.
            kept = tensor.rows(start, stop) if role != "vocab" else None
            if kept is not None:
                return kept, full
            host = tensor.dequantize_rows(np.arange(start, stop))
        else:
            host = np.ascontiguousarray(np.asarray(tensor)[start:stop])
        if role == "vocab":
            chunk = -(-full[0] // self.shard.ranks)
            if host.shape[0] < chunk:  # the last rank's chunk, padded so that every rank gathers alike
                host = np.concatenate([host, np.zeros((chunk - host.shape[0], *host.shape[1:]), host.dtype)])
        return host, full

    def _prepare(self, tensor: Any, name: str, sources: list[str]) -> Array:
        role = role_of(sources[0])
        prepared = super()._prepare(tensor, name, sources)
        self._origin[id(prepared)] = sources[0]
        size = weight_bytes(prepared)
        parts = self._parts or [(role, 1)]
        whole = sum(n for _, n in parts)
        for part_role, n in parts:  # a stacked weight's bytes go to its parts' roles
            self.bytes_by_role[part_role] += size * n // whole
        return prepared
