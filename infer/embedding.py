"""Text embeddings: whole texts through a network, pooled into one vector each.

What sentence-transformers computes for a folder it saved (``modules.json``:
a Transformer, then Pooling, optional Dense layers and Normalize), and what a
bare Hugging Face model (``BertModel``, ``Qwen3Model``) gives pooled the way
its family is used:

1. Each text (after the prompt, if one is asked for) is tokenized with the
   model's special tokens and cut to ``max_seq_length``.
2. The texts run through the network in ragged batches
   (:class:`EncoderContext`): no cache, no padding, each text attending only
   to its own tokens: bidirectionally for an encoder (BERT, EmbeddingGemma),
   causally for a decoder embedder (Qwen3-Embedding). So a text embeds to the
   same vector alone and in any batch, within float32 rounding.
3. The last hidden states of each text are pooled
   (:func:`pool`: the modes of sentence-transformers' ``Pooling``), then the
   ``Dense`` layers apply, then ``Normalize``.

``Model.embed``'s ``dimensions`` then keeps the first ``dimensions`` values
(Matryoshka representation learning, Kusupati et al. 2022) and
``normalize`` scales each row to unit L2 norm.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from infer.errors import ConfigError, EmbeddingError
from infer.kv.attention import AttentionContext
from infer.ops import AttentionBatch, Backend

log = logging.getLogger(__name__)

#: sentence-transformers' pooling modes (``Pooling.POOLING_MODES``), and the
#: legacy ``pooling_mode_*`` keys of ``1_Pooling/config.json`` in the order
#: sentence-transformers concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken",
}
#: Short names ``Model.embed(pooling=...)`` also takes (llama.cpp's ``--pooling`` names).
_POOLING_ALIASES = {"last": "lasttoken", "mean_sqrt_len": "mean_sqrt_len_tokens", "weighted_mean": "weightedmean"}
#: ``2_Dense/config.json``'s ``activation_function`` (a torch class path) -> numpy.
_DENSE_ACTIVATIONS = {
    "Identity": lambda x: x,
    "Tanh": np.tanh,
    "ReLU": lambda x: np.maximum(x, 0),
    "Sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "GELU": lambda x: 0.5 * x * (1 + _erf(x / np.sqrt(2.0))),
    "SiLU": lambda x: x / (1 + np.exp(-x)),
}
#: Tokens one embedding forward feeds at most (all texts together).
DEFAULT_EMBED_BATCH_TOKENS = 2048


def _erf(x: np.ndarray) -> np.ndarray:
    from math import erf

    return np.vectorize(erf, otypes=[np.float64])(x).astype(x.dtype)


class EncoderContext(AttentionContext):
    """The attention context of one forward over whole new texts, no cache.

    Text ``b`` is rows ``query_start[b]:query_start[b + 1]`` of the forward,
    at positions ``0..length - 1``. Attention reads the keys and values of
    this forward itself: the "pool" is the forward's own rows, in blocks of
    one position, text ``b``'s block table the rows of its tokens. So no
    padding exists, and no row sees another text. Causal or bidirectional is
    the architecture's call (``ctx.attention(..., causal=False)``).

    ``token_types`` (int32 ``[tokens]`` or None) carries BERT's segment ids
    (a cross-encoder's query/document pair).
    """

    def __init__(self, ops: Backend, lengths: Sequence[int], token_types: np.ndarray | None = None) -> None:
        lengths = [int(n) for n in lengths]
        if not lengths or min(lengths) < 1:
            raise ValueError("an encoder forward needs at least one text of at least one token")
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
        width = max(lengths)
        tables = np.zeros((len(lengths), width), np.int32)
        for b, n in enumerate(lengths):
            tables[b, :n] = np.arange(starts[b], starts[b] + n, dtype=np.int32)
        host = AttentionBatch(starts, np.asarray(lengths, np.int32), tables, 1, width)
        self.batch = AttentionBatch(ops.from_numpy(starts), ops.from_numpy(host.seq_lens), ops.from_numpy(tables),
                                    1, width, host)
        self._setup(ops, ops.from_numpy(positions), int(starts[-1]), [], width)
        self.sequences = []
        self.query_start = self.batch.query_start
        self.token_types = None if token_types is None else ops.from_numpy(np.asarray(token_types, np.int32))

    def attention(self, layer: int, q: Any, k: Any, v: Any, *, scale: float, window: int | None = None,
                  softcap: float | None = None, sinks: Any = None, causal: bool = True) -> Any:
        """Attend over this forward's own keys (see the class docstring)."""
        return self.ops.attention(q, k, v, self.batch, scale=scale, causal=causal, window=window, softcap=softcap,
                                  sinks=sinks)


# -- what a sentence-transformers folder says ------------------------------------------------


@dataclass(frozen=True)
class Dense:
    """A sentence-transformers ``Dense`` module: ``activation(x @ weight.T + bias)``."""

    weight: np.ndarray  # [out, in] float32
    bias: np.ndarray | None
    activation: str = "Identity"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        return _DENSE_ACTIVATIONS[self.activation](y).astype(np.float32)


@dataclass
class EmbeddingConfig:
    """How a model's token states become one vector per text."""

    #: Pooling modes, concatenated in this order (usually one).
    pooling: tuple[str, ...] = ("mean",)
    #: False: tokens of the prompt are left out of the pooling (INSTRUCTOR-style models).
    include_prompt: bool = True
    #: The ``Dense`` modules after pooling, in order.
    dense: list[Dense] = field(default_factory=list)
    #: The pipeline ends in a ``Normalize`` module.
    normalize: bool = False
    #: Named prompts (``config_sentence_transformers.json``), e.g. ``{"query": "query: "}``.
    prompts: dict[str, str] = field(default_factory=dict)
    #: The prompt used when none is named.
    default_prompt_name: str | None = None
    #: Longest input in tokens (``sentence_bert_config.json``), or None: the model's context.
    max_seq_length: int | None = None
    #: Texts are lowercased before tokenizing (``sentence_bert_config.json``'s ``do_lower_case``).
    lowercase: bool = False
    #: Where the settings came from, for messages.
    source: str = "the model's defaults"


def pooling_modes(value: object, where: str, error: type[Exception] = ConfigError) -> tuple[str, ...]:
    """Pooling modes from a name or a list of names (``error`` for a bad one:
    a :class:`ConfigError` in a file, an :class:`EmbeddingError` as an argument)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise error(f"{where}: pooling mode must be a name or a list of names, found {value!r}")
    modes = tuple(_POOLING_ALIASES.get(n, n) for n in names)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad:
        raise error(f"{where}: pooling mode {bad[0]!r} is not supported; supported: "
                    f"{', '.join(POOLING_MODES)}")
    return modes


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it as JSON: {exc}") from exc
    if not isinstance(data, (dict, list)):
        raise ConfigError(f"{path}: must hold a JSON object, found {type(data).__name__}")
    return data  # type: ignore[return-value]


def read_pooling(path: Path) -> tuple[tuple[str, ...], bool]:
    """``1_Pooling/config.json``: the pooling modes and ``include_prompt``."""
    cfg = _read_json(path)
    if "pooling_mode" in cfg:
        modes = pooling_modes(cfg["pooling_mode"], str(path))
    else:
        modes = tuple(mode for key, mode in _LEGACY_POOLING_KEYS.items() if cfg.get(key)) or ("mean",)
    include = cfg.get("include_prompt", True)
    if not isinstance(include, bool):
        raise ConfigError(f"{path}: include_prompt must be true or false, found {include!r}")
    return modes, include


def read_dense(folder: Path, tensors: Any) -> Dense:
    """A ``Dense`` module: its folder's ``config.json`` and its weights
    (``linear.weight``, ``linear.bias``) from ``tensors``, the
    :class:`~infer.package.TensorSource` the format opened (safetensors only)."""
    cfg = _read_json(folder / "config.json")
    try:
        n_in, n_out = int(cfg["in_features"]), int(cfg["out_features"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{folder / 'config.json'}: in_features and out_features must be integers") from exc
    act_path = cfg.get("activation_function") or "torch.nn.modules.activation.Tanh"  # sentence-transformers' default
    act = str(act_path).rsplit(".", 1)[-1]
    if act not in _DENSE_ACTIVATIONS:
        raise ConfigError(f"{folder / 'config.json'}: activation_function {act_path!r} is not supported; "
                          f"supported: {', '.join(_DENSE_ACTIVATIONS)}")
    if tensors is None:
        raise ConfigError(f"{folder}: the Dense module's weights were not opened with the model")
    names = set(tensors.names())
    weight = np.array(tensors.get("linear.weight"), np.float32) if "linear.weight" in names else None
    if weight is None or weight.shape != (n_out, n_in):
        raise ConfigError(f"{folder}: linear.weight must be [{n_out}, {n_in}], found "
                          f"{None if weight is None else list(weight.shape)}")
    bias = None
    if cfg.get("bias", True):
        bias = np.array(tensors.get("linear.bias"), np.float32) if "linear.bias" in names else None
        if bias is None or bias.shape != (n_out,):
            raise ConfigError(f"{folder}: linear.bias must be [{n_out}]")
    return Dense(weight, bias, act)


#: A GGUF file's ``pooling_type`` (formats/gguf_arch.py) -> the pooling modes it means.
_GGUF_POOLING = {"mean": ("mean",), "cls": ("cls",), "last": ("lasttoken",)}


def read_embedding_config(folder: Path | None, default_pooling: tuple[str, ...],
                          config: dict[str, Any] | None = None,
                          module_tensors: dict[str, Any] | None = None) -> EmbeddingConfig:
    """The embedding pipeline of a model folder: its sentence-transformers
    modules (``modules.json``) where it has them, else the pooling a GGUF
    file names (``{arch}.pooling_type``, as ``config["pooling_type"]``), else
    ``default_pooling``."""
    gguf = (config or {}).get("pooling_type")
    cfg = EmbeddingConfig(pooling=_GGUF_POOLING.get(gguf, default_pooling),
                          source="the GGUF file's pooling_type" if gguf in _GGUF_POOLING else "the model's defaults")
    if folder is None or not folder.is_dir() or not (folder / "modules.json").is_file():
        return cfg
    modules = _read_json(folder / "modules.json")
    cfg.source = str(folder / "modules.json")
    if not isinstance(modules, list):
        raise ConfigError(f"{folder / 'modules.json'}: must be a list of modules")
    for module in sorted(modules, key=lambda m: m.get("idx", 0) if isinstance(m, dict) else 0):
        if not isinstance(module, dict) or not isinstance(module.get("type"), str):
            raise ConfigError(f"{folder / 'modules.json'}: every module needs a 'type', found {module!r}")
        kind = module["type"].rsplit(".", 1)[-1]
        path = folder / str(module.get("path", ""))
        if kind == "Transformer":  # sentence-transformers 2-4 name the limit here, 5+ in the tokenizer's config
            if (path / "sentence_bert_config.json").is_file():
                cfg.lowercase = _read_json(path / "sentence_bert_config.json").get("do_lower_case") is True
            for file, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json",
                                                                                "model_max_length")):
                length = _read_json(path / file).get(key) if (path / file).is_file() else None
                if isinstance(length, int) and not isinstance(length, bool) and length > 0:
                    cfg.max_seq_length = length
                    break
        elif kind == "Pooling":
            cfg.pooling, cfg.include_prompt = read_pooling(path / "config.json")
        elif kind == "Dense":
            cfg.dense.append(read_dense(path, (module_tensors or {}).get(str(module.get("path", "")))))
        elif kind == "Normalize":
            cfg.normalize = True
        else:
            raise ConfigError(f"{folder / 'modules.json'}: module type {module['type']!r} is not supported; "
                              "supported: Transformer, Pooling, Dense, Normalize")
    st_config = folder / "config_sentence_transformers.json"
    if st_config.is_file():
        data = _read_json(st_config)
        prompts = data.get("prompts") or {}
        if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
            raise ConfigError(f"{st_config}: prompts must map names to strings")
        cfg.prompts = dict(prompts)
        name = data.get("default_prompt_name")
        if name is not None and name not in cfg.prompts:
            raise ConfigError(f"{st_config}: default_prompt_name {name!r} is not one of the prompts "
                              f"({', '.join(cfg.prompts) or 'none'})")
        cfg.default_prompt_name = name
    return cfg


# -- pooling ------------------------------------------------------------------------------------


def pool(hidden: np.ndarray, modes: Sequence[str], skip: int = 0) -> np.ndarray:
    """One text's token states ``[tokens, hidden]`` pooled as
    sentence-transformers' ``Pooling`` does, the modes concatenated.

    ``skip`` leading tokens (a prompt, with ``include_prompt`` false) are left
    out; ``weightedmean`` weighs the kept token at position ``p`` by ``p + 1``
    (its position in the whole text), ``cls`` takes the first kept token.
    """
    h = hidden[skip:] if skip < hidden.shape[0] else hidden[:0]
    n = h.shape[0]
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(h[0] if n else np.zeros(hidden.shape[1], np.float32))
        elif mode == "max":
            out.append(h.max(axis=0) if n else np.full(hidden.shape[1], -np.inf, np.float32))
        elif mode == "mean":
            out.append(h.sum(axis=0) / max(n, 1e-9))
        elif mode == "mean_sqrt_len_tokens":
            out.append(h.sum(axis=0) / np.sqrt(max(n, 1e-9)))
        elif mode == "weightedmean":
            w = np.arange(skip + 1, skip + n + 1, dtype=np.float32)[:, None]
            out.append((h * w).sum(axis=0) / max(float(w.sum()), 1e-9))
        elif mode == "lasttoken":
            out.append(hidden[-1])
        else:
            raise EmbeddingError(f"pooling mode {mode!r} is not supported; supported: {', '.join(POOLING_MODES)}")
    return np.concatenate(out).astype(np.float32)


def finish(vectors: np.ndarray, config: EmbeddingConfig, *, normalize: bool, dimensions: int | None) -> np.ndarray:
    """Pooled vectors ``[n, d]`` through the Dense and Normalize modules, cut
    to ``dimensions`` and L2-normalized when ``normalize``."""
    x = vectors.astype(np.float32)
    for dense in config.dense:
        x = dense(x)
    if config.normalize:
        x = _l2(x)
    if dimensions is not None:
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= x.shape[1]:
            raise EmbeddingError(f"dimensions must be an integer from 1 to the model's {x.shape[1]}, "
                                 f"got {dimensions!r}")
        x = x[:, :dimensions]
    if normalize:
        x = _l2(x)
    return np.ascontiguousarray(x, dtype=np.float32)


def _l2(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit norm, as ``torch.nn.functional.normalize`` (eps 1e-12)."""
    norms = np.sqrt((x.astype(np.float64) ** 2).sum(axis=1, keepdims=True))
    return (x / np.maximum(norms, 1e-12)).astype(np.float32)


def batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of texts grouped into forwards of at most ``max_tokens`` tokens
    (a longer text runs alone), in order."""
    out: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(lengths):
        if current and total + n > max_tokens:
            out.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        out.append(current)
    return out


def encode_tokens(network: Any, ops: Backend, ids: Sequence[Sequence[int]], *,
                  token_types: Sequence[Sequence[int]] | None = None,
                  max_batch_tokens: int = DEFAULT_EMBED_BATCH_TOKENS) -> list[np.ndarray]:
    """The last hidden states ``[tokens, hidden]`` of each token sequence,
    in ragged batches through :class:`EncoderContext`."""
    out: list[np.ndarray] = [np.zeros((0, 0), np.float32)] * len(ids)
    for group in batches([len(t) for t in ids], max_batch_tokens):
        flat = np.concatenate([np.asarray(ids[i], np.int32) for i in group])
        types = None if token_types is None else np.concatenate([np.asarray(token_types[i], np.int32)
                                                                 for i in group])
        ctx = EncoderContext(ops, [len(ids[i]) for i in group], types)
        hidden = ops.to_numpy(ops.astype(network.forward(ops.from_numpy(flat), ctx), "float32"))
        start = 0
        for i in group:
            out[i] = hidden[start:start + len(ids[i])]
            start += len(ids[i])
    return out


# -- the Model's side ---------------------------------------------------------------------------


def default_pooling(network: Any) -> tuple[str, ...]:
    """How a bare model folder (no ``modules.json``) pools: mean for an
    encoder (what sentence-transformers gives a plain BERT), the last token
    for a causal decoder (Qwen3-Embedding)."""
    return ("mean",) if getattr(network, "is_encoder", False) else ("lasttoken",)


def prompt_text(config: EmbeddingConfig, prompt: str | None, prompt_name: str | None) -> str:
    """The prompt to put before each text: ``prompt`` itself, the named one
    of ``config_sentence_transformers.json``, else its default (or none)."""
    if prompt is not None and prompt_name is not None:
        raise EmbeddingError("give prompt= or prompt_name=, not both")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise EmbeddingError(f"prompt must be a string, got {type(prompt).__name__}")
        return prompt
    name = prompt_name if prompt_name is not None else config.default_prompt_name
    if name is None:
        return ""
    if name not in config.prompts:
        raise EmbeddingError(f"prompt_name {name!r} is not one of the model's prompts "
                             f"({', '.join(config.prompts) or 'none'}; from {config.source})")
    return config.prompts[name]


def _is_id(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def as_inputs(texts: object) -> tuple[list[str | list[int]], bool]:
    """``texts`` as a list of texts or token id lists, and whether one input was given alone."""
    if isinstance(texts, str):
        return [texts], True
    if isinstance(texts, np.ndarray):
        texts = texts.tolist()
    if isinstance(texts, Sequence) and texts and all(_is_id(t) for t in texts):
        return [[int(t) for t in texts]], True  # type: ignore[union-attr]
    if not isinstance(texts, Sequence) or isinstance(texts, (bytes, bytearray)):
        raise EmbeddingError(f"texts must be a string or a list of strings (or of token id lists), "
                             f"got {type(texts).__name__}")
    if not texts:
        raise EmbeddingError("texts is empty: give at least one text")
    out: list[str | list[int]] = []
    for i, t in enumerate(texts):
        if isinstance(t, str):
            out.append(t)
        elif isinstance(t, (Sequence, np.ndarray)) and not isinstance(t, (bytes, bytearray)) and all(
                _is_id(x) for x in t):
            out.append([int(x) for x in t])
        else:
            raise EmbeddingError(f"texts[{i}] must be a string or a list of token ids, got {type(t).__name__}")
    return out, False


class Truncator:
    """Token ids of texts with the model's special tokens, cut to ``limit``
    tokens the way transformers' tokenizers truncate (the content is cut,
    the special tokens the post-processor adds are kept)."""

    def __init__(self, tokenizer: Any, limit: int) -> None:
        self.tokenizer, self.limit = tokenizer, limit
        self._cutting: Any = None

    def __call__(self, text: str, pair: str | None = None) -> tuple[list[int], list[int]]:
        """``(ids, token type ids)`` of ``text`` (and of the pair ``text``, ``pair``)."""
        if pair is None:
            ids = self.tokenizer.encode(text)
            if len(ids) <= self.limit:
                return ids, [0] * len(ids)
        if self._cutting is None:
            import tokenizers

            self._cutting = tokenizers.Tokenizer.from_str(self.tokenizer.backend.to_str())
            self._cutting.no_padding()
            self._cutting.enable_truncation(self.limit)
        enc = self._cutting.encode(text, pair) if pair is not None else self._cutting.encode(text)
        return list(enc.ids), list(enc.type_ids)


def _check_ids(ids: list[int], vocab: int, limit: int, i: int) -> None:
    if not ids:
        raise EmbeddingError(f"input {i} is empty: give at least one token")
    if len(ids) > limit:
        raise EmbeddingError(f"input {i} has {len(ids)} tokens; the model takes at most {limit}")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise EmbeddingError(f"input {i} holds token id {bad[0]}, outside the vocabulary (0..{vocab - 1})")


def embed(model: Any, texts: object, *, normalize: bool = True, dimensions: int | None = None,
          pooling: str | Sequence[str] | None = None, prompt: str | None = None, prompt_name: str | None = None,
          max_batch_tokens: int = DEFAULT_EMBED_BATCH_TOKENS) -> tuple[np.ndarray, int]:
    """:meth:`infer.Model.embed`, and the tokens it read (for ``usage``)."""
    config = model.embedding_config
    items, _ = as_inputs(texts)
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1):
        raise EmbeddingError(f"dimensions must be a positive integer, got {dimensions!r}")
    modes = config.pooling if pooling is None else pooling_modes(pooling, "pooling", EmbeddingError)
    network = model.network
    limit = min(config.max_seq_length or network.max_context, network.max_context)
    before = prompt_text(config, prompt, prompt_name)
    skip = 0
    ids: list[list[int]] = []
    truncate = None
    for i, item in enumerate(items):
        if isinstance(item, str):
            if truncate is None:
                truncate = Truncator(model.tokenizer, limit)
            ids.append(truncate((before + item).lower() if config.lowercase else before + item)[0])
        else:
            ids.append(item)
        _check_ids(ids[-1], network.vocab_size, limit, i)
    if before and not config.include_prompt:  # sentence-transformers' prompt_length
        prompt_ids = model.tokenizer.encode(before)
        skip = len(prompt_ids) - (1 if prompt_ids and model.tokenizer.is_special(prompt_ids[-1]) else 0)
    with model._lock:
        states = encode_tokens(network, model.backend, ids, max_batch_tokens=max_batch_tokens)
    pooled = np.stack([pool(h, modes, skip if isinstance(items[i], str) else 0) for i, h in enumerate(states)])
    return finish(pooled, config, normalize=normalize, dimensions=dimensions), sum(len(t) for t in ids)


# -- reranking ----------------------------------------------------------------------------------

#: Qwen3-Reranker's prompt (its model card): a yes/no judgement, read at the last position.
QWEN3_RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
                       "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                       "<|im_start|>user\n")
QWEN3_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1 / (1 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def cross_encoder_activation(config: dict[str, Any], labels: int) -> str:
    """The activation sentence-transformers' ``CrossEncoder.predict`` applies
    to the logits: ``config.json``'s ``sentence_transformers.activation_fn``
    (or the older ``sbert_ce_default_activation_function``), else Sigmoid
    for one label and Identity for more."""
    st = config.get("sentence_transformers")
    path = (st.get("activation_fn") if isinstance(st, dict) else None) or config.get(
        "sbert_ce_default_activation_function")
    if isinstance(path, str):
        name = path.rsplit(".", 1)[-1]
        if name not in _DENSE_ACTIVATIONS:
            raise ConfigError(f"config.json: the cross-encoder's activation {path!r} is not supported; "
                              f"supported: {', '.join(_DENSE_ACTIVATIONS)}")
        return name
    return "Sigmoid" if labels == 1 else "Identity"


def rerank(model: Any, query: str, documents: Sequence[str], *, instruction: str | None = None,
           max_batch_tokens: int = DEFAULT_EMBED_BATCH_TOKENS) -> tuple[list[float], int]:
    """:meth:`infer.Model.rerank`, and the tokens it read."""
    if not isinstance(query, str):
        raise EmbeddingError(f"query must be a string, got {type(query).__name__}")
    if isinstance(documents, str) or not isinstance(documents, Sequence) or not documents or not all(
            isinstance(d, str) for d in documents):
        raise EmbeddingError("documents must be a non-empty list of strings")
    network, ops = model.network, model.backend
    limit = network.max_context
    if getattr(network, "classify", None) is not None and getattr(network, "num_labels", 0):
        cut = Truncator(model.tokenizer, min(model.embedding_config.max_seq_length or limit, limit))
        pairs = [cut(query, doc) for doc in documents]
        ids, types = [p[0] for p in pairs], [p[1] for p in pairs]
        for i, t in enumerate(ids):
            _check_ids(t, network.vocab_size, limit, i)
        with model._lock:
            states = encode_tokens(network, ops, ids, token_types=types, max_batch_tokens=max_batch_tokens)
            first = ops.from_numpy(np.stack([h[0] for h in states]))
            logits = ops.to_numpy(ops.astype(network.classify(first), "float32")).astype(np.float32)
        act = cross_encoder_activation(model.config, network.num_labels)
        if network.num_labels == 1:
            scores = _DENSE_ACTIVATIONS[act](logits[:, 0])
        else:  # several labels: the probability of the last one ("relevant")
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            scores = e[:, -1] / e.sum(axis=1)
        return [float(s) for s in scores], sum(len(t) for t in ids)
    if getattr(network, "is_encoder", False):
        raise EmbeddingError("this model embeds but does not rerank: reranking needs a cross-encoder "
                             "(BertForSequenceClassification) or a yes/no reranker LM (Qwen3-Reranker)")
    return _rerank_yes_no(model, query, documents, instruction or DEFAULT_RERANK_INSTRUCTION, max_batch_tokens)


def logit_score_tokens(folder: Path | None) -> tuple[int, int] | None:
    """The ``(true, false)`` token ids of a sentence-transformers ``CrossEncoder``
    folder's ``LogitScore`` module (a reranker LM saved by sentence-transformers 5+),
    or None without one."""
    if folder is None or not folder.is_dir() or not (folder / "modules.json").is_file():
        return None
    modules = _read_json(folder / "modules.json")
    for module in modules if isinstance(modules, list) else []:
        if isinstance(module, dict) and str(module.get("type", "")).rsplit(".", 1)[-1] == "LogitScore":
            cfg = _read_json(folder / str(module.get("path", "")) / "config.json")
            true, false = cfg.get("true_token_id"), cfg.get("false_token_id")
            if not isinstance(true, int) or not isinstance(false, int):
                raise ConfigError(f"{folder}: the LogitScore module needs integer true_token_id and false_token_id "
                                  f"(a score of one token's logit alone is not supported), found {true!r}, {false!r}")
            return true, false
    return None


def _rerank_yes_no(model: Any, query: str, documents: Sequence[str], instruction: str,
                   max_batch_tokens: int) -> tuple[list[float], int]:
    """Qwen3-Reranker: ``sigmoid(logit[yes] - logit[no])`` at the last
    position of its prompt (= the softmax over the two logits' ``yes``)."""
    tok, network, ops = model.tokenizer, model.network, model.backend
    yes, no = logit_score_tokens(model.package.path) or (tok.token_to_id("yes"), tok.token_to_id("no"))
    if yes is None or no is None:
        raise EmbeddingError("reranking with a language model reads its 'yes' and 'no' tokens, which this "
                             "tokenizer lacks")
    prefix = tok.encode(QWEN3_RERANK_PREFIX, add_special_tokens=False)
    suffix = tok.encode(QWEN3_RERANK_SUFFIX, add_special_tokens=False)
    ids = []
    for i, doc in enumerate(documents):
        body = tok.encode(f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}", add_special_tokens=False)
        room = network.max_context - len(prefix) - len(suffix)
        ids.append(prefix + body[:max(room, 0)] + suffix)  # as the model card: the body is cut, not the prompt
        _check_ids(ids[-1], network.vocab_size, network.max_context, i)
    with model._lock:
        states = encode_tokens(network, ops, ids, max_batch_tokens=max_batch_tokens)
        last = ops.from_numpy(np.stack([h[-1] for h in states]))
        logits = ops.to_numpy(ops.astype(network.compute_logits(last), "float32"))
    return [float(s) for s in _sigmoid(logits[:, yes] - logits[:, no])], sum(len(t) for t in ids)
