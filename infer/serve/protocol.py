"""OpenAI's request bodies, validated; what is not supported is refused by name.

Every parameter of OpenAI's completions and chat completions APIs is either
implemented, accepted as the no-op it is here (``user``, ``best_of: 1``) or
refused with a 400 naming it (:class:`~infer.errors.RequestError`): an
unknown field too, so a client never gets silently different behaviour from
what it asked for. Beyond OpenAI's: ``top_k``, ``min_p``,
``repetition_penalty`` and ``ignore_eos``, as vLLM and llama.cpp's server
accept them, llama.cpp's samplers (:class:`LlamaSamplers`: DRY, XTC,
top-nσ, typical, mirostat, ``penalty_last_n``, ``samplers``), and vLLM's ``chat_template_kwargs``, ``thinking_budget`` and
(on completions) ``response_format``. The helpers here (``response_schema``,
``check_tools``, ``tool_choice``, ``check_stops``, ``joined_text``) are
shared with the Responses and Anthropic Messages endpoints.

:class:`ServerLike` is what every endpoint module uses of the server: the
endpoints take it, the app's :class:`~infer.serve.app.Server` is it (the app
imports the endpoint modules, so they cannot import it back).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from infer.errors import RequestError
from infer.serve import media

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from infer.chat import ChatPlan
    from infer.model import Model
    from infer.request import GenerationRequest, PreparedRequest
    from infer.serve.choice import Choice, Emit, ReplyEvents
    from infer.serve.loop import EngineLoop


#: Most choices one request may ask for (``n``).
MAX_N = 16
#: Most alternatives per token (``logprobs`` / ``top_logprobs``), as OpenAI's chat API.
MAX_TOP_LOGPROBS = 20
#: Most stop sequences of the Anthropic Messages API (OpenAI's endpoints take 4), and their longest.
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256


def check_stops(stop: str | list[str] | None, param: str, most: int) -> tuple[str, ...]:
    """Stop strings: at most ``most``, each non-empty and at most
    :data:`MAX_STOP_LENGTH` characters (each is searched for after every token)."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > most or not all(stops) or any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise RequestError(f"{param} takes at most {most} non-empty strings of at most {MAX_STOP_LENGTH} "
                           f"characters; got {len(stops)}", param)
    return tuple(stops)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class LlamaSamplers(_Body):
    """llama.cpp's samplers, as llama-server's ``/completion`` names them:
    extra body fields of every generation endpoint. Unset fields keep the
    defaults (each sampler off); their ranges are
    :class:`~infer.request.GenerationRequest`'s to check (a 400 naming the field)."""

    penalty_last_n: int | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    top_n_sigma: float | None = None
    #: llama-server's ``typical_p``.
    typical_p: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    samplers: list[str] | None = None

    def sampler_options(self) -> dict[str, Any]:
        """The fields given, as :class:`~infer.request.GenerationRequest` options."""
        return {name: value for name in LlamaSamplers.model_fields
                if (value := getattr(self, name)) is not None}


class _Sampling(LlamaSamplers):
    """What both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Beyond OpenAI (vLLM, llama.cpp's server).
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False

    def stops(self) -> tuple[str, ...]:
        return check_stops(self.stop, "stop", 4)

    def bias(self, vocab_size: int) -> dict[int, float]:
        """``logit_bias`` with integer keys, each checked against the vocabulary."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= token < vocab_size:
                raise RequestError(f"logit_bias names token id {token}, but the vocabulary has {vocab_size} ids",
                                   "logit_bias")
            if not -100 <= value <= 100:
                raise RequestError(f"logit_bias[{key}] must be in [-100, 100], got {value}", "logit_bias")
            out[token] = value
        return out


Prompt = Union[str, list[str], list[int], list[list[int]]]


class ChatTemplateKwargs(_Body):
    """What a request may pass to the chat template (vLLM's ``chat_template_kwargs``)."""

    enable_thinking: bool | None = None


def joined_text(content: Any, where: str, noun: str, kinds: Collection[str],
                refuse: Callable[[int, str], RequestError]) -> str:
    """The text of a message's ``content``: a string, or a list of parts
    (``noun``: the API's word for them) whose ``type`` is one of ``kinds``,
    each with a ``text``. Another shape is a 400 naming ``where``; a part of
    another type is ``refuse(index, type)``, in the API's own words."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of {noun}", where)
    texts = []
    for j, part in enumerate(content):
        kind: Any = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise refuse(j, kind)
        texts.append(part["text"])
    return "".join(texts)


def response_schema(fmt: Any, param: str) -> dict[str, Any] | bool | None:
    """The JSON schema a ``response_format`` (chat completions'), or a
    Responses ``text.format``, asks for: ``{"type": "json_object"}`` is any
    object, ``{"type": "json_schema", "json_schema": {"schema": ...}}`` (or
    the schema beside ``type``, as the Responses API puts it) that schema,
    strict or not; ``text`` or None is no constraint."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise RequestError(f"{param} must be an object with a 'type'", param)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema", fmt)
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise RequestError(f"{param} of type json_schema needs a 'schema' (a JSON schema object)", param)
        return schema
    raise RequestError(f"{param} type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'", param)


