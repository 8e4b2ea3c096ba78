"""Requests/s of 1 vs N Ray Serve replicas of ``infer serve`` (examples/ray-serve) under concurrent clients.

    python benchmarks/replicas.py [--model smollm2-135m] [--backend numpy] [--replicas 1,2] [--cpus 2]
                                  [--clients 8] [--requests 4] [--new-tokens 32] [--repeats 3] [--out FILE]

One local Ray instance with ``--cpus`` CPUs. For each replica count R, the
example's application is deployed with R replicas of ``--cpus / R`` CPUs each
(so R replicas split the same machine; Ray sets each replica's
``OMP_NUM_THREADS`` to its share), then ``--clients`` clients each send
``--requests`` greedy completions one after another (a closed loop: different
prompts, ``--new-tokens`` tokens with end-of-sequence ignored). requests/s is
all requests over the wall time of the run; a run is repeated ``--repeats``
times after one warm-up request per replica, and the median is reported.
Writes a JSON report (default benchmarks/results/replicas.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "ray-serve"))

import infer_ray_serve  # noqa: E402

log = logging.getLogger("benchmarks.replicas")
NAME = "bench"
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in old green trees".split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(i: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(24))


def run_once(url: str, clients: int, requests: int, new_tokens: int, offset: int) -> dict[str, Any]:
    """``clients`` closed-loop clients, ``requests`` completions each; returns requests/s and who served."""
    body = {"model": NAME, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}

    def client(c: int) -> list[str]:
        served = []
        with httpx.Client(timeout=600) as http:
            for r in range(requests):
                reply = http.post(url + "/v1/completions", json={**body, "prompt": _prompt(offset + c * requests + r)})
                reply.raise_for_status()
                assert reply.json()["usage"]["completion_tokens"] == new_tokens
                served.append(reply.headers[infer_ray_serve.REPLICA_HEADER])
        return served

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        served = [s for ss in pool.map(client, range(clients)) for s in ss]
    wall = time.perf_counter() - start
    return {"requests_per_s": len(served) / wall, "wall_s": wall,
            "per_replica": {r: served.count(r) for r in sorted(set(served))}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--replicas", default="1,2", help="replica counts, comma-separated")
    parser.add_argument("--cpus", type=float, default=float(os.cpu_count() or 1), help="CPUs of the Ray instance")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="completions per client per run")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "replicas.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import ray
    from ray import serve

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT / "examples" / "ray-serve")}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    results = []
    try:
        for replicas in (int(r) for r in args.replicas.split(",")):
            spec = infer_ray_serve.ReplicaArgs(model=args.model, backend=args.backend, model_name=NAME,
                                               num_replicas=replicas, num_cpus=args.cpus / replicas)
            serve.run(infer_ray_serve.build(spec), name="bench", route_prefix="/")
            threads = {httpx.get(url + "/replica").json()["omp_num_threads"] for _ in range(8)}
            run_once(url, replicas * 2, 1, args.new_tokens, offset=10_000)  # warm-up: every replica's first forward
            runs = [run_once(url, args.clients, args.requests, args.new_tokens, offset=1000 * k)
                    for k in range(args.repeats)]
            rps = [r["requests_per_s"] for r in runs]
            row = {"replicas": replicas, "cpus_per_replica": args.cpus / replicas, "omp_num_threads": sorted(threads),
                   "requests_per_s_median": statistics.median(rps), "requests_per_s": rps,
                   "per_replica": [r["per_replica"] for r in runs]}
            log.info("%d replica(s): %.2f requests/s (median of %s)", replicas, row["requests_per_s_median"],
                     ", ".join(f"{x:.2f}" for x in rps))
            results.append(row)
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "model": args.model, "backend": args.backend, "cpus": args.cpus, "machine_cores": os.cpu_count(),
              "clients": args.clients, "requests_per_client": args.requests, "new_tokens": args.new_tokens,
              "ray": ray.__version__, "results": results}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
