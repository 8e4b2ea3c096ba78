"""lm-evaluation-harness on infer: the model type ``infer``.

Importing this module registers :class:`InferLM` with lm-eval under ``infer``;
``python -m infer.tools.harness`` is lm-eval's own command line with it
registered::

    python -m infer.tools.harness run --model infer \\
        --model_args pretrained=smollm2-135m,backend=numpy --tasks hellaswag

(``lm_eval`` itself finds no third-party model types: it has no plugin entry
point, so ``--model infer`` needs this module imported first.) From Python::

    import lm_eval, infer.tools.harness
    lm_eval.simple_evaluate(model="infer", model_args="pretrained=smollm2-135m", tasks=[...])

The requests are encoded exactly as lm-eval's ``hf`` model encodes them (the
same :class:`lm_eval.api.model.TemplateLM` code: a context's trailing spaces go
to the continuation, an empty context is the end-of-text token) and scored by
:meth:`infer.Model.score`, many per forward; rolling log-likelihoods use
lm-eval's own windows; ``generate_until`` runs each group of requests with the
same generation arguments as one continuous batch (:meth:`infer.Model.generate`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from infer.errors import MissingDependencyError

try:
    # lm-eval registers its own model types only when its registry is empty at the first
    # look-up: register them first, or ours would hide them all.
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as exc:  # pragma: no cover - exercised only without lm-eval
    raise MissingDependencyError(
        "the lm-evaluation-harness adapter needs lm-eval: pip install 'infer-engine[eval]' (or pip install lm-eval)"
    ) from exc

from tqdm.auto import tqdm

import infer

#: Requests scored per call of Model.score (they share forwards of up to its max_batch_tokens).
_SCORE_CHUNK = 64


@register_model("infer")
class InferLM(TemplateLM):
    """An :class:`infer.Model` as an lm-eval model.

    ``--model_args`` (all optional but ``pretrained``): ``pretrained`` (a
    catalog alias, folder, ``.gguf`` file or ``org/name``), ``backend``,
    ``dtype``, ``quantize`` (as for :func:`infer.load`), ``max_length``
    (tokens a request may span; default the model's context), ``add_bos_token``
    (default: True for Gemma models, else False, as lm-eval's ``hf`` model),
    ``max_batch_tokens`` (tokens per scoring forward). lm-eval's ``device``
    picks ``torch:cuda``/``torch:mps`` when no backend is given; ``batch_size``
    is accepted and unused (the batch engine batches by tokens).
    """

    def __init__(
        self, pretrained: str, backend: str | None = None, dtype: str | None = None, quantize: str | None = None,
        max_length: int | None = None, add_bos_token: bool | None = None, max_batch_tokens: int = 512,
        device: str | None = None, batch_size: Any = None, max_batch_size: Any = None, **unused: Any,
    ) -> None:
        super().__init__()
        if backend is None and device:
            kind = str(device).split(":")[0]
            backend = {"cuda": "torch:cuda", "mps": "torch:mps"}.get(kind)
        self.model = infer.load(pretrained, backend=backend, dtype=dtype, quantize=quantize)
        self._name = str(pretrained)
        context = self.model.context_length
        self._max_length = min(int(max_length), context) if max_length else context
        if add_bos_token is None:
            add_bos_token = self.model.model_type.startswith("gemma")
        self.add_bos_token = _flag(add_bos_token)
        self.max_batch_tokens = int(max_batch_tokens)

    # -- what TemplateLM needs -------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        tokenizer = self.model.tokenizer
        if tokenizer.eos_token_id is not None:
            return int(tokenizer.eos_token_id)
        return min(self.model.eos_token_ids)

    @property
    def prefix_token_id(self) -> int:
        bos = self.model.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self._name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.model.tokenizer.encode(string, add_special_tokens=special)

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return self.model.tokenizer.decode(tokens)

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), whether greedy decoding gives the
        continuation)`` per request, from its token ids. A request longer than
        ``max_length + 1`` keeps its last tokens, as lm-eval's ``hf`` model does."""
        out: list[tuple[float, bool]] = []
        keep = min(self.max_length + 1, self.model.context_length)
        with tqdm(total=len(requests), desc="infer loglikelihood", disable=disable_tqdm, file=sys.stderr) as bar:
            for start in range(0, len(requests), _SCORE_CHUNK):
                chunk = requests[start:start + _SCORE_CHUNK]
                ids = [(context + continuation)[-keep:] for _, context, continuation in chunk]
                scores = self.model.score(ids, max_batch_tokens=self.max_batch_tokens)
                for (key, _, continuation), score in zip(chunk, scores):
                    n = len(continuation)
                    result = (float(sum(score.logprobs[-n:])), bool(all(score.greedy[-n:])))
                    out.append(result)
                    self.cache_hook.add_partial("loglikelihood", key, result)
                bar.update(len(chunk))
        return out

    # -- the other two request types ----------------------------------------------------

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood in lm-eval's rolling windows of ``max_length``
        (each after the first conditioned on one token before it)."""
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, pred in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(text, add_special_tokens=False), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(((text, ""), context, pred))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or, with ``do_sample``, sampled) continuations, cut at the
        first ``until`` string; requests with the same arguments run as one batch."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        with tqdm(total=len(requests), desc="infer generate_until", disable=disable_tqdm, file=sys.stderr) as bar:
            for indices in groups.values():
                kwargs = dict(requests[indices[0]].args[1])
                until = kwargs.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                eos = self.tok_decode([self.eot_token_id])
                if eos and eos not in until:
                    until.append(eos)
                max_tokens = int(kwargs.pop("max_gen_toks", 256))
                sample = _flag(kwargs.pop("do_sample", False))
                temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0))
                args = dict(max_tokens=max_tokens, stop=until or None, temperature=temperature if sample else 0.0)
                contexts = [requests[i].args[0] for i in indices]
                texts = self.model.generate([c for c in contexts if self.tok_encode(c)],
                                            add_special_tokens=self.add_bos_token, **args)
                # An empty context is the prefix token alone, as in loglikelihood.
                texts.reverse()
                texts = [texts.pop() if self.tok_encode(c) else self.model.complete([self.prefix_token_id], **args).text
                         for c in contexts]
                for i, text in zip(indices, texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(indices))
        return out

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.model.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)


def _flag(value: Any) -> bool:
    """A boolean from ``--model_args`` (lm-eval passes ``True``/``False`` or strings)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes")
    return bool(value)


def main() -> None:
    """lm-eval's command line, with the ``infer`` model type registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
