"""gpt-oss (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025).

``model_type`` ``gpt_oss`` as transformers' ``GptOssForCausalLM`` computes it.
Against Llama (:mod:`.llama`):

* **Attention sinks** (model card, section 2.1 "Architecture"; Xiao et al. 2023, "Efficient
  Streaming Language Models with Attention Sinks"): each head has one learned
  logit ``self_attn.sinks[h]`` that joins its softmax's denominator and
  carries no value, so a head may attend to "nothing". The contract's
  ``attention(..., sinks=)`` computes it.
* **Banded and dense layers alternate**: ``layer_types`` (transformers'
  default: even layers ``sliding_attention``, odd ones ``full_attention``);
  the sliding ones see their last ``sliding_window`` keys (128 in the
  released models) and keep only those (:class:`~infer.kv.attention.SlidingWindow`).
* Biases on q, k, v and o (``attention_bias``, default true); an explicit
  ``head_dim`` (64); YaRN rope (``rope_theta`` 150 000, factor 32 over 4096
  positions, ``truncate`` false: the ramp's ends are not rounded to whole
  dimensions), transformers' default when config.json gives none.
* **Every MLP is a mixture of experts** (:class:`GptOssMoE`): the router
  ``mlp.router`` (weight and bias) scores ``num_local_experts`` experts,
  each token takes the ``num_experts_per_tok`` best *logits* and softmaxes
  over those alone (the same weights as Mixtral's softmax over all experts
  renormalised over the chosen ones; transformers' order is followed). The
  experts are stored stacked, as ``x @ W`` matrices: ``experts.gate_up_proj``
  ``[experts, hidden, 2 * intermediate]`` with gate and up *interleaved*
  (gate the even columns, up the odd ones) and ``experts.down_proj``
  ``[experts, intermediate, hidden]``, each with a bias ``[experts, out]``
  (``gate_up_proj_bias``, ``down_proj_bias``). They are loaded as
  ``linear``'s ``[experts, out, in]``, gate rows first, and each expert
  runs on the rows routed to it (:func:`~.moe.mix_experts`).
* **The clamped SwiGLU** of each expert: the gate clamped from above and the
  up projection on both sides at ``swiglu_limit`` (7), then
  ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)`` (alpha 1.702). ``hidden_act``
  is not read: transformers' experts compute this whatever it says.
* From GGUF (llama.cpp's ``gpt-oss``), the experts come in llama.cpp's layout:
  ``experts.{e}.gate_proj`` / ``up_proj`` ``[I, hidden]`` and ``down_proj`` ``[hidden, I]``
  per expert, biases ``gate_proj_bias`` / ``up_proj_bias`` ``[experts, I]``
  (``formats/gguf_arch.py``); each expert's gate and up rows are stacked into one weight
  as stored, so MXFP4 or other blocks stay blocks.

Per layer:
    h = h + o_proj(attention_sinks(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))   x = input_layernorm(h)
    h = h + sum_{e in topk(router(x))} softmax_topk(router(x))_e * expert_e(x)        x = post_attention_layernorm(h)
    expert_e(x) = down_e(clamped_swiglu(gate_up_e(x)))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infer.architecture import WeightLoader
from infer.config import check_layer_types, from_dict, rope_parameters
from infer.errors import ConfigError
from infer.kv.attention import FullAttention, LayerState, SlidingWindow
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import Attention, Block, Decoder, DecoderLayer, Weights
from .moe import mix_experts, sigmoid
from .rope import RotaryEmbedding, context_length

LAYER_TYPES = ("sliding_attention", "full_attention")

#: transformers' ``GptOssConfig`` rope when config.json has none (the released models').
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass
class GptOssConfig:
    """``config.json`` fields read (transformers names and defaults)."""

    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    vocab_size: int = 201_088
    num_key_value_heads: int | None = 8
    head_dim: int | None = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int | None = 128
    layer_types: list[str] | None = None
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rope: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "vocab_size", "max_position_embeddings", "num_local_experts"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, found {getattr(self, name)}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a positive multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"config.json: head_dim must be positive and even (rope), found {self.head_dim}")
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ConfigError(f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 "
                              f"and num_local_experts ({self.num_local_experts})")
        if not self.swiglu_limit > 0:
            raise ConfigError(f"config.json: swiglu_limit must be positive, found {self.swiglu_limit}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"config.json: sliding_window must be positive or null, found {self.sliding_window}")
        if self.layer_types is None:  # transformers' default: even layers slide, odd ones see everything
            self.layer_types = [LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)]
        check_layer_types(self.layer_types, self.num_hidden_layers, LAYER_TYPES)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None for full attention (a null
        ``sliding_window`` makes every layer full, as transformers' masks do)."""
        assert self.layer_types is not None  # set by validate()
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def _interleaved_to_stacked(w: Any) -> Any:
    """``gate_up_proj`` ``[experts, hidden, 2I]`` (x @ W, gate = even columns,
    up = odd ones) as ``[experts, 2I, hidden]`` (``linear``'s ``[out, in]``),
    gate rows first, then up."""
    e, d, n2 = w.shape
    return w.reshape(e, d, n2 // 2, 2).transpose(0, 3, 2, 1).reshape(e, n2, d)  # a contiguous copy


def _interleaved_bias(b: Any) -> Any:
    """``gate_up_proj_bias`` ``[experts, 2I]`` (interleaved) as gate biases, then up biases."""
    e, n2 = b.shape
    return b.reshape(e, n2 // 2, 2).transpose(0, 2, 1).reshape(e, n2)


def _transposed(w: Any) -> Any:
    """``down_proj`` ``[experts, I, hidden]`` (x @ W) as ``[experts, hidden, I]``."""
    return w.transpose(0, 2, 1).copy()


class GptOssMoE:
    """The router and stacked experts under ``{prefix}`` (``...mlp.``), see the module docstring."""

    def __init__(self, ops: Backend, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                 alpha: float, limit: float) -> None:
        self.ops, self.hidden, self.intermediate = ops, hidden, intermediate
        self.num_experts, self.top_k, self.alpha, self.limit = num_experts, top_k, alpha, limit

    def load(self, w: WeightLoader, prefix: str) -> Weights:
        e, d, n = self.num_experts, self.hidden, self.intermediate
        p = prefix + "experts."
        weights = {"router": w.get(prefix + "router.weight", (e, d)),
                   "router.bias": w.get(prefix + "router.bias", (e,))}
        if w.has(p + "0.gate_proj.weight"):  # llama.cpp's layout (GGUF): already [out, in], gate and up apart
            return {**weights, **self._load_split(w, p)}
        # Stored [in, out] with gate/up interleaved; kept as [experts, out, in] with gate rows
        # first, so each expert's slice is a plain linear weight.
        return {**weights,
                "gate_up_proj": w.get(p + "gate_up_proj", (e, d, 2 * n), transform=_interleaved_to_stacked),
                "gate_up_proj.bias": w.get(p + "gate_up_proj_bias", (e, 2 * n), transform=_interleaved_bias),
                "down_proj": w.get(p + "down_proj", (e, n, d), transform=_transposed),
                "down_proj.bias": w.get(p + "down_proj_bias", (e, d))}

    def _load_split(self, w: WeightLoader, p: str) -> Weights:
        """Experts as llama.cpp's converter writes them: ``{e}.gate_proj`` and ``{e}.up_proj``
        ``[I, hidden]``, ``{e}.down_proj`` ``[hidden, I]``, biases ``[experts, out]``. Each
        expert's gate and up rows are stacked into one weight where stored alike (quantized
        blocks stay blocks, :meth:`~infer.architecture.WeightLoader.get_stacked`)."""
        ops, e, d, n = self.ops, self.num_experts, self.hidden, self.intermediate
        experts = []
        for i in range(e):
            q = f"{p}{i}."
            gate_up = w.get_stacked(q + "gate_up_proj.weight", [(q + "gate_proj.weight", (n, d)),
                                                                 (q + "up_proj.weight", (n, d))])
            one = {"down_proj": w.get(q + "down_proj.weight", (d, n))}
            if gate_up is None:
                one.update(gate_proj=w.get(q + "gate_proj.weight", (n, d)), up_proj=w.get(q + "up_proj.weight", (n, d)))
            else:
                one["gate_up_proj"] = gate_up
            experts.append(one)
        bias = ops.concat([w.get(p + "gate_proj_bias", (e, n)), w.get(p + "up_proj_bias", (e, n))], axis=-1)
        return {"experts": experts, "gate_up_proj.bias": bias, "down_proj.bias": w.get(p + "down_proj_bias", (e, d))}

    def route(self, x: Array, w: Weights) -> tuple[Array, list[list[int]]]:
        """Gate weights ``[tokens, top_k]`` (softmax of the chosen logits) and the chosen experts."""
        ops = self.ops
        logits = ops.linear(x, w["router"], w["router.bias"])  # [tokens, experts]
        top, chosen = ops.topk(logits, self.top_k)
        return ops.softmax(top, axis=-1), [[int(j) for j in row] for row in ops.to_numpy(chosen).tolist()]

    def expert(self, e: int, x: Array, w: Weights) -> Array:
        """Expert ``e`` on its rows ``x`` ``[rows, hidden]``."""
        ops, n = self.ops, self.intermediate
        one = w["experts"][e] if "experts" in w else {"gate_up_proj": _row(ops, w["gate_up_proj"], e),
                                                      "down_proj": _row(ops, w["down_proj"], e)}
        bias = _row(ops, w["gate_up_proj.bias"], e)
        if "gate_up_proj" in one:
            gate_up = ops.linear(x, one["gate_up_proj"], bias)
            gate, up = ops.slice(gate_up, -1, 0, n), ops.slice(gate_up, -1, n, 2 * n)
        else:  # gate and up stored differently (a GGUF mix of types)
            gate = ops.linear(x, one["gate_proj"], ops.slice(bias, -1, 0, n))
            up = ops.linear(x, one["up_proj"], ops.slice(bias, -1, n, 2 * n))
        gate, up = ops.clip(gate, None, self.limit), ops.clip(up, -self.limit, self.limit)
        glu = ops.mul(gate, sigmoid(ops, ops.mul(gate, self.alpha)))
        return ops.linear(ops.mul(ops.add(up, 1.0), glu), one["down_proj"], _row(ops, w["down_proj.bias"], e))

    def __call__(self, x: Array, w: Weights) -> Array:
        weights, ids = self.route(x, w)
        return mix_experts(self.ops, x, weights, ids, lambda e, rows: self.expert(e, rows, w))


def _row(ops: Backend, stacked: Array, e: int) -> Array:
    """Expert ``e``'s slice of a stacked ``[experts, ...]`` weight (a view where the backend has them)."""
    return ops.reshape(ops.slice(stacked, 0, e, e + 1), ops.shape(stacked)[1:])


class GptOssForCausalLM(Decoder):
    """Embedding, layers of sink attention and mixture of experts, final norm, output head."""

    ignored_tensors = ("rotary_emb.inv_freq",)

    def __init__(self, config: GptOssConfig, weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        cfg, w = config, weights
        d, nh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        assert hd is not None and cfg.layer_types is not None  # set by validate()
        self.num_layers, self.vocab_size = cfg.num_hidden_layers, cfg.vocab_size
        self.max_context = context_length(cfg.rope, cfg.max_position_embeddings)
        self.eps = cfg.rms_norm_eps
        attention = Attention(ops, d, nh, cfg.num_key_value_heads, hd)
        moe = GptOssMoE(ops, d, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok,
                        alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
        block = Block(ops, attention, moe, cfg.rms_norm_eps)
        self.embed_tokens = w.get("model.embed_tokens.weight", (cfg.vocab_size, d))
        self.rope = {"default": RotaryEmbedding(ops, hd, cfg.rope, cfg.max_position_embeddings)}
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            attn = attention.load(w, a, bias=cfg.attention_bias)
            weights = {"attn_norm": w.get(p + "input_layernorm.weight", (d,)), **attn,
                       "mlp_norm": w.get(p + "post_attention_layernorm.weight", (d,)), **moe.load(w, p + "mlp.")}
            self.layers.append(DecoderLayer(i, block, weights, scale=hd ** -0.5, window=cfg.window(i),
                                            sinks=w.get(a + "sinks", (nh,))))
        self.norm = w.get("model.norm.weight", (d,))
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else w.get("lm_head.weight", (cfg.vocab_size, d))

    def layer_states(self) -> list[LayerState]:
        """Sliding layers keep their window's keys and values only."""
        return [FullAttention() if layer.window is None else SlidingWindow(layer.window) for layer in self.layers]


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> GptOssForCausalLM:
    """Build a gpt-oss model from a ``config.json`` dict."""
    config = dict(config)
    if "num_local_experts" not in config and "num_experts" in config:  # transformers' attribute_map
        config["num_local_experts"] = config["num_experts"]
    if not config.get("rope_parameters") and not config.get("rope_scaling"):
        config["rope_parameters"] = dict(DEFAULT_ROPE)
    for key in ("rope_parameters", "rope_scaling"):  # as transformers' standardize_rope_params
        raw = config.get(key)
        if isinstance(raw, dict) and raw.get("rope_type", raw.get("type")) == "yarn":
            raw = dict(raw)
            if "original_max_position_embeddings" in config:  # a top-level value wins
                raw["original_max_position_embeddings"] = config["original_max_position_embeddings"]
            raw.setdefault("original_max_position_embeddings", config.get("max_position_embeddings", 131_072))
            config[key] = raw
    rope = rope_parameters(config, 150_000.0)
    cfg = from_dict(GptOssConfig, {**config, "rope": rope})
    return GptOssForCausalLM(cfg, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register gpt-oss."""
    register(ArchitectureSpec(name="gpt_oss", model_types=("gpt_oss",), build=build,
                              description="gpt-oss 20b, 120b (attention sinks, alternating banded layers, MoE)"))
