"""``POST /slots/{name}?action=save|restore|erase`` and cached tokens in the APIs' usage.

A slot is a named state file in ``--slot-save-path``. One server saves a long system prompt's
state; a second server, with a fresh model (nothing cached), restores it, and a chat request
that starts with that conversation reports the saved tokens as cached — in OpenAI's
``usage.prompt_tokens_details.cached_tokens`` and Anthropic's ``cache_read_input_tokens`` —
and answers what the model answers without any cache. Names are confined to the folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
from reference import load_tiny, tiny_model_dir
from test_serve import KEY, NAME, running

import infer
from infer.serve import create_app

SYSTEM = ("You are a careful assistant who answers in short sentences, cites nothing, and never makes up facts; "
          "when unsure you say so plainly and suggest where to look.")
CONVERSATION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a KV cache?"}]
AUTH = {"Authorization": f"Bearer {KEY}"}


def serve(folder: Path | None) -> Any:
    model = infer.load(tiny_model_dir("smollm2_like"), backend="numpy")
    return running(create_app(model, model_name=NAME, api_key=KEY, slot_save_path=folder))


def slot(url: str, name: str, action: str, body: Any = None) -> httpx.Response:
    return httpx.post(f"{url}/slots/{name}?action={action}", json=body, headers=AUTH, timeout=120)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    folder = tmp_path_factory.mktemp("slots")
    with serve(folder) as url:
        r = slot(url, "assistant", "save", {"messages": CONVERSATION})
        assert r.status_code == 200, r.text
        out = r.json()
    assert out["n_saved"] > 16 and out["n_written"] == (folder / "assistant").stat().st_size
    return folder, out["n_saved"]


@pytest.fixture(scope="module")
def restored(saved: tuple[Path, int]) -> Iterator[tuple[str, int]]:
    folder, n = saved
    with serve(folder) as url:  # a fresh model: its prefix cache holds nothing
        r = slot(url, "assistant", "restore")
        assert r.status_code == 200, r.text
        assert r.json()["n_restored"] == n and r.json()["n_cached"] == n
        yield url, n


def test_a_restored_slot_is_reported_as_cached_tokens(restored: tuple[str, int]) -> None:
    url, n = restored
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(model=NAME, messages=CONVERSATION, max_tokens=8, temperature=0)
    assert reply.usage.prompt_tokens_details.cached_tokens == n
    want = load_tiny("smollm2_like").chat(CONVERSATION, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == want


def test_anthropic_reports_cache_read_input_tokens(restored: tuple[str, int]) -> None:
    url, n = restored
    body = {"model": NAME, "max_tokens": 4, "system": SYSTEM, "messages": CONVERSATION[1:]}
    r = httpx.post(url + "/v1/messages", json=body, headers={**AUTH, "anthropic-version": "2023-06-01"}, timeout=60)
    usage = r.json()["usage"]
    assert usage["cache_read_input_tokens"] == n
    count = httpx.post(url + "/v1/messages/count_tokens", json={k: body[k] for k in ("model", "system", "messages")},
                       headers={**AUTH, "anthropic-version": "2023-06-01"}).json()["input_tokens"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == count


def test_a_prompt_without_a_hit_reports_none_cached(restored: tuple[str, int]) -> None:
    url, _ = restored
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    reply = client.completions.create(model=NAME, prompt="Completely unrelated words here", max_tokens=2)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("name", ["%2E%2E%2Fescape", "..", ".hidden", "a%2Fb", "..%5Cx", "x" * 200])
def test_slot_names_cannot_leave_the_folder(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "slots"
    with serve(folder) as url:
        r = slot(url, name, "save", {"prompt": "Hello there"})
    assert r.status_code in (400, 404), r.text
    if r.status_code == 400:
        assert r.json()["error"]["code"] == "invalid_slot_name"
    assert list(tmp_path.rglob("*")) == [folder]  # nothing written anywhere


def test_erase_restore_and_bad_requests(tmp_path: Path) -> None:
    with serve(tmp_path) as url:
        assert slot(url, "p", "save", {"prompt": [5, 6, 7, 8, 9] * 5}).json()["n_saved"] == 25
        assert slot(url, "p", "restore").status_code == 200
        assert slot(url, "p", "erase").json()["n_erased"] == 1
        assert not (tmp_path / "p").exists()
        assert slot(url, "p", "erase").status_code == 404
        assert slot(url, "p", "restore").status_code == 404
        assert slot(url, "p", "delete").status_code == 400
        assert slot(url, "p", "save", {"prompt": []}).status_code == 400
        assert slot(url, "p", "save", {"prompt": "x", "messages": CONVERSATION}).status_code == 400
        (tmp_path / "junk").write_bytes(b"not a state file at all")
        r = slot(url, "junk", "restore")
        assert r.status_code == 400 and "state file" in r.json()["error"]["message"]


def test_slots_are_off_without_a_folder() -> None:
    with serve(None) as url:
        r = slot(url, "p", "save", {"prompt": "Hello"})
    assert r.status_code == 501 and r.json()["error"]["code"] == "slots_disabled"
