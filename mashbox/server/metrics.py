"""Prometheus metrics for GET /metrics, in a registry of this server's own.

Two sources:

- The engine's snapshot (``backend.stats()``), read at each scrape by a
  collector: requests running and waiting, KV cache use, cached prefix tokens
  and host cache bytes (what an endpoint picker weighs), the cache layout,
  and the engine's token counters (prompt, generated, prefix lookups and hits,
  preemptions). Counting tokens in the engine counts requests that never
  finish too. The backend's totals go on over the workers it ran (a new one
  counts from 0), whether or not a scrape came between; a scrape while no
  worker has sent any shows the last ones, so they never go down.
- The HTTP layer's ``request_finished``: finishes by reason and protocol (one
  per HTTP request, retries and device errors included, which the engine alone
  cannot count) and the latency histograms; ``request_refused``: requests a full
  queue refused, by scope; ``error_answered``: every error answer, by its status.

Every name starts with ``mashbox:``. Labels: ``model_name``, ``protocol``,
``finished_reason``, ``scope``, ``status``, ``block_size``, ``num_gpu_blocks`` only; label values come
from fixed sets or the model, never from a user, a key or a session.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from mashbox.engine.events import Finish
from mashbox.engine.stats import EngineStats
from mashbox.server.admission import combined_waiting

if TYPE_CHECKING:
    from mashbox.engine.info import ModelInfo
    from mashbox.server.backend import Backend

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # every name is valid in the classic text format
PROTOCOLS = frozenset({"chat", "completions", "responses", "messages", "tasks"})  # tasks: each generation
FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "abort", "error"})
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
ENGINE_COUNTERS = {  # EngineStats field -> (metric name, help)
    "prompt_tokens": ("mashbox:prompt_tokens", "Prompt tokens the engine took in (prefilled or cached)."),
    "generated_tokens": ("mashbox:generation_tokens", "Tokens the engine generated."),
    "prefix_lookup_tokens": ("mashbox:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_hit_tokens": ("mashbox:prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "prefix_miss_tokens": ("mashbox:prefix_cache_misses", "Prompt tokens looked up and computed, not served "
                           "from the prefix cache."),
    "prefix_diverged": ("mashbox:prefix_cache_diverged", "Prompts that left a longer cached prefix before its "
                        "end (the x-mashbox-cache header and the log say where)."),
    "preemptions": ("mashbox:num_preemptions", "Requests preempted (mashbox never preempts)."),
    "draft_tokens": ("mashbox:spec_decode_num_draft_tokens", "Tokens proposed by speculation and checked."),
    "accepted_tokens": ("mashbox:spec_decode_num_accepted_tokens", "Proposed tokens the model's own choice "
                        "confirmed (kept)."),
}


_RESTARTS_HELP = "Times the worker was started again after a fault."
_COMPILES_HELP = "Programs compiled after ready (the engine compiles none)."


class _Totals:
    """The engine's counters as last seen: kept while no worker has sent any (one starting again)."""

    def __init__(self) -> None:
        self.sums: dict[str, int] = dict.fromkeys(ENGINE_COUNTERS, 0)

    def update(self, stats: EngineStats) -> None:
        for name in ENGINE_COUNTERS:
            self.sums[name] = max(self.sums[name], getattr(stats, name))


@dataclass(slots=True)
class _Scrape:
    model_name: str
    stats: EngineStats | None
    info: ModelInfo | None  # the model loaded last: a worker starting again keeps it
    waiting: int
    worker_restarts: int


class _EngineCollector(Collector):
    """Yields the engine's gauges and counters from the scrape ``render`` set."""

    def __init__(self, totals: _Totals) -> None:
        self.totals = totals
        self.scrape = _Scrape("", None, None, 0, 0)

    def collect(self) -> Iterator[Metric]:
        scrape = self.scrape
        stats, model = scrape.stats, [scrape.model_name]
        yield _gauge("mashbox:num_requests_running", "Requests being answered.", model, stats.running if stats else 0)
        yield _gauge("mashbox:num_requests_waiting", "Requests waiting for a slot.", model, scrape.waiting)
        yield _gauge("mashbox:kv_cache_usage_perc", "KV cache use, 0..1.", model, stats.kv_usage if stats else 0.0)
        yield _gauge("mashbox:prefix_cache_tokens", "Prompt prefix tokens cached in the slots, ready to be reused.",
                     model, stats.prefix_cached_tokens if stats else 0)
        yield _gauge("mashbox:host_cache_bytes", "Bytes of prompt prefixes kept in host memory.", model,
                     stats.host_cache_bytes if stats else 0)
        if scrape.info is not None:  # an endpoint picker reads it: kept while a worker restarts (info is)
            yield _layout(scrape.model_name, scrape.info.ctx, scrape.info.slots)
        for field, (name, doc) in ENGINE_COUNTERS.items():
            yield _counter(name, doc, model, self.totals.sums[field])
        yield _counter("mashbox:worker_restarts", _RESTARTS_HELP, model, scrape.worker_restarts)
        yield _counter("mashbox:compiles_after_ready", _COMPILES_HELP, model, 0)


