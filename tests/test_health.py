"""The Health body and status code, from a fake backend."""

from __future__ import annotations

from fake_backend import FakeBackend, engine_stats, model_info

from mashbox.server.health import cache_namespace, health

HEALTH_FIELDS = {
    "status", "live_rows", "waiting", "cache_bytes", "host_cache_bytes", "snapshot_bytes", "host_cache_cap_bytes",
    "host_cache_evictions", "cache_namespace", "deployment_id", "component_set_sha", "certification",
    "compiles_after_ready", "routed_experts", "worker_pid", "worker_restarts",
}


def test_ready():
    stats = engine_stats(running=3, waiting=1, host_cache_cap_bytes=512 * 2**20)
    backend = FakeBackend(snapshot=stats, worker_pid=4242, worker_restarts=2)
    code, body = health(backend, waiting=4, cache_cap_bytes=512 * 2**20)
    assert code == 200
    assert set(body) == HEALTH_FIELDS
    assert body["status"] == "ok"
    assert body["live_rows"] == 3 and body["waiting"] == 4
    assert body["cache_bytes"] == body["host_cache_bytes"] == body["snapshot_bytes"] == 0
    assert body["host_cache_cap_bytes"] == 512 * 2**20 and body["host_cache_evictions"] == 0
    assert body["cache_namespace"].startswith("sha256:")
    assert body["deployment_id"] is None and body["component_set_sha"] is None and body["routed_experts"] is None
    assert isinstance(body["certification"], str)
    assert body["compiles_after_ready"] == 0
    assert body["worker_pid"] == 4242 and body["worker_restarts"] == 2


def test_loading():
    code, body = health(FakeBackend(state="loading", info=None, snapshot=None), waiting=2)
    assert code == 503
    assert body["status"] == "loading"
    assert body["live_rows"] is None and body["waiting"] == 2
    assert body["cache_namespace"] is None and body["compiles_after_ready"] is None
    assert "worker_pid" not in body  # in-process: no worker
    assert body["host_cache_cap_bytes"] == 0


def test_host_cache_figures_come_from_the_engine():
    stats = engine_stats(host_cache_bytes=3000, host_cache_cap_bytes=2**20, host_cache_evictions=2)
    _, body = health(FakeBackend(snapshot=stats), waiting=0, cache_cap_bytes=5)
    assert body["cache_bytes"] == body["host_cache_bytes"] == 3000
    assert body["host_cache_cap_bytes"] == 2**20 and body["host_cache_evictions"] == 2
    _, loading = health(FakeBackend(state="loading", info=None, snapshot=None), waiting=0, cache_cap_bytes=5)
    assert loading["host_cache_cap_bytes"] == 5 and loading["host_cache_bytes"] == 0


def test_worker_restarting_reports_loading_and_counts_restarts():
    backend = FakeBackend(state="loading", snapshot=None, worker_pid=99, worker_restarts=1)
    code, body = health(backend, waiting=0)
    assert (code, body["status"], body["worker_restarts"], body["worker_pid"]) == (503, "loading", 1, 99)


def test_failed_load_is_not_ready():
    code, body = health(FakeBackend(state="failed", info=None, snapshot=None), waiting=0)
    assert (code, body["status"]) == (503, "failed")


def test_engine_waiting_counts_without_admission():
    _, body = health(FakeBackend(snapshot=engine_stats(waiting=3)), waiting=0)
    assert body["waiting"] == 3


def test_cache_namespace_is_stable_and_tracks_what_cached_states_depend_on():
    same = cache_namespace(model_info())
    assert same == cache_namespace(model_info())
    assert same != cache_namespace(model_info(weights="/models/other.gguf"))
    assert same != cache_namespace(model_info(ctx=1024))
    assert same != cache_namespace(model_info(dtype="bfloat16"))
    assert same != cache_namespace(model_info(kv_dtype="q8_0"))  # an f16 and a q8_0 server shared the id
    assert same == cache_namespace(model_info(gb=9.9))  # not part of what a cached prompt means


def test_openapi_schema_names_every_field_and_the_bodies_fit_it():
    from jsonschema import validate

    from mashbox.server.openapi import HEALTH

    ready = health(FakeBackend(snapshot=engine_stats(), worker_pid=7), waiting=0)[1]
    loading = health(FakeBackend(state="loading", info=None, snapshot=None), waiting=0)[1]
    assert set(HEALTH["properties"]) == HEALTH_FIELDS
    for body in (ready, loading):
        validate(body, HEALTH)
