"""One generation request: what to generate and how, checked in one place.

A :class:`GenerationRequest` holds every option a request may carry —
sampling, stop rules, penalties, log-probabilities, a constraint on the
output, tools and reasoning options — and checks them when it is made, so a
bad value fails before any token, with a typed error. :meth:`Model.generate
<infer.Model.generate>`, ``complete`` and ``chat`` build one from their
keyword arguments, and every endpoint of the HTTP server builds one from its
body; both then hand it to :meth:`Model.prepare <infer.Model.prepare>`, which
fills in the model's defaults (its generation config) and compiles the
constraint once, giving a :class:`PreparedRequest` that makes each choice's
:class:`~infer.engine.sampling.Sampler` and
:class:`~infer.engine.generate.StopConditions`. Defaults live here and in the
model's generation config, nowhere else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, TypedDict, Union

from infer.completion import stop_strings
from infer.engine.generate import StopConditions
from infer.engine.samplers import Breakers
from infer.engine.sampling import Constraint, Sampler, SamplingParams
from infer.errors import ContextLengthError, SamplingParameterError, StructuredOutputError

if TYPE_CHECKING:
    from infer.engine.structured import Grammar

#: ``tool_choice``: ``"auto"`` (the model decides), ``"none"`` (no tools),
#: ``"required"`` (at least one call) or the name of the one function to call.
ToolChoice = Union[Literal["auto", "none", "required"], str]

#: OpenAI's and vLLM's ``reasoning_effort`` values (passed to chat templates).
REASONING_EFFORTS = ("minimal", "low", "medium", "high")

#: The sampling rules a model's generation config may set: None takes the model's value.
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
#: llama.cpp's samplers (SamplingParams' defaults are theirs; None in a list option: the default).
_LLAMA_CPP = ("penalty_last_n", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
              "dry_sequence_breakers", "xtc_probability", "xtc_threshold", "top_n_sigma", "typical_p", "mirostat",
              "mirostat_tau", "mirostat_eta", "samplers")


# The keyword options of the Python API, typed once: each is a field of GenerationRequest
# (tests/test_request.py checks that the two lists agree) and the methods of infer.Model take
# them as ``**options: Unpack[...]``, so a type checker and an editor see every name and type.


class SamplingOptions(TypedDict, total=False):
    """The sampling rules as keyword arguments (:meth:`infer.Model.sampling_params`):
    :class:`~infer.engine.sampling.SamplingParams`' fields, where None in
    ``temperature``, ``top_k``, ``top_p``, ``min_p`` or ``repetition_penalty``
    means the model's default."""

    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repetition_penalty: float | None
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    logit_bias: Mapping[int, float] | None
    penalty_last_n: int
    dry_multiplier: float
    dry_base: float
    dry_allowed_length: int
    dry_penalty_last_n: int
    dry_sequence_breakers: Sequence[str] | None
    xtc_probability: float
    xtc_threshold: float
    top_n_sigma: float
    typical_p: float
    mirostat: int
    mirostat_tau: float
    mirostat_eta: float
    samplers: Sequence[str] | None


class GenerateOptions(SamplingOptions, total=False):
    """The keyword options of :meth:`infer.Model.generate` (documented there):
    the sampling rules, stop rules, speculative decoding and a constraint."""

    max_tokens: int | None
    stop: str | Sequence[str] | None
    ignore_eos: bool
    #: ``"ngram"``, ``"mtp"``, a draft :class:`infer.Model` or a
    #: :class:`~infer.engine.speculative.DraftSource`.
    speculative: Any
    num_speculative_tokens: int | None
    json_schema: dict[str, Any] | bool | str | None
    regex: str | None
    grammar: str | None
    #: A loaded LoRA adapter's name (for a list of prompts: one name, or a
    #: list with one name or None per prompt); None: the base model.
    adapter: str | Sequence[str | None] | None
    adapter_scale: float


class GenerationOptions(GenerateOptions, total=False):
    """Every field of :class:`GenerationRequest` as a keyword argument: what
    :meth:`infer.Model.complete`, ``chat`` and ``generate_tokens`` take
    (log-probabilities, tools and reasoning options besides
    :class:`GenerateOptions`)."""

    logprobs: int | None
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: ToolChoice | None
    parallel_tool_calls: bool
    enable_thinking: bool | None
    reasoning_effort: str | None
    thinking_budget: int | None
    reasoning_parser: str | None
    tool_parser: str | None


