"""Tiny random embedding and reranking models, for tests/test_embeddings.py.

Not a test file. Each model is a folder sentence-transformers saved (or a bare
transformers model class, or a cross-encoder), built once under
``<cache>/embed-v<VERSION>/<name>`` the way tests/reference.py builds its tiny
decoders (written to a temporary sibling, then renamed into place).

Weights are redrawn as tests/reference.py does and for the same reason (so a
dropped bias or norm weight changes the vectors): matrices N(0, 1/fan_in),
norm weights 1 + N(0, 0.1) (stored minus 1 where the norm scales by 1 + w),
biases N(0, 0.1), embeddings N(0, 1).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from reference import SPECIAL_TOKENS, _TRAINING_TEXT, _build_dir, cache_root, tiny_tokenizer_json

VERSION = "2"
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TEXTS = [
    "The capital of France is Paris.",
    "Once upon a time there was a little model that wanted to learn to speak, and it read every book.",
    "the sun",
    "Hello! How are you today?",
    "Numbers are words too: one, two, three.",
]
_BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=64, type_vocab_size=2)


def bert_vocab() -> list[str]:
    """A WordPiece vocabulary: the specials, the training text's words, letters and ``##`` letters."""
    words = sorted({w.strip(".,:;!?'\"").lower() for w in _TRAINING_TEXT.split()} - {""})
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    punct = list(".,:;!?'\"-()")
    return BERT_SPECIALS + words + letters + ["##" + c for c in letters] + punct


def _bert_tokenizer(out: Path, token_types: bool = True) -> int:
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(bert_vocab())}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                                model_input_names=["input_ids", "token_type_ids", "attention_mask"]
                                                if token_types else ["input_ids", "attention_mask"])
    fast.save_pretrained(out)  # token types as BertTokenizerFast gives them: cross-encoders read them
    return len(vocab)


