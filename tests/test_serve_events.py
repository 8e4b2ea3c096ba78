"""The chat APIs' stream states fed by hand: what one reply of reasoning, text,
a tool call and text again streams as, event by event, with no server.

The clients' tests (tests/test_serve*.py) drive these through real requests;
here the paths a tiny model rarely takes are pinned down: a reasoning block
closed by the answer, a call between two pieces of text, the indices and
sequence numbers across all of them.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("starlette")

from infer.chat import Delta  # noqa: E402
from infer.serve.anthropic import MessageStream  # noqa: E402
from infer.serve.responses import ResponsesRequest, ResponseStream  # noqa: E402
from infer.tool_parsers import Call  # noqa: E402

CALL = Call("get_weather", '{"city": "Paris"}')
DELTAS = [Delta("reasoning", "Hm"), Delta("reasoning", "m."), Delta("content", "Let me see."),
          Delta("tool_call", index=0, call_id="call_1", call=CALL), Delta("content", "Done.")]


def finished_choice() -> Any:
    """What the stream states read of a choice that said :data:`DELTAS` and stopped."""
    reply = SimpleNamespace(reasoning="Hmm.", content="Let me see.Done.", calls=[(0, "call_1", CALL)])
    return SimpleNamespace(index=0, tokens=9, cached_tokens=0, finish_reason="stop", reply=reply,
                           text=SimpleNamespace(stop_string=None))


def fed(events: Any) -> list[dict[str, Any]]:
    out = events.start()
    for d in DELTAS:
        out += events.delta(d)
    return out + events.finish()


def test_messages_blocks_open_and_close_in_order() -> None:
    out = fed(MessageStream(finished_choice(), "tiny", prompt_tokens=4))
    shape = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type")) for e in out]
    assert shape == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "text"), ("content_block_delta", 3, "text_delta"), ("content_block_stop", 3, None),
        ("message_delta", None, None), ("message_stop", None, None)]
    assert out[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert out[-2]["usage"] == {"output_tokens": 9}
    assert out[9]["content_block"] == {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    assert json.loads(out[10]["delta"]["partial_json"]) == {"city": "Paris"}


def test_responses_items_and_sequence_numbers() -> None:
    body = ResponsesRequest(model="tiny", input="Hi")
    events = ResponseStream(finished_choice(), body, "tiny", prompt_tokens=4,
                            tokenizer=SimpleNamespace(encode=lambda text, add_special_tokens: list(text)))
    out = fed(events)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    added = [(e["output_index"], e["item"]["type"]) for e in out if e["type"] == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message"), (2, "function_call"), (3, "message")]
    done = [e["item"] for e in out if e["type"] == "response.output_item.done"]
    assert [item.get("content", [{}])[0].get("text") for item in done] == ["Hmm.", "Let me see.", None, "Done."]
    final = out[-1]["response"]
    assert out[-1]["type"] == "response.completed" and final["status"] == "completed" and final["output"] == done
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 4}
    assert [e["delta"] for e in out if e["type"].endswith(".delta")] == ["Hm", "m.", "Let me see.",
                                                                         '{"city": "Paris"}', "Done."]


def test_the_server_has_every_member_the_endpoints_use_with_its_signature() -> None:
    """:class:`~infer.serve.protocol.ServerLike` names what endpoints use of the server; the server must keep
    it (a static checker proves the same at each call; this holds without one)."""
    import inspect

    from infer.serve.app import Server
    from infer.serve.protocol import ServerLike

    methods = [name for name, value in vars(ServerLike).items() if inspect.isfunction(value) and name[0] != "_"]
    assert len(methods) > 10
    for name in methods:
        want = inspect.signature(getattr(ServerLike, name))
        got = inspect.signature(getattr(Server, name))
        assert list(got.parameters) == list(want.parameters), name
        assert inspect.iscoroutinefunction(getattr(Server, name)) == inspect.iscoroutinefunction(
            getattr(ServerLike, name)), name
    source = inspect.getsource(Server.__init__)  # the attributes, which the server sets as it starts
    assert set(ServerLike.__annotations__) == {"model", "name", "loop", "slot_save_path"}
    assert all(f"self.{name} = " in source for name in ServerLike.__annotations__)
