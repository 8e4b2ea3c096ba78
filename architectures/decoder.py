"""The decoder every architecture here is written as.

Embedding (optionally scaled), a stack of residual blocks, final norm; the
output head is :meth:`~infer.architecture.CausalLM.compute_logits`. Each
block is pre-norm (Xiong et al. 2020, "On Layer Normalization in the
Transformer Architecture"), optionally with norms after attention and MLP
too (Gemma 2/3's "sandwich"; without them ``post_*_norm`` is the identity):

    h = h + post_attn_norm(attention.out(attend(attention.qkv(attn_norm(h)))))
    h = h + post_mlp_norm(mlp(mlp_norm(h)))

What an architecture chooses, and where:

* the **attention part**: ``qkv(x, w, cos, sin) -> q, k, v`` before the
  context's attention call and ``out(o, w) -> [tokens, hidden]`` after it.
  :class:`Attention` (grouped-query, optional biases and per-head q/k norm)
  here; deepseek_v3's latent attention is another;
* the **MLP part**: ``mlp(x, w) -> [tokens, hidden]``, e.g.
  :class:`~.mlp.GatedMLP` or :class:`~.moe.DeepseekMoE`; a layer may use its
  own (DeepSeek's first layers are dense);
* per layer (:class:`DecoderLayer`): its weights, attention scale and
  window, and which rotary table it uses (None: no rope in that layer);
* the embedding scale, and anything else by overriding :meth:`Decoder.embed`
  or :meth:`~infer.architecture.CausalLM.compute_logits`.

The parts are stateless settings; weights travel in per-layer dicts whose keys
name roles (``attn_norm``, ``attn_post_norm``, ``mlp_norm``,
``mlp_post_norm``) or Hugging Face projections (``q_proj`` or the stacked
``qkv_proj``, ``o_proj``, ``gate_up_proj``, ...). So the math of a block is
pure functions of arrays (:class:`Block`), shared by every layer built with the
same parts.

The residual stream: a block returns its output *before* the residual add,
and the next norm adds it (``fused_add_rms_norm``: one op for both).

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

from collections.abc import Callable
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

    def load(self, w: WeightLoader, prefix: str) -> tuple[Weights, Weights]:
        """Its weights under ``prefix``: those ``qkv`` reads, and those ``out`` reads."""
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

    def load(self, w: WeightLoader, prefix: str, *, bias: bool | None = None) -> tuple[Weights, Weights]:
        """The projections under ``prefix`` (``...self_attn.``): those read
        before attention, and ``o_proj`` (and its bias) read after. ``bias``
        None: biases where the checkpoint has them. The q/k norm weights are
        the architecture's to add (``q_norm``, ``k_norm``: ``[head_dim]``)."""
        nh, nkv, hd, d = self.heads, self.kv_heads, self.head_dim, self.hidden
        out = {"o_proj": w.get(prefix + "o_proj.weight", (d, nh * hd))}
        if w.has(prefix + "o_proj.bias") if bias is None else bias:
            out["o_proj.bias"] = w.get(prefix + "o_proj.bias", (d,))
        return load_qkv(w, prefix, nh, nkv, hd, d, bias=bias), out

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


