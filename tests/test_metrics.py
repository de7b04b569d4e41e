"""/metrics content: names, labels, engine counters, histograms. No server."""

from __future__ import annotations

from fake_backend import FakeBackend, engine_stats
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from mashbox.engine.events import Finish, Timings, Usage
from mashbox.server.metrics import CONTENT_TYPE, Metrics

SECRET = "sk-very-secret"
SESSION = "session-1234"


def finish(reason: str = "stop", predicted_n: int = 5, predicted_ms: float = 400.0) -> Finish:
    timings = Timings(10, 50.0, predicted_n, predicted_ms, cache_n=0, queue_ms=250.0)
    return Finish(reason, Usage(10, predicted_n), timings)  # type: ignore[arg-type]


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(text: bytes, name: str, **labels: str) -> float:
    found = [v for (n, ls), v in samples(text).items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_every_name_starts_with_mashbox_and_no_label_carries_a_key_or_session():
    metrics = Metrics("tiny")
    metrics.request_finished("chat", finish(), 0.1, 0.2, 1.0)
    metrics.request_finished(SESSION, SECRET, None, None, 0.5)  # junk values are folded, never labels
    metrics.error_answered(404)
    metrics.error_answered(12345)
    text = metrics.render(FakeBackend(), waiting=0)
    assert samples(text)
    for (name, labels), _ in samples(text).items():
        assert name.startswith("mashbox:"), name
        assert {k for k, _ in labels} <= {"model_name", "protocol", "finished_reason", "status", "block_size", "num_gpu_blocks", "le"}
    assert SECRET.encode() not in text and SESSION.encode() not in text
    assert value(text, "mashbox:request_finished_total", protocol="other", finished_reason="other") == 1
    assert value(text, "mashbox:error_answers_total", status="404") == 1
    assert value(text, "mashbox:error_answers_total", status="other") == 1


def test_own_registry_not_the_global_one():
    Metrics("tiny")
    Metrics("tiny")  # a second server in one process registers nothing twice
    assert not [m for m in REGISTRY.collect() if m.name.startswith("mashbox:")]
    assert CONTENT_TYPE.startswith("text/plain")


def test_engine_gauges_and_layout():
    backend = FakeBackend(snapshot=engine_stats(running=3, waiting=2, kv_tokens_used=1024, prefix_cached_tokens=768,
                                                host_cache_bytes=4096))
    text = Metrics("tiny").render(backend, waiting=5)
    assert value(text, "mashbox:prefix_cache_tokens", model_name="tiny") == 768
    assert value(text, "mashbox:host_cache_bytes") == 4096
    assert value(text, "mashbox:num_requests_running", model_name="tiny") == 3
    assert value(text, "mashbox:num_requests_waiting") == 5  # admitted waiting includes the engine's 2
    assert value(text, "mashbox:kv_cache_usage_perc") == 0.5
    assert value(text, "mashbox:cache_config_info", block_size="512", num_gpu_blocks="4") == 1
    assert value(text, "mashbox:num_preemptions_total") == 0
    assert value(text, "mashbox:compiles_after_ready_total") == 0


def test_loading_backend_renders_zeros():
    backend = FakeBackend(state="loading", info=None, snapshot=None)
    text = Metrics().render(backend, waiting=1)
    assert value(text, "mashbox:num_requests_running", model_name="tiny") == 0
    assert value(text, "mashbox:num_requests_waiting") == 1
    assert value(text, "mashbox:prompt_tokens_total") == 0
    assert not [k for k in samples(text) if k[0] == "mashbox:cache_config_info"]


def test_token_counters_come_from_the_engine_and_hold_while_a_worker_starts_again():
    metrics, backend = Metrics("tiny"), FakeBackend()
    counts = {"prompt_tokens": 100, "generated_tokens": 40, "prefix_lookup_tokens": 90, "prefix_hit_tokens": 60}
    backend.snapshot = engine_stats(**counts)
    metrics.render(backend, 0)
    backend.snapshot = engine_stats(**{**counts, "prompt_tokens": 150, "generated_tokens": 50})
    metrics.render(backend, 0)
    backend.snapshot, backend.worker_restarts = None, 1  # the worker died and is starting again: no stats
    text = metrics.render(backend, 0)
    assert value(text, "mashbox:prompt_tokens_total") == 150 and value(text, "mashbox:generation_tokens_total") == 50
    assert value(text, "mashbox:prefix_cache_queries_total") == 90
    assert value(text, "mashbox:prefix_cache_hits_total") == 60
    assert value(text, "mashbox:worker_restarts_total") == 1
    assert value(text, "mashbox:cache_config_info", block_size="512", num_gpu_blocks="4") == 1  # it went away
    backend.snapshot = engine_stats(prompt_tokens=180, generated_tokens=55, prefix_lookup_tokens=100,
                                    prefix_hit_tokens=60)  # the backend's totals go on over its workers
    text = metrics.render(backend, 0)
    assert value(text, "mashbox:prompt_tokens_total") == 180 and value(text, "mashbox:generation_tokens_total") == 55


def test_an_engines_totals_go_on_from_the_workers_before_it():
    earlier = engine_stats(prompt_tokens=150, generated_tokens=50, prefix_lookup_tokens=90, prefix_hit_tokens=60)
    now = engine_stats(prompt_tokens=30, generated_tokens=5, prefix_lookup_tokens=10, prefix_hit_tokens=0)
    total = now.after(earlier)
    assert (total.prompt_tokens, total.generated_tokens, total.prefix_miss_tokens) == (180, 55, 40)
    assert total.running == now.running and now.after(None) is now


def test_finishes_by_reason_and_histograms():
    metrics = Metrics("tiny")
    metrics.request_finished("chat", finish("stop"), 0.1, 0.3, 2.0)
    metrics.request_finished("chat", finish("length"), None, 0.5, 3.0)
    metrics.request_finished("messages", finish("error", predicted_n=0, predicted_ms=0.0), 0.0, None, 0.1)
    metrics.request_finished("responses", "abort", None, None, 0.2)
    text = metrics.render(FakeBackend(), 0)
    for protocol, reason in (("chat", "stop"), ("chat", "length"), ("messages", "error"), ("responses", "abort")):
        assert value(text, "mashbox:request_finished_total", protocol=protocol, finished_reason=reason) == 1
    assert value(text, "mashbox:time_to_first_token_seconds_count", protocol="chat") == 2
    assert value(text, "mashbox:time_to_first_token_seconds_sum", protocol="chat") == 0.8
    assert value(text, "mashbox:e2e_request_latency_seconds_count", protocol="responses") == 1
    assert value(text, "mashbox:request_queue_time_seconds_sum", protocol="chat") == 0.35  # 0.1 + engine's 250 ms
    queued = {dict(ls).get("protocol") for name, ls in samples(text) if name.startswith("mashbox:request_queue")}
    assert queued == {"chat", "messages"}  # the abort had no queue time to observe
    assert value(text, "mashbox:time_per_output_token_seconds_sum", protocol="chat") == 0.2  # 2 x 400 ms / 4
    assert value(text, "mashbox:time_per_output_token_seconds_bucket", protocol="chat", le="0.1") == 2
    assert value(text, "mashbox:e2e_request_latency_seconds_bucket", protocol="chat", le="120.0") == 2
