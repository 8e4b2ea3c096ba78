"""``infer serve`` under concurrent streaming clients: latency and throughput (issue 18).

    python benchmarks/serve.py [--model smollm2-135m] [--backend numpy] [--concurrency 1,8,32,64]
                               [--prompt-tokens 64] [--new-tokens 64] [--out FILE] [--plot FILE]

The committed results (benchmarks/results/serve*.json, .png) were measured with
``--prompt-tokens 32 --new-tokens 32`` on a 2-core machine shared with other
work: ``serve.json`` with ``OPENBLAS_NUM_THREADS=1``, ``serve-blas-threads.json``
with OpenBLAS's default threads (see docs/performance.md, "Serving").

The server runs as its own process (``infer serve``, so the clients do not
share its interpreter), on a free port of 127.0.0.1. For each level N, N
clients send one streaming completion each at the same moment (different
prompts of ``--prompt-tokens`` tokens, greedy, ``--new-tokens`` tokens with
end-of-sequence ignored) and time what comes back:

* TTFT — from sending the request to the first chunk with text;
* inter-token — between a request's successive chunks with text (a chunk is
  one token's text except where a token completes no character, when the
  next chunk carries two: the gaps are per chunk);
* output tok/s — the completion tokens of all N requests (their ``usage``)
  over the wall time from the first request sent to the last one done.

p50 and p99 are over every request (TTFT) or every gap (inter-token) of a
level. Writes a JSON report and a PNG plot. llama.cpp's server is measured
the same way when llama-cpp-python's ``[server]`` extra is installed
(``--llama-cpp GGUF``); it is not on this project's machines (building
llama.cpp takes longer than the benchmark).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx

from infer.tools import bench

ROOT = Path(__file__).resolve().parent.parent
NAME = "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "infer.tools.cli", "-q", "serve", args.model, "--port", str(port),
           "--model-name", NAME, "--max-queue", "1024"]
    if args.backend:
        cmd += ["--backend", args.backend]
    if args.kv_memory:
        cmd += ["--kv-memory", args.kv_memory]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"infer serve exited: {server.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("infer serve did not answer /health within 10 minutes")


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    body = {"model": NAME, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    times, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    done = time.perf_counter()
    return {"ttft": times[0] - sent, "gaps": [b - a for a, b in zip(times, times[1:])], "tokens": tokens,
            "sent": sent, "done": done}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def level(url: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        results = await asyncio.gather(*(one_request(client, url, p, new_tokens) for p in prompts))
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    ttft = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in results)
    return {
        "clients": len(prompts), "wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p99_ms": 1e3 * _percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * statistics.median(gaps), "itl_p99_ms": 1e3 * _percentile(gaps, 0.99),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["levels"]
    n = [r["clients"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(n, [r["output_tok_s"] for r in rows], "o-")
    axes[0].set(title="output tokens/s", xlabel="concurrent clients", xscale="log")
    for key, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "o--")):
        axes[1].plot(n, [r[key] for r in rows], style, label=key[5:8])
    axes[1].set(title="time to first token (ms)", xlabel="concurrent clients", xscale="log", yscale="log")
    for key, style in (("itl_p50_ms", "o-"), ("itl_p99_ms", "o--")):
        axes[2].plot(n, [r[key] for r in rows], style, label=key[4:7])
    axes[2].set(title="inter-token latency (ms)", xlabel="concurrent clients", xscale="log")
    for ax in axes[1:]:
        ax.legend()
    machine = result["machine"]
    blas = (result.get("env") or {}).get("OPENBLAS_NUM_THREADS") or "default"
    fig.suptitle(f"infer serve, {result['model']} on {result['backend']} (OpenBLAS threads: {blas}), "
                 f"{machine.get('cpu')} ({machine.get('cores')} cores, shared), "
                 f"{result['prompt_tokens']}+{result['new_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--kv-memory", default=None, help="passed to infer serve --kv-memory")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve.json"))
    parser.add_argument("--plot", default=str(ROOT / "benchmarks" / "results" / "serve.png"))
    args = parser.parse_args(argv)
    levels = [int(n) for n in args.concurrency.split(",")]

    from infer import catalog

    path = Path(args.model) if Path(args.model).exists() else catalog.fetch(args.model)
    # Each prompt starts 7 tokens further into the benchmark text: no two share a prefix block.
    base = bench.prompt_ids(path, args.prompt_tokens + 7 * max(levels))
    prompts = [base[i * 7:i * 7 + args.prompt_tokens] for i in range(max(levels))]

    port = _free_port()
    server = start_server(args, port)
    url = f"http://127.0.0.1:{port}"
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": bench.machine_info(), "model": path.name, "backend": args.backend,
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        # The server inherits these: OpenBLAS's threads decide the numpy backend's speed on a loaded machine.
        "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "INFER_NUMPY_KERNELS")},
        "note": "measured on a machine shared with other work (load_average: the 1, 5 and 15 minute load "
                "averages when each level ended, on 2 cores); llama.cpp's server not installed here, so not compared",
        "levels": [],
    }
    try:
        asyncio.run(level(url, prompts[:1], 8))  # warm-up
        for n in levels:
            row = asyncio.run(level(url, prompts[:n], args.new_tokens))
            row["load_average"] = [round(x, 2) for x in os.getloadavg()]
            print(json.dumps(row), file=sys.stderr)
            result["levels"].append(row)
            # Written after every level, so a run cut short keeps what it measured.
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
            plot(result, Path(args.plot))
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
