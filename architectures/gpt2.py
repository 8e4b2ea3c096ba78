"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

``model_type`` ``gpt2`` as transformers' ``GPT2LMHeadModel`` computes it
(GPT-2 small to XL, DistilGPT2, and the many tutorials' first model).
Against Llama (:mod:`.llama`), nearly everything that Llama later changed:

* Learned absolute positions: ``wpe[position]`` is added to the token
  embedding ``wte[token]``; no rope (every layer's rotary table is None).
* LayerNorm with a bias (``ln_1``, ``ln_2``, final ``ln_f``), eps
  ``layer_norm_epsilon``, before each sublayer (:class:`~.decoder.Block`
  with ``layer_norm``).
* The projections are ``Conv1D`` modules, whose weights are stored
  transposed (``[in, out]``): transposed once at load into the contract's
  ``[out, in]``. q, k and v are one ``c_attn`` projection (with a bias),
  read as the stacked ``qkv_proj``; every projection has a bias.
* A plain MLP: ``c_proj(gelu_new(c_fc(x)))`` (:class:`~.mlp.MLP`; gelu_new
  is the tanh approximation), ``n_inner`` wide (4 x hidden by default).
* Softmax scale ``head_dim ** -0.5`` (1 without ``scale_attn_weights``),
  divided by ``layer + 1`` with ``scale_attn_by_inverse_layer_idx``.
* Tensor names under ``transformer.`` (as transformers saves them) or at the
  top level (the original OpenAI checkpoint), whose causal-mask buffers
  ``h.N.attn.bias`` / ``masked_bias`` are ignored.

Per layer:
    h = h + c_proj(attention(split(c_attn(ln_1(h)))))
    h = h + mlp.c_proj(gelu_new(mlp.c_fc(ln_2(h))))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infer.architecture import WeightLoader
from infer.config import from_dict
from infer.errors import ConfigError
from infer.kv.attention import AttentionContext
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import ACTIVATIONS, Attention, Block, Decoder, DecoderLayer, activation
from .mlp import MLP


@dataclass
class GPT2Config:
    """``config.json`` fields read (transformers names and defaults)."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    add_cross_attention: bool = False
    tie_word_embeddings: bool = True

    def validate(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, found {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"config.json: n_embd ({self.n_embd}) is not divisible by n_head ({self.n_head})")
        if self.add_cross_attention:
            raise ConfigError("config.json: add_cross_attention is true (an encoder-decoder GPT-2); "
                              "only decoder-only models are supported")
        activation("activation_function", self.activation_function)


def _conv1d(a: Any) -> Any:
    """A Conv1D weight ``[in, out]`` as a linear weight ``[out, in]``."""
    return a.T.copy()


class GPT2LMHeadModel(Decoder):
    """Token and position embeddings, LayerNorm blocks, final LayerNorm, (tied) head."""

    def __init__(self, config: GPT2Config, weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        cfg, w, d, nh = config, weights, config.n_embd, config.n_head
        hd, inner = d // nh, config.n_inner or 4 * config.n_embd
        self.num_layers, self.vocab_size, self.max_context = cfg.n_layer, cfg.vocab_size, cfg.n_positions
        self.eps = cfg.layer_norm_epsilon
        p = "transformer." if w.has("transformer.wte.weight") else ""  # transformers' names, or OpenAI's
        self.ignored_tensors = tuple(f"{p}h.{i}.attn.{b}" for i in range(cfg.n_layer) for b in ("bias", "masked_bias"))

        def linear(name: str, n_in: int, n_out: int) -> dict[str, Array]:
            return {"": w.get(name + ".weight", (n_in, n_out), transform=_conv1d),
                    ".bias": w.get(name + ".bias", (n_out,))}

        def named(key: str, parts: dict[str, Array]) -> dict[str, Array]:
            return {key + suffix: value for suffix, value in parts.items()}

        def norm(key: str, name: str) -> dict[str, Array]:
            return {key: w.get(name + ".weight", (d,)), key + ".bias": w.get(name + ".bias", (d,))}

        block = Block(ops, Attention(ops, d, nh, nh, hd), MLP(ops, ACTIVATIONS[cfg.activation_function]), self.eps,
                      layer_norm=True)
        self.embed_tokens = w.get(p + "wte.weight", (cfg.vocab_size, d))
        self.embed_positions = w.get(p + "wpe.weight", (cfg.n_positions, d))
        self.rope = {}
        self.layers = []
        for i in range(cfg.n_layer):
            h = f"{p}h.{i}."
            scale = hd ** -0.5 if cfg.scale_attn_weights else 1.0
            if cfg.scale_attn_by_inverse_layer_idx:
                scale /= i + 1
            weights = {**norm("attn_norm", h + "ln_1"), **named("qkv_proj", linear(h + "attn.c_attn", d, 3 * d)),
                       **named("o_proj", linear(h + "attn.c_proj", d, d)), **norm("mlp_norm", h + "ln_2"),
                       **named("up_proj", linear(h + "mlp.c_fc", d, inner)),
                       **named("down_proj", linear(h + "mlp.c_proj", inner, d))}
            self.layers.append(DecoderLayer(i, block, weights, scale=scale, rope=None))
        self.norm, self.norm_bias = w.get(p + "ln_f.weight", (d,)), w.get(p + "ln_f.bias", (d,))
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else w.get("lm_head.weight", (cfg.vocab_size, d))

    def embed(self, input_ids: Array, ctx: AttentionContext) -> Array:
        ops = self.ops
        return ops.add(ops.embedding(self.embed_tokens, input_ids), ops.embedding(self.embed_positions, ctx.positions))

    def final_norm(self, h: Array, residual: Array | None) -> Array:
        return self.ops.layer_norm(self.ops.add(h, residual), self.norm, self.norm_bias, self.eps)


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> GPT2LMHeadModel:
    """Build a GPT-2 model from a ``config.json`` dict."""
    return GPT2LMHeadModel(from_dict(GPT2Config, config), weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register GPT-2."""
    register(ArchitectureSpec(name="gpt2", model_types=("gpt2",), build=build,
                              description="GPT-2 (small to XL), DistilGPT2"))
