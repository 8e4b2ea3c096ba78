"""Hostile HTTP: every malformed or abusive body gets a 4xx in its API's error shape, never a 5xx or a hang.

The bodies are sent raw (httpx), to every generation endpoint: non-JSON,
wrong types, NaN, out-of-vocabulary token ids, huge ``n``, ``logprobs`` and
``max_tokens``, 10,000 stop strings, deep nesting, lone surrogates and bad
schemas; then hypothesis throws arbitrary JSON at them. A client that sends
half a body and goes silent is answered 408 without holding anything.
Afterwards the server still answers and its KV pool holds no page.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import tiny_model_dir
from test_serve import KEY, NAME, running, settled

import infer
from infer.serve import create_app

ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"]
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    model = infer.load(tiny_model_dir("smollm2_like"), backend="numpy")
    with running(create_app(model, model_name=NAME, api_key=KEY, body_timeout=1.0)) as base:
        yield base


def valid(endpoint: str) -> dict[str, Any]:
    """A small valid body of ``endpoint``."""
    if endpoint == "/v1/completions":
        return {"model": NAME, "prompt": "Hi", "max_tokens": 2}
    if endpoint == "/v1/responses":
        return {"model": NAME, "input": "Hi", "max_output_tokens": 2}
    return {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def post(url: str, endpoint: str, content: bytes | str) -> httpx.Response:
    return httpx.post(url + endpoint, headers=HEADERS, content=content, timeout=30)


def assert_shaped_4xx(reply: httpx.Response, endpoint: str) -> dict[str, Any]:
    assert 400 <= reply.status_code < 500, (endpoint, reply.status_code, reply.text[:300])
    body = reply.json()
    if endpoint == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"]
        return {"message": body["error"]["message"], "param": None}
    assert body["error"]["message"] and "type" in body["error"]
    return body["error"]


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def hostile(endpoint: str) -> list[tuple[str, bytes | str]]:
    """(what, body) pairs every endpoint must refuse."""
    base = valid(endpoint)
    dumps = json.dumps
    out: list[tuple[str, bytes | str]] = [
        ("empty", b""),
        ("not json", b"{nope"),
        ("not utf-8", b"\xff\xfe{}"),
        ("a list", b"[]"),
        ("a number", b"3"),
        ("NaN temperature", dumps(base).replace('"max_', '"temperature": NaN, "max_')),
        ("infinite top_p", dumps(base).replace('"max_', '"top_p": Infinity, "max_')),
        ("deep nesting", '{"model": "tiny", "x": ' + deep(5000) + "}"),
        ("nesting past the limit", dumps({**base, "metadata": json.loads(deep(100))})),
        ("lone surrogate", dumps(base).replace('"Hi"', '"\\ud800"')),
        ("wrong model type", dumps({**base, "model": 5})),
        ("huge max_tokens as a string", dumps({**base, "max_tokens": "1e999"})),
        ("negative max_tokens", dumps({**base, "max_tokens": -1, "max_output_tokens": -1})),
        ("unknown field", dumps({**base, "tfs_z": 2})),
        ("mirostat 3", dumps({**base, "mirostat": 3})),
        ("negative dry_base", dumps({**base, "dry_base": -1})),
        ("xtc_probability 2", dumps({**base, "xtc_probability": 2})),
        ("an unknown sampler", dumps({**base, "samplers": ["top_k", "nope"]})),
    ]
    if endpoint == "/v1/completions":
        out += [("out-of-vocabulary ids", dumps({**base, "prompt": [1, 2, 10**9]})),
                ("negative ids", dumps({**base, "prompt": [-1]})),
                ("huge n", dumps({**base, "n": 10**6})),
                ("huge logprobs", dumps({**base, "logprobs": 10**6})),
                ("10,000 stops", dumps({**base, "stop": ["x"] * 10_000})),
                ("prompt a dict", dumps({**base, "prompt": {"a": 1}})),
                ("bad schema", dumps({**base, "response_format": {"type": "json_schema",
                                                                  "json_schema": {"schema": {"type": 7}}}}))]
    if endpoint == "/v1/chat/completions":
        out += [("messages a string", dumps({**base, "messages": "hi"})),
                ("no messages", dumps({**base, "messages": []})),
                ("content a number", dumps({**base, "messages": [{"role": "user", "content": 5}]})),
                ("huge n", dumps({**base, "n": 10**6})),
                ("huge top_logprobs", dumps({**base, "logprobs": True, "top_logprobs": 10**6})),
                ("10,000 stops", dumps({**base, "stop": ["x"] * 10_000})),
                ("bad schema", dumps({**base, "response_format": {"type": "json_schema",
                                                                  "json_schema": {"schema": {"type": "nope"}}}})),
                ("schema not an object", dumps({**base, "response_format": {"type": "json_schema",
                                                                            "json_schema": {"schema": "x"}}})),
                ("bad tools", dumps({**base, "tools": [{"type": "function", "function": {"name": 5}}]})),
                ("forced call, no tools", dumps({**base, "tool_choice": "required"})),
                ("forced call with a bad schema", dumps({**base, "tool_choice": "required", "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]})),
                ("logit_bias out of vocabulary", dumps({**base, "logit_bias": {"99999999": 1}}))]
    if endpoint == "/v1/messages":
        out += [("no max_tokens", dumps({"model": NAME, "messages": base["messages"]})),
                ("max_tokens 0", dumps({**base, "max_tokens": 0})),  # Anthropic requires at least 1
                ("10,000 stop sequences", dumps({**base, "stop_sequences": ["x"] * 10_000})),
                ("role system in messages", dumps({**base, "messages": [{"role": "system", "content": "x"}]})),
                ("image block", dumps({**base, "messages": [{"role": "user", "content": [{"type": "image"}]}]})),
                ("bad thinking", dumps({**base, "thinking": {"type": "enabled", "budget_tokens": -5}})),
                ("bad output schema", dumps({**base, "output_config": {"format": {"type": "json_schema",
                                                                                  "schema": {"type": "nope"}}}}))]
    if endpoint == "/v1/responses":
        out += [("input a number", dumps({**base, "input": 5})),
                ("empty input items", dumps({**base, "input": []})),
                ("unknown item", dumps({**base, "input": [{"type": "computer_call"}]})),
                ("previous_response_id", dumps({**base, "previous_response_id": "resp_x"})),
                ("bad text format", dumps({**base, "text": {"format": {"type": "json_schema", "schema": 3}}}))]
    return out


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_hostile_bodies_are_4xx_in_the_apis_shape(url: str, endpoint: str) -> None:
    for what, content in hostile(endpoint):
        reply = post(url, endpoint, content)
        error = assert_shaped_4xx(reply, endpoint)
        assert error["message"], what
    # Named problems are named.
    if endpoint != "/v1/messages":
        body = hostile(endpoint)
        nan = post(url, endpoint, dict(body)["NaN temperature"])
        assert "NaN" in nan.json()["error"]["message"]
        nested = post(url, endpoint, dict(body)["nesting past the limit"])
        assert "nests deeper" in nested.json()["error"]["message"]
    assert post(url, endpoint, json.dumps(valid(endpoint))).status_code == 200


def test_specific_refusals_name_the_problem(url: str) -> None:
    ids = post(url, "/v1/completions", json.dumps({**valid("/v1/completions"), "prompt": [1, 10**9]})).json()
    assert ids["error"]["param"] == "prompt" and str(10**9) in ids["error"]["message"]
    stops = post(url, "/v1/chat/completions", json.dumps({**valid("/v1/chat/completions"), "stop": ["x"] * 10_000}))
    assert stops.json()["error"]["param"] == "stop" and "10000" in stops.json()["error"]["message"]
    schema = post(url, "/v1/chat/completions", json.dumps({**valid("/v1/chat/completions"), "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}})).json()
    assert schema["error"]["param"] == "response_format" and "nope" in schema["error"]["message"]


JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) |
                    st.text(max_size=10), lambda kids: st.lists(kids, max_size=4) |
                    st.dictionaries(st.text(max_size=6), kids, max_size=4), max_leaves=12)
FIELDS = ["model", "prompt", "messages", "input", "max_tokens", "max_output_tokens", "n", "stop", "stop_sequences",
          "temperature", "top_p", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format", "text",
          "system", "thinking", "logit_bias", "seed", "echo", "stream", "instructions", "role", "content"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(endpoint=st.sampled_from(ENDPOINTS), body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6),
       keep=st.booleans())
def test_arbitrary_json_never_gets_a_5xx(url: str, endpoint: str, body: dict[str, Any], keep: bool) -> None:
    if keep:  # near a valid request: the valid body with some fields replaced
        body = {**valid(endpoint), **body}
        for key in ("max_tokens", "max_output_tokens"):
            if not isinstance(body.get(key), int) or body[key] > 8:
                body[key] = 2
        body["n"] = 1 if endpoint in ("/v1/completions", "/v1/chat/completions") else body.get("n", 1)
        body.pop("n", None) if endpoint in ("/v1/responses", "/v1/messages") else None
        body["stream"] = False
    reply = post(url, endpoint, json.dumps(body))
    assert reply.status_code < 500, (body, reply.text[:300])
    if reply.status_code >= 400:
        assert_shaped_4xx(reply, endpoint)


def test_half_a_request_then_silence_is_a_408_and_holds_nothing(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"model\": ".encode())
        start = time.monotonic()
        reply = sock.recv(4096).decode()
        assert time.monotonic() - start < 8
    assert reply.startswith("HTTP/1.1 408"), reply[:200]
    # Meanwhile and afterwards the server serves.
    assert post(url, "/v1/completions", json.dumps(valid("/v1/completions"))).status_code == 200


def test_many_silent_clients_hold_no_one_up(url: str) -> None:
    """Clients that stop halfway through their headers or their body, many at once: the next
    request is answered as fast as ever."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    try:
        for i in range(24):
            sock = socket.create_connection((host, int(port)), timeout=10)
            head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            sock.sendall((head if i % 2 else head + "Content-Length: 900\r\n\r\n{\"prompt\": ").encode())
            socks.append(sock)
        start = time.monotonic()
        assert post(url, "/v1/completions", json.dumps(valid("/v1/completions"))).status_code == 200
        assert time.monotonic() - start < 5
    finally:
        for sock in socks:
            sock.close()


def test_after_all_that_the_server_serves_and_its_pool_is_empty(url: str) -> None:
    for endpoint in ENDPOINTS:
        assert post(url, endpoint, json.dumps(valid(endpoint))).status_code == 200
    m = settled(url)
    assert (m["infer_requests_running"], m["infer_requests_waiting"], m["infer_kv_blocks_used"]) == (0, 0, 0)
    assert httpx.get(url + "/health").json() == {"status": "ok"}
