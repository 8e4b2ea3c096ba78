"""The server's Prometheus metrics (``GET /metrics``).

Each app has a registry of its own (two apps in one process, as in tests,
keep their counts apart). Gauges are read when scraped, from the batch
engine; counters and histograms are updated by the engine thread as tokens
come out.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from infer.serve.loop import EngineLoop, TokenStream

#: Seconds: from a few milliseconds (a tiny model) to a minute (a long prompt waiting its turn).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    """The metrics of one server over ``loop``."""

    def __init__(self, loop: EngineLoop) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        batch = loop.batch

        def blocks(field: str) -> float:
            pool = batch.pool
            return 0.0 if pool is None else float(getattr(pool.stats(), field))

        Gauge("infer_requests_running", "Requests in the running batch.", registry=r).set_function(
            lambda: loop.running)
        Gauge("infer_requests_waiting", "Requests waiting for admission.", registry=r).set_function(
            lambda: loop.waiting)
        Gauge("infer_kv_blocks_used", "KV pool blocks referenced by a request (0 without a paged pool).",
              registry=r).set_function(lambda: blocks("used"))
        Gauge("infer_kv_blocks_cached", "Unreferenced KV blocks kept for prefix reuse (evictable).",
              registry=r).set_function(lambda: blocks("cached"))
        Gauge("infer_kv_blocks_total", "KV pool blocks (0 without a paged pool).", registry=r).set_function(
            lambda: blocks("total"))
        Gauge("infer_kv_bytes_held", "Bytes of keys, values (every state group: sliding windows hold their "
              "window only) and recurrent state slots referenced by requests (0 without a paged pool).",
              registry=r).set_function(lambda: 0.0 if batch.pool is None else float(batch.pool.bytes_held()))

        def slots(total: bool) -> float:
            store = batch.engine.state_store
            return 0.0 if store is None else float(store.num_slots if total else store.slots_held())

        Gauge("infer_state_slots_used", "Recurrent state slots held: live states and checkpoints (0 without "
              "recurrent layers).", registry=r).set_function(lambda: slots(False))
        Gauge("infer_state_slots_total", "Recurrent state slots (0 without recurrent layers).",
              registry=r).set_function(lambda: slots(True))
        self.prompt_tokens = Counter("infer_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generated_tokens = Counter("infer_generated_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("infer_requests", "Requests finished, by endpoint and finish reason.",
                                ["endpoint", "finish_reason"], registry=r)
        self.time_to_first_token = Histogram(
            "infer_time_to_first_token_seconds", "From a request's submission to its first token.",
            buckets=_TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            "infer_time_per_output_token_seconds", "Between a request's tokens after the first (a step that "
            "gives several counts each at its share).", buckets=_TOKEN_BUCKETS, registry=r)

    def on_tokens(self, stream: TokenStream, count: int, seconds: float, first: bool) -> None:
        """The engine thread's report of ``count`` new tokens of ``stream``."""
        self.generated_tokens.inc(count)
        if first:
            self.time_to_first_token.observe(seconds)
            count -= 1
            seconds = 0.0
        for _ in range(count):
            self.time_per_output_token.observe(seconds / max(count, 1))

    def text(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
