"""Token log-probabilities in OpenAI's two shapes, and the prompt's (``echo``).

Generated tokens get theirs from the batch engine, from the same row of
logits their token was sampled from (:class:`~infer.engine.sampling.TokenLogprob`:
the log-softmax of the raw logits, before temperature and filters, as
OpenAI and vLLM report them). A prompt's come from one teacher-forced pass
over it (:func:`prompt_logprobs`, by infer's scorer), run on the engine
thread between steps.
"""

from __future__ import annotations

from typing import Any

from infer.engine.runner import Engine
from infer.engine.sampling import TokenLogprob
from infer.engine.scoring import score_sequences
from infer.tokenizer import Tokenizer


def prompt_logprobs(engine: Engine, prompt: list[int], k: int) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it, with
    ``k`` alternatives (None for the first token, which nothing predicts),
    by :func:`~infer.engine.scoring.score_sequences`."""
    score = score_sequences(engine, [prompt], top_logprobs=k)[0]
    tops = score.top or [()] * len(score.logprobs)
    return [None, *(TokenLogprob(t, lp, top) for t, lp, top in zip(prompt[1:], score.logprobs, tops))]


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