def sampling_params(options: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """The :class:`~infer.engine.sampling.SamplingParams` of ``options`` (keys
    of :class:`SamplingOptions`): a rule left out or None takes its value from
    ``defaults`` (a model's generation config), else greedy decoding's; a
    ``logit_bias`` of None is none. Raises
    :class:`~infer.errors.SamplingParameterError` for a value out of range."""
    rules = {**(defaults or {}), **{k: options[k] for k in _SAMPLING if options.get(k) is not None}}
    rest = {k: options[k] for k in ("seed", "presence_penalty", "frequency_penalty") if k in options}
    rest.update({k: options[k] for k in _LLAMA_CPP if options.get(k) is not None})
    return SamplingParams(**rules, **rest, logit_bias=options.get("logit_bias") or ())


@dataclass(frozen=True)
class GenerationRequest:
    """Everything one request asks for, checked on construction.

    ``None`` means "the model's default" (its generation config, else the
    library's: greedy decoding, :data:`~infer.model.DEFAULT_MAX_TOKENS`).
    Raises :class:`~infer.errors.SamplingParameterError` (or
    :class:`~infer.errors.StructuredOutputError` for two constraints at
    once, or one with ``ignore_eos``) for a bad value.
    """

    #: Most new tokens; None: the model's generation config, else 128.
    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    #: Makes sampling repeatable; choice ``i`` of several samples with ``seed + i``.
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: Token id -> bias in [-100, 100].
    logit_bias: Mapping[int, float] | None = None
    #: llama.cpp's samplers (see :class:`~infer.engine.sampling.SamplingParams`; each default is off).
    penalty_last_n: int = -1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    #: None: llama.cpp's (``"\n"``, ``":"``, ``'"'``, ``"*"``).
    dry_sequence_breakers: tuple[str, ...] | None = None
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    top_n_sigma: float = -1.0
    typical_p: float = 1.0
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    #: The sampler chain's order, llama.cpp's names; None: the default order.
    samplers: tuple[str, ...] | None = None
    #: Texts that end generation (not included in the output).
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    #: Record each token's log-probability with this many alternatives; None: none.
    logprobs: int | None = None
    #: A constraint on the output (at most one; after the reasoning, if any).
    json_schema: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    grammar: str | None = None
    #: Speculative decoding (Python API only; see :meth:`infer.Model.generate`).
    speculative: Any = None
    num_speculative_tokens: int | None = None
    #: Function tools, in OpenAI's shape (rendered by the chat template).
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: ToolChoice | None = None
    #: Whether a forced call may be several (``tool_choice="required"``).
    parallel_tool_calls: bool = True
    #: Thinking on or off, passed to chat templates (None: the template's default).
    enable_thinking: bool | None = None
    #: ``"minimal"``, ``"low"``, ``"medium"`` or ``"high"``, passed to chat templates.
    reasoning_effort: str | None = None
    #: Most reasoning tokens: after this many, the end of thinking is forced.
    thinking_budget: int | None = None
    #: The reasoning parser's name (:mod:`infer.reasoning`; ``"none"``: no
    #: parsing); None: chosen from the model's template.
    reasoning_parser: str | None = None
    #: The tool-call format's name (:mod:`infer.tool_parsers`); None: chosen from the template.
    tool_parser: str | None = None
    #: The LoRA adapter (a loaded adapter's name) the request runs with; None:
    #: the base model. For a list of prompts, also a tuple with one name (or
    #: None) per prompt (docs/adapters.md).
    adapter: str | tuple[str | None, ...] | None = None
    #: Multiplies the adapter's term (1.0: as trained; 0: the base model).
    adapter_scale: float = 1.0

    def __post_init__(self) -> None:
        def count(name: str, value: object, low: int = 0) -> None:
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise SamplingParameterError(f"{name} must be an integer >= {low}, got {value!r}")

        count("max_tokens", self.max_tokens)
        count("logprobs", self.logprobs)
        count("thinking_budget", self.thinking_budget)
        count("num_speculative_tokens", self.num_speculative_tokens, 1)
        object.__setattr__(self, "stop", stop_strings(self.stop) if self.stop else ())
        for name in ("dry_sequence_breakers", "samplers"):  # lists as tuples (the request stays hashable)
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if self.logit_bias is not None and not isinstance(self.logit_bias, Mapping):
            raise SamplingParameterError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        sampling_params(self.sampling_options())  # the ranges of the sampling rules are SamplingParams' to check
        constraints = [n for n in ("json_schema", "regex", "grammar") if getattr(self, n) is not None]
        if len(constraints) > 1:
            raise StructuredOutputError(f"give one of json_schema=, regex=, grammar=; got {constraints}")
        if self.tools is not None:
            if isinstance(self.tools, (str, bytes, Mapping)) or not isinstance(self.tools, Sequence) or not all(
                    isinstance(t, Mapping) for t in self.tools):
                raise SamplingParameterError("tools must be a list of tool definitions (dicts)")
            object.__setattr__(self, "tools", tuple(dict(t) for t in self.tools))
        if self.tool_choice is not None:
            if not isinstance(self.tool_choice, str) or not self.tool_choice:
                raise SamplingParameterError(
                    f"tool_choice must be 'auto', 'none', 'required' or a function's name, got {self.tool_choice!r}")
            if self.tool_choice not in ("auto", "none") and self.tool_choice != "required":
                names = tool_names(self.tools or ())
                if self.tool_choice not in names:
                    raise SamplingParameterError(
                        f"tool_choice names the function {self.tool_choice!r}, which is not among the tools "
                        f"({sorted(names) or 'none given'})")
            if self.tool_choice == "required" and not self.tools:
                raise SamplingParameterError("tool_choice 'required' needs tools")
        if isinstance(self.adapter, list):
            object.__setattr__(self, "adapter", tuple(self.adapter))
        names = self.adapter if isinstance(self.adapter, tuple) else (self.adapter,)
        if not all(a is None or (isinstance(a, str) and a) for a in names):
            raise SamplingParameterError(f"adapter must be an adapter's name (or a list of names for a list of "
                                         f"prompts), got {self.adapter!r}")
        if not isinstance(self.adapter_scale, (int, float)) or isinstance(self.adapter_scale, bool) or \
                not math.isfinite(self.adapter_scale):
            raise SamplingParameterError(f"adapter_scale must be a finite number, got {self.adapter_scale!r}")
        if self.enable_thinking is not None and not isinstance(self.enable_thinking, bool):
            raise SamplingParameterError(f"enable_thinking must be true or false, got {self.enable_thinking!r}")
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise SamplingParameterError(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {self.reasoning_effort!r}")

    @classmethod
    def from_options(cls, **options: Any) -> GenerationRequest:
        """A request from :meth:`infer.Model.generate`'s keyword arguments;
        an unknown one is a :class:`~infer.errors.SamplingParameterError`
        naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise SamplingParameterError(f"unknown generation option(s) {unknown}; the options are {sorted(names)}")
        if options.get("stop") is not None:
            options["stop"] = stop_strings(options["stop"])
        else:
            options.pop("stop", None)
        return cls(**options)

    def sampling_options(self) -> SamplingOptions:
        """The request's sampling rules (None where it leaves one to the model)."""
        return {k: getattr(self, k) for k in SamplingOptions.__annotations__}  # type: ignore[return-value]

    def replace(self, **changes: Any) -> GenerationRequest:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    @property
    def forces_tool_call(self) -> bool:
        """Whether ``tool_choice`` requires a call (``"required"`` or a name)."""
        return self.tool_choice not in (None, "auto", "none")

    @property
    def tools_offered(self) -> tuple[dict[str, Any], ...] | None:
        """The tools the template renders and the parser reads (None with ``tool_choice="none"``)."""
        return self.tools if self.tools and self.tool_choice != "none" else None

    def template_options(self) -> dict[str, Any]:
        """What the chat template is given besides the messages: ``tools``,
        ``enable_thinking``, ``reasoning_effort`` (each only when set)."""
        out: dict[str, Any] = {}
        if self.tools_offered is not None:
            out["tools"] = list(self.tools_offered)
        if self.enable_thinking is not None:
            out["enable_thinking"] = self.enable_thinking
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        return out


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The function names of OpenAI-shaped tools (``{"type": "function",
    "function": {"name": ...}}``; a bare ``{"name": ...}`` too)."""
    names = []
    for tool in tools:
        function = tool.get("function", tool)
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


@dataclass
class PreparedRequest:
    """A request with the model's defaults filled in and its constraint
    compiled (by :meth:`infer.Model.prepare`): it makes each choice's sampler
    and stop rules."""

    request: GenerationRequest
    #: The sampling rules, the model's defaults filled in (seed: choice 0's).
    params: SamplingParams
    #: ``max_tokens``, or the model's default.
    max_tokens: int
    eos_token_ids: frozenset[int]
    context_length: int
    #: The compiled constraint on the answer (None without one).
    grammar: Grammar | None = None
    #: Wraps each choice's constraint (e.g. to apply it after the reasoning,
    #: or to force the end of thinking); set by whoever knows the prompt.
    wrap: Callable[[Constraint | None], Constraint | None] | None = field(default=None, repr=False)
    #: DRY's sequence breakers as token ids (None: DRY is off, or no tokenizer resolved them).
    breakers: Breakers | None = field(default=None, repr=False)

    def sampler(self, index: int = 0) -> Sampler:
        """Choice ``index``'s sampler: its own matcher of the constraint, and
        seed ``seed + index``."""
        params = self.params
        if params.seed is not None and index:
            params = dataclasses.replace(params, seed=params.seed + index)
        constraint: Constraint | None = None if self.grammar is None else self.grammar.matcher()
        if self.wrap is not None:
            constraint = self.wrap(constraint)
        return Sampler(params, logprobs=self.request.logprobs, constraint=constraint, breakers=self.breakers)

    def stop_conditions(self, prompt_tokens: int | None = None) -> StopConditions:
        """The stop rules; with ``prompt_tokens``, ``max_tokens`` is capped
        to the positions the context has left (what a server, which reserves
        prompt + ``max_tokens`` of KV memory at admission, wants), and a
        prompt that leaves none is a :class:`~infer.errors.ContextLengthError`."""
        limit = self.max_tokens
        if prompt_tokens is not None:
            room = self.context_length - prompt_tokens
            if room < 1 and limit != 0:
                raise ContextLengthError(
                    f"the prompt has {prompt_tokens} tokens but the model's context is {self.context_length} "
                    "positions, and at least one must remain for generation")
            limit = min(limit, max(room, 0))
        return StopConditions(max_tokens=limit, eos_token_ids=self.eos_token_ids,
                              ignore_eos=self.request.ignore_eos)

