"""The public model object: text in, text out.

:class:`Model` joins the three separate things — the network (what to
compute), the :class:`~infer.engine.Engine` (when, with which cache) and the
backend (how) — with the tokenizer and chat template, and turns text into
token ids and back, including stop strings and streaming.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # typing has Unpack from 3.11 on
    from typing_extensions import Unpack

import numpy as np

from infer import multimodal
from infer.architecture import CausalLM
from infer.multimodal import ImagePrompts, PromptMedia
from infer.chat import ChatPlan, ChatReply, plan_chat
from infer.completion import Completion, CompletionChunk, Stream, collect, incomplete, stream_chunks, texts
from infer.adapters.slots import MAX_CPU_LORAS, MAX_LORA_RANK, MAX_LORAS, Adapters
from infer.engine import Engine
from infer.engine.batch import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BATCH_TOKENS, BatchEngine, KVLayout, RequestHandle
from infer.engine.generate import Generation, generate, owner
from infer.engine.samplers import Breakers, dry_breakers
from infer.engine.sampling import SamplingParams, TokenLogprob
from infer.embedding import (
    DEFAULT_EMBED_BATCH_TOKENS,
    EmbeddingConfig,
    default_pooling,
    embed,
    read_embedding_config,
    rerank,
)
from infer.engine.scoring import DEFAULT_SCORE_BATCH_TOKENS, Score, score_sequences
from infer.engine.speculative import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DraftModelSource,
    DraftSource,
    MTPDraft,
    NGramDraft,
    Speculation,
    SpeculativeStats,
)
from infer.engine.structured import Grammar, GrammarTokenizer
from infer.errors import (
    AdapterError,
    CacheFullError,
    GenerationError,
    ImageError,
    IncompleteOutputError,
    SamplingParameterError,
    StructuredOutputError,
    TokenizerError,
    UnsupportedAdapterError,
)
from infer.ops import Backend
from infer.kv.snapshot import RestoredState
from infer.package import ModelPackage
from infer.request import (
    GenerateOptions,
    GenerationOptions,
    GenerationRequest,
    PreparedRequest,
    SamplingOptions,
    sampling_params,
)
from infer.saved_state import (
    DEFAULT_PROMPT_CACHE_BYTES,
    SavedState,
    StateSource,
    attach_prompt_cache,
    load_state,
    save_state,
)
from infer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 128

#: Why a tensor-parallel model takes no LoRA adapters: each rank holds a share
#: of every weight in a process of its own, and the adapters' factors and each
#: step's rows would have to be split and sent the same way.
TENSOR_PARALLEL_ADAPTERS = ("LoRA adapters are not supported under tensor parallelism (this model runs over "
                            "{ranks} ranks, each holding a share of the weights the adapters attach to): load "
                            "it without tensor_parallel to use adapters, or merge the adapter into the weights "
                            "first (PEFT's merge_and_unload) and load the merged model")

Message = dict[str, Any]


class Model:
    """A loaded model. Build it with :func:`infer.load`."""

    def __init__(self, package: ModelPackage, network: CausalLM, backend: Backend, *,
                 kv_dtype: str | None = None) -> None:
        #: The normalized model package (config, tensors, generation defaults).
        self.package = package
        #: The architecture instance holding the weights.
        self.network = network
        #: The compute backend.
        self.backend = backend
        #: The engine that runs the network and owns the KV cache.
        self.engine = Engine(network, backend, kv_dtype=kv_dtype)
        self._batch_engine: BatchEngine | None = None
        self._grammar_tokenizer: GrammarTokenizer | None = None
        #: DRY's breakers resolved against the vocabulary, per breaker list (a pass over every token).
        self._breakers: dict[tuple[str, ...], Breakers] = {}
        # Held by each step of a Stream and by the async methods, so those never run two forwards at once.
        self._lock = threading.RLock()
        #: Speculative decoding figures of every request this model ran, per
        #: draft source name (cumulative; see :class:`~infer.engine.speculative.SpeculativeStats`).
        self.speculative_stats: dict[str, SpeculativeStats] = {}
        self._embedding_config: EmbeddingConfig | None = None
        # Set by load_state: single requests then run in the batch engine's pool and reuse its prefixes.
        self._reuse_prefixes = False
        self._image_prompts: ImagePrompts | None = None
        #: Where each tensor of the package went (the loader's record,
        #: :attr:`~infer.architecture.WeightLoader.sources`): what adapters attach by.
        self.weight_sources: dict[str, tuple[Any, int]] = {}

    def close(self) -> None:
        """Release what the model holds beyond memory: a tensor-parallel
        model's worker processes exit and its process group is left
        (:mod:`infer.distributed`). The model cannot run afterwards. Calling
        it again does nothing; ``with infer.load(...) as model:`` calls it
        at the end of the block."""
        self.network.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.package.path.name if self.package.path else "?"
        return f"<infer.Model {self.package.model_type} {where!r} on {self.backend.name}/{self.backend.device}>"

    # -- properties -------------------------------------------------------------

    @property
    def reads_images(self) -> bool:
        """True when the model takes images (a vision-language family; docs/vision.md)."""
        return self.network.vision is not None

    @property
    def image_prompts(self) -> ImagePrompts:
        """The model's image side (:class:`infer.multimodal.ImagePrompts`):
        its processor, and the rules that turn text and images into a prompt.

        Raises:
            ImageError: the model reads text only.
        """
        if self._image_prompts is None:
            prompts = multimodal.for_model(self.package, self.network, self.backend, self.tokenizer)
            if prompts is None:
                raise ImageError(f"{self.model_type} reads text only: it takes no images (docs/vision.md lists the "
                                 "families that do)")
            self._image_prompts = prompts
        return self._image_prompts

    def image_prompt(self, text: str, images: Sequence[Any], *, add_special_tokens: bool = True,
                     names: Sequence[str] | None = None) -> tuple[list[int], PromptMedia]:
        """``text`` with ``images`` as token ids and their
        :class:`~infer.multimodal.PromptMedia` (what :meth:`generate` runs
        with ``images=``): each placeholder expanded to the image's tokens,
        the vision tower run once per image. Raises
        :class:`~infer.errors.ImageError` or
        :class:`~infer.errors.ContextLengthError`."""
        return self.image_prompts.build(text, images, add_special_tokens=add_special_tokens, names=names,
                                        context=self.context_length)

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

    def sampling_params(self, **options: Unpack[SamplingOptions]) -> SamplingParams:
        """Sampling parameters: the ones given (the sampling arguments of
        :meth:`generate`: ``temperature``, ``top_k``, ``top_p``, ``min_p``,
        ``repetition_penalty``, ``seed``, ``presence_penalty``,
        ``frequency_penalty``, ``logit_bias`` and llama.cpp's samplers), else the model's generation
        defaults, else greedy decoding. A ``logit_bias`` id past the
        vocabulary is a :class:`~infer.errors.SamplingParameterError`."""
        _check_keywords("sampling_params", options, SamplingOptions)
        params = sampling_params(options, self.package.generation.sampling_overrides())
        vocab = self.network.vocab_size
        beyond = [t for t, _ in params.logit_bias if t >= vocab]  # type: ignore[misc]
        if beyond:
            raise SamplingParameterError(
                f"logit_bias names token id {beyond[0]}, but the vocabulary has {vocab} ids (0..{vocab - 1})")
        return params

    def generate_tokens(
        self,
        prompt_ids: Sequence[int],
        *,
        request: GenerationRequest | None = None,
        **options: Unpack[GenerationOptions],
    ) -> Generation:
        """Generate from token ids; iterate the result for new token ids
        (its ``stats`` holds the speculative decoding figures, if any).

        Keyword arguments are those of :meth:`generate` except ``stop`` and
        ``stream`` (or one ``request``).
        """
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
            raise GenerationError(f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}")
        prepared = self.prepare(_request_of(request, options))
        if prepared.request.stop:
            raise GenerationError("generate_tokens gives token ids, which stop strings cannot cut; use generate() "
                                  "or complete() for stop=")
        spec = self.speculation(prepared.request.speculative, prepared.request.num_speculative_tokens)
        pool = self.batch_engine.pool if self._reuse_prefixes else None
        return generate(self.engine, list(prompt_ids), prepared.sampler(), prepared.stop_conditions(), spec,
                        kv_pool=pool, adapter=self._adapter_of(prepared.request)[0],
                        adapter_scale=prepared.request.adapter_scale)

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """``request`` with this model's defaults filled in (sampling rules and
        ``max_tokens`` from its generation config) and its constraint compiled
        for its tokenizer: what makes each choice's sampler and stop rules.
        What every entry point (``generate``, ``chat``, the server's endpoints)
        runs a request through. Raises the typed errors of
        :meth:`sampling_params`, :meth:`grammar` and :meth:`speculation`."""
        r = request
        params = self.sampling_params(**r.sampling_options())
        compiled = self.grammar(json_schema=r.json_schema, regex=r.regex, grammar=r.grammar,
                                speculative=r.speculative, ignore_eos=r.ignore_eos)
        self.speculation(r.speculative, r.num_speculative_tokens)  # checks the arguments before anything runs
        return PreparedRequest(r, params, self._max_tokens(r.max_tokens), self.eos_token_ids, self.context_length,
                               compiled, breakers=self.dry_breakers(params.dry_sequence_breakers) if params.dry_on
                               else None)

    def dry_breakers(self, strings: Sequence[str]) -> Breakers:
        """DRY's sequence breakers ``strings`` as this vocabulary's token ids
        (:func:`~infer.engine.samplers.dry_breakers`), computed once per list;
        none without a tokenizer."""
        key = tuple(strings)
        if key not in self._breakers:
            tokenizer = self.package.tokenizer
            if tokenizer is None:
                return {}
            ids = [[i] for i in range(tokenizer.vocab_size)]
            texts = tokenizer.backend.decode_batch(ids, skip_special_tokens=False)
            self._breakers[key] = dry_breakers(
                key, texts, lambda text: tokenizer.encode(text, add_special_tokens=False))
        return self._breakers[key]

    @property
    def default_max_tokens(self) -> int:
        """``max_tokens`` of a request that gives none: the generation
        config's ``max_new_tokens``, else :data:`DEFAULT_MAX_TOKENS`."""
        return self.package.generation.max_new_tokens or DEFAULT_MAX_TOKENS

    def grammar(
        self, *, json_schema: dict[str, Any] | str | None = None, regex: str | None = None, grammar: str | None = None,
        speculative: object = None, ignore_eos: bool = False,
    ) -> Grammar | None:
        """The constraint of ``generate``'s ``json_schema``, ``regex`` or
        ``grammar`` argument, compiled for this model's tokenizer and checked
        (None when none is given). Raises
        :class:`~infer.errors.StructuredOutputError` for an invalid one, or
        one combined with speculative decoding or ``ignore_eos``."""
        if json_schema is None and regex is None and grammar is None:
            return None
        if speculative is not None:
            raise StructuredOutputError(
                "constrained decoding (json_schema=, regex=, grammar=) does not combine with speculative decoding: "
                "draft tokens are not checked against the constraint; drop speculative=")
        if ignore_eos:
            raise StructuredOutputError(
                "constrained decoding ends at an end-of-sequence token once the output is complete; "
                "ignore_eos=True would generate past it")
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.network.vocab_size, self.eos_token_ids)
        return Grammar(self._grammar_tokenizer, json_schema=json_schema, regex=regex, grammar=grammar)

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
        self, prompt: str | Sequence[str], *, stream: bool = False, add_special_tokens: bool = True,
        images: Sequence[Any] | None = None, request: GenerationRequest | None = None,
        **options: Unpack[GenerateOptions],
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
            presence_penalty, frequency_penalty: OpenAI's penalties in
                [-2, 2] (0 is off): a token generated ``c`` times so far loses
                ``c * frequency_penalty + presence_penalty`` from its logit.
            logit_bias: token id -> number in [-100, 100] added to its logit
                (OpenAI's ``logit_bias``; -100 bans a token).
            penalty_last_n, dry_multiplier, dry_base, dry_allowed_length,
                dry_penalty_last_n, dry_sequence_breakers, xtc_probability,
                xtc_threshold, top_n_sigma, typical_p, mirostat, mirostat_tau,
                mirostat_eta, samplers: llama.cpp's samplers and their order,
                each off by default (docs/sampling.md).
            seed: makes sampling repeatable.
            stop: text(s) that end generation; not included in the output.
            ignore_eos: keep going past end-of-sequence tokens (benchmarks).
            stream: return an iterator of text chunks instead of a string.
            add_special_tokens: let the tokenizer add BOS etc. to the prompt.
            images: pictures the prompt shows (a path, bytes, a PIL image or
                a ``data:`` URL each), for a model that reads images: each
                of the family's placeholders in the prompt (``<image>``,
                ``<start_of_image>``) takes the next image; a prompt without
                one gets them in front (docs/vision.md).
            speculative: speculative decoding with draft tokens from
                ``"ngram"`` (prompt lookup), ``"mtp"`` (the model's
                multi-token-prediction modules), a draft :class:`Model`
                sharing this one's tokenizer, or a
                :class:`~infer.engine.speculative.DraftSource`. Greedy output is
                unchanged; sampled output keeps its distribution. Figures in
                :attr:`speculative_stats`. See docs/speculative.md.
            num_speculative_tokens: draft tokens per forward (default 4).
            json_schema, regex, grammar: constrained decoding (one of them):
                only output that matches a JSON schema (a dict), a regular
                expression, or a Lark or GBNF grammar; see docs/structured.md.
                Raises :class:`~infer.errors.IncompleteOutputError` when
                generation ends before the output matches in full.
            adapter: a loaded LoRA adapter's name (:meth:`load_adapter`) to
                generate with; for a list of prompts, also a list with one name
                (or None: the base model) per prompt, run in one batch
                (docs/adapters.md). Default None: the base model.
            adapter_scale: multiplies the adapter's term (1.0: as trained).
            request: all of the above as one
                :class:`~infer.request.GenerationRequest` (then give none of
                them as keywords).

        The keyword options are typed as :class:`~infer.request.GenerateOptions`.
        :meth:`complete` takes the same arguments and returns the tokens,
        their log-probabilities and why generation ended as well.
        """
        _check_keywords("generate", options, GenerateOptions)
        prepared = self.prepare(_request_of(request, options))
        if not isinstance(prompt, str):
            if not isinstance(prompt, Sequence) or not all(isinstance(p, str) for p in prompt):
                raise GenerationError("prompt must be a string or a list of strings")
            if images:
                raise GenerationError("images= goes with one prompt, not a list")
            if stream:
                raise GenerationError("stream=True takes one prompt, not a list")
            completions = self._complete_batch(list(prompt), prepared, add_special_tokens=add_special_tokens)
            for i, c in enumerate(completions):
                if c.valid is False:
                    raise IncompleteOutputError(incomplete(c.finish_reason, f"prompt {i}'s output"), c.text)
            return [c.text for c in completions]
        if images:
            ids, media = self.image_prompt(prompt, images, add_special_tokens=add_special_tokens)
        else:
            ids, media = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens), None
        pieces = texts(self._chunks(ids, prepared, media=media))
        return Stream(pieces, self._lock) if stream else "".join(pieces)

    async def agenerate(self, prompt: str | Sequence[str], **kwargs: Any) -> str | list[str] | Stream[str]:
        """:meth:`generate` for ``asyncio``: the same arguments and result,
        computed in a worker thread so the event loop keeps running (with
        ``stream=True`` the :class:`~infer.completion.Stream`, to ``async for``).
        Calls on one model run one at a time."""
        if kwargs.get("stream"):
            return self.generate(prompt, **kwargs)  # type: ignore[return-value]
        import asyncio  # here: its import is a noticeable share of a small model's load

        return await asyncio.to_thread(self._locked, self.generate, prompt, **kwargs)  # type: ignore[arg-type]

    async def acomplete(
        self, prompt: str | Sequence[int] | Sequence[str], **kwargs: Any,
    ) -> Completion | list[Completion] | Stream[CompletionChunk]:
        """:meth:`complete` for ``asyncio``, as :meth:`agenerate` is :meth:`generate`'s."""
        if kwargs.get("stream"):
            return self.complete(prompt, **kwargs)  # type: ignore[return-value]
        import asyncio

        return await asyncio.to_thread(self._locked, self.complete, prompt, **kwargs)  # type: ignore[arg-type]

    def _locked(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(*args, **kwargs)

    def complete(
        self,
        prompt: str | Sequence[int] | Sequence[str],
        *,
        echo: bool = False,
        stream: bool = False,
        add_special_tokens: bool = True,
        images: Sequence[Any] | None = None,
        request: GenerationRequest | None = None,
        **options: Unpack[GenerationOptions],
    ) -> Completion | Stream[CompletionChunk] | list[Completion]:
        """Continue ``prompt`` like :meth:`generate`, with the details: a
        :class:`~infer.completion.Completion` with the text, the new token ids,
        ``finish_reason`` (``"eos"``, ``"stop"`` for a stop string,
        ``"length"``) and the token usage.

        Args:
            prompt: a text, token ids (used as they are), or a list of texts
                (returns a list, run as one continuous batch).
            logprobs: give every new token's log-probability under the model
                (before temperature and filters) with its ``logprobs`` most
                likely alternatives (0: none); None gives no log-probabilities.
            echo: also score the prompt (``prompt_logprobs``, with as many
                alternatives as ``logprobs``); not with ``stream`` (score the
                prompt with :meth:`score` then).
            stream: return an :class:`~infer.completion.Stream` of
                :class:`~infer.completion.CompletionChunk` objects as the text
                comes; the last one has ``finish_reason`` and ``usage``.
            images: pictures for a text prompt, as :meth:`generate` takes
                them (the usage's prompt tokens count the image tokens).
            options: every other argument of :meth:`generate`
                (:class:`~infer.request.GenerationOptions`).

        With ``json_schema``, ``regex`` or ``grammar``, the completion's
        ``valid`` says whether its text matches in full (False when generation
        ended first; :meth:`generate` raises instead).
        """
        if stream and echo:
            raise GenerationError("echo=True takes stream=False; with a stream, score the prompt with Model.score")
        if request is not None and options.get("logprobs") is not None:
            request = request.replace(logprobs=options.pop("logprobs"))
        prepared = self.prepare(_request_of(request, options))
        k = prepared.request.logprobs
        if isinstance(prompt, Sequence) and not isinstance(prompt, str) and prompt and all(
                isinstance(p, str) for p in prompt):
            if stream:
                raise GenerationError("stream=True takes one prompt, not a list")
            return self._complete_batch(list(prompt), prepared, add_special_tokens=add_special_tokens,  # type: ignore[arg-type]
                                        echo=echo)
        media = None
        if images:
            if not isinstance(prompt, str) or echo:
                raise GenerationError("images= goes with one text prompt, without echo")
            ids, media = self.image_prompt(prompt, images, add_special_tokens=add_special_tokens)
        else:
            ids = self._prompt_ids(prompt, add_special_tokens)
        chunks = self._chunks(ids, prepared, media=media)
        if stream:
            return Stream(chunks, self._lock)
        return collect(chunks, ids, logprobs=k is not None,
                       prompt_logprobs=self._prompt_logprobs(ids, k) if echo else None)

    def _prompt_ids(self, prompt: str | Sequence[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not isinstance(prompt, Sequence) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            raise GenerationError("prompt must be a string, a list of token ids or a list of strings")
        return [int(t) for t in prompt]

    def _prompt_logprobs(self, ids: list[int], logprobs: int | None) -> list[TokenLogprob | None]:
        """What ``echo=True`` gives: each prompt token's log-probability after the ones before it."""
        score = score_sequences(self.engine, [ids], top_logprobs=logprobs or 0)[0]
        tops = score.top or [()] * len(score.logprobs)
        return [None, *(TokenLogprob(t, lp, top) for t, lp, top in zip(ids[1:], score.logprobs, tops))]

    def _chunks(self, ids: list[int], prepared: PreparedRequest,
                skip_special_tokens: bool = True, media: PromptMedia | None = None) -> Iterator[CompletionChunk]:
        """One request, streamed as chunks (the engine of :meth:`generate`,
        :meth:`complete` and :meth:`chat`)."""
        request = prepared.request
        spec = self.speculation(request.speculative, request.num_speculative_tokens)
        pool = self.batch_engine.pool if self._reuse_prefixes else None
        generation = generate(self.engine, ids, prepared.sampler(), prepared.stop_conditions(), spec, kv_pool=pool,
                              media=media, adapter=self._adapter_of(request)[0],
                              adapter_scale=request.adapter_scale)
        return stream_chunks(self.tokenizer, generation, request.stop, logprobs=request.logprobs is not None,
                             skip_special_tokens=skip_special_tokens, eos_token_ids=self.eos_token_ids)

    def _complete_batch(self, prompts: list[str], prepared: PreparedRequest, *, add_special_tokens: bool = True,
                        echo: bool = False) -> list[Completion]:
        """Every prompt in one continuous batch; each result equals what
        :meth:`complete` gives for that prompt alone (each request has its
        own matcher of the constraint)."""
        request = prepared.request
        logprobs = request.logprobs
        ids = [self.tokenizer.encode(p, add_special_tokens=add_special_tokens) for p in prompts]
        adapters = self._adapter_of(request, len(prompts))
        batch = self.batch_engine
        handles = []
        alone: list[int] = []
        try:
            for i, prompt_ids in enumerate(ids):  # each request gets its own Sampler (and seed) and figures
                spec = self.speculation(request.speculative, request.num_speculative_tokens)
                try:
                    handles.append(batch.submit(prompt_ids, prepared.sampler(), prepared.stop_conditions(),
                                                speculation=spec, adapter=adapters[i],
                                                adapter_scale=request.adapter_scale))
                except CacheFullError as exc:
                    # More than the batch engine's KV memory holds even alone: generated on
                    # its own afterwards, as complete(prompt) would, so the limits are the same.
                    log.info("prompt %d runs alone after the batch: %s", i, exc)
                    alone.append(i)
            batched = [i for i in range(len(prompts)) if i not in alone]
            streams = [stream_chunks(self.tokenizer, _as_generation(h), request.stop, logprobs=logprobs is not None)
                       for h in handles]
            chunks: dict[int, list[CompletionChunk]] = {i: [] for i in batched}
            live = list(range(len(batched)))
            while live:  # round robin, so a stop string ends its request early
                for j in list(live):
                    chunk = next(streams[j], None)
                    if chunk is None:
                        live.remove(j)
                    else:
                        chunks[batched[j]].append(chunk)
            for i in alone:
                alone_request = dataclasses.replace(prepared, request=request.replace(adapter=adapters[i]))
                chunks[i] = list(self._chunks(ids[i], alone_request))
        finally:
            for h in handles:
                batch.cancel(h)
        return [collect(chunks[i], p, logprobs=logprobs is not None,
                        prompt_logprobs=self._prompt_logprobs(p, logprobs) if echo else None)
                for i, p in enumerate(ids)]

    def score(
        self,
        text: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        *,
        add_special_tokens: bool = True,
        context: int | None = None,
        stride: int | None = None,
        top_logprobs: int = 0,
        max_batch_tokens: int = DEFAULT_SCORE_BATCH_TOKENS,
        progress: bool = False,
    ) -> Score | list[Score]:
        """How likely the model finds ``text``: a :class:`~infer.engine.scoring.Score`
        with the scored ``token_ids``, one ``logprobs`` value per token after
        the first (natural log of p(token | the tokens before it)) and the
        ``perplexity``.

        Args:
            text: a text or token ids, or a list of either (returns a list;
                scored together, many per forward).
            add_special_tokens: let the tokenizer add BOS etc. to a text.
            context: the window in tokens (default: the model's context); a
                longer text is scored in sliding windows.
            stride: how far consecutive windows start apart (default half a
                window); each token is scored once, in the first window that
                reaches it (see :mod:`infer.engine.scoring`).
            top_logprobs: also keep this many most likely tokens per position.
            max_batch_tokens: most tokens one forward feeds.
            progress: a progress bar of the tokens scored.
        """
        many = not isinstance(text, str) and isinstance(text, Sequence) and bool(text) and all(
            isinstance(t, (str, Sequence)) and not isinstance(t, (bytes, bytearray)) for t in text)
        items = list(text) if many else [text]  # type: ignore[list-item]
        ids = [self._prompt_ids(t, add_special_tokens) for t in items]  # type: ignore[arg-type]
        scores = score_sequences(self.engine, ids, context=context, stride=stride, max_batch_tokens=max_batch_tokens,
                                 top_logprobs=top_logprobs, progress=progress)
        return scores if many else scores[0]

    # -- embeddings and reranking ------------------------------------------------

    @property
    def embedding_config(self) -> EmbeddingConfig:
        """How :meth:`embed` pools: the folder's sentence-transformers modules
        (``modules.json``: pooling, dense layers, normalize, prompts), else the
        family's default (mean for an encoder, the last token for a decoder)."""
        if self._embedding_config is None:
            self._embedding_config = read_embedding_config(self.package.path, default_pooling(self.network),
                                                           self.package.config, self.package.module_tensors)
        return self._embedding_config

    def embed(
        self,
        texts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        *,
        normalize: bool = True,
        dimensions: int | None = None,
        pooling: str | Sequence[str] | None = None,
        prompt: str | None = None,
        prompt_name: str | None = None,
        max_batch_tokens: int = DEFAULT_EMBED_BATCH_TOKENS,
    ) -> np.ndarray:
        """One float32 embedding row per text: ``[n, dim]`` (``[1, dim]`` for one text).

        The texts run through the network whole, many per forward with no
        padding (a text embeds alike alone and in any batch), and are pooled
        as the model's sentence-transformers modules say (docs/embeddings.md).

        Args:
            texts: a text or a list of texts, or token ids (a list, or a list of lists).
            normalize: scale each row to unit L2 norm (after ``dimensions``).
            dimensions: keep the first ``dimensions`` values (Matryoshka models), then normalize.
            pooling: override the pooling: ``"cls"``, ``"mean"``, ``"max"``,
                ``"lasttoken"`` (or ``"last"``), ``"mean_sqrt_len_tokens"``, ``"weightedmean"``.
            prompt: text to put before each text (e.g. ``"query: "``).
            prompt_name: a prompt of the model's ``config_sentence_transformers.json``
                (e.g. ``"query"``); default: its ``default_prompt_name``, if any.
            max_batch_tokens: most tokens one forward feeds.

        Raises:
            EmbeddingError: no texts, an empty one, one past the context given as
                token ids, a bad ``dimensions``, pooling or prompt name.
        """
        return embed(self, texts, normalize=normalize, dimensions=dimensions, pooling=pooling, prompt=prompt,
                     prompt_name=prompt_name, max_batch_tokens=max_batch_tokens)[0]

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        instruction: str | None = None,
        max_batch_tokens: int = DEFAULT_EMBED_BATCH_TOKENS,
        return_tokens: bool = False,
    ) -> list[float] | tuple[list[float], int]:
        """A relevance score per document for ``query``, in the documents' order
        (higher is more relevant).

        A cross-encoder (``BertForSequenceClassification``) reads each
        ``(query, document)`` pair as one text with token types 0 and 1, and
        scores it as sentence-transformers' ``CrossEncoder.predict``: the
        logit through the configured activation (sigmoid for one label); with
        several labels the softmax probability of the last. A language model
        scores as Qwen3-Reranker: ``P(yes)`` against ``no`` at the last position
        of its judging prompt, with ``instruction`` (default: web search).

        ``return_tokens`` also returns the tokens read (the server's ``usage``).
        """
        scores, tokens = rerank(self, query, documents, instruction=instruction, max_batch_tokens=max_batch_tokens)
        return (scores, tokens) if return_tokens else scores

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
        prompt_cache_dir: str | os.PathLike[str] | None = None,
        prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
        encoder_memory: int | None = None,
    ) -> BatchEngine:
        """Replace :attr:`batch_engine` with one of these settings and return it.

        Args:
            kv_memory: bytes of keys and values all running requests together
                may hold (default 256 MiB); reserved at once in the paged layout,
                where loaded LoRA adapters' factors take pages of it (docs/adapters.md, "Memory").
            kv_layout: ``"paged"``, ``"contiguous"`` or ``"auto"`` (paged where
                the backend has native paged attention).
            block_size: positions per page (paged layout).
            max_batch_tokens: most tokens one forward processes.
            prompt_cache_dir: a folder where prefix blocks are kept on disk
                as they leave use, and read back by a later request whose
                prompt starts with them, in this process or a later one
                (docs/kv-cache.md, "The disk tier"); single requests then run
                in the batch engine's pool too, so they find them.
            prompt_cache_bytes: the most that folder holds (least recently
                used blocks go first).
            encoder_memory: bytes of vision-tower activations and image
                embeddings all running requests together may hold (default
                4 GiB; docs/vision.md, "Memory"): a request with images waits
                until its images fit.

        Raises :class:`~infer.errors.GenerationError` while the current batch
        engine still has requests.
        """
        if self._batch_engine is not None and self._batch_engine.has_work():
            raise GenerationError("the batch engine still has requests; finish or cancel them first")
        batch = BatchEngine(self.engine, kv_layout=kv_layout, kv_memory=kv_memory, block_size=block_size,
                            max_batch_tokens=max_batch_tokens, encoder_memory=encoder_memory)
        if prompt_cache_dir is not None:
            attach_prompt_cache(self, batch, prompt_cache_dir, prompt_cache_bytes)
        self._batch_engine = batch
        self._reuse_prefixes = prompt_cache_dir is not None
        return batch

    # -- saved states --------------------------------------------------------------

    def save_state(self, path: str | os.PathLike[str], conversation_or_tokens: StateSource) -> SavedState:
        """Compute the state of a prompt and write it to ``path`` (atomically):
        token ids, a prompt text, or a conversation (a list of messages,
        rendered with the chat template without a generation prompt, so the
        next turn's prompt starts with it). What the prefix cache holds of it
        already is not computed again. A later process loads it with
        :meth:`load_state`; the file format is in docs/kv-cache.md.

        Raises :class:`~infer.errors.StateUnsupportedError` under tensor
        parallelism or for a model loaded from no file."""
        with self._lock:
            return save_state(self, path, conversation_or_tokens)

    def load_state(self, path: str | os.PathLike[str]) -> RestoredState:
        """Enter the state saved at ``path`` (by :meth:`save_state`, here or
        in another process) in this model's prefix cache: from now on a
        request whose prompt starts with the saved tokens computes only the
        rest (``usage.cached_tokens`` counts what it found). Single requests
        (``generate``, ``complete``, ``chat``) run in the batch engine's
        pool from then on, so they find it.

        Raises :class:`~infer.errors.StateMismatchError` when the file was
        saved by another model (weights, architecture, tokenizer) or cache
        setting (``kv_dtype``, block size), naming what differs;
        :class:`~infer.errors.StateFileError` for a truncated or altered
        file; :class:`~infer.errors.StateUnsupportedError` under tensor
        parallelism."""
        with self._lock:
            restored = load_state(self, path)
            self._reuse_prefixes = True
            return restored

    def plan_chat(
        self, messages: Sequence[Message], request: GenerationRequest, *, template: str | None = None,
    ) -> ChatPlan:
        """What a chat request runs: :func:`infer.chat.plan_chat` for this
        model. Raises :class:`~infer.errors.ChatTemplateError`,
        :class:`~infer.errors.SamplingParameterError` or
        :class:`~infer.errors.StructuredOutputError` before any token."""
        return plan_chat(self, messages, request, template=template)

    def chat(
        self,
        messages: Sequence[Message],
        *,
        template: str | None = None,
        stream: bool = False,
        request: GenerationRequest | None = None,
        **options: Unpack[GenerationOptions],
    ) -> ChatReply | Iterator[str]:
        """Reply to a conversation, rendered with the model's chat template
        (or ``template``). ``messages`` are ``{"role", "content"}`` dicts; the
        other arguments are those of :meth:`generate` except ``prompt`` and
        ``add_special_tokens`` (the template already places every special
        token), and those of a chat :class:`~infer.request.GenerationRequest`:
        ``tools``, ``tool_choice``, ``enable_thinking``, ``reasoning_effort``,
        ``thinking_budget``, ``reasoning_parser``, ``tool_parser``.

        Returns a :class:`~infer.chat.ChatReply`: the answer's text, with a
        reasoning model's thinking in ``reasoning_content`` and the tool
        calls in ``tool_calls``. With ``stream=True``, an iterator of the
        answer's text pieces (the reasoning and the tool calls are not in it).
        """
        plan = self.plan_chat(messages, _request_of(request, options), template=template)
        chunks = self._chunks(plan.prompt_ids, plan.prepared, skip_special_tokens=plan.skip_special_tokens,
                              media=plan.media)
        return Stream(plan.answer(chunks), self._lock) if stream else plan.reply(chunks)

    async def achat(self, messages: Sequence[Message], **kwargs: Any) -> str | Stream[str]:
        """:meth:`chat` for ``asyncio``, as :meth:`agenerate` is :meth:`generate`'s."""
        if kwargs.get("stream"):
            return self.chat(messages, **kwargs)  # type: ignore[return-value]
        import asyncio

        return await asyncio.to_thread(self._locked, self.chat, messages, **kwargs)

    # -- helpers ---------------------------------------------------------------------

    # -- LoRA adapters (docs/adapters.md) -------------------------------------------------

    @property
    def adapters(self) -> Adapters:
        """The model's LoRA adapters (:class:`~infer.adapters.slots.Adapters`:
        ``.loaded`` by name, the limits), made on first use with the default limits."""
        engine = self.engine
        if engine.adapters is None:
            self._check_adapters_run_here()
            engine.adapters = Adapters(self.network, self.backend, self.weight_sources,
                                       config=self.config, budgets=engine.budget_pools)
        return engine.adapters

    def _check_adapters_run_here(self) -> None:
        """Adapters attach to the weights this process holds: a tensor-parallel
        model's are shares on every rank, so they are refused there."""
        ranks = getattr(self.network, "ranks", 1)
        if ranks > 1:
            raise UnsupportedAdapterError(TENSOR_PARALLEL_ADAPTERS.format(ranks=ranks))

    def configure_adapters(self, *, max_loras: int = MAX_LORAS, max_cpu_loras: int = MAX_CPU_LORAS,
                           max_lora_rank: int = MAX_LORA_RANK) -> None:
        """Set the adapter limits (vLLM's names): ``max_loras`` adapters in one
        batch, ``max_cpu_loras`` adapters loaded, ``max_lora_rank`` the
        largest rank loaded. Exceeding one is an
        :class:`~infer.errors.AdapterLimitError`. Refused while adapters are loaded."""
        if self.engine.adapters is not None and self.engine.adapters.loaded:
            raise AdapterError("configure_adapters before loading adapters (unload them first)")
        self._check_adapters_run_here()
        self.engine.adapters = Adapters(self.network, self.backend, self.weight_sources, max_loras=max_loras,
                                        max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank,
                                        config=self.config, budgets=self.engine.budget_pools)

    def load_adapter(self, name: str, path: str | os.PathLike[str], *, merge: bool = False) -> None:
        """Load the LoRA adapter at ``path`` (a PEFT folder, or a GGUF adapter
        file) under ``name``; requests then ask for it with ``adapter=name``.
        Loading under a name already loaded replaces that adapter (its cached
        prefixes are never reused: the prefix cache keys by the adapter's content).

        ``merge=True`` adds the adapter into the weights instead: every
        request then runs it, at the speed of the base model; only on a
        float base (a quantized one is refused, it would become float) and
        with no other adapter loaded. :meth:`unload_adapter` subtracts it again.

        Raises:
            AdapterFormatError, UnsupportedAdapterError, AdapterResizesEmbeddingsError:
                the adapter cannot be read or is not supported (DoRA, added tokens, ...).
            AdapterMismatchError: it was made for another base model.
            AdapterLimitError: over ``max_lora_rank`` or ``max_cpu_loras``; or
                :class:`~infer.errors.AdapterMemoryError`: a KV pool sized by a memory
                budget (the batch engine's) cannot spare the pages its bytes need.
            AdapterInUseError: replacing an adapter a running request uses.
            AdapterMergeError: ``merge`` refused (quantized base, other adapters).
        """
        with self._lock:
            self.adapters.load(name, path, merge=merge)
            if merge:
                self._recapture()

    def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name``.

        Raises:
            AdapterNotFoundError: none is loaded under ``name``.
            AdapterInUseError: a running request (a stream not yet finished) uses it;
                its output is never changed.
        """
        with self._lock:
            merged = self.adapters.get(name).merged
            self.adapters.unload(name)
            if merged:
                self._recapture()

    def _recapture(self) -> None:
        """Captured steps hold the weights they were recorded with: after a
        merge changed them, record anew."""
        engine = self.engine
        if engine.decode_step is not None:
            engine.capture_decode(compile=engine.decode_step.compiled)

    def _adapter_of(self, request: GenerationRequest, prompts: int | None = None) -> list[str | None]:
        """The request's adapter per prompt (``prompts`` None: one prompt)."""
        adapter = request.adapter
        if isinstance(adapter, tuple):
            if prompts is None or len(adapter) != prompts:
                raise GenerationError(f"adapter lists {len(adapter)} names for "
                                      f"{'one prompt' if prompts is None else f'{prompts} prompts'}; give one name, "
                                      f"or one per prompt")
            return list(adapter)
        return [adapter] * (prompts or 1)

    def _max_tokens(self, max_tokens: int | None) -> int:
        if max_tokens is None:
            return self.default_max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise SamplingParameterError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
        return max_tokens


def _check_keywords(method: str, options: Mapping[str, Any], accepted: type) -> None:
    """Python's own error for a keyword that ``method`` does not take: its
    options are the keys of ``accepted`` (a TypedDict), not spelled out in its signature."""
    unknown = [k for k in options if k not in accepted.__annotations__]
    if unknown:
        raise TypeError(f"Model.{method}() got an unexpected keyword argument {unknown[0]!r}")


def _request_of(request: GenerationRequest | None, options: Mapping[str, Any]) -> GenerationRequest:
    """``request``, or one made of keyword ``options``; both at once is a
    :class:`~infer.errors.GenerationError` (an option left at its default is no conflict)."""
    if request is None:
        return GenerationRequest.from_options(**options)
    if not isinstance(request, GenerationRequest):
        raise GenerationError(f"request must be an infer.GenerationRequest, got {type(request).__name__}")
    defaults = {f.name: f.default for f in dataclasses.fields(GenerationRequest)}
    given = sorted(k for k, v in options.items() if v is not None and v != defaults.get(k))
    if given:
        raise GenerationError(f"give request= or keyword options, not both (also given: {given})")
    return request


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
    gen = Generation(tokens_iter=iter(()), prompt_tokens=handle.prompt_tokens, sampler=handle.sampler)

    def tokens(gen: Generation) -> Iterator[int]:
        try:
            for token in handle:
                gen.cached_tokens = handle.cached_tokens or 0
                yield token
        finally:
            handle.cancel()
            try:
                if gen.finish_reason is None:
                    gen.finish_reason = handle.finish_reason
            except ReferenceError:  # closed because the generation was dropped: nobody reads the reason
                pass

    gen.tokens_iter = tokens(owner(gen))  # a weak hold: dropping the generation cancels the request
    return gen
