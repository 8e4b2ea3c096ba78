"""The public model object: text in, text out.

:class:`Model` joins the three separate things — the network (what to
compute), the :class:`~infer.engine.Engine` (when, with which cache) and the
backend (how) — with the tokenizer and chat template, and turns text into
token ids and back, including stop strings and streaming.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from infer.architecture import CausalLM
from infer.engine import Engine
from infer.engine.batch import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BATCH_TOKENS, BatchEngine, KVLayout, RequestHandle
from infer.engine.generate import Generation, StopConditions, generate
from infer.engine.sampling import SamplingParams
from infer.engine.speculative import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DraftModelSource,
    DraftSource,
    MTPDraft,
    NGramDraft,
    Speculation,
    SpeculativeStats,
)
from infer.errors import CacheFullError, ChatTemplateError, GenerationError, SamplingParameterError, TokenizerError
from infer.ops import Backend
from infer.package import ModelPackage
from infer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 128

Message = dict[str, Any]


class Model:
    """A loaded model. Build it with :func:`infer.load`."""

    def __init__(self, package: ModelPackage, network: CausalLM, backend: Backend) -> None:
        #: The normalized model package (config, tensors, generation defaults).
        self.package = package
        #: The architecture instance holding the weights.
        self.network = network
        #: The compute backend.
        self.backend = backend
        #: The engine that runs the network and owns the KV cache.
        self.engine = Engine(network, backend)
        self._batch_engine: BatchEngine | None = None
        #: Speculative decoding figures of every request this model ran, per
        #: draft source name (cumulative; see :class:`~infer.engine.speculative.SpeculativeStats`).
        self.speculative_stats: dict[str, SpeculativeStats] = {}

    def __repr__(self) -> str:
        where = self.package.path.name if self.package.path else "?"
        return f"<infer.Model {self.package.model_type} {where!r} on {self.backend.name}/{self.backend.device}>"

    # -- properties -------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (raises :class:`TokenizerError` if it has none)."""
        if self.package.tokenizer is None:
            raise TokenizerError(
                f"the model at {self.package.path} has no tokenizer; generate from token ids with "
                "generate_tokens()"
            )
        return self.package.tokenizer

    @property
    def config(self) -> dict[str, Any]:
        """Hyperparameters under their ``config.json`` names."""
        return self.package.config

    @property
    def model_type(self) -> str:
        return self.package.model_type

    @property
    def context_length(self) -> int:
        """Positions the model supports (prompt + generated)."""
        return self.engine.max_context

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end generation: the generation config's, else the tokenizer's."""
        ids = set(self.package.generation.eos_token_ids)
        if not ids and self.package.tokenizer is not None:
            ids.update(self.package.tokenizer.eos_token_ids)
        return frozenset(ids)

    # -- generation ---------------------------------------------------------------

    def sampling_params(
        self,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
    ) -> SamplingParams:
        """Sampling parameters: the ones given, else the model's generation
        defaults, else greedy decoding."""
        values = self.package.generation.sampling_overrides()
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                     repetition_penalty=repetition_penalty)
        values.update({k: v for k, v in given.items() if v is not None})
        return SamplingParams(seed=seed, **values)

    def generate_tokens(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int | None = None,
        ignore_eos: bool = False,
        speculative: str | Model | DraftSource | None = None,
        num_speculative_tokens: int | None = None,
        **sampling: Any,
    ) -> Generation:
        """Generate from token ids; iterate the result for new token ids
        (its ``stats`` holds the speculative decoding figures, if any).

        Keyword arguments are those of :meth:`generate` except ``stop`` and
        ``stream``.
        """
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
            raise GenerationError(f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}")
        params = self.sampling_params(**sampling)
        stop = StopConditions(
            max_tokens=self._max_tokens(max_tokens), eos_token_ids=self.eos_token_ids, ignore_eos=ignore_eos
        )
        spec = self.speculation(speculative, num_speculative_tokens)
        return generate(self.engine, list(prompt_ids), params, stop, spec)

    def speculation(
        self, speculative: str | Model | DraftSource | None, num_speculative_tokens: int | None = None,
    ) -> Speculation | None:
        """The :class:`~infer.engine.speculative.Speculation` of one request, from
        ``generate``'s ``speculative`` and ``num_speculative_tokens``
        arguments; None without speculation. Its figures are also added to
        :attr:`speculative_stats` as the request runs."""
        if speculative is None:
            if num_speculative_tokens is not None:
                raise SamplingParameterError(
                    "num_speculative_tokens needs speculative= ('ngram', 'mtp' or a draft Model)")
            return None
        if isinstance(speculative, str):
            if speculative == "ngram":
                source: DraftSource = NGramDraft()
            elif speculative == "mtp":
                source = MTPDraft(self.engine)
            else:
                raise SamplingParameterError(
                    f"speculative must be 'ngram', 'mtp', a draft infer.Model or a DraftSource, got {speculative!r}")
        elif isinstance(speculative, Model):
            source = DraftModelSource(speculative.engine, self.network.vocab_size)
            _check_same_vocabulary(self, speculative)
        elif isinstance(speculative, DraftSource):
            source = speculative
        else:
            raise SamplingParameterError(
                f"speculative must be 'ngram', 'mtp', a draft infer.Model or a DraftSource, got "
                f"{type(speculative).__name__}")
        k = DEFAULT_NUM_SPECULATIVE_TOKENS if num_speculative_tokens is None else num_speculative_tokens
        totals = self.speculative_stats.setdefault(source.name, SpeculativeStats(source.name))
        return Speculation(source, k, totals=[totals])

    def generate(
        self,
        prompt: str | Sequence[str],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        stream: bool = False,
        add_special_tokens: bool = True,
        speculative: str | Model | DraftSource | None = None,
        num_speculative_tokens: int | None = None,
    ) -> str | Iterator[str] | list[str]:
        """Continue ``prompt`` and return the new text.

        Args:
            prompt: the text to continue, or a list of texts (returns a list).
            max_tokens: most new tokens (default: the model's generation
                config, else 128).
            temperature: 0 is greedy; default the model's generation config,
                else 0.
            top_k, top_p, min_p: filters (0, 1.0, 0.0 are off).
            repetition_penalty: CTRL penalty (1.0 is off).
            seed: makes sampling repeatable.
            stop: text(s) that end generation; not included in the output.
            ignore_eos: keep going past end-of-sequence tokens (benchmarks).
            stream: return an iterator of text chunks instead of a string.
            add_special_tokens: let the tokenizer add BOS etc. to the prompt.
            speculative: speculative decoding with draft tokens from
                ``"ngram"`` (prompt lookup), ``"mtp"`` (the model's
                multi-token-prediction modules), a draft :class:`Model`
                sharing this one's tokenizer, or a
                :class:`~infer.engine.speculative.DraftSource`. Greedy output is
                unchanged; sampled output keeps its distribution. Figures in
                :attr:`speculative_stats`. See docs/speculative.md.
            num_speculative_tokens: draft tokens per forward (default 4).
        """
        kwargs = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                      min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                      ignore_eos=ignore_eos, speculative=speculative,
                      num_speculative_tokens=num_speculative_tokens)
        if not isinstance(prompt, str):
            if not isinstance(prompt, Sequence) or not all(isinstance(p, str) for p in prompt):
                raise GenerationError("prompt must be a string or a list of strings")
            if stream:
                raise GenerationError("stream=True takes one prompt, not a list")
            return self._generate_batch(list(prompt), stop=stop, add_special_tokens=add_special_tokens, **kwargs)
        ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        chunks = self._stream_text(self.generate_tokens(ids, **kwargs), _stop_strings(stop))
        return chunks if stream else "".join(chunks)

    def _generate_batch(
        self, prompts: list[str], *, stop: str | Sequence[str] | None, add_special_tokens: bool,
        max_tokens: int | None, ignore_eos: bool, speculative: str | Model | DraftSource | None,
        num_speculative_tokens: int | None, **sampling: Any,
    ) -> list[str]:
        """Every prompt in one continuous batch; each result equals what
        :meth:`generate` gives for that prompt alone."""
        stops = _stop_strings(stop)
        params = self.sampling_params(**sampling)
        self.speculation(speculative, num_speculative_tokens)  # checks the arguments before anything runs
        conditions = StopConditions(
            max_tokens=self._max_tokens(max_tokens), eos_token_ids=self.eos_token_ids, ignore_eos=ignore_eos
        )
        ids = [self.tokenizer.encode(p, add_special_tokens=add_special_tokens) for p in prompts]
        batch = self.batch_engine
        handles = []
        alone: list[int] = []
        try:
            for i, prompt_ids in enumerate(ids):  # each request gets its own Sampler (and seed) and figures
                spec = self.speculation(speculative, num_speculative_tokens)
                try:
                    handles.append(batch.submit(prompt_ids, params, conditions, speculation=spec))
                except CacheFullError as exc:
                    # More than the batch engine's KV memory holds even alone: generated on
                    # its own afterwards, as generate(prompt) would, so the limits are the same.
                    log.info("prompt %d runs alone after the batch: %s", i, exc)
                    alone.append(i)
            batched = [i for i in range(len(prompts)) if i not in alone]
            streams = [self._stream_text(_as_generation(h), stops) for h in handles]
            texts: list[list[str]] = [[] for _ in batched]
            live = list(range(len(batched)))
            while live:  # round robin, so a stop string ends its request early
                for i in list(live):
                    chunk = next(streams[i], None)
                    if chunk is None:
                        live.remove(i)
                    else:
                        texts[i].append(chunk)
            results = dict(zip(batched, ("".join(t) for t in texts)))
            for i in alone:
                generation = self.generate_tokens(ids[i], max_tokens=conditions.max_tokens, ignore_eos=ignore_eos,
                                                  speculative=speculative,
                                                  num_speculative_tokens=num_speculative_tokens, **sampling)
                results[i] = "".join(self._stream_text(generation, stops))
            return [results[i] for i in range(len(prompts))]
        finally:
            for h in handles:
                batch.cancel(h)

    @property
    def batch_engine(self) -> BatchEngine:
        """The continuous-batching engine behind ``generate([...])``: made on
        first use with default settings (or by :meth:`configure_batching`);
        its KV memory and prefix cache persist across calls. Submit requests
        to it directly to serve them as they arrive."""
        if self._batch_engine is None:
            self._batch_engine = BatchEngine(self.engine)
        return self._batch_engine

    def configure_batching(
        self,
        *,
        kv_memory: int | None = None,
        kv_layout: KVLayout = "auto",
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    ) -> BatchEngine:
        """Replace :attr:`batch_engine` with one of these settings and return it.

        Args:
            kv_memory: bytes of keys and values all running requests together
                may hold (default 256 MiB); reserved at once in the paged layout.
            kv_layout: ``"paged"``, ``"contiguous"`` or ``"auto"`` (paged where
                the backend has native paged attention).
            block_size: positions per page (paged layout).
            max_batch_tokens: most tokens one forward processes.

        Raises :class:`~infer.errors.GenerationError` while the current batch
        engine still has requests.
        """
        if self._batch_engine is not None and self._batch_engine.has_work():
            raise GenerationError("the batch engine still has requests; finish or cancel them first")
        self._batch_engine = BatchEngine(self.engine, kv_layout=kv_layout, kv_memory=kv_memory,
                                         block_size=block_size, max_batch_tokens=max_batch_tokens)
        return self._batch_engine

    def chat(
        self,
        messages: Sequence[Message],
        *,
        template: str | None = None,
        stream: bool = False,
        stop: str | Sequence[str] | None = None,
        **kwargs: Any,
    ) -> str | Iterator[str]:
        """Reply to a conversation, rendered with the model's chat template
        (or ``template``). ``messages`` are ``{"role", "content"}`` dicts; the
        other arguments are those of :meth:`generate` except ``prompt`` and
        ``add_special_tokens`` (the template already places every special
        token)."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ChatTemplateError(f"messages must be a list of dicts with a 'role', got {type(messages).__name__}")
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, template=template)
        # The template already holds every special token the model expects.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        chunks = self._stream_text(self.generate_tokens(ids, **kwargs), _stop_strings(stop))
        return chunks if stream else "".join(chunks)

    # -- helpers ---------------------------------------------------------------------

    def _max_tokens(self, max_tokens: int | None) -> int:
        if max_tokens is None:
            return self.package.generation.max_new_tokens or DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise SamplingParameterError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
        return max_tokens

    def _stream_text(self, generation: Generation, stops: tuple[str, ...]) -> Iterator[str]:
        """Detokenize incrementally, cutting at the first stop string.

        Text that might be the start of a stop string is held back until it
        is known not to be one, so a stop string is never partly emitted.
        """
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        pending = ""
        for token in generation:
            pending += decoder.push(token)
            if not pending:
                continue
            if stops:
                cut = _first_stop(pending, stops)
                if cut is not None:
                    if cut:
                        yield pending[:cut]
                    generation.finish_reason = "stop_string"
                    generation.tokens_iter.close()  # type: ignore[attr-defined]
                    return
                keep = _held_back(pending, stops)
                emit, pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
            else:
                emit, pending = pending, ""
            if emit:
                yield emit
        pending += decoder.flush()
        if stops:
            cut = _first_stop(pending, stops)
            if cut is not None:
                pending = pending[:cut]
                generation.finish_reason = "stop_string"
        if pending:
            yield pending


