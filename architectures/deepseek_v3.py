"""DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024), and its MTP modules.

``model_type`` ``deepseek_v3`` as transformers' ``DeepseekV3ForCausalLM``
computes it (also Kimi K2 and the other models of that shape). Against Llama:

* Multi-head latent attention (report section 2.1.1, eqs. 1-11). Keys and
  values come from one low-rank latent per token: ``kv_a_proj_with_mqa``
  gives the latent (``kv_lora_rank``, then ``kv_a_layernorm``) and one shared
  rotary key part (``qk_rope_head_dim``); ``kv_b_proj`` expands the latent to
  each head's un-rotated key (``qk_nope_head_dim``) and value
  (``v_head_dim``). Queries go through their own low-rank pair
  (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``) or, with ``q_lora_rank``
  null (DeepSeek-V2-Lite), one ``q_proj``. Each head's key is
  ``[k_nope; k_rope]`` (the rope part shared by every head, "decoupled
  rope"), so keys are ``qk_nope + qk_rope`` wide and values ``v_head_dim``:
  the engine caches them expanded (not the latent).
* The rotary part is laid out in interleaved pairs when ``rope_interleave``
  (the released weights); the contract's ``rope(..., interleaved=True)``
  rotates those pairs in place. transformers also de-interleaves them, but
  queries and keys are permuted alike, so every dot product is the same.
* YaRN rope scaling (:mod:`.rope`); with a scaling type and
  ``mscale_all_dim``, the softmax scale is multiplied by
  ``yarn_mscale(factor, mscale_all_dim) ** 2`` as transformers does.
* Feed-forward: dense gated MLPs in the first ``first_k_dense_replace``
  layers, then DeepSeekMoE (:mod:`.moe`): sigmoid router with bias-corrected,
  group-limited top-k choice, ``routed_scaling_factor``, shared experts.
* ``kv_a_layernorm`` and ``q_a_layernorm`` use eps 1e-6 whatever
  ``rms_norm_eps`` says (transformers builds them with the default).

MTP modules (report section 2.2; layouts and the reasoning in docs/mtp.md):
``num_nextn_predict_layers`` modules stored as extra layers
``model.layers.{num_hidden_layers + d}`` with ``enorm``, ``hnorm``,
``eh_proj``, a full decoder block, ``shared_head.norm``, and optionally
their own ``embed_tokens`` and ``shared_head.head`` (otherwise the main
model's are used; in DeepSeek's release they are copies of them). Module
``d`` at position ``p``::

    h' = eh_proj([enorm(embed(t[p+1])) ; hnorm(h[p])])     embedding first, then hidden
    h_out = block(h')                                        own KV cache layer num_layers + d
    logits = head(shared_head.norm(h_out))                   predicts t[p+2]

``h`` is the main model's hidden state *after* its final norm (depth 0) or
the previous module's ``h_out`` (before its shared-head norm). Other
checkpoint namings (Qwen3-Next ``mtp.*``, GGUF ``blk.N.nextn.*``) are mapped
to these names by the format modules.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from infer.architecture import WeightLoader
from infer.config import from_dict, rope_parameters
from infer.errors import ConfigError
from infer.kv.attention import AttentionContext
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import Block, Decoder, DecoderLayer
from .mlp import GatedMLP
from .moe import DeepseekMoE
from .rope import RotaryEmbedding, yarn_mscale

log = logging.getLogger(__name__)

LATENT_NORM_EPS = 1e-6  # q_a_layernorm, kv_a_layernorm: transformers' default, not rms_norm_eps


@dataclass
class DeepseekV3Config:
    """``config.json`` fields read by this architecture (transformers names).
    A null ``q_lora_rank`` means queries without the low-rank pair; null
    ``n_group``/``topk_group`` mean no group limit."""

    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_interleave: bool = True
    attention_bias: bool = False
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    num_nextn_predict_layers: int = 0
    rope: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                     "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings", "n_group",
                     "topk_group"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, found {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"config.json: qk_rope_head_dim must be even, found {self.qk_rope_head_dim}")
        if self.hidden_act not in ("silu", "swish"):
            raise ConfigError(f"config.json: hidden_act {self.hidden_act!r} is not supported; supported: silu")
        if self.scoring_func != "sigmoid" or self.topk_method != "noaux_tc":
            raise ConfigError(
                f"config.json: routing scoring_func={self.scoring_func!r}, topk_method={self.topk_method!r} is not "
                "supported; supported: sigmoid with noaux_tc (DeepSeek-V3)"
            )
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise ConfigError(f"config.json: n_routed_experts ({self.n_routed_experts}) is not a multiple of "
                                  f"n_group ({self.n_group})")
            eligible = self.topk_group * (self.n_routed_experts // self.n_group)
            if not 0 < self.num_experts_per_tok <= eligible or self.topk_group > self.n_group:
                raise ConfigError(
                    f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and the "
                    f"{eligible} experts of topk_group ({self.topk_group}) of n_group ({self.n_group}) groups"
                )
            if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                raise ConfigError("config.json: group-limited routing scores each group by its two best experts; "
                                  f"{self.n_routed_experts} experts in {self.n_group} groups leave fewer")
        if self.num_nextn_predict_layers < 0:
            raise ConfigError(f"config.json: num_nextn_predict_layers must be >= 0, found "
                              f"{self.num_nextn_predict_layers}")

    def is_moe(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace


class LatentAttention:
    """Multi-head latent attention (module docstring), an attention part of
    :mod:`.decoder`."""

    def __init__(self, ops: Backend, cfg: DeepseekV3Config) -> None:
        self.ops, self.cfg, self.heads = ops, cfg, cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank, self.interleaved, self.q_lora = cfg.kv_lora_rank, cfg.rope_interleave, cfg.q_lora_rank
        self.scale = (self.nope + self.rope_dim) ** -0.5
        if cfg.rope.get("rope_type", "default") != "default" and cfg.rope.get("mscale_all_dim"):
            self.scale *= yarn_mscale(float(cfg.rope["factor"]), float(cfg.rope["mscale_all_dim"])) ** 2

    def load(self, w: WeightLoader, p: str) -> dict[str, Array]:
        """The weights under ``p`` (``...self_attn.``)."""
        cfg, d, nh, r, rd = self.cfg, self.cfg.hidden_size, self.heads, self.kv_lora_rank, self.rope_dim
        qk = self.nope + rd

        def get(name: str, shape: tuple[int, ...], bias: bool = False) -> dict[str, Array]:
            out = {name: w.get(p + name + ".weight", shape)}
            if bias and cfg.attention_bias:
                out[name + ".bias"] = w.get(p + name + ".bias", shape[:1])
            return out

        q = get("q_proj", (nh * qk, d)) if self.q_lora is None else {
            **get("q_a_proj", (self.q_lora, d), bias=True), **get("q_a_layernorm", (self.q_lora,)),
            **get("q_b_proj", (nh * qk, self.q_lora))}
        before = {**q, **get("kv_a_proj_with_mqa", (r + rd, d), bias=True), **get("kv_a_layernorm", (r,)),
                  **get("kv_b_proj", (nh * (self.nope + self.v_dim), r))}
        return {**before, **get("o_proj", (d, nh * self.v_dim), bias=True)}

    def qkv(self, x: Array, w: dict[str, Array], cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        ops = self.ops
        t, nh, nope, rd = ops.shape(x)[0], self.heads, self.nope, self.rope_dim
        if self.q_lora is None:
            q = ops.linear(x, w["q_proj"])
        else:
            q = ops.linear(x, w["q_a_proj"], w.get("q_a_proj.bias"))
            q = ops.linear(ops.rms_norm(q, w["q_a_layernorm"], LATENT_NORM_EPS), w["q_b_proj"])
        q = ops.reshape(q, (t, nh, nope + rd))
        q_rot = ops.rope(ops.slice(q, 2, nope, nope + rd), cos, sin, interleaved=self.interleaved)
        q = ops.concat([ops.slice(q, 2, 0, nope), q_rot], 2)  # [tokens, heads, nope + rope]
        compressed = ops.linear(x, w["kv_a_proj_with_mqa"], w.get("kv_a_proj_with_mqa.bias"))  # [tokens, latent + rope]
        r = self.kv_lora_rank
        latent = ops.rms_norm(ops.slice(compressed, 1, 0, r), w["kv_a_layernorm"], LATENT_NORM_EPS)
        k_rot = ops.reshape(ops.slice(compressed, 1, r, r + rd), (t, 1, rd))
        k_rot = ops.rope(k_rot, cos, sin, interleaved=self.interleaved)  # one rotary key, shared by every head
        kv = ops.reshape(ops.linear(latent, w["kv_b_proj"]), (t, nh, nope + self.v_dim))
        k_rot = ops.add(ops.zeros((t, nh, rd), ops.dtype(kv)), k_rot)  # broadcast to every head
        k = ops.concat([ops.slice(kv, 2, 0, nope), k_rot], 2)  # [tokens, heads, nope + rope]
        v = ops.slice(kv, 2, nope, nope + self.v_dim)  # [tokens, heads, v_head_dim]
        return q, k, v

    def out(self, o: Array, w: dict[str, Array]) -> Array:
        o = self.ops.reshape(o, (-1, self.heads * self.v_dim))  # [tokens, heads * v_head_dim]
        return self.ops.linear(o, w["o_proj"], w.get("o_proj.bias"))


@dataclass
class MTPModule:
    """One multi-token prediction module, ``model.layers.{layer}.*`` (module docstring)."""

    enorm: Array
    hnorm: Array
    eh_proj: Array
    layer: DecoderLayer
    norm: Array  # shared_head.norm
    embed_tokens: Array
    head: Array  # shared_head.head


class DeepseekV3ForCausalLM(Decoder):
    """Embedding, decoder layers (dense, then MoE), final norm, output head; MTP modules."""

    ignored_tensors = ("rotary_emb.inv_freq",)

    def __init__(self, config: DeepseekV3Config, weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        cfg, w, d = config, weights, config.hidden_size
        self.num_layers = cfg.num_hidden_layers
        self.max_context = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        attention = LatentAttention(ops, cfg)
        dense = Block(ops, attention, GatedMLP(ops, d, cfg.intermediate_size, "silu"), cfg.rms_norm_eps)
        moe = Block(ops, attention, DeepseekMoE(
            ops, d, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok,
            n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
        ), cfg.rms_norm_eps)

        def layer(i: int) -> DecoderLayer:  # also the block of an MTP module
            p, block = f"model.layers.{i}.", moe if cfg.is_moe(i) else dense
            weights = {"attn_norm": w.get(p + "input_layernorm.weight", (d,)), **attention.load(w, p + "self_attn."),
                       "mlp_norm": w.get(p + "post_attention_layernorm.weight", (d,)), **block.mlp.load(w, p + "mlp.")}
            return DecoderLayer(i, block, weights, scale=attention.scale)

        self.embed_tokens = w.get("model.embed_tokens.weight", (cfg.vocab_size, d))
        self.rope = {"default": RotaryEmbedding(ops, cfg.qk_rope_head_dim, cfg.rope, cfg.max_position_embeddings)}
        self.layers = [layer(i) for i in range(cfg.num_hidden_layers)]
        self.norm = w.get("model.norm.weight", (d,))
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else w.get("lm_head.weight", (cfg.vocab_size, d))
        first = cfg.num_hidden_layers
        self.mtp: list[MTPModule] = []
        if cfg.num_nextn_predict_layers and not w.has(f"model.layers.{first}.eh_proj.weight"):
            # e.g. a checkpoint saved by transformers, which drops the MTP layers at load
            log.info("deepseek_v3: config.json announces %d MTP modules but the checkpoint holds none "
                     "(no model.layers.%d.eh_proj.weight); running without", cfg.num_nextn_predict_layers, first)
        else:
            for i in range(first, first + cfg.num_nextn_predict_layers):
                p = f"model.layers.{i}."
                own = {name: w.get(p + name, (cfg.vocab_size, d))  # else the main model's
                       for name in ("embed_tokens.weight", "shared_head.head.weight") if w.has(p + name)}
                self.mtp.append(MTPModule(
                    enorm=w.get(p + "enorm.weight", (d,)), hnorm=w.get(p + "hnorm.weight", (d,)),
                    eh_proj=w.get(p + "eh_proj.weight", (d, 2 * d)), layer=layer(i),
                    norm=w.get(p + "shared_head.norm.weight", (d,)),
                    embed_tokens=own.get("embed_tokens.weight", self.embed_tokens),
                    head=own.get("shared_head.head.weight", self.lm_head),
                ))
        self.num_mtp_modules = len(self.mtp)

    def mtp_forward(self, depth: int, hidden: Array, input_ids: Array, ctx: AttentionContext) -> Array:
        ops, m = self.ops, self._module(depth)
        e = ops.rms_norm(ops.embedding(m.embed_tokens, input_ids), m.enorm, self.eps)
        h = ops.rms_norm(hidden, m.hnorm, self.eps)
        x = ops.linear(ops.concat([e, h], 1), m.eh_proj)  # [embedding ; hidden], as eh_proj was trained
        out, residual = m.layer.block.forward(x, None, m.layer, ctx, self.rope_tables(ctx))
        return ops.add(out, residual)  # [tokens, hidden], before the shared-head norm

    def mtp_compute_logits(self, depth: int, hidden: Array) -> Array:
        m = self._module(depth)
        return self.ops.linear(self.ops.rms_norm(hidden, m.norm, self.eps), m.head)

    def _module(self, depth: int) -> MTPModule:
        if not 0 <= depth < self.num_mtp_modules:
            raise IndexError(f"MTP depth {depth} out of range: the model has {self.num_mtp_modules} MTP modules")
        return self.mtp[depth]


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> DeepseekV3ForCausalLM:
    """Build a DeepSeek-V3 model from a ``config.json`` dict."""
    cfg = from_dict(DeepseekV3Config, {**config, "rope": rope_parameters(config)})
    return DeepseekV3ForCausalLM(cfg, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register DeepSeek-V3."""
    register(ArchitectureSpec(
        name="deepseek_v3", model_types=("deepseek_v3",), build=build,
        description="DeepSeek-V3/R1 and models of its shape (MLA, DeepSeekMoE, MTP modules)",
    ))
