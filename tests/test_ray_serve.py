"""examples/ray-serve: two Ray Serve replicas of ``infer serve`` behind one endpoint.

One local Ray instance (2 CPUs, no dashboard) for the module; the example's
:func:`infer_ray_serve.build` deploys two replicas of the tiny random
llama-family model on numpy, half a CPU each, behind Serve's proxy on a free
port of 127.0.0.1. The official ``openai`` client talks to the proxy, and what
comes back is compared with what the same model gives in this process
(``Model.generate`` / ``Model.chat``), token for token, as tests/test_serve.py
does for one server. Each answer names its replica (``X-Infer-Replica``), which
is how the test knows both served.

The example is imported from its folder when it is not installed (CI installs
it: ``pip install -e examples/ray-serve``); the replicas find it on the
``PYTHONPATH`` of the Ray instance's runtime environment.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install \"ray[serve]\")")
serve = pytest.importorskip("ray.serve", reason="ray serve is not installed (pip install \"ray[serve]\")")

import httpx2 as httpx  # noqa: E402
import openai  # noqa: E402
from reference import load_tiny, tiny_model_dir  # noqa: E402

from infer.serve import load_app  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ray-serve"
try:
    import infer_ray_serve
except ImportError:
    sys.path.insert(0, str(EXAMPLE))
    import infer_ray_serve

NAME = "tiny"
KEY = "sk-ray-test"
APP = "infer-test"
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Hello! How are you today?"}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def reference() -> Any:
    """The same model through the Python API, in this process."""
    return load_tiny("smollm2_like")


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """Two replicas behind Serve's proxy; yields the proxy's base URL."""
    path = os.pathsep.join(p for p in (str(EXAMPLE), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = infer_ray_serve.ReplicaArgs(model=str(tiny_model_dir("smollm2_like")), backend="numpy",
                                           model_name=NAME, api_key=KEY, num_replicas=2, num_cpus=0.5)
        serve.run(infer_ray_serve.build(args), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def client(endpoint: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_two_replicas_run_and_are_healthy(endpoint: str) -> None:
    status = serve.status().applications[APP]
    assert status.status == "RUNNING"
    (deployment,) = status.deployments.values()
    assert deployment.replica_states == {"RUNNING": 2}
    health = httpx.get(endpoint + "/health")  # no key: for load balancers
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert health.headers[infer_ray_serve.REPLICA_HEADER]


def test_both_replicas_answer_greedy_completions_as_infer_does(client: openai.OpenAI, reference: Any) -> None:
    prompts = [PROMPT, "The capital of France is", "Numbers are words too:", "A B C"] * 4
    want = {p: reference.generate(p, max_tokens=12, temperature=0) for p in set(prompts)}

    def ask(prompt: str) -> tuple[str, str]:
        raw = client.completions.with_raw_response.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
        return raw.parse().choices[0].text, raw.headers[infer_ray_serve.REPLICA_HEADER]

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, prompts))
    assert [text for text, _ in answers] == [want[p] for p in prompts]
    replicas = {replica for _, replica in answers}
    assert len(replicas) == 2, replicas  # Serve spread the 16 requests over both


def test_replica_endpoint_names_two_processes(endpoint: str) -> None:
    # One request at a time may all go to one replica (Serve routes on the queue lengths it has
    # cached); requests that overlap are spread, as in the test above.
    def ask(_: int) -> tuple[str, dict[str, Any]]:
        reply = httpx.get(endpoint + "/replica", headers={"Authorization": f"Bearer {KEY}"})
        return reply.headers[infer_ray_serve.REPLICA_HEADER], reply.json()

    seen: dict[str, int] = {}
    with ThreadPoolExecutor(8) as pool:
        for _ in range(10):
            for header, info in pool.map(ask, range(16)):
                assert header == info["replica_id"]
                seen[info["replica_id"]] = info["pid"]
            if len(seen) == 2:
                break
    assert len(seen) == 2 and len(set(seen.values())) == 2 and os.getpid() not in seen.values(), seen
    assert httpx.get(endpoint + "/replica").status_code == 401  # behind the key, as all but /health


def test_streamed_completion_equals_generate(client: openai.OpenAI, reference: Any) -> None:
    want = reference.generate(PROMPT, max_tokens=20, temperature=0, ignore_eos=True)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 20


def test_chat_whole_and_streamed_equal_model_chat(client: openai.OpenAI, reference: Any) -> None:
    want = reference.chat(MESSAGES, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=0)
    assert whole.choices[0].message.content == want
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_errors_come_through_the_proxy(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    bad = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)


def test_the_health_check_asks_the_apps_own_health() -> None:
    """What ``InferReplica.check_health`` calls, in process: 503 while the
    engine thread is not running (Serve then replaces the replica), 200 while it is."""
    app = load_app(tiny_model_dir("smollm2_like"), backend="numpy")
    loop = app.state.server.loop
    assert asyncio.run(infer_ray_serve._get_status(app, "/health")) == 503
    loop.start()
    try:
        assert asyncio.run(infer_ray_serve._get_status(app, "/health")) == 200
    finally:
        loop.stop()
    assert asyncio.run(infer_ray_serve._get_status(app, "/health")) == 503


def test_deleting_the_app_lets_a_stream_in_flight_finish(client: openai.OpenAI, endpoint: str,
                                                         reference: Any) -> None:
    """Serve drains a replica before it stops it: a stream that has begun
    gets every token; then the endpoint has no route (404). Runs last."""
    want = reference.generate(PROMPT, max_tokens=48, temperature=0, ignore_eos=True)
    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=48, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = [next(chunks).choices[0].text]
    deleting = threading.Thread(target=serve.delete, args=(APP,))
    deleting.start()
    text += [c.choices[0].text for c in chunks if c.choices]
    deleting.join(60)
    assert not deleting.is_alive()
    assert "".join(text) == want
    deadline = time.monotonic() + 30
    while httpx.get(endpoint + "/health").status_code != 404 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(endpoint + "/health").status_code == 404