def check_tools(tools: list[Any], param: str) -> list[dict[str, Any]]:
    """OpenAI function tools, each checked: ``{"type": "function", "function": {"name", "parameters"?}}``."""
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise RequestError(f"{param}[{i}] must be a function tool: {{\"type\": \"function\", \"function\": "
                               "{\"name\": ..., \"parameters\": {...}}}", param)
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"{param}[{i}].function needs a name", param)
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise RequestError(f"{param}[{i}].function.parameters must be a JSON schema object", param)
    return tools


def tool_choice(choice: Any) -> str | None:
    """``tool_choice`` as a :class:`~infer.request.GenerationRequest` takes
    it: ``"auto"``, ``"none"``, ``"required"`` or the named function's name."""
    if choice is None or isinstance(choice, str):
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError("tool_choice must be 'auto', 'none', 'required' or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return name


class CompletionRequest(_Sampling):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    # Beyond OpenAI's completions (vLLM takes it): the output's JSON schema.
    response_format: dict[str, Any] | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # Beyond OpenAI (vLLM): template options, and a cap on the reasoning's tokens.
    chat_template_kwargs: ChatTemplateKwargs | None = None
    thinking_budget: int | None = Field(None, ge=0)

    def chat_options(self) -> dict[str, Any]:
        """The chat options of a :class:`~infer.request.GenerationRequest`:
        the constraint of ``response_format``, the tools, the thinking options."""
        out: dict[str, Any] = {"json_schema": response_schema(self.response_format, "response_format")}
        if self.tools:
            out["tools"] = check_tools(self.tools, "tools")
        out["tool_choice"] = tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            out["parallel_tool_calls"] = self.parallel_tool_calls
        out["reasoning_effort"] = self.reasoning_effort
        out["thinking_budget"] = self.thinking_budget
        if self.chat_template_kwargs is not None:
            out["enable_thinking"] = self.chat_template_kwargs.enable_thinking
        return out

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them: text content, and the
        arguments of earlier tool calls as objects rather than JSON text."""
        out = []
        for i, message in enumerate(self.messages):
            if not isinstance(message.get("role"), str):
                raise RequestError(f"messages[{i}] has no role", f"messages[{i}].role")
            message = dict(message)
            where = f"messages[{i}].content"
            content = message.get("content")
            message["content"] = "" if content is None else media.content(
                content, where, ("text",),
                lambda j, kind: RequestError(f"{where}[{j}] is of type {kind!r}; this server takes text and "
                                             "image_url parts", where))
            calls = message.get("tool_calls")
            if calls:
                message["tool_calls"] = [_template_call(call) for call in calls]
            out.append(message)
        return out


def _template_call(call: Any) -> Any:
    """OpenAI's ``{"function": {"name", "arguments": "<json>"}}`` with the
    arguments decoded, as Hugging Face chat templates expect."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}


def parse(model: type[_Body], body: Any) -> Any:
    """``body`` (decoded JSON) as ``model``, or a :class:`~infer.errors.RequestError`
    naming the first parameter at fault."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(part) for part in first["loc"]]
        param = loc[0] if loc else None
        if first["type"] == "extra_forbidden":
            raise RequestError(f"unsupported parameter {'.'.join(loc)!r}: infer's server does not implement it",
                               param, code="unsupported_parameter") from None
        raise RequestError(f"invalid {'.'.join(loc)}: {first['msg']}", param) from None


class ServerLike(Protocol):
    """What the endpoint modules use of :class:`infer.serve.app.Server`
    (see its methods for what each does)."""

    #: The served model, its id as clients name it, and the thread that steps its batch engine.
    model: Model
    name: str
    loop: EngineLoop
    #: The folder of ``/slots/{name}``'s saved states (None: slots are off).
    slot_save_path: Path | None

    async def read_body(self, request: Request) -> Any: ...
    def check_model(self, name: str) -> None: ...
    def unsupported(self, param: str, why: str) -> RequestError: ...
    def sampling_request(self, body: _Sampling, *, max_tokens: int | None, logprobs: int | None = None,
                         **options: Any) -> GenerationRequest: ...
    def build_request(self, **fields: Any) -> GenerationRequest: ...
    async def prepare(self, request: GenerationRequest) -> PreparedRequest: ...
    async def chat_plan(self, conversation: list[dict[str, Any]], request: GenerationRequest,
                        param: str = "response_format") -> ChatPlan: ...
    async def start(self, prepared: PreparedRequest, prompts: list[list[int]], n: int = 1,
                    skip_special_tokens: bool = True, media: Any = None) -> list[Choice]: ...
    async def start_chat(self, plan: ChatPlan, n: int = 1) -> list[Choice]: ...
    def usage(self, prompts: list[list[int]], choices: list[Choice]) -> dict[str, Any]: ...
    async def run_all(self, request: Request, choices: list[Choice], endpoint: str) -> None: ...
    async def run_replies(self, request: Request, choices: list[Choice], endpoint: str) -> None: ...
    async def respond(self, request: Request, events: ReplyEvents, endpoint: str, stream: bool) -> Response: ...
    async def stream_reply(self, events: ReplyEvents, emit: Emit) -> None: ...
    def sse(self, produce: Callable[[Emit], Awaitable[None]], choices: list[Choice], endpoint: str, *,
            failure: Callable[[BaseException], dict[str, Any]], named: bool = False) -> Response: ...
