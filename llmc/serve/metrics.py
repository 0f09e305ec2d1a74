"""Prometheus metrics of one server: a registry per app, so two apps in a process never share counts.

Request-level figures (latencies, token counts, running/waiting) are measured here, in the HTTP
layer, from the outputs each request receives; engine-level figures (KV blocks, prefix-cache hits,
preemptions) are read from `LLMEngine.stats()` at scrape time by a collector. "Waiting" means
admitted with no output yet (the engine has not run a step with it); "running" means at least one
output received and not finished.
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Reads the engine's counters at scrape time (plain integers: a read from the HTTP thread while
    the loop thread steps sees a value from just before or just after a step)."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        yield _gauge("llmc_kv_blocks_used", "KV cache blocks in use", s["blocks_used"])
        yield _gauge("llmc_kv_blocks_total", "KV cache blocks of the engine", s["blocks_total"])
        q = s["prefix_cache_query_tokens"]
        yield _gauge("llmc_prefix_cache_hit_rate", "prefix-cache hit tokens / queried tokens, since start",
                     s["prefix_cache_hit_tokens"] / q if q else 0.0)
        c = CounterMetricFamily("llmc_preemptions", "sequences preempted by the scheduler")
        c.add_metric([], s["num_preemptions"])
        yield c
        c = CounterMetricFamily("llmc_engine_steps", "engine steps run")
        c.add_metric([], s["steps"])
        yield c


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


class ServerMetrics:
    """The metrics of one app, and the per-request hooks that update them."""

    def __init__(self, stats: Callable[[], dict]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("llmc_http_requests", "HTTP requests to /v1 by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.running = Gauge("llmc_requests_running", "requests with outputs, not finished", registry=r)
        self.waiting = Gauge("llmc_requests_waiting", "requests admitted, no output yet", registry=r)
        self.prompt_tokens = Counter("llmc_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("llmc_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("llmc_request_finished", "engine requests finished, by reason", ["reason"],
                                registry=r)
        self.ttft = Histogram("llmc_time_to_first_token_seconds", "arrival to first generated token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("llmc_inter_token_latency_seconds", "time between outputs, per token",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("llmc_e2e_request_latency_seconds", "arrival to last output", buckets=_LATENCY,
                             registry=r)
        self.queue = Histogram("llmc_request_queue_time_seconds",
                               "arrival to the end of the first engine step that ran the request",
                               buckets=_LATENCY, registry=r)
        r.register(_EngineCollector(stats))

    def track(self, num_prompt_tokens: int) -> RequestTimer:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.waiting.inc()
        return RequestTimer(self)


class RequestTimer:
    """Times one engine request from its outputs; `done()` must run once, however the request ends."""

    def __init__(self, m: ServerMetrics):
        self.m, self.start = m, time.monotonic()
        self.last: float | None = None  # time of the last output that carried tokens
        self.seen_output = False
        self.closed = False

    def output(self, new_tokens: int) -> None:
        now = time.monotonic()
        if not self.seen_output:
            self.seen_output = True
            self.m.waiting.dec()
            self.m.running.inc()
            self.m.queue.observe(now - self.start)
        if new_tokens:
            self.m.generation_tokens.inc(new_tokens)
            if self.last is None:
                self.m.ttft.observe(now - self.start)
            else:
                gap = (now - self.last) / new_tokens
                for _ in range(new_tokens):
                    self.m.itl.observe(gap)
            self.last = now

    def done(self, reason: str | None) -> None:
        if self.closed:
            return
        self.closed = True
        (self.m.running if self.seen_output else self.m.waiting).dec()
        self.m.finished.labels(reason or "abort").inc()
        self.m.e2e.observe(time.monotonic() - self.start)