def _gauge(name: str, doc: str, model: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(model, value)
    return family


def _counter(name: str, doc: str, model: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(model, value)
    return family


def _layout(model_name: str, ctx: int, slots: int) -> GaugeMetricFamily:
    doc = ("KV cache layout: one block per slot, holding one whole context (block_size = ctx, num_gpu_blocks = "
           "slots: vLLM's label, which endpoint pickers read, whatever the device).")
    labels = ["model_name", "block_size", "num_gpu_blocks"]
    family = GaugeMetricFamily("mashbox:cache_config_info", doc, labels=labels)
    family.add_metric([model_name, str(ctx), str(slots)], 1.0)
    return family


class Metrics:
    """The server's metrics. ``model_name`` labels them all (create_app: ``Metrics(backend.model_id)``);
    left empty, the engine's part takes ``backend.model_id`` and the request metrics ``""``."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._totals = _Totals()
        self._engine = _EngineCollector(self._totals)
        self.registry.register(self._engine)
        labels = ["model_name", "protocol"]
        self.finished = Counter(
            "mashbox:request_finished", "Requests answered, by finish reason.", [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.refused = Counter(
            "mashbox:request_refused", "Requests refused for a full queue (429, or 529 on Messages), by whose "
            "allowance was spent: the tenant's or the server's.", ["model_name", "scope"], registry=self.registry,
        )
        self.errors = Counter(
            "mashbox:error_answers", "Requests answered with an error status (4xx, 5xx) before any output, by "
            "status: bad fields, unknown models or routes, refused keys, a full queue, a loading worker.",
            ["model_name", "status"], registry=self.registry,
        )
        self.ttft = _histogram("mashbox:time_to_first_token_seconds", "Time to first token.", labels, self.registry)
        self.queue = _histogram("mashbox:request_queue_time_seconds", "Time waiting for a slot.", labels, self.registry)
        self.e2e = _histogram("mashbox:e2e_request_latency_seconds", "Arrival to last byte.", labels, self.registry)
        self.tpot = _histogram(
            "mashbox:time_per_output_token_seconds", "Decode time per new token after the first.", labels,
            self.registry, TOKEN_BUCKETS,
        )

    def request_refused(self, scope: str) -> None:
        self.refused.labels(self.model_name, scope if scope in ("tenant", "server") else "other").inc()

    def error_answered(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status) if 400 <= status <= 599 else "other").inc()

    def request_finished(
        self, protocol: str, finish: Finish | str, queue_s: float | None, ttft_s: float | None, e2e_s: float
    ) -> None:
        """One HTTP request ended: ``finish`` is its Finish, or a reason (e.g. abort) when it had none.

        ``queue_s`` None takes the engine's queue_ms; ``ttft_s`` None (no token) observes nothing.
        """
        labels = (self.model_name, protocol if protocol in PROTOCOLS else "other")
        reason = finish.reason if isinstance(finish, Finish) else finish
        self.finished.labels(*labels, reason if reason in FINISH_REASONS else "other").inc()
        self.e2e.labels(*labels).observe(e2e_s)
        if queue_s is None and isinstance(finish, Finish):
            queue_s = finish.timings.queue_ms / 1000
        if queue_s is not None:
            self.queue.labels(*labels).observe(queue_s)
        if ttft_s is not None:
            self.ttft.labels(*labels).observe(ttft_s)
        if isinstance(finish, Finish) and finish.timings.predicted_n >= 2:
            self.tpot.labels(*labels).observe(finish.timings.predicted_ms / 1000 / (finish.timings.predicted_n - 1))

    def render(self, backend: Backend, waiting: int) -> bytes:
        """The Prometheus text, the engine's part read from ``backend`` now."""
        stats = backend.stats()
        waiting = combined_waiting(waiting, stats.waiting if stats else 0)
        scrape = _Scrape(self.model_name or backend.model_id, stats, backend.info, waiting, backend.worker_restarts)
        with self._lock:
            if stats is not None:
                self._totals.update(stats)
            self._engine.scrape = scrape
            return generate_latest(self.registry)


def _histogram(
    name: str, doc: str, labels: list[str], registry: CollectorRegistry, buckets: tuple[float, ...] = LATENCY_BUCKETS
) -> Histogram:
    return Histogram(name, doc, labels, registry=registry, buckets=buckets)
