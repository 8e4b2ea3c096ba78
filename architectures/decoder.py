"""The decoder every architecture here is written as.

Embedding (optionally scaled), a stack of residual blocks, final norm; the
output head is :meth:`~infer.architecture.CausalLM.compute_logits`. Each
block is pre-norm (Xiong et al. 2020, "On Layer Normalization in the
Transformer Architecture"), optionally with norms after its sublayers too
(Gemma 2/3's "sandwich"; without them ``post_*_norm`` is the identity):

    h = h + post_attn_norm(mix(attn_norm(h)))       mix: attention, or the layer kind's mixer
    h = h + post_mlp_norm(mlp(mlp_norm(h)))

:meth:`Decoder.forward` is one loop over the layers, each through its
block's :meth:`Block.forward`; the rotary tables are computed once per forward.

What an architecture chooses, and where:

* the **attention part**: ``qkv(x, w, cos, sin) -> q, k, v`` before the
  context's attention call and ``out(o, w) -> [tokens, hidden]`` after it.
  :class:`Attention` (grouped-query, optional biases and per-head q/k norm)
  here; deepseek_v3's latent attention is another;
* the **mixers** of a hybrid's other layer kinds (:class:`Mixer`: LFM2's short
  convolution, Granite 4.0-H's Mamba2), by the layer's ``kind``;
* the **MLP part**: ``mlp(x, w) -> [tokens, hidden]``, e.g.
  :class:`~.mlp.GatedMLP` or :class:`~.moe.DeepseekMoE`; a layer may use its
  own (DeepSeek's first layers are dense);
* per layer (:class:`DecoderLayer`): its kind, weights, attention scale and
  window, and which rotary table it uses (None: no rope in that layer);
* the embedding scale, and anything else by overriding :meth:`Decoder.embed`
  or :meth:`~infer.architecture.CausalLM.compute_logits`.

The parts are stateless settings; weights travel in one dict per layer whose
keys name roles (``attn_norm``, ``attn_post_norm``, ``mlp_norm``,
``mlp_post_norm``) or Hugging Face projections (``q_proj`` or the stacked
``qkv_proj``, ``o_proj``, ``gate_up_proj``, ...). So the math of a block is
pure functions of arrays (:class:`Block`), shared by every layer built with the
same parts.

The residual stream: a block returns its output *before* the residual add,
and the next norm adds it (:func:`add_rms_norm`: ``fused_add_rms_norm``, one
op for both, which backends fuse).

How the families fit (docs/architectures.md has the table): per-head q/k norms
(Qwen3) are ``Attention(qk_norm="head")``, norms over the whole q and k projections
(OLMo 2) ``qk_norm="full"``; mixture-of-experts MLPs with a softmax top-k router
(Mixtral, Qwen3-MoE) are :class:`~.moe.SparseMoE`, over :func:`~.moe.mix_experts`;
layers without rope (SmolLM3) have ``rope`` None; Granite's multipliers are the
embedding scale, the layer's ``scale``, :class:`Block`'s ``residual_scale`` and a
:meth:`~infer.architecture.CausalLM.compute_logits` override; norms only after each
sublayer (OLMo 2) or LayerNorm with biases (GPT-2) are variants of :class:`Block`,
learned positions (GPT-2) an :meth:`Decoder.embed` override.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Protocol

from infer.architecture import CausalLM, WeightLoader
from infer.errors import ConfigError
from infer.kv.attention import AttentionContext
from infer.ops import Array, Backend

from .projections import load_qkv, qkv
from .rope import RotaryEmbedding

#: ``config.json`` activation names -> the contract's op.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh"}

Weights = dict[str, Any]


def activation(key: str, name: str) -> str:
    """The op for activation ``name`` read from ``config.json`` key ``key``."""
    if name not in ACTIVATIONS:
        raise ConfigError(f"config.json: {key} {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class AttentionPart(Protocol):
    """The two halves of an attention sublayer around ``ctx.attention``."""

    def load(self, w: WeightLoader, prefix: str) -> Weights:
        """Its weights under ``prefix`` (``...self_attn.``), those ``qkv`` and ``out`` read."""
        ...

    def qkv(self, x: Array, w: Weights, cos: Array | None, sin: Array | None) -> tuple[Array, Array, Array]:
        """q ``[t, q_heads, dk]``, k ``[t, kv_heads, dk]``, v ``[t, kv_heads, dv]`` from the normed input."""
        ...

    def out(self, o: Array, w: Weights) -> Array:
        """The sublayer's output ``[t, hidden]`` from attention's ``[t, q_heads, dv]``."""
        ...


class MLPPart(Protocol):
    """A feed-forward sublayer."""

    def load(self, w: WeightLoader, prefix: str) -> Weights:
        """Its weights under ``prefix`` (``...mlp.``)."""
        ...

    def __call__(self, x: Array, w: Weights) -> Array:
        """``[tokens, hidden]`` from the normed input ``[tokens, hidden]``."""
        ...


class Mixer(Protocol):
    """A first sublayer other than attention (a short convolution, a Mamba2
    mixer), keeping its state in the context's recurrent layer."""

    def __call__(self, x: Array, w: Weights, ctx: AttentionContext, layer: int) -> Array:
        """``[tokens, hidden]`` from the normed input, reading and writing cache layer ``layer``'s state."""
        ...


