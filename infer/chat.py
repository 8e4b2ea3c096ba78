"""A chat request from messages to a reply: its plan, and its reply read back.

:func:`plan_chat` (:meth:`infer.Model.plan_chat`) renders the conversation with the chat
template (tools, ``enable_thinking``, ``reasoning_effort``), chooses the
reasoning parser and tool-call format, turns a forced tool call into the
format's grammar, and applies the request's constraint to the answer after
the reasoning (:class:`~infer.reasoning.ReasoningConstraint`): a
:class:`ChatPlan`. What every chat entry point runs — :meth:`infer.Model.chat`
and the server's chat completions, Responses and Anthropic Messages
endpoints — so they give the same tokens and read them the same way.

A :class:`ReplyParser` reads one choice's text as it comes: reasoning, then
content and tool calls, each as deltas (:class:`Delta`) that join into the
whole reply (:class:`ChatReply`); :meth:`ChatPlan.answer` and
:meth:`ChatPlan.reply` read a generated reply's chunks with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from infer.completion import CompletionChunk, texts
from infer.errors import ChatTemplateError, SamplingParameterError, StructuredOutputError
from infer.multimodal import image_parts
from infer.reasoning import (
    ReasoningConstraint,
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
    reasoning_parser_for,
)
from infer.request import GenerationRequest, PreparedRequest, tool_names
from infer.tokenizer import Tokenizer
from infer.tool_parsers import Call, ToolCallStream, ToolParser, get_tool_parser, openai_call, tool_parser_for
from infer.tool_parsers.base import MAX_FORCED_CALLS


@dataclass(frozen=True)
class Delta:
    """A piece of a reply: reasoning or content text, or a whole tool call
    (with its index among the reply's calls and its id)."""

    kind: Literal["reasoning", "content", "tool_call"]
    text: str = ""
    index: int = 0
    call_id: str = ""
    call: Call | None = None


class ChatReply(str):
    """What :meth:`infer.Model.chat` returns: the answer's text (a ``str``),
    with the reasoning and the tool calls beside it.

    Attributes:
        reasoning_content: the thinking of a reasoning model (None when it
            wrote none, or the model does not reason).
        tool_calls: calls in OpenAI's shape (``{"id", "type": "function",
            "function": {"name", "arguments"}}``), when tools were given.
        finish_reason: ``"eos"``, ``"stop"``, ``"length"`` or ``"tool_calls"``.
    """

    reasoning_content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None

    def __new__(cls, content: str, reasoning_content: str | None = None,
                tool_calls: list[dict[str, Any]] | None = None, finish_reason: str | None = None) -> ChatReply:
        reply = super().__new__(cls, content)
        reply.reasoning_content = reasoning_content
        reply.tool_calls = tool_calls or []
        reply.finish_reason = finish_reason
        return reply


class ReplyParser:
    """One choice's text in, :class:`Delta` pieces out: the reasoning first
    (by the plan's reasoning parser), then the content, and in it the tool
    calls (by the plan's tool-call format). :attr:`reasoning`,
    :attr:`content` and :attr:`calls` hold everything given out so far."""

    def __init__(self, reasoning: ReasoningParser | None, in_reasoning: bool, tools: ToolParser | None) -> None:
        self._reasoning = None if reasoning is None else ReasoningStream(reasoning, in_reasoning)
        self._tools = None if tools is None else ToolCallStream(tools)
        self.reasoning = ""
        self.content = ""
        self.calls: list[tuple[int, str, Call]] = []
        #: Why generation ended, once the caller knows.
        self.finish_reason: str | None = None

    def feed(self, piece: str) -> list[Delta]:
        """The pieces that ``piece`` settles."""
        if self._reasoning is None:
            return self._content(piece, final=False)
        thought, said = self._reasoning.feed(piece)
        return self._thought(thought) + self._content(said, final=False)

    def finish(self) -> list[Delta]:
        """The end of the reply: everything still held back."""
        if self._reasoning is None:
            return self._content("", final=True)
        thought, said = self._reasoning.finish()
        return self._thought(thought) + self._content(said, final=True)

    def _thought(self, text: str) -> list[Delta]:
        self.reasoning += text
        return [Delta("reasoning", text)] if text else []

    def _content(self, text: str, final: bool) -> list[Delta]:
        if self._tools is None:
            said, calls = text, []
        else:
            said, calls = self._tools.finish() if final and not text else self._tools.feed(text)
            if final and text:
                more, late = self._tools.finish()
                said, calls = said + more, calls + late
        self.content += said
        self.calls.extend(calls)
        out = [Delta("content", said)] if said else []
        return out + [Delta("tool_call", index=i, call_id=cid, call=c) for i, cid, c in calls]

    def openai_calls(self) -> list[dict[str, Any]]:
        """The calls so far in OpenAI's ``tool_calls`` shape."""
        return [openai_call(None, cid, call) for _, cid, call in self.calls]


@dataclass
class ChatPlan:
    """A chat request ready to run (see the module docs)."""

    #: The rendered prompt and its token ids.
    prompt_text: str
    prompt_ids: list[int]
    #: The request, with the model's defaults and its answer's constraint.
    prepared: PreparedRequest
    reasoning: ReasoningParser | None = None
    #: Whether the output begins inside the reasoning (the template opened it).
    in_reasoning: bool = False
    tools: ToolParser | None = None
    #: The tool-call format's name (None without tools).
    tool_format: str | None = None
    #: Whether the reply is decoded without special tokens: not where the
    #: reasoning's or the calls' markers are special tokens of this model.
    skip_special_tokens: bool = True
    #: The messages' images (:class:`infer.multimodal.PromptMedia`), or None.
    media: Any = None

    def reply_parser(self) -> ReplyParser:
        """A fresh parser for one choice's reply."""
        return ReplyParser(self.reasoning, self.in_reasoning, self.tools)

    def answer(self, chunks: Iterable[CompletionChunk]) -> Iterator[str]:
        """The answer's text pieces of a streamed reply (the reasoning and
        the tool calls left out)."""
        reader = self.reply_parser()
        for piece in texts(chunks):
            yield from (d.text for d in reader.feed(piece) if d.kind == "content")
        yield from (d.text for d in reader.finish() if d.kind == "content")

    def reply(self, chunks: Iterable[CompletionChunk]) -> ChatReply:
        """The whole reply read from ``chunks``: the answer, the reasoning,
        the tool calls and why generation ended. Raises
        :class:`~infer.errors.IncompleteOutputError` when a constrained
        answer does not match in full."""
        reader = self.reply_parser()
        for _ in texts(_fed(chunks, reader)):
            pass
        reader.finish()
        calls = reader.openai_calls()
        return ChatReply(reader.content, reader.reasoning or None, calls,
                         "tool_calls" if calls else reader.finish_reason)


def _fed(chunks: Iterable[CompletionChunk], reader: ReplyParser) -> Iterator[CompletionChunk]:
    """``chunks``, each one's text fed to ``reader``; the last one's finish
    reason kept as ``reader.finish_reason``."""
    for c in chunks:
        reader.feed(c.text)
        if c.finish_reason is not None:
            reader.finish_reason = c.finish_reason
        yield c


class ChatModel(Protocol):
    """What planning a chat needs of a model (:class:`infer.Model` is one)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def model_type(self) -> str: ...

    def prepare(self, request: GenerationRequest) -> PreparedRequest: ...


def plan_chat(model: ChatModel, messages: Sequence[dict[str, Any]], request: GenerationRequest, *,
              template: str | None = None) -> ChatPlan:
    """What a chat request runs on ``model``: ``messages`` rendered with the
    chat template (or ``template``) and the request's tools and thinking
    options; the reasoning parser and tool-call format (the request's, else
    chosen from the template); a forced tool call (``tool_choice``
    ``"required"`` or a name) as the format's grammar; and the answer's
    constraint and thinking budget applied after the reasoning. Raises
    :class:`~infer.errors.ChatTemplateError`,
    :class:`~infer.errors.SamplingParameterError` or
    :class:`~infer.errors.StructuredOutputError` before any token."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of dicts with a 'role', got {type(messages).__name__}")
    tokenizer = model.tokenizer
    messages, images, names = image_parts(messages)
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, template=template,
                                         **request.template_options())
    # The template already holds every special token the model expects.
    media = None
    if images:  # each image part rendered as the family's placeholder, expanded to its tokens
        ids, media = model.image_prompt(text, images, add_special_tokens=False, names=names)  # type: ignore[attr-defined]
    else:
        ids = tokenizer.encode(text, add_special_tokens=False)
    named = tokenizer.chat_templates
    tools = request.tools_offered
    source = named.get(template, template) if template else named.get(
        "tool_use" if tools and "tool_use" in named else "default")
    if request.reasoning_parser == "none":
        reasoning = None
    elif request.reasoning_parser is not None:
        reasoning = get_reasoning_parser(request.reasoning_parser)
    else:
        reasoning = reasoning_parser_for(model.model_type, source)
    if request.thinking_budget is not None and reasoning is None:
        raise SamplingParameterError(
            "thinking_budget needs a reasoning model: no reasoning parser is chosen for this model's template "
            "(name one with reasoning_parser=)")
    in_reasoning = reasoning is not None and reasoning.starts_in_reasoning(text)
    fmt = parser = None
    if tools is not None:
        fmt = request.tool_parser or tool_parser_for(model.model_type, source)
        parser = get_tool_parser(fmt, tools)
        # A marker that is a special token is named by its id in a forced call's grammar.
        parser.special = {m: i for m in parser.special_markers
                          if (i := tokenizer.token_to_id(m)) is not None and i in tokenizer.special_ids}
    if request.forces_tool_call:
        assert parser is not None  # the request checked that tools come with a forced choice
        if request.json_schema is not None or request.regex is not None or request.grammar is not None:
            raise StructuredOutputError("a forced tool call (tool_choice) and a constraint on the output "
                                        "(json_schema, regex, grammar) exclude each other")
        required = request.tool_choice == "required"
        chosen = list(tools or ()) if required else [t for t in tools or () if tool_names([t]) ==
                                                       [request.tool_choice]]
        most = MAX_FORCED_CALLS if required and request.parallel_tool_calls else 1
        request = request.replace(grammar=parser.grammar(chosen, most))
    prepared = model.prepare(request)
    if reasoning is not None and (prepared.grammar is not None or request.thinking_budget is not None):
        def after_reasoning(inner: Any, parser: ReasoningParser = reasoning) -> ReasoningConstraint:
            return ReasoningConstraint(tokenizer, parser, in_reasoning, budget=request.thinking_budget,
                                       inner=inner)
        prepared.wrap = after_reasoning
    markers = ((reasoning.starts + reasoning.ends) if reasoning is not None else ()) + (
        parser.markers if parser is not None else ())
    specials = tokenizer.special_ids
    special = any(p is not None and p.needs_special_tokens for p in (reasoning, parser)) or any(
        tokenizer.token_to_id(m) in specials for m in markers)
    return ChatPlan(text, ids, prepared, reasoning, in_reasoning, parser, fmt, skip_special_tokens=not special,
                    media=media)
