"""The prefix cache's disk tier (``prompt_cache_dir``): prefix blocks that survive a restart.

A request's blocks are written to the folder as they leave use; a later process with the same
folder reads them back for a prompt that starts with them, computes only the rest, reports
the cached tokens, and answers what an uncached run answers — for full attention, sliding
windows and a hybrid's recurrent checkpoints. The folder stays under its bound, a damaged
entry is a miss, and two processes writing one folder at once leave only whole entries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from reference import tiny_model_dir
from test_serve import KEY, NAME, running

import infer
from infer.kv.state_file import read_state_file
from infer.serve import create_app

PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 250, 70)]

# Another process: a fresh model on the same folder, one request; prints its tokens and cached count.
LATER = textwrap.dedent("""
    import json, sys
    import infer
    job = json.loads(sys.argv[1])
    model = infer.load(job["model"], backend=job.get("backend", "numpy"))
    model.configure_batching(prompt_cache_dir=job["dir"], prompt_cache_bytes=job.get("bytes", 2**30))
    out = []
    for prompt in job["prompts"]:
        done = model.complete(prompt, max_tokens=4, ignore_eos=True)
        out.append({"tokens": done.token_ids, "cached": done.usage.cached_tokens})
    print(json.dumps(out))
""")


def later(variant: str, folder: Path, prompts: list[list[int]], **extra: object) -> subprocess.Popen:
    job = {"model": str(tiny_model_dir(variant)), "dir": str(folder), "prompts": prompts, **extra}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen([sys.executable, "-c", LATER, json.dumps(job)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def result(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def greedy(variant: str, prompt: list[int]) -> list[int]:
    return list(infer.load(tiny_model_dir(variant)).generate_tokens(prompt, max_tokens=4, ignore_eos=True))


@pytest.mark.parametrize("variant", ["llama3", "gemma3", "qwen3_5", "mamba2"])
def test_a_later_process_reads_the_prompt_back(variant: str, tmp_path: Path) -> None:
    model = infer.load(tiny_model_dir(variant))
    model.configure_batching(prompt_cache_dir=tmp_path)
    first = model.complete(PROMPT[:50], max_tokens=2, ignore_eos=True)
    assert first.usage.cached_tokens == 0
    assert any(tmp_path.rglob("*.kv"))
    prompt = PROMPT[:50] + PROMPT[60:66]  # the same start, another ending
    got = result(later(variant, tmp_path, [prompt]))[0]
    assert got["cached"] == 48  # every full block of the first prompt, from disk
    assert got["tokens"] == greedy(variant, prompt)


@pytest.mark.parametrize("variant", ["qwen3_5", "gemma3"])
def test_a_saved_state_is_read_back_whole_by_a_later_process(variant: str, tmp_path: Path) -> None:
    """A saved state's tail (its partial last block and final recurrent state) and the logits
    after it go to the folder too: a later process that loads no state finds all of it there."""
    model = infer.load(tiny_model_dir(variant))
    model.configure_batching(prompt_cache_dir=tmp_path)
    model.save_state(tmp_path / "saved.state", PROMPT[:45])
    assert any(tmp_path.rglob("*.logits"))
    exact, longer = PROMPT[:45], PROMPT[:45] + PROMPT[60:66]
    got = result(later(variant, tmp_path, [longer, exact]))
    assert got[0]["cached"] == 45  # the tail read back too, not just the 2 full blocks
    assert got[0]["tokens"] == greedy(variant, longer)
    assert got[1]["cached"] == 45  # every saved position, and the logits after them from disk: nothing computed
    assert got[1]["tokens"] == greedy(variant, exact)


def test_the_folder_stays_under_its_bound(tmp_path: Path) -> None:
    model = infer.load(tiny_model_dir("llama3"))
    model.configure_batching(prompt_cache_dir=tmp_path, prompt_cache_bytes=40_000)
    rng = np.random.default_rng(9)
    for _ in range(6):
        model.complete([int(t) for t in rng.integers(3, 250, 40)], max_tokens=1)
        assert sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()) <= 40_000
    assert model.batch_engine.pool.disk.writes > 6  # blocks were written (and the oldest trimmed)


def test_a_damaged_entry_is_a_miss(tmp_path: Path) -> None:
    model = infer.load(tiny_model_dir("llama3"))
    model.configure_batching(prompt_cache_dir=tmp_path)
    model.complete(PROMPT[:40], max_tokens=1)
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) == 2
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[-3] ^= 0xFF
        f.write_bytes(bytes(raw))
    got = result(later("llama3", tmp_path, [PROMPT[:44]]))[0]
    assert got["cached"] == 0 and got["tokens"] == greedy("llama3", PROMPT[:44])


def test_two_processes_share_one_folder(tmp_path: Path) -> None:
    prompts = [PROMPT[:40] + PROMPT[i:i + 8] for i in range(40, 60, 4)]
    a, b = later("llama3", tmp_path, prompts), later("llama3", tmp_path, prompts[::-1])
    want = {tuple(p): greedy("llama3", p) for p in prompts}
    for out, order in ((result(a), prompts), (result(b), prompts[::-1])):
        assert [o["tokens"] for o in out] == [want[tuple(p)] for p in order]
    entries = list(tmp_path.rglob("*.kv"))
    assert entries
    for f in entries:  # only whole, valid entries
        read_state_file(f)
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    third = result(later("llama3", tmp_path, [prompts[0]]))[0]
    assert third["cached"] == 32 and third["tokens"] == greedy("llama3", prompts[0])


def test_a_restarted_server_reports_the_cached_system_prompt(tmp_path: Path) -> None:
    import httpx2 as httpx

    system = ("You are a careful assistant who answers in short sentences, cites nothing, and never makes up "
              "facts; when unsure you say so plainly and suggest where to look.")

    def chat(url: str, question: str) -> dict:
        body = {"model": NAME, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=120)
        return r.json()

    def server() -> object:
        model = infer.load(tiny_model_dir("smollm2_like"))
        model.configure_batching(prompt_cache_dir=tmp_path)
        return running(create_app(model, model_name=NAME, api_key=KEY))

    with server() as url:
        first = chat(url, "What is a KV cache?")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    with server() as url:  # a restart: nothing in memory
        second = chat(url, "And what is paging?")
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 and cached % 16 == 0 and cached < second["usage"]["prompt_tokens"]