class Attention:
    """Multi-head attention with grouped keys and values (Ainslie et al. 2023,
    "GQA"), as Llama computes it: ``q_proj``, ``k_proj``, ``v_proj`` (stacked
    into one ``qkv_proj`` where stored alike, :mod:`.projections`) with biases
    where present, optionally RMSNorm over each head's q and k (``qk_norm``:
    Gemma 3, Qwen3), rope, then ``o_proj``."""

    def __init__(self, ops: Backend, hidden: int, heads: int, kv_heads: int, head_dim: int, *,
                 qk_norm: bool | str = False, eps: float = 1e-6) -> None:
        self.ops, self.hidden = ops, hidden
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        #: False, True or "head" (RMSNorm over each head's q and k: Gemma 3, Qwen3) or
        #: "full" (over the whole q and k projections, before the heads split: OLMo 2).
        self.qk_norm, self.eps = ("head" if qk_norm is True else qk_norm), eps

    def load(self, w: WeightLoader, prefix: str, *, bias: bool | None = None) -> Weights:
        """The projections under ``prefix`` (``...self_attn.``): q, k and v
        (stacked where stored alike) and ``o_proj``. ``bias`` None: biases
        where the checkpoint has them. The q/k norm weights are the
        architecture's to add (``q_norm``, ``k_norm``: ``[head_dim]``)."""
        nh, nkv, hd, d = self.heads, self.kv_heads, self.head_dim, self.hidden
        out = {"o_proj": w.get(prefix + "o_proj.weight", (d, nh * hd))}
        if w.has(prefix + "o_proj.bias") if bias is None else bias:
            out["o_proj.bias"] = w.get(prefix + "o_proj.bias", (d,))
        return load_qkv(w, prefix, nh, nkv, hd, d, bias=bias) | out

    def qkv(self, x: Array, w: Weights, cos: Array | None, sin: Array | None) -> tuple[Array, Array, Array]:
        ops = self.ops
        q, k, v = qkv(ops, x, w, self.heads, self.kv_heads, self.head_dim)  # [t, heads, head_dim]
        if self.qk_norm == "head":
            q = ops.rms_norm(q, w["q_norm"], self.eps)  # per head, over head_dim
            k = ops.rms_norm(k, w["k_norm"], self.eps)
        elif self.qk_norm == "full":  # over heads * head_dim
            t, hd = ops.shape(x)[0], self.head_dim
            q = ops.reshape(ops.rms_norm(ops.reshape(q, (t, -1)), w["q_norm"], self.eps), (t, self.heads, hd))
            k = ops.reshape(ops.rms_norm(ops.reshape(k, (t, -1)), w["k_norm"], self.eps), (t, self.kv_heads, hd))
        if cos is None:  # a layer without positions (e.g. SmolLM3's NoPE layers)
            return q, k, v
        return ops.rope(q, cos, sin), ops.rope(k, cos, sin), v

    def out(self, o: Array, w: Weights) -> Array:
        o = self.ops.reshape(o, (-1, self.heads * self.head_dim))  # [tokens, heads * head_dim]
        return self.ops.linear(o, w["o_proj"], w.get("o_proj.bias"))


def add_rms_norm(ops: Backend, y: Array, residual: Array | None, weight: Array | None,
                 eps: float) -> tuple[Array, Array]:
    """One step of the residual stream: adds ``y`` (a sublayer's output) to
    ``residual`` and norms the sum, ``(rms_norm(residual + y), residual + y)``,
    in one ``fused_add_rms_norm`` (backends fuse it: one pass over the rows).
    ``residual`` None: ``y`` starts the stream (the embedding); nothing to add."""
    if residual is None:
        return ops.rms_norm(y, weight, eps), y
    return ops.fused_add_rms_norm(y, residual, weight, eps)


