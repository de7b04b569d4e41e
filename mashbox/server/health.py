"""The Health body of GET /v1/health (and /health, /, HEAD).

200 with status ``ok`` when the backend is ready; 503 before, with status
``loading`` while the model loads or its worker starts again, and ``failed``
when the load failed (the spec names ok and loading; a failed load will
never be ready, so it is not called loading; the CLI exits on it anyway).

Fields the engine cannot know yet are null, never invented: the host prompt
cache's figures come from the engine once it runs (until then the cap is the
configured one and the bytes 0); there are no snapshots (0), no compiled-program
deployment or component set (null), no certification gate (``uncertified``),
and the engine compiles no programs (``compiles_after_ready`` is 0 once
ready). ``worker_pid`` is left out where the engine runs in this process.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from mashbox.server.admission import combined_waiting

if TYPE_CHECKING:
    from mashbox.engine.info import ModelInfo
    from mashbox.server.backend import Backend

CACHE_POLICY = "slot-prefix+host-lru/1"  # bump when what a cached prompt state means changes
CERTIFICATION = "uncertified"
_STATUS = {"ready": "ok", "loading": "loading", "failed": "failed"}


def health(backend: Backend, waiting: int, cache_cap_bytes: int = 0) -> tuple[int, dict[str, Any]]:
    """(HTTP status, Health body); ``waiting`` is the admission count."""
    ready = backend.state == "ready"
    stats = backend.stats()
    info = backend.info if ready else None
    body: dict[str, Any] = {
        "status": _STATUS.get(backend.state, "loading"),
        "live_rows": stats.running if stats else None,
        "waiting": combined_waiting(waiting, stats.waiting if stats else 0),
        "cache_bytes": stats.host_cache_bytes if stats else 0,
        "host_cache_bytes": stats.host_cache_bytes if stats else 0,
        "snapshot_bytes": 0,
        "host_cache_cap_bytes": stats.host_cache_cap_bytes if stats else cache_cap_bytes,
        "host_cache_evictions": stats.host_cache_evictions if stats else 0,
        "cache_namespace": cache_namespace(info) if info else None,
        "deployment_id": None,
        "component_set_sha": None,
        "certification": CERTIFICATION,
        "compiles_after_ready": 0 if ready else None,
        "routed_experts": None,
        "worker_restarts": backend.worker_restarts,
    }
    if backend.worker_pid is not None:
        body["worker_pid"] = backend.worker_pid
    return (200 if ready else 503), body


def cache_namespace(info: ModelInfo) -> str:
    """What cached prompt states are valid for: model, weights (their tokenizer and
    chat template come with them), context, numerics (the KV cache's form too) and the cache policy."""
    parts = [info.id, info.weights, info.source, info.ctx, info.dtype, info.weights_mode, info.kv_dtype, CACHE_POLICY]
    digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()
    return f"sha256:{digest[:32]}"
