"""Gemma 4 text models (Google DeepMind, Gemma 4, 2026).

``model_type`` ``gemma4_text`` as transformers' ``Gemma4ForCausalLM`` computes
it, and the language model of a ``gemma4`` (``Gemma4ForConditionalGeneration``)
checkpoint, whose text settings sit under ``text_config`` and weights under
``model.language_model.``. Against Gemma 3 (:mod:`.gemma3`):

* **Two head sizes.** Sliding layers have ``head_dim``; full-attention layers
  ``global_head_dim`` (512 unless given) and, with ``attention_k_eq_v``,
  ``num_global_key_value_heads``. transformers 5 writes the result per layer
  (``per_layer_config``: ``{"<layer>": {"head_dim": ..., "num_key_value_heads":
  ...}}``); both forms are read.
* **KV sharing.** The last ``num_kv_shared_layers`` layers compute no keys or
  values: each attends over those of the last earlier layer of its own kind
  (sliding or full), so it is a :class:`~infer.kv.attention.SharedKV` layer
  and allocates nothing. ``use_double_wide_mlp`` doubles those layers'
  feed-forward width.
* **Value norm, keys as values.** Values get an RMSNorm without a weight;
  with ``attention_k_eq_v`` full layers have no ``v_proj`` and their values
  are the key projection (before the key norm and rope). The softmax scale
  is 1 (the q/k norms set the logit scale).
* **Proportional rope** on the full layers (:mod:`.rope`, ``proportional``):
  a quarter of the frequencies spread over the whole head.
* **Per-layer input embeddings (PLE).** A second embedding
  ``[vocab_size_per_layer_input, layers * P]`` (``P =
  hidden_size_per_layer_input``, scaled by ``sqrt(P)``) plus a projection of
  the scaled input embedding (``per_layer_model_projection / sqrt(hidden)``,
  then RMSNorm over ``P``), summed and scaled by ``1 / sqrt(2)``, give each
  layer its own ``[tokens, P]`` input; after its feed-forward a layer adds
  ``post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(h))
  * input))``.
* **The optional MoE block** (``enable_moe_block``): beside the dense MLP, a
  router (RMSNorm without weight, times ``router.scale / sqrt(hidden)``, a
  float32 softmax over ``num_experts``, top ``top_k_experts`` renormalised,
  times ``per_expert_scale``) sends the layer's residual stream, normed by
  ``pre_feedforward_layernorm_2``, to gated experts stored stacked
  (``experts.gate_up_proj`` ``[E, 2I, hidden]``, gate rows first;
  ``experts.down_proj`` ``[E, hidden, I]``); the two outputs are normed
  (``post_feedforward_layernorm_1`` / ``_2``) and summed.
* Each layer's output is multiplied by its ``layer_scalar``. RMSNorm weights
  multiply as they are (``w``, not Gemma 3's ``1 + w``).

Per layer (x = input_layernorm(h)):
    h = h + post_attention_layernorm(o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v_norm(v))))
    m = mlp(pre_feedforward_layernorm(h))      [+ MoE: norm_1(m) + norm_2(experts(norm_pre_2(h)))]
    h = h + post_feedforward_layernorm(m)
    h = h + post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(h)) * ple[layer]))
    h = h * layer_scalar
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infer.architecture import WeightLoader, host_array
from infer.config import check_layer_types, from_dict, rope_parameters
from infer.errors import ConfigError
from infer.kv.attention import AttentionContext, FullAttention, LayerState, SharedKV, SlidingWindow
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import ACTIVATIONS, Decoder, activation
from .gemma3 import LAYER_TYPES
from .mlp import GatedMLP
from .moe import mix_experts
from .rope import RotaryEmbedding, context_length


@dataclass
class Gemma4Config:
    """``config.json`` fields read (transformers' ``Gemma4TextConfig`` names and defaults)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: dict[str, Any] | None = None
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    rope: dict[str, dict[str, Any]] = field(default_factory=dict)  # layer type -> rope settings

    def validate(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "global_head_dim", "vocab_size", "sliding_window"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, found {getattr(self, name)}")
        activation("hidden_activation", self.hidden_activation)
        if self.use_bidirectional_attention == "all":
            raise ConfigError("config.json: use_bidirectional_attention is 'all' (an encoder); only causal "
                              "gemma4 language models are supported")
        n = self.num_hidden_layers
        if self.layer_types is None:  # transformers' default: 5 sliding layers to 1 full one
            self.layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
        check_layer_types(self.layer_types, n, LAYER_TYPES)
        self.layer_types = [*self.layer_types[:-1], "full_attention"]  # transformers forces the last one full
        if not 0 <= self.num_kv_shared_layers < n:
            raise ConfigError(f"config.json: num_kv_shared_layers {self.num_kv_shared_layers} must be at least 0 "
                              f"and fewer than the {n} layers (some layer must compute the keys shared)")
        for i in range(n):
            heads, kv = self.num_attention_heads, self.kv_heads(i)
            if kv <= 0 or heads % kv:
                raise ConfigError(f"config.json: layer {i} has {heads} query heads over {kv} key/value heads "
                                  "(they must divide evenly)")
            self.kv_source(i)  # raises for a shared layer with no layer of its kind before the shared ones
        if self.enable_moe_block:
            for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
                if not getattr(self, name) or getattr(self, name) <= 0:
                    raise ConfigError(f"config.json: enable_moe_block needs a positive {name}, "
                                      f"found {getattr(self, name)}")
            if self.top_k_experts > self.num_experts:  # type: ignore[operator]
                raise ConfigError(f"config.json: top_k_experts {self.top_k_experts} exceeds num_experts "
                                  f"{self.num_experts}")

    def _override(self, layer: int) -> dict[str, Any] | None:
        if self.per_layer_config is None:
            return None
        return self.per_layer_config.get(str(layer)) or self.per_layer_config.get(layer) or {}  # type: ignore[call-overload]

    def is_full(self, layer: int) -> bool:
        assert self.layer_types is not None  # set by validate()
        return self.layer_types[layer] == "full_attention"

    def layer_head_dim(self, layer: int) -> int:
        """Head size of ``layer``: ``per_layer_config``'s, else ``global_head_dim`` on full layers."""
        override = self._override(layer)
        if override is not None:
            return int(override.get("head_dim", self.head_dim))
        return self.global_head_dim if self.is_full(layer) else self.head_dim

    def kv_heads(self, layer: int) -> int:
        """Key/value heads of ``layer`` (``num_global_key_value_heads`` on full layers with ``attention_k_eq_v``)."""
        override = self._override(layer)
        if override is not None:
            return int(override.get("num_key_value_heads", self.num_key_value_heads))
        if self.is_full(layer) and self.attention_k_eq_v and self.num_global_key_value_heads is not None:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values ``layer`` reads (None: it computes its own): for the
        last ``num_kv_shared_layers`` layers, the last earlier non-shared layer of the same kind."""
        assert self.layer_types is not None
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        if layer < first_shared:
            return None
        kind = self.layer_types[layer]
        for j in range(first_shared - 1, -1, -1):
            if self.layer_types[j] == kind:
                return j
        raise ConfigError(f"config.json: layer {layer} ({kind}) shares keys and values, but no layer before the "
                          f"{self.num_kv_shared_layers} shared ones is a {kind} layer to share them")


@dataclass
class Gemma4Layer:
    """One layer's settings and weights."""

    index: int
    kind: str
    head_dim: int
    kv_heads: int
    window: int | None
    #: The layer whose keys and values this one reads, or None (its own).
    source: int | None
    #: Whether values are the key projection (``attention_k_eq_v`` on a full layer).
    k_eq_v: bool
    w: dict[str, Any]


class Gemma4ForCausalLM(Decoder):
    """Scaled embedding with per-layer inputs, Gemma 4 layers, final norm, tied head, optional soft-cap."""

    def __init__(self, config: Gemma4Config, weights: WeightLoader, ops: Backend, prefix: str = "model.") -> None:
        super().__init__(config, weights, ops)
        cfg, w, d = config, weights, config.hidden_size
        assert cfg.layer_types is not None  # set by validate()
        self.num_layers, self.vocab_size = cfg.num_hidden_layers, cfg.vocab_size
        self.max_context = context_length(cfg.rope["full_attention"], cfg.max_position_embeddings)
        self.eps = cfg.rms_norm_eps
        self.final_softcap = cfg.final_logit_softcapping
        self.heads = cfg.num_attention_heads
        self.act = ACTIVATIONS[cfg.hidden_activation]
        norm = lambda name, n=d: w.get(name + ".weight", (n,))  # noqa: E731
        self.embed_tokens = w.get(prefix + "embed_tokens.weight", (cfg.vocab_size, d))
        self.embed_scale = ops.from_numpy(host_array([d ** 0.5]))  # rounded to the compute dtype, as transformers
        # Rope per layer kind, over that kind's head size (transformers resolves the config per layer type).
        self.rope = {}
        for kind in sorted(set(cfg.layer_types)):
            first = cfg.layer_types.index(kind)
            self.rope[kind] = RotaryEmbedding(ops, cfg.layer_head_dim(first), cfg.rope[kind],
                                              cfg.max_position_embeddings)
        # Per-layer inputs.
        self.ple_dim = p = cfg.hidden_size_per_layer_input
        if p:
            n = cfg.num_hidden_layers
            self.ple_embed = w.get(prefix + "embed_tokens_per_layer.weight", (cfg.vocab_size_per_layer_input, n * p))
            self.ple_scale = ops.from_numpy(host_array([p ** 0.5]))
            self.ple_projection = w.get(prefix + "per_layer_model_projection.weight", (n * p, d))
            self.ple_norm = norm(prefix + "per_layer_projection_norm", p)
        self.unit = {n: ops.from_numpy(host_array([1.0] * n)) for n in {cfg.layer_head_dim(i)
                                                                         for i in range(cfg.num_hidden_layers)} | {d}}
        self.mlp = GatedMLP(ops, d, cfg.intermediate_size, self.act)
        if cfg.enable_moe_block:
            self.expert = GatedMLP(ops, d, cfg.moe_intermediate_size, self.act)  # type: ignore[arg-type]
        self.layers = [self._load_layer(cfg, w, prefix, i) for i in range(cfg.num_hidden_layers)]  # type: ignore[misc]
        self.norm = norm(prefix + "norm")
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings
                        else w.get("lm_head.weight", (cfg.vocab_size, d)))

    def _load_layer(self, cfg: Gemma4Config, w: WeightLoader, prefix: str, i: int) -> Gemma4Layer:
        d, nh = cfg.hidden_size, cfg.num_attention_heads
        hd, kv, source = cfg.layer_head_dim(i), cfg.kv_heads(i), cfg.kv_source(i)
        p, a = f"{prefix}layers.{i}.", f"{prefix}layers.{i}.self_attn."
        k_eq_v = cfg.attention_k_eq_v and cfg.is_full(i)
        bias = cfg.attention_bias
        lw: dict[str, Any] = {}

        def linear(key: str, name: str, rows: int, cols: int) -> None:
            lw[key] = w.get(name + ".weight", (rows, cols))
            if bias:
                lw[key + ".bias"] = w.get(name + ".bias", (rows,))

        linear("q_proj", a + "q_proj", nh * hd, d)
        linear("o_proj", a + "o_proj", d, nh * hd)
        lw["q_norm"] = w.get(a + "q_norm.weight", (hd,))
        if source is None:
            linear("k_proj", a + "k_proj", kv * hd, d)
            if not k_eq_v:
                linear("v_proj", a + "v_proj", kv * hd, d)
            lw["k_norm"] = w.get(a + "k_norm.weight", (hd,))
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            lw[name] = w.get(p + name + ".weight", (d,))
        wide = 2 if cfg.use_double_wide_mlp and source is not None else 1
        lw["mlp"] = GatedMLP(self.ops, d, cfg.intermediate_size * wide, self.act).load(w, p + "mlp.")
        if cfg.enable_moe_block:
            e, inter = cfg.num_experts, cfg.moe_intermediate_size
            assert e is not None and inter is not None
            lw["router.proj"] = w.get(p + "router.proj.weight", (e, d))
            # norm without weight, times scale / sqrt(hidden): one RMSNorm weight
            lw["router.scale"] = w.get(p + "router.scale", (d,), transform=lambda s: s * d ** -0.5)
            lw["router.per_expert_scale"] = w.get(p + "router.per_expert_scale", (e,))
            gate_up = w.get_unstacked(p + "experts.gate_up_proj", (e, 2 * inter, d))
            down = w.get_unstacked(p + "experts.down_proj", (e, d, inter))
            lw["experts"] = [{"gate_up_proj": gu, "down_proj": dn} for gu, dn in zip(gate_up, down)]
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                         "pre_feedforward_layernorm_2"):
                lw[name] = w.get(p + name + ".weight", (d,))
        if self.ple_dim:
            lw["ple_gate"] = w.get(p + "per_layer_input_gate.weight", (self.ple_dim, d))
            lw["ple_projection"] = w.get(p + "per_layer_projection.weight", (d, self.ple_dim))
            lw["ple_norm"] = w.get(p + "post_per_layer_input_norm.weight", (d,))
        lw["layer_scalar"] = w.get(p + "layer_scalar", (1,)) if w.has(p + "layer_scalar") else None
        window = None if cfg.is_full(i) else cfg.sliding_window
        return Gemma4Layer(i, cfg.layer_types[i], hd, kv, window, source, k_eq_v, lw)  # type: ignore[index]

    def layer_states(self) -> list[LayerState]:
        """Sliding layers keep their window; shared layers nothing of their own."""
        states: list[LayerState] = []
        for layer in self.layers:
            if layer.source is not None:
                states.append(SharedKV(layer.source))
            else:
                states.append(FullAttention() if layer.window is None else SlidingWindow(layer.window))
        return states

    def per_layer_inputs(self, input_ids: Array, h: Array) -> Array:
        """``[tokens, layers, P]``: the token's own per-layer embedding plus the
        projection of its (scaled) input embedding ``h``, over ``sqrt(2)``."""
        ops, n, p = self.ops, self.num_layers, self.ple_dim
        t = ops.shape(h)[0]
        own = ops.reshape(ops.mul(ops.embedding(self.ple_embed, input_ids), self.ple_scale), (t, n, p))
        projected = ops.mul(ops.linear(h, self.ple_projection), self.config.hidden_size ** -0.5)
        projected = ops.rms_norm(ops.reshape(projected, (t, n, p)), self.ple_norm, self.eps)
        return ops.mul(ops.add(projected, own), 2.0 ** -0.5)

    def forward(self, input_ids: Array, ctx: AttentionContext) -> Array:
        ops = self.ops
        h = self.embed(input_ids, ctx)
        ple = self.per_layer_inputs(input_ids, h) if self.ple_dim else None
        tables = {kind: rope(ctx) for kind, rope in self.rope.items()}
        for layer in self.layers:
            h = self.layer(layer, h, None if ple is None else ops.slice(ple, 1, layer.index, layer.index + 1),
                           tables[layer.kind], ctx)
        return ops.rms_norm(h, self.norm, self.eps)

    def layer(self, layer: Gemma4Layer, h: Array, ple: Array | None, rope: tuple[Array, Array],
              ctx: AttentionContext) -> Array:
        """One layer on the stream ``h`` ``[tokens, hidden]`` (module docstring)."""
        ops, w, eps = self.ops, layer.w, self.eps
        t, hd, cos, sin = ops.shape(h)[0], layer.head_dim, *rope
        x = ops.rms_norm(h, w["input_layernorm"], eps)
        q = ops.reshape(ops.linear(x, w["q_proj"], w.get("q_proj.bias")), (t, self.heads, hd))
        q = ops.rope(ops.rms_norm(q, w["q_norm"], eps), cos, sin)
        k = v = None
        if layer.source is None:
            k = ops.reshape(ops.linear(x, w["k_proj"], w.get("k_proj.bias")), (t, layer.kv_heads, hd))
            v = k if layer.k_eq_v else ops.reshape(ops.linear(x, w["v_proj"], w.get("v_proj.bias")),
                                                   (t, layer.kv_heads, hd))
            k = ops.rope(ops.rms_norm(k, w["k_norm"], eps), cos, sin)
            v = ops.rms_norm(v, self.unit[hd], eps)
        o = ctx.attention(layer.index, q, k, v, scale=1.0, window=layer.window)
        a = ops.linear(ops.reshape(o, (t, self.heads * hd)), w["o_proj"], w.get("o_proj.bias"))
        h = ops.add(h, ops.rms_norm(a, w["post_attention_layernorm"], eps))
        m = self.mlp(ops.rms_norm(h, w["pre_feedforward_layernorm"], eps), w["mlp"])
        if "experts" in w:
            routed = self.experts(h, w)
            m = ops.add(ops.rms_norm(m, w["post_feedforward_layernorm_1"], eps),
                        ops.rms_norm(routed, w["post_feedforward_layernorm_2"], eps))
        h = ops.add(h, ops.rms_norm(m, w["post_feedforward_layernorm"], eps))
        if ple is not None:
            g = ops.mul(getattr(ops, self.act)(ops.linear(h, w["ple_gate"])), ops.reshape(ple, (t, self.ple_dim)))
            h = ops.add(h, ops.rms_norm(ops.linear(g, w["ple_projection"]), w["ple_norm"], eps))
        return h if w["layer_scalar"] is None else ops.mul(h, w["layer_scalar"])

    def experts(self, h: Array, w: dict[str, Any]) -> Array:
        """The MoE block's output for the residual stream ``h`` (module docstring)."""
        ops, k = self.ops, self.config.top_k_experts
        scores = ops.linear(ops.rms_norm(h, w["router.scale"], self.eps), w["router.proj"])
        probs = ops.softmax(ops.astype(scores, "float32"), axis=-1)  # [tokens, experts]
        weights, chosen = ops.topk(probs, k)
        weights = ops.div(weights, ops.sum(weights, axis=-1, keepdims=True))
        ids = [[int(j) for j in row] for row in ops.to_numpy(chosen).tolist()]
        scale = ops.take(w["router.per_expert_scale"], ops.reshape(chosen, (-1,)), axis=0)
        weights = ops.mul(weights, ops.reshape(ops.astype(scale, "float32"), (-1, k)))
        x = ops.rms_norm(h, w["pre_feedforward_layernorm_2"], self.eps)
        return mix_experts(ops, x, weights, ids, lambda e, rows: self.expert(rows, w["experts"][e]))

    def compute_logits(self, hidden: Array) -> Array:
        logits = super().compute_logits(hidden)  # [rows, vocab]
        return logits if self.final_softcap is None else self.ops.softcap(logits, self.final_softcap)