#: The rotary tables of one forward, ``(cos, sin)`` ``[tokens, rope_dim / 2]`` by
#: :attr:`DecoderLayer.rope` key; ``None`` maps to ``(None, None)`` (no rope).
Tables = dict[str | None, tuple[Any, Any]]


class Block:
    """One residual block, read straight down:

        x = norm(h)              the stream, normed
        h = h + mix(x)           attention, or the layer kind's own mixer
        x = norm(h)
        h = h + mlp(x)

    :meth:`forward` keeps the stream's last add pending: it takes the previous
    block's output before its residual add and returns its own, so the next
    norm does the add (:func:`add_rms_norm`: one fused op for both).

    The first sublayer (:meth:`mix`) goes by the layer's :attr:`~DecoderLayer.kind`:
    ``"attention"`` is the attention part around the context's attention call;
    another kind is the mixer ``mixers`` names for it, a callable
    ``(x, weights, ctx, cache_layer) -> [tokens, hidden]`` (LFM2's short
    convolution, Mamba2's mixer). A hybrid whose mixer is neither overrides
    :meth:`mix` (Falcon-H1's parallel heads) or :meth:`attend` (Qwen3.5's gate).

    The variants, each a keyword: ``post_norms`` adds a norm after each
    sublayer (Gemma's sandwich: ``attn_post_norm``, ``mlp_post_norm``);
    ``pre_norms=False`` drops the norms before them (OLMo 2 then norms only
    after); ``layer_norm`` makes every norm a LayerNorm with its bias where
    the weights hold ``<name>.bias`` (GPT-2); ``residual_scale`` multiplies
    each sublayer's output before it joins the residual stream (Granite's
    ``residual_multiplier``).
    """

    def __init__(self, ops: Backend, attention: AttentionPart | None, mlp: MLPPart, eps: float, *,
                 mixers: dict[str, Mixer] | None = None, post_norms: bool = False, pre_norms: bool = True,
                 layer_norm: bool = False, residual_scale: float | None = None) -> None:
        self.ops, self.attention, self.mlp, self.eps = ops, attention, mlp, eps
        self.mixers = dict(mixers or {})
        self.post_norms, self.pre_norms, self.layer_norm = post_norms, pre_norms, layer_norm
        self.residual_scale = residual_scale

    def forward(self, h: Array, residual: Array | None, layer: DecoderLayer, ctx: AttentionContext,
                tables: Tables) -> tuple[Array, Array]:
        """The block on the stream: ``h`` is the previous block's output before
        its residual add (``residual`` None: ``h`` is the embedding). Returns
        this block's output before its add, and the residual stream."""
        w = layer.weights
        x, residual = self.add_norm(h, residual, w, "attn_norm")
        y = self.sublayer_out(self.mix(x, layer, ctx, tables), w, "attn_post_norm")
        x, residual = self.add_norm(y, residual, w, "mlp_norm")
        return self.sublayer_out(self.mlp(x, w), w, "mlp_post_norm"), residual

    def mix(self, x: Array, layer: DecoderLayer, ctx: AttentionContext, tables: Tables) -> Array:
        """The first sublayer's output ``[tokens, hidden]``, by the layer's kind."""
        mixer = self.mixers.get(layer.kind)
        if mixer is not None:
            return mixer(x, layer.weights, ctx, layer.index)
        return self.attend(x, layer, ctx, tables)

    def attend(self, x: Array, layer: DecoderLayer, ctx: AttentionContext, tables: Tables) -> Array:
        """The attention sublayer: the part's projections around ``ctx.attention``."""
        assert self.attention is not None, f"layer {layer.index} is an attention layer of a block without attention"
        cos, sin = tables[layer.rope]
        q, k, v = self.attention.qkv(x, layer.weights, cos, sin)
        o = ctx.attention(layer.index, q, k, v, scale=layer.scale, window=layer.window, sinks=layer.sinks,
                          causal=layer.causal)
        return self.attention.out(o, layer.weights)

    def add_norm(self, y: Array, residual: Array | None, w: Weights, name: str) -> tuple[Array, Array]:
        """(the input of the next sublayer, the residual stream ``residual + y``);
        ``residual`` None: ``y`` is the stream."""
        ops = self.ops
        if self.pre_norms and not self.layer_norm:
            return add_rms_norm(ops, y, residual, w[name], self.eps)
        stream = y if residual is None else ops.add(y, residual)
        if not self.pre_norms:
            return stream, stream
        return self.norm(stream, w, name), stream

    def norm(self, x: Array, w: Weights, name: str) -> Array:
        """Norm ``name`` of the layer's weights: RMSNorm, or LayerNorm with its bias."""
        if self.layer_norm:
            return self.ops.layer_norm(x, w[name], w.get(name + ".bias"), self.eps)
        return self.ops.rms_norm(x, w[name], self.eps)

    def sublayer_out(self, y: Array, w: Weights, name: str) -> Array:
        """A sublayer's output as it joins the stream: post-normed and scaled where the variant says."""
        if self.post_norms:
            y = self.norm(y, w, name)
        return y if self.residual_scale is None else self.ops.mul(y, self.residual_scale)


