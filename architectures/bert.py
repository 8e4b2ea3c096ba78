"""BERT (Devlin et al. 2018, "BERT: Pre-training of Deep Bidirectional
Transformers for Language Understanding") as an encoder for embeddings and
cross-encoder reranking.

``model_type`` ``bert`` as transformers' ``BertModel`` and
``BertForSequenceClassification`` compute it: what most deployed embedders
are (all-MiniLM, bge, e5, gte) and the classic cross-encoder rerankers
(ms-marco-MiniLM). Against the decoders of :mod:`.decoder`:

* Bidirectional attention: every token attends to every token of its own
  text (``ctx.attention(..., causal=False)``); no KV cache is kept between
  forwards (:class:`~infer.embedding.EncoderContext` runs whole texts).
* Learned absolute positions and token types: the input is
  ``LayerNorm(word[token] + token_type[type] + position[p])``; the types
  are zeros unless the context carries them (a query/document pair of a
  cross-encoder: 0 for the first segment, 1 for the second).
* Post-LayerNorm blocks (the original Transformer's, Vaswani et al. 2017),
  every projection with a bias, and an exact-erf gelu MLP by default:

    h = LayerNorm(h + attention.output.dense(attend(query(h), key(h), value(h))))
    h = LayerNorm(h + output.dense(gelu(intermediate.dense(h))))

* The pooler ``tanh(pooler.dense(h[CLS]))`` is read only where a
  classifier sits on it (``BertForSequenceClassification``'s ``classifier``:
  :meth:`BertModel.classify`); sentence-transformers pools the token states
  itself and never uses it.

Tensor names are a bare ``BertModel``'s (``embeddings.``, ``encoder.``), or
under ``bert.`` (``BertForSequenceClassification``, ``BertForMaskedLM``);
the masked-LM and next-sentence heads (``cls.``) are ignored.

DistilBERT (``distilbert``: msmarco- and multi-qa-distilbert) is BERT with
other names (``transformer.layer.N.attention.q_lin``, ``sa_layer_norm``,
``ffn.lin1``, ``output_layer_norm``; ``dim``, ``n_layers``... in its config)
and no token types; its classifier's ReLU layer is not read.

RoBERTa and XLM-RoBERTa (``roberta``, ``xlm-roberta``: multilingual-e5,
bge-m3, most multilingual cross-encoders) are the same network with two
differences, as transformers' ``RobertaModel``: positions start after the
padding id (token ``p`` of a text sits at ``pad_token_id + 1 + p``; a text
holds no padding token, so this is transformers' cumulative count exactly),
and the sequence classifier is ``out_proj(tanh(dense(h[<s>])))`` under
``classifier.`` with no pooler. Names sit under ``roberta.`` or at the top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infer.architecture import CausalLM, WeightLoader, host_array
from infer.config import from_dict
from infer.errors import ConfigError, UnsupportedOpError
from infer.kv.attention import AttentionContext
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import ACTIVATIONS, activation


@dataclass
class BertConfig:
    """``config.json`` fields read (transformers names and defaults)."""

    vocab_size: int = 30522
    model_type: str = "bert"
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    is_decoder: bool = False
    add_cross_attention: bool = False
    position_embedding_type: str = "absolute"
    architectures: list[str] | None = None
    num_labels: int | None = None
    id2label: dict[str, str] | None = None

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, found {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"config.json: hidden_size ({self.hidden_size}) is not divisible by "
                              f"num_attention_heads ({self.num_attention_heads})")
        if self.is_decoder or self.add_cross_attention:
            raise ConfigError("config.json: is_decoder / add_cross_attention is true (BERT as a decoder); "
                              "only the bidirectional encoder is supported")
        if self.position_embedding_type != "absolute":
            raise ConfigError(f"config.json: position_embedding_type {self.position_embedding_type!r} is not "
                              "supported; supported: 'absolute'")
        activation("hidden_act", self.hidden_act)

    @property
    def labels(self) -> int:
        """Outputs of the classifier: ``num_labels``, else ``id2label``'s count, else 2 (transformers' default)."""
        if self.num_labels is not None:
            return self.num_labels
        return len(self.id2label) if self.id2label else 2


#: Where each layer's tensors are, by role: the stack's prefix and the names in a layer.
LAYER_NAMES = {
    "bert": ("encoder.layer", {
        "query": "attention.self.query", "key": "attention.self.key", "value": "attention.self.value",
        "attn_out": "attention.output.dense", "attn_norm": "attention.output.LayerNorm",
        "up": "intermediate.dense", "down": "output.dense", "mlp_norm": "output.LayerNorm"}),
    "distilbert": ("transformer.layer", {
        "query": "attention.q_lin", "key": "attention.k_lin", "value": "attention.v_lin",
        "attn_out": "attention.out_lin", "attn_norm": "sa_layer_norm",
        "up": "ffn.lin1", "down": "ffn.lin2", "mlp_norm": "output_layer_norm"}),
}


class BertModel(CausalLM):
    """Embeddings, post-LayerNorm encoder layers; optionally the pooler and a
    sequence classifier on top (a cross-encoder)."""

    #: Attends bidirectionally over whole texts: run it through
    #: :class:`~infer.embedding.EncoderContext`, not the generation engine.
    is_encoder = True

    def __init__(self, config: BertConfig, weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        cfg, w, d = config, weights, config.hidden_size
        roberta, distil = cfg.model_type in ("roberta", "xlm-roberta"), cfg.model_type == "distilbert"
        p = next((q for q in ("bert.", "roberta.", "distilbert.") if w.has(q + "embeddings.word_embeddings.weight")),
                 "")
        #: Added to every position (RoBERTa's start after the padding id).
        self.position_offset = (cfg.pad_token_id or 0) + 1 if roberta else 0
        self.num_layers, self.vocab_size = cfg.num_hidden_layers, cfg.vocab_size
        self.max_context = cfg.max_position_embeddings - self.position_offset
        self._offset = ops.from_numpy(host_array([self.position_offset], "int32")) if self.position_offset else None
        self.heads, self.head_dim, self.eps = cfg.num_attention_heads, d // cfg.num_attention_heads, cfg.layer_norm_eps
        self.act = ACTIVATIONS[cfg.hidden_act]

        def linear(name: str, n_in: int, n_out: int) -> tuple[Array, Array]:
            return w.get(name + ".weight", (n_out, n_in)), w.get(name + ".bias", (n_out,))

        def norm(name: str) -> tuple[Array, Array]:
            return w.get(name + ".weight", (d,)), w.get(name + ".bias", (d,))

        e = p + "embeddings."
        self.word_embeddings = w.get(e + "word_embeddings.weight", (cfg.vocab_size, d))
        self.position_embeddings = w.get(e + "position_embeddings.weight", (cfg.max_position_embeddings, d))
        self.token_type_embeddings = None if distil else w.get(e + "token_type_embeddings.weight",
                                                                (cfg.type_vocab_size, d))
        self.embeddings_norm = norm(e + "LayerNorm")
        stack, names = LAYER_NAMES["distilbert" if distil else "bert"]
        sizes = {"up": (d, cfg.intermediate_size), "down": (cfg.intermediate_size, d)}
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            a = f"{p}{stack}.{i}."
            self.layers.append({role: norm(a + name) if role.endswith("norm") else
                                linear(a + name, *sizes.get(role, (d, d))) for role, name in names.items()})
        #: ``tanh(dense(h[CLS]))`` and the classifier on it, where the checkpoint has them
        #: (RoBERTa's classification head: its own dense layer, then ``out_proj``).
        self.pooler = linear(p + "pooler.dense", d, d) if w.has(p + "pooler.dense.weight") else None
        # DistilBERT's classifier sits on a ReLU layer (pre_classifier), which the op contract lacks: not read.
        self.classifier = linear("classifier", d, cfg.labels) if w.has("classifier.weight") and not distil else None
        if w.has("classifier.dense.weight"):
            self.pooler, self.classifier = linear("classifier.dense", d, d), linear("classifier.out_proj", d,
                                                                                     cfg.labels)
        self.num_labels = cfg.labels if self.classifier is not None else 0
        self.lm_head = self.word_embeddings  # the tied MLM decoder's weight; an encoder has no next-token head
        self.ignored_tensors = tuple(n for n in w.tensors.names() if n.startswith("cls."))
        if self.pooler is None:  # tensors transformers keeps but the embedding path never reads
            self.ignored_tensors += (p + "embeddings.position_ids",)

    def forward(self, input_ids: Array, ctx: AttentionContext) -> Array:
        """The last layer's hidden states ``[tokens, hidden]`` of every token
        (what sentence-transformers pools)."""
        ops = self.ops
        types = getattr(ctx, "token_types", None)
        h = ops.embedding(self.word_embeddings, input_ids)
        if self.token_type_embeddings is not None:  # DistilBERT has none
            if types is None or self.config.type_vocab_size == 1:  # type 0 throughout (RoBERTa has no other)
                types = ops.zeros((ctx.num_tokens,), "int32")
            h = ops.add(h, ops.embedding(self.token_type_embeddings, types))
        positions = ctx.positions if self._offset is None else ops.add(ctx.positions, self._offset)
        h = ops.add(h, ops.embedding(self.position_embeddings, positions))
        h = ops.layer_norm(h, *self.embeddings_norm, self.eps)
        t, nh, hd = ops.shape(h)[0], self.heads, self.head_dim
        for i, w in enumerate(self.layers):
            q, k, v = (ops.reshape(ops.linear(h, *w[n]), (t, nh, hd)) for n in ("query", "key", "value"))
            o = ctx.attention(i, q, k, v, scale=hd ** -0.5, causal=False)  # [t, heads, head_dim]
            h = ops.layer_norm(ops.add(h, ops.linear(ops.reshape(o, (t, nh * hd)), *w["attn_out"])), *w["attn_norm"],
                               self.eps)
            m = ops.linear(getattr(ops, self.act)(ops.linear(h, *w["up"])), *w["down"])
            h = ops.layer_norm(ops.add(h, m), *w["mlp_norm"], self.eps)
        return h

    def classify(self, first: Array) -> Array:
        """Classifier logits ``[rows, num_labels]`` from the hidden states of
        each text's first (``[CLS]``) token ``[rows, hidden]``:
        ``classifier(tanh(pooler.dense(h)))``, as
        ``BertForSequenceClassification`` (dropout off)."""
        if self.classifier is None or self.pooler is None:
            raise UnsupportedOpError("this BERT checkpoint has no pooler and classifier "
                                     "(it is not a BertForSequenceClassification cross-encoder)")
        ops = self.ops
        return ops.linear(ops.tanh(ops.linear(first, *self.pooler)), *self.classifier)

    def compute_logits(self, hidden: Array) -> Array:
        raise UnsupportedOpError("BERT is an encoder and predicts no next token; use Model.embed() or "
                                 "Model.rerank()")


def distilbert_config(config: dict[str, Any]) -> dict[str, Any]:
    """DistilBERT's ``config.json`` (``dim``, ``n_layers``, ``n_heads``,
    ``hidden_dim``, ``activation``; transformers' defaults) in BERT's names;
    its LayerNorms' eps is transformers' fixed 1e-12."""
    return {**config, "hidden_size": config.get("dim", 768), "num_hidden_layers": config.get("n_layers", 6),
            "num_attention_heads": config.get("n_heads", 12), "intermediate_size": config.get("hidden_dim", 3072),
            "hidden_act": config.get("activation", "gelu"), "layer_norm_eps": 1e-12, "type_vocab_size": 1}


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> BertModel:
    """Build a BERT, DistilBERT or (XLM-)RoBERTa encoder from a ``config.json`` dict."""
    if config.get("model_type") == "distilbert":
        config = distilbert_config(config)
    return BertModel(from_dict(BertConfig, config), weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register BERT."""
    register(ArchitectureSpec(name="bert", model_types=("bert", "distilbert", "roberta", "xlm-roberta"), build=build,
                              description="BERT and (XLM-)RoBERTa encoders for embeddings and reranking "
                                          "(all-MiniLM, bge, e5, cross-encoders)"))
