"""Prometheus metrics for ``/metrics``, with vLLM's names and meanings under an ``anygpu_`` prefix.

Latencies are measured in the server, from the request's arrival (before tokenization, as vLLM does) with
the monotonic clock: time to first token, inter-token latency (each gap between tokens a client receives),
end-to-end latency.  Engine state (running and waiting requests, KV-cache usage) is read at scrape time
from the engine's ``stats()`` (``engine/protocol.py``).  Each app gets its own registry, so several servers
(tests) in one process do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets in seconds: decode steps are milliseconds on GPUs, tens of ms on CPUs; requests take up to minutes.
_FAST = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class ServerMetrics:
    def __init__(self, model_name: str, engine):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self._model = model_name

        def gauge(name, doc, fn):
            g = Gauge(f"anygpu_{name}", doc, labels, registry=r)
            g.labels(model_name).set_function(fn)

        gauge("num_requests_running", "Requests in the running batch.", lambda: engine.stats().num_running)
        gauge("num_requests_waiting", "Requests waiting to be scheduled.", lambda: engine.stats().num_waiting)
        gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
              lambda: engine.stats().kv_cache_usage)
        # One label value per app: take each family's child once (``labels()`` costs a lock and a lookup, and
        # the ITL histogram is observed for every streamed token).
        self.prompt_tokens = Counter("anygpu_prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("anygpu_generation_tokens", "Tokens generated.", labels,
                                         registry=r).labels(model_name)
        self._request_success = Counter("anygpu_request_success", "Finished requests, by finish reason.",
                                        labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("anygpu_time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=_SLOW, registry=r).labels(model_name)
        self.itl = Histogram("anygpu_inter_token_latency_seconds", "Gap between consecutive tokens.", labels,
                             buckets=_FAST, registry=r).labels(model_name)
        self.e2e = Histogram("anygpu_e2e_request_latency_seconds", "Arrival to the last token.", labels,
                             buckets=_SLOW, registry=r).labels(model_name)
        self.prompt_len = Histogram("anygpu_request_prompt_tokens", "Prompt length.", labels, buckets=_TOKENS,
                                    registry=r).labels(model_name)
        self.output_len = Histogram("anygpu_request_generation_tokens", "Generated tokens per request.", labels,
                                    buckets=_TOKENS, registry=r).labels(model_name)

    def request_success(self, reason: str):
        return self._request_success.labels(self._model, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one request's tokens as the client receives them, and records it when it ends."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.m, self.arrival, self.last = metrics, arrival, None
        self.tokens = 0

    def tokens_out(self, now: float, count: int) -> None:
        if count <= 0:
            return
        if self.last is None:
            self.m.ttft.observe(now - self.arrival)
        else:
            # Several tokens in one delivery (a busy event loop): spread the gap over them.
            gap = (now - self.last) / count
            for _ in range(count):
                self.m.itl.observe(gap)
        self.last = now
        self.tokens += count
        self.m.generation_tokens.inc(count)

    def finished(self, now: float, prompt_tokens: int, reason: str | None) -> None:
        self.m.e2e.observe(now - self.arrival)
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.prompt_len.observe(prompt_tokens)
        self.m.output_len.observe(self.tokens)
        self.m.request_success(reason or "abort").inc()
