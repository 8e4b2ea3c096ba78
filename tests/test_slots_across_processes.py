"""Slots saved by one server process and restored by ANOTHER process, on hybrid and windowed models.

One server (this process) saves, per model, a conversation and a prompt of token ids as slots.
A second process starts its own servers on fresh models (nothing cached), restores the slots
and serves: a chat request going on from the conversation (OpenAI and Anthropic), and a
completion of exactly the saved token ids. Each must report the saved tokens as cached —
``usage.prompt_tokens_details.cached_tokens``, ``cache_read_input_tokens`` — and answer
what an uncached model answers. Qwen3.5 (gated DeltaNet beside attention), Granite 4.0-H
(Mamba2 beside attention) and Gemma 3 (sliding windows): the families whose restored
prompts llama.cpp recomputes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
from reference import tiny_model_dir
from test_serve import KEY, NAME, running

import infer
from infer.serve import create_app

VARIANTS = ("qwen3_5", "granitemoehybrid", "gemma3")
SYSTEM = ("You are a careful assistant who answers in short sentences, cites nothing, and never makes up facts; "
          "when unsure you say so plainly and suggest where to look.")
CONVERSATION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a KV cache?"}]
#: A prompt of token ids ending inside a block (2 blocks of 16 and a tail of 13).
IDS = [int(t) for t in np.random.default_rng(3).integers(3, 250, 45)]
AUTH = {"Authorization": f"Bearer {KEY}"}
ANTHROPIC = {**AUTH, "anthropic-version": "2023-06-01"}

# The second process: per model a fresh server on the slot folder; restore, then the requests.
LATER = textwrap.dedent("""
    import json, sys
    import httpx2 as httpx
    import infer
    from infer.serve import create_app
    from test_serve import running
    job = json.loads(sys.argv[1])
    auth = {"Authorization": "Bearer " + job["key"]}
    out = {}
    for variant, folder in job["folders"].items():
        model = infer.load(job["dirs"][variant], backend="numpy")
        with running(create_app(model, model_name=job["name"], api_key=job["key"], slot_save_path=folder)) as url:
            post = lambda path, body, headers=auth: httpx.post(url + path, json=body, headers=headers, timeout=300)
            restored = {s: post("/slots/" + s + "?action=restore", None).json() for s in ("chat", "ids")}
            chat = post("/v1/chat/completions", {"model": job["name"], "messages": job["messages"],
                                                 "max_tokens": 6, "temperature": 0}).json()
            anthropic = post("/v1/messages", {"model": job["name"], "max_tokens": 6, "system": job["system"],
                                              "messages": job["messages"][1:], "temperature": 0},
                             {**auth, "anthropic-version": "2023-06-01"}).json()
            completion = post("/v1/completions", {"model": job["name"], "prompt": job["ids"], "max_tokens": 4,
                                                  "temperature": 0}).json()
            out[variant] = {"restored": restored, "chat": chat, "anthropic": anthropic, "completion": completion}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folders, saved, want = {}, {}, {}
    for variant in VARIANTS:
        folder = tmp_path_factory.mktemp(f"slots-{variant}")
        with running(create_app(infer.load(tiny_model_dir(variant)), model_name=NAME, api_key=KEY,
                                slot_save_path=folder)) as url:
            saved[variant] = {}
            for slot, body in (("chat", {"messages": CONVERSATION}), ("ids", {"prompt": IDS})):
                r = httpx.post(f"{url}/slots/{slot}?action=save", json=body, headers=AUTH, timeout=300)
                assert r.status_code == 200, r.text
                saved[variant][slot] = r.json()["n_saved"]
        folders[variant] = str(folder)
        fresh = infer.load(tiny_model_dir(variant))  # no cache: the answers to match
        want[variant] = {"chat": fresh.chat(CONVERSATION, max_tokens=6, temperature=0),
                         "completion": fresh.complete(IDS, max_tokens=4, temperature=0).text}
    job = {"folders": folders, "dirs": {v: str(tiny_model_dir(v)) for v in VARIANTS}, "key": KEY, "name": NAME,
           "messages": CONVERSATION, "system": SYSTEM, "ids": IDS}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", LATER, json.dumps(job)], capture_output=True, text=True, env=env,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return {"got": json.loads(run.stdout.strip().splitlines()[-1]), "saved": saved, "want": want}


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_slot_restored_by_another_process_is_reported_cached(served: dict, variant: str) -> None:
    got, saved, want = served["got"][variant], served["saved"][variant], served["want"][variant]
    n = saved["chat"]
    assert n > 16 and saved["ids"] == len(IDS)
    for slot in ("chat", "ids"):  # every saved token entered the new process's prefix cache
        assert got["restored"][slot]["n_restored"] == got["restored"][slot]["n_cached"] == saved[slot]
    # The next turn: the saved conversation is cached, the generation prompt after it computed.
    chat = got["chat"]
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    assert n < chat["usage"]["prompt_tokens"]
    assert chat["choices"][0]["message"]["content"] == want["chat"]
    # Anthropic: the same prompt; input_tokens counts only what was not read from the cache.
    usage = got["anthropic"]["usage"]
    assert usage["cache_read_input_tokens"] == n
    assert usage["input_tokens"] + n == chat["usage"]["prompt_tokens"]
    assert got["anthropic"]["content"][0]["text"] == want["chat"]
    # Exactly the saved token ids: all of them cached, the first token drawn from the saved logits.
    completion = got["completion"]
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] == len(IDS)
    assert completion["choices"][0]["text"] == want["completion"]