def _check_same_vocabulary(target: Model, draft: Model) -> None:
    """A draft model must speak the target's token ids: same tokenizer vocabulary."""
    if draft is target:
        return
    if target.package.tokenizer is None or draft.package.tokenizer is None:
        if target.network.vocab_size != draft.network.vocab_size:
            raise GenerationError(
                f"the draft model's vocabulary ({draft.network.vocab_size} ids) differs from the target's "
                f"({target.network.vocab_size}), and without tokenizers their ids cannot be matched")
        return
    mine = target.tokenizer.backend.get_vocab(with_added_tokens=True)
    theirs = draft.tokenizer.backend.get_vocab(with_added_tokens=True)
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
        raise GenerationError(
            f"the draft model {draft!r} does not share the target's tokenizer: vocabularies of {len(theirs)} "
            f"and {len(mine)} tokens, differing e.g. at {differ}; a draft model must use the same token ids"
        )


def _as_generation(handle: RequestHandle) -> Generation:
    """A batched request seen as a :class:`Generation` (closing its token
    iterator, as a stop string does, cancels the request)."""
    gen = Generation(tokens_iter=iter(()), prompt_tokens=handle.prompt_tokens)

    def tokens() -> Iterator[int]:
        try:
            yield from handle
        finally:
            handle.cancel()
            if gen.finish_reason is None:
                gen.finish_reason = handle.finish_reason

    gen.tokens_iter = tokens()
    return gen


def _stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise SamplingParameterError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(stop)


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that begins some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best