class Block:
    """A residual block's math around its attention call, for one choice of
    attention and MLP parts, as three pure pieces:

    * ``first(h, w, cos, sin) -> (q, k, v, residual)`` for the first layer run;
    * ``before(h, residual, w, cos, sin) -> (q, k, v, residual)``, which also
      adds the previous block's output to the residual stream (fused with
      the input norm);
    * ``after(o, residual, w) -> (out, residual)``, ``out`` being the
      block's output before its residual add.

    ``before`` and ``first`` read the layer's :attr:`DecoderLayer.attn_in`,
    ``after`` its :attr:`DecoderLayer.attn_out`. Graph capture is the
    engine's (:mod:`infer.engine.capture`: the whole step, attention
    included), so these are plain functions.

    The variants, each a keyword: ``post_norms`` adds a norm after each
    sublayer (Gemma's sandwich: ``attn_post_norm``, ``mlp_post_norm``);
    ``pre_norms=False`` drops the norms before them (OLMo 2 then norms only
    after); ``layer_norm`` makes every norm a LayerNorm with its bias where
    the weights hold ``<name>.bias`` (GPT-2); ``residual_scale`` multiplies
    each sublayer's output before it joins the residual stream (Granite's
    ``residual_multiplier``).
    """

    def __init__(self, ops: Backend, attention: AttentionPart, mlp: MLPPart, eps: float, *,
                 post_norms: bool = False, pre_norms: bool = True, layer_norm: bool = False,
                 residual_scale: float | None = None) -> None:
        self.attention, self.mlp = attention, mlp

        def norm(x: Array, w: Weights, name: str) -> Array:
            if layer_norm:
                return ops.layer_norm(x, w[name], w.get(name + ".bias"), eps)
            return ops.rms_norm(x, w[name], eps)

        def add_norm(x: Array, residual: Array, w: Weights, name: str) -> tuple[Array, Array]:
            """(the input of the next sublayer, the residual stream ``x + residual``)."""
            if not pre_norms:
                residual = ops.add(x, residual)
                return residual, residual
            if layer_norm:
                residual = ops.add(x, residual)
                return norm(residual, w, name), residual
            return ops.fused_add_rms_norm(x, residual, w[name], eps)

        def sublayer_out(y: Array, w: Weights, name: str) -> Array:
            if post_norms:
                y = norm(y, w, name)
            return y if residual_scale is None else ops.mul(y, residual_scale)

        def first(h: Array, w: Weights, cos: Array, sin: Array) -> tuple[Array, ...]:
            return (*attention.qkv(norm(h, w, "attn_norm") if pre_norms else h, w, cos, sin), h)

        def before(h: Array, residual: Array, w: Weights, cos: Array, sin: Array) -> tuple[Array, ...]:
            x, residual = add_norm(h, residual, w, "attn_norm")
            return (*attention.qkv(x, w, cos, sin), residual)

        def after(o: Array, residual: Array, w: Weights) -> tuple[Array, Array]:
            a = sublayer_out(attention.out(o, w), w, "attn_post_norm")
            x, residual = add_norm(a, residual, w, "mlp_norm")
            return sublayer_out(mlp(x, w), w, "mlp_post_norm"), residual

        self.first: Callable[..., Any] = first
        self.before: Callable[..., Any] = before
        self.after: Callable[..., Any] = after


@dataclass
class DecoderLayer:
    """One layer: where its keys and values go, the block that computes it,
    its weights and its attention settings."""

    #: Cache layer ``ctx.attention`` stores this layer's keys and values in.
    index: int
    block: Block
    #: Weights read before attention: ``attn_norm`` and the attention part's.
    attn_in: Weights
    #: Weights read after: the attention part's output, the other norms, the MLP's.
    attn_out: Weights
    #: Softmax scale.
    scale: float
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
        """Token embeddings ``[tokens, hidden]`` (``ctx`` holds their positions)."""
        h = self.ops.embedding(self.embed_tokens, input_ids)
        return h if self.embed_scale is None else self.ops.mul(h, self.embed_scale)

    def forward(self, input_ids: Array, ctx: AttentionContext) -> Array:
        h, residual = self.run_layers(self.embed(input_ids, ctx), self.layers, ctx)
        return self.final_norm(h, residual)  # [tokens, hidden]

    def final_norm(self, h: Array, residual: Array) -> Array:
        """The final norm of the last block's output added to the residual stream."""
        return self.ops.fused_add_rms_norm(h, residual, self.norm, self.eps)[0]

    def run_layers(self, h: Array, layers: list[DecoderLayer], ctx: AttentionContext) -> tuple[Array, Array]:
        """Run ``layers`` on the stream ``h`` ``[tokens, hidden]``: returns the
        last block's output before its residual add, and the residual stream."""
        tables: dict[str | None, tuple[Any, Any]] = {None: (None, None)}
        tables.update((kind, rope(ctx)) for kind, rope in self.rope.items())  # cos, sin [tokens, rope_dim/2]
        residual = None
        for layer in layers:
            block = layer.block
            cos, sin = tables[layer.rope]
            if residual is None:
                q, k, v, residual = block.first(h, layer.attn_in, cos, sin)
            else:
                q, k, v, residual = block.before(h, residual, layer.attn_in, cos, sin)
            o = ctx.attention(layer.index, q, k, v, scale=layer.scale, window=layer.window, sinks=layer.sinks,
                              causal=layer.causal)
            h, residual = block.after(o, residual, layer.attn_out)
        assert residual is not None, "run_layers needs at least one layer"
        return h, residual
