"""Token log-probabilities in OpenAI's two shapes, and the prompt's (``echo``).

Generated tokens get theirs from the batch engine, from the same row of
logits their token was sampled from (:class:`~infer.engine.sampling.TokenLogprob`:
the log-softmax of the raw logits, before temperature and filters, as
OpenAI and vLLM report them). A prompt's come from one teacher-forced pass
over it (:func:`prompt_logprobs`), run on the engine thread between steps.
"""

from __future__ import annotations

from typing import Any

from infer.engine.runner import Engine
from infer.engine.sampling import TokenLogprob, token_logprob
from infer.tokenizer import Tokenizer

#: Prompt positions per forward of :func:`prompt_logprobs`: bounds the logits
#: copied to the host at once (rows x vocab x 4 bytes; 32 MiB for a 32k vocabulary).
PROMPT_CHUNK = 256


def prompt_logprobs(engine: Engine, prompt: list[int], k: int) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it, with
    ``k`` alternatives (None for the first token, which nothing predicts):
    the prompt fed in chunks through a cache of its own, every row's logits kept."""
    seq = engine.new_sequence(len(prompt))
    out: list[TokenLogprob | None] = [None]
    try:
        for start in range(0, len(prompt) - 1, PROMPT_CHUNK):
            chunk = prompt[start:start + PROMPT_CHUNK]
            logits = engine.run(engine.prepare([seq], [chunk], all_logits=True)).host_logits()
            for row, target in enumerate(prompt[start + 1:start + 1 + len(chunk)]):
                out.append(token_logprob(logits[row], target, k))
    finally:
        engine.release(seq)
    return out


def token_text(tokenizer: Tokenizer, token: int) -> str:
    """One token's text as OpenAI's logprobs show it (special tokens included)."""
    return tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, entries: list[tuple[int, TokenLogprob | None]],
                        offset: int) -> dict[str, Any]:
    """The completions API's ``logprobs`` object for ``(token, logprob)``
    pairs, their text offsets counted from ``offset``."""
    tokens, values, tops, offsets = [], [], [], []
    for token, entry in entries:
        text = token_text(tokenizer, token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        values.append(None if entry is None else entry.logprob)
        tops.append(None if entry is None else _by_text(tokenizer, entry.top))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _by_text(tokenizer: Tokenizer, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
    """OpenAI's ``{token text: logprob}``; where two ids read the same (byte
    tokens of half a character), the more likely one's stays."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(token_text(tokenizer, token), logprob)
    return out


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """The chat API's ``logprobs.content`` list."""
    def item(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
