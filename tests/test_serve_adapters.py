"""``infer serve`` with LoRA adapters: each adapter is a ``model`` id of its own (vLLM's
convention), listed in ``/v1/models``; two adapters in concurrent streams each give what
the library gives alone (greedy, token for token: tests/test_serve.py says why batching
cannot change a greedy choice of the tiny models); the operator's endpoints load and
unload at run time, and unloading an adapter a running stream uses is a 409.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
from adapters_reference import build_peft_adapter
from reference import tiny_model_dir
from test_serve import running

import infer
from infer.serve import create_app

pytest.importorskip("uvicorn")
PROMPT = "Once upon a time"
VARIANT = "smollm2_like"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve-adapters")
    base = tiny_model_dir(VARIANT)
    return {"a": build_peft_adapter(base, root / "a", seed=11),
            "b": build_peft_adapter(base, root / "b", r=8, use_rslora=True, seed=12)}


def test_adapters_are_models_and_concurrent_streams_equal_the_library(adapters: dict[str, Path]) -> None:
    library = infer.load(tiny_model_dir(VARIANT), backend="numpy", adapters=adapters)
    want = {name: library.generate(PROMPT, adapter=name, max_tokens=16, temperature=0, ignore_eos=True)
            for name in ("a", "b")}
    want["tiny"] = library.generate(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    assert len(set(want.values())) == 3  # the adapters change the text

    model = infer.load(tiny_model_dir(VARIANT), backend="numpy", adapters=adapters)
    app = create_app(model, model_name="tiny", enable_adapter_updates=True)
    with running(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert {m.id for m in client.models.list().data} == {"tiny", "a", "b"}
        got: dict[str, str] = {}

        def stream(name: str) -> None:
            chunks = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            got[name] = "".join(c.choices[0].text for c in chunks if c.choices)

        threads = [threading.Thread(target=stream, args=(n,)) for n in ("a", "b", "tiny", "a")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == want
        chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == library.chat([{"role": "user", "content": "Hi"}], adapter="b",
                                                               max_tokens=8, temperature=0)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="c", prompt=PROMPT, max_tokens=2)
    pool = model.batch_engine.pool
    assert pool is None or pool.stats().used == 0
    assert model.adapters.in_use("a") == 0 and model.adapters.in_use("b") == 0


def test_load_and_unload_endpoints_and_409_while_in_use(adapters: dict[str, Path]) -> None:
    model = infer.load(tiny_model_dir(VARIANT), backend="numpy")
    with running(create_app(model, model_name="tiny")) as url:  # the operator did not enable updates
        assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "x"}).status_code == 404
    with running(create_app(model, model_name="tiny", enable_adapter_updates=True)) as url:
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a"])})
        assert r.status_code == 200, r.text
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert "a" in {m.id for m in client.models.list().data}
        # A sequence that runs with "a" (as a stream's does until it ends): unloading is refused.
        held = model.engine.new_sequence(adapter="a")
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 409 and "running" in r.text
        text = client.completions.create(model="a", prompt=PROMPT, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        assert text == model.generate(PROMPT, adapter="a", max_tokens=12, temperature=0, ignore_eos=True)
        model.engine.release(held)
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 200, r.text
        assert {m.id for m in client.models.list().data} == {"tiny"}
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 404
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
        assert r.status_code == 400


def test_cli_lora_option() -> None:
    from infer.tools.cli import build_parser, lora_option

    assert lora_option("/x/adapter.gguf:0.5") == ("adapter", "/x/adapter.gguf", 0.5)
    assert lora_option("/x/my-lora") == ("my-lora", "/x/my-lora", 1.0)
    args = build_parser().parse_args(["serve", "m", "--lora", "a:2", "--lora", "b", "--enable-lora-updates"])
    assert args.lora == ["a:2", "b"] and args.enable_lora_updates
    assert build_parser().parse_args(["run", "m", "hi", "--lora", "a"]).lora == ["a"]


def test_cli_run_with_lora(adapters: dict[str, Path], capsys: Any) -> None:
    from infer.tools.cli import main

    assert main(["-q", "run", str(tiny_model_dir(VARIANT)), PROMPT, "--backend", "numpy", "-n", "6", "-t", "0",
                 "--lora", f"{adapters['a']}:1.0"]) == 0
    library = infer.load(tiny_model_dir(VARIANT), backend="numpy", adapters={"a": adapters["a"]})
    assert capsys.readouterr().out == library.generate(PROMPT, adapter="a", max_tokens=6, temperature=0) + "\n"
