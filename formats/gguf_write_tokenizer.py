"""The ``tokenizer.ggml.*`` metadata of a GGUF file, from a ``tokenizer.json``.

The reverse of :mod:`infer.formats.gguf_tokenizer`, and written against its
tables (token types, the pre-tokenizer regexes by llama.cpp name), so that what
is written is what infer, llama.cpp and transformers read back.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import numpy as np

from infer.errors import TokenizerError
from infer.package import ModelPackage

from .gguf_tokenizer import _PRE_TOKENIZERS, BYTE, CONTROL, NORMAL, UNUSED, USER_DEFINED

log = logging.getLogger(__name__)



def _pre_regexes(pre: dict[str, Any] | None) -> tuple[str, ...] | None:
    """The split regexes a byte-level ``tokenizer.json`` pre-tokenizer applies, in order,
    in the spelling of the reader's table; None for a pre-tokenizer it cannot express."""
    from .gguf_tokenizer import _DIGITS, _GPT2

    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    out: list[str] = []
    for step in steps:
        kind = step.get("type")
        if kind == "Split" and isinstance(step.get("pattern"), dict) and "Regex" in step["pattern"]:
            out.append(step["pattern"]["Regex"])
        elif kind == "Digits" and step.get("individual_digits"):
            out.append(_DIGITS)
        elif kind == "ByteLevel":
            if step.get("use_regex", True):
                out.append(_GPT2)
        else:
            return None
    return tuple(out)


#: The names written for each pre-tokenizer: the first of the reader's names for it.
_PRE_NAMES = ("gpt-2", "llama-bpe", "qwen2", "smollm", "deepseek-v3", "tekken", "gpt-4o", "qwen35", "dbrx")


def tokenizer_metadata(package: ModelPackage, vocab_size: int, architecture: str = "") -> dict[str, Any]:
    """``tokenizer.ggml.*`` and ``tokenizer.chat_template*`` for the package's tokenizer.

    Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen2, SmolLM2...) become
    ``gpt2`` with llama.cpp's name for their pre-tokenizer; BPE with byte fallback
    (Llama 2, Gemma...) becomes ``llama`` (see :func:`_sentencepiece`). The
    vocabulary is padded to ``vocab_size`` with ``[PADn]`` tokens as llama.cpp's
    converter does. ``architecture``: the GGUF architecture (Gemma's files spell
    their multi-space tokens with spaces).

    Raises:
        TokenizerError: a tokenizer kind or pre-tokenizer llama.cpp has no name for.
    """
    tok = package.tokenizer
    if tok is None:
        log.warning("%s has no tokenizer: the GGUF file will carry none", package.path)
        return {}
    spec = json.loads(tok.backend.to_str())
    model = spec.get("model", {})
    where = f"{package.path}: tokenizer.json"
    if model.get("type") != "BPE":
        raise TokenizerError(f"{where}: a {model.get('type')} tokenizer cannot be written as GGUF yet; supported: "
                             f"byte-level BPE (gpt2) and SentencePiece-style BPE with byte fallback (llama)")
    sentencepiece = bool(model.get("byte_fallback"))
    if sentencepiece:
        pre = None
    else:
        regexes = _pre_regexes(spec.get("pre_tokenizer"))
        ignore = bool(model.get("ignore_merges"))
        pre = next((n for n in _PRE_NAMES if (_PRE_TOKENIZERS[n].regexes, _PRE_TOKENIZERS[n].ignore_merges)
                    == (regexes, ignore)), None)
        if pre is None:
            raise TokenizerError(f"{where}: its pre-tokenizer ({json.dumps(spec.get('pre_tokenizer'))[:200]}) has "
                                 f"no name llama.cpp knows; known: {', '.join(_PRE_NAMES)}")
    n = max(vocab_size, tok.vocab_size)
    tokens: list[str | None] = [None] * n
    for text, index in model.get("vocab", {}).items():
        tokens[index] = text
    types = np.full(n, NORMAL, np.int32)
    for added in spec.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    for i, text in enumerate(tokens):
        if text is None:
            tokens[i], types[i] = f"[PAD{i}]", UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    md: dict[str, Any]
    if sentencepiece:
        md = _sentencepiece(spec, tokens, types, gemma=architecture.startswith("gemma"))
        md["tokenizer.ggml.merges"] = merges
        if model.get("unk_token") in tokens:
            md["tokenizer.ggml.unknown_token_id"] = tokens.index(model["unk_token"])
    else:
        md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    empty = tok.encode("")
    for key, token_id in (("bos", tok.bos_token_id), ("eos", tok.eos_token_id),
                          ("padding", tok.token_to_id(tok.pad_token) if tok.pad_token else None)):
        if token_id is not None:
            md[f"tokenizer.ggml.{key}_token_id"] = int(token_id)
    ends = [i for i in package.generation.eos_token_ids if i != tok.eos_token_id]
    ends += [i for i in tok.eos_token_ids if i != tok.eos_token_id and i not in ends]
    if ends:  # the first further end token: llama.cpp's end-of-turn
        md["tokenizer.ggml.eot_token_id"] = int(ends[0])
    md["tokenizer.ggml.add_bos_token"] = tok.bos_token_id is not None and empty[:1] == [tok.bos_token_id]
    md["tokenizer.ggml.add_eos_token"] = tok.eos_token_id is not None and empty[-1:] == [tok.eos_token_id]
    for name, template in tok.chat_templates.items():
        md["tokenizer.chat_template" if name == "default" else f"tokenizer.chat_template.{name}"] = template
    return md


def _sentencepiece(spec: dict[str, Any], tokens: list[str], types: np.ndarray, gemma: bool) -> dict[str, Any]:
    """``llama`` (SentencePiece) vocabulary fields: byte tokens typed BYTE, scores as
    llama.cpp's files have them (-1000 for control and user-defined tokens, 0 for bytes,
    minus the id for the rest: a tokenizer.json has no scores, its ids rank the pieces),
    and whether a space is prepended (a ``Prepend("▁")`` normalizer or a Metaspace
    pre-tokenizer that prepends). Gemma's runs of ``▁`` are user-defined tokens
    spelled with spaces in llama.cpp's files (the reader spells them back)."""
    byte = re.compile(r"<0x[0-9A-F]{2}>")
    for i, text in enumerate(tokens):
        if types[i] == NORMAL and byte.fullmatch(text):
            types[i] = BYTE
        elif gemma and len(text) > 1 and text == "▁" * len(text):
            tokens[i], types[i] = " " * len(text), USER_DEFINED
    scores = np.where(types == NORMAL, -np.arange(len(tokens), dtype=np.float32),
                      np.where(types == BYTE, np.float32(0), np.float32(-1000)))

    def steps(part: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
        return [] if not part else part.get(key, []) if part.get("type") == "Sequence" else [part]

    prefix = any(n.get("type") == "Prepend" and n.get("prepend") == "▁"
                 for n in steps(spec.get("normalizer"), "normalizers")) or any(
        p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never"
        and p.get("add_prefix_space", True) for p in steps(spec.get("pre_tokenizer"), "pretokenizers"))
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores.astype(np.float32), "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.add_space_prefix": prefix}