@dataclass
class DecoderLayer:
    """One layer: its cache layer, kind, block, weights and attention settings."""

    #: Cache layer the layer's keys and values (or its recurrent state) live in.
    index: int
    block: Block
    #: Its weights by role: the norms (``attn_norm``, ``mlp_norm``, ...), the
    #: mixer's or attention part's, the MLP part's.
    weights: Weights
    #: Softmax scale (None in a layer without attention).
    scale: float | None = None
    #: The layer's kind: a key of :attr:`Block.mixers` (that mixer mixes it), else
    #: attention (a family may keep its config's name, e.g. ``"full_attention"``).
    kind: str = "attention"
    #: Sliding window, or None for full attention.
    window: int | None = None
    #: Key of the rotary table in :attr:`Decoder.rope`, or None for no rope.
    rope: str | None = "default"
    #: Attention sinks ``[q_heads]`` (gpt-oss: one learned logit per head joins
    #: each softmax, with no value), or None.
    sinks: Array | None = None
    #: False: bidirectional attention over the sequence (an embedding model's,
    #: e.g. EmbeddingGemma's ``use_bidirectional_attention``).
    causal: bool = True

    @property
    def attn_in(self) -> Weights:
        """Deprecated: the weights read before attention were a split for the
        capture pieces that are gone; every weight is in :attr:`weights`."""
        warnings.warn("DecoderLayer.attn_in is deprecated; read DecoderLayer.weights", DeprecationWarning,
                      stacklevel=2)
        return self.weights

    @property
    def attn_out(self) -> Weights:
        """Deprecated: as :attr:`attn_in`."""
        warnings.warn("DecoderLayer.attn_out is deprecated; read DecoderLayer.weights", DeprecationWarning,
                      stacklevel=2)
        return self.weights


class Decoder(CausalLM):
    """Embedding, decoder layers, final norm (see the module docstring).

    A subclass reads its weights in ``__init__`` and sets the attributes below
    (and ``lm_head``, ``num_layers``, ``max_context``, ``vocab_size``).
    """

    #: Input embedding ``[vocab, hidden]``.
    embed_tokens: Array
    #: Multiplies the embeddings (Gemma: ``sqrt(hidden)``); None: no scale.
    embed_scale: Array | None = None
    #: Rotary tables by the key layers name them with (:attr:`DecoderLayer.rope`).
    rope: dict[str, RotaryEmbedding]
    layers: list[DecoderLayer]
    #: Final norm weight and eps.
    norm: Array
    eps: float

    def embed(self, input_ids: Array, ctx: AttentionContext) -> Array:
        """Token embeddings ``[tokens, hidden]`` (``ctx`` holds their positions),
        scaled, with the forward's image rows put in (unscaled, as
        transformers places image features after the scale: ``ctx.inject``)."""
        h = self.ops.embedding(self.embed_tokens, input_ids)
        return ctx.inject(h if self.embed_scale is None else self.ops.mul(h, self.embed_scale))

    def forward(self, input_ids: Array, ctx: AttentionContext) -> Array:
        h, residual = self.embed(input_ids, ctx), None
        tables = self.rope_tables(ctx)
        for layer in self.layers:
            h, residual = layer.block.forward(h, residual, layer, ctx, tables)
        return self.final_norm(h, residual)  # [tokens, hidden]

    def rope_tables(self, ctx: AttentionContext) -> Tables:
        """Every rotary table of this forward, computed once (:data:`Tables`)."""
        tables: Tables = {None: (None, None)}
        tables.update((kind, rope(ctx)) for kind, rope in self.rope.items())  # cos, sin [tokens, rope_dim/2]
        return tables

    def final_norm(self, h: Array, residual: Array | None) -> Array:
        """The final norm of the last block's output added to the residual stream."""
        return add_rms_norm(self.ops, h, residual, self.norm, self.eps)[0]