#: transformers' rope settings when config.json gives none.
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}


def layer_rope(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rope settings per layer type: ``rope_parameters`` per type, each missing type
    taking transformers' default (:data:`DEFAULT_ROPE`)."""
    raw = config.get("rope_parameters")
    if raw is not None and not (isinstance(raw, dict) and set(raw) <= set(LAYER_TYPES)):
        raise ConfigError(f"config.json: gemma4's rope_parameters must be given per layer type "
                          f"({', '.join(LAYER_TYPES)}), found keys {sorted(raw) if isinstance(raw, dict) else raw!r}")
    raw = raw or {}
    return {kind: rope_parameters({"rope_parameters": raw.get(kind) or DEFAULT_ROPE[kind]},
                                  DEFAULT_ROPE[kind]["rope_theta"]) for kind in LAYER_TYPES}


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Gemma4ForCausalLM:
    """Build a Gemma 4 language model from a ``config.json`` dict (``gemma4_text``, or
    ``gemma4`` with its ``text_config``)."""
    prefix = "model."
    if config.get("model_type") == "gemma4":
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("config.json: a gemma4 config needs a text_config object")
        config, prefix = {"tie_word_embeddings": config.get("tie_word_embeddings", True), **text}, \
            "model.language_model."
    cfg = from_dict(Gemma4Config, {**config, "rope": layer_rope(config)})
    return Gemma4ForCausalLM(cfg, weights, ops, prefix)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Gemma 4 (text)."""
    register(ArchitectureSpec(
        name="gemma4", model_types=("gemma4_text", "gemma4"), build=build,
        description="Gemma 4 text models (E2B, E4B, 31B, 26B-A4B; the language model of the multimodal ones)",
    ))