def _bpe_tokenizer(out: Path, eos_after: bool) -> None:
    """tests/reference.py's byte-level BPE tokenizer; ``eos_after`` appends
    ``<|endoftext|>`` to every text (Qwen3-Embedding's post-processor)."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_str(tiny_tokenizer_json())
    if eos_after:
        tok.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
            special_tokens=[("<|endoftext|>", 0)])
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0], "model_max_length": 256}))


def randomize(model: Any, one_plus_w: bool = False) -> None:
    """Redraw every weight (see the module docstring)."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(("norm.weight", "LayerNorm.weight")):
                p.copy_((0.0 if one_plus_w else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias") or name.endswith("LayerNorm.bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embeddings" in name or name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn_like(p))
            elif p.dim() == 2:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                raise RuntimeError(f"no init rule for {name} {tuple(p.shape)}")


def _st_save(modules: list[Any], out: Path, **options: Any) -> None:
    from sentence_transformers import SentenceTransformer

    SentenceTransformer(modules=modules, device="cpu", **options).save(str(out))


def _transformer_module(folder: Path, max_seq_length: int | None = None) -> Any:
    from sentence_transformers.base.modules.transformer import Transformer

    module = Transformer(str(folder), max_seq_length=max_seq_length)
    return module


def _build_bert(out: Path, classifier: int = 0, kind: str = "Bert") -> None:
    """A BERT (or ``kind`` "Roberta", "XLMRoberta": positions after the padding id 0) folder."""
    import torch
    import transformers

    vocab = _bert_tokenizer(out, token_types=kind == "Bert")  # RoBERTa's tokenizers give no token types
    extra = {} if kind == "Bert" else {"pad_token_id": 0, "max_position_embeddings": 66, "type_vocab_size": 1}
    if kind == "DistilBert":
        config = transformers.DistilBertConfig(vocab_size=vocab, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                               max_position_embeddings=64)
    else:
        config = getattr(transformers, f"{kind}Config")(vocab_size=vocab, **{**_BERT, **extra})
    torch.manual_seed(0)
    if classifier:
        config.num_labels = classifier
        model = getattr(transformers, f"{kind}ForSequenceClassification")(config)
    else:
        model = getattr(transformers, f"{kind}Model")(config, **({} if kind == "DistilBert" else
                                                                 {"add_pooling_layer": False}))
    randomize(model)
    model.save_pretrained(out)


def _dense(n_in: int, n_out: int, activation: Any, bias: bool = True) -> Any:
    import torch
    from sentence_transformers.base.modules.dense import Dense

    torch.manual_seed(1)
    dense = Dense(n_in, n_out, bias=bias, activation_function=activation)
    randomize(dense)
    return dense


def _build(name: str, out: Path) -> None:
    import torch
    import transformers
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    if name == "bert":  # a bare BertModel folder: no sentence-transformers files
        _build_bert(out)
    elif name == "bert_cross":  # a cross-encoder: BertForSequenceClassification with one label
        _build_bert(out, classifier=1)
    elif name == "bert_cross2":  # two labels
        _build_bert(out, classifier=2)
    elif name == "roberta_cross":  # an XLM-RoBERTa cross-encoder (its classification head, no pooler)
        _build_bert(out, classifier=1, kind="XLMRoberta")
    elif name == "st_roberta":  # multilingual-e5-like: RoBERTa, mean pooling, Normalize
        bare = out.parent / f".{out.name}.model"
        bare.mkdir(exist_ok=True)
        _build_bert(bare, kind="Roberta")
        _st_save([_transformer_module(bare), Pooling(64, "mean"), Normalize()], out,
                 prompts={"query": "query: ", "document": "passage: "})
    elif name == "st_distilbert":  # msmarco-distilbert-like: DistilBERT, CLS pooling, Normalize
        bare = out.parent / f".{out.name}.model"
        bare.mkdir(exist_ok=True)
        _build_bert(bare, kind="DistilBert")
        _st_save([_transformer_module(bare), Pooling(64, "cls"), Normalize()], out)
    elif name == "st_bert":  # all-MiniLM-like: mean pooling, then a tanh Dense, then Normalize; prompts
        bare = out.parent / f".{out.name}.model"
        bare.mkdir(exist_ok=True)
        _build_bert(bare)
        _st_save([_transformer_module(bare, max_seq_length=24), Pooling(64, "mean"), _dense(64, 32, torch.nn.Tanh()),
                  Normalize()], out, prompts={"query": "query: ", "document": "passage: "})
    elif name == "st_bert_cls":  # bge-like: CLS pooling, no Dense; the prompt left out of the pooling
        bare = out.parent / f".{out.name}.model"
        bare.mkdir(exist_ok=True)
        _build_bert(bare)
        _st_save([_transformer_module(bare), Pooling(64, "cls", include_prompt=False), Normalize()], out,
                 prompts={"query": "Represent this sentence for searching relevant passages: "},
                 default_prompt_name="query")
    elif name == "st_qwen3":  # Qwen3-Embedding-like: a bare Qwen3Model, last token (EOS appended), Normalize
        bare = out.parent / f".{out.name}.model"
        bare.mkdir(exist_ok=True)
        config = transformers.Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=256, tie_word_embeddings=True)
        model = transformers.Qwen3Model(config)
        randomize(model)
        model.save_pretrained(bare)
        _bpe_tokenizer(bare, eos_after=True)
        _st_save([_transformer_module(bare), Pooling(64, "lasttoken"), Normalize()], out,
                 prompts={"query": "Instruct: find the answer\nQuery:"})
    elif name == "st_gemma3":  # EmbeddingGemma-like: bidirectional Gemma 3, mean pooling, two Dense, Normalize
        bare = out.parent / f".{out.name}.model"
        bare.mkdir(exist_ok=True)
        config = transformers.Gemma3TextConfig(
            vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"], max_position_embeddings=256,
            use_bidirectional_attention=True, hidden_activation="gelu_pytorch_tanh")
        model = transformers.Gemma3TextModel(config)
        randomize(model, one_plus_w=True)
        model.save_pretrained(bare)
        _bpe_tokenizer(bare, eos_after=False)
        _st_save([_transformer_module(bare), Pooling(64, "mean"), _dense(64, 96, torch.nn.Identity(), bias=False),
                  _dense(96, 48, torch.nn.Identity(), bias=False), Normalize()], out,
                 prompts={"query": "task: search result | query: ", "document": "title: none | text: "})
    else:
        raise KeyError(name)
    shutil.rmtree(out.parent / f".{out.name}.model", ignore_errors=True)  # sentence-transformers copied it into out


MODELS = ("bert", "bert_cross", "bert_cross2", "roberta_cross", "st_bert", "st_bert_cls", "st_distilbert",
          "st_roberta", "st_qwen3", "st_gemma3")


def model_dir(name: str) -> Path:
    """The folder of tiny model ``name`` (one of :data:`MODELS`), built on first use."""
    if name not in MODELS:
        raise KeyError(name)
    return _build_dir(cache_root() / f"embed-v{VERSION}" / name, lambda out: _build(name, out))
