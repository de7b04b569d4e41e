"""A minimal stand-in for ``Backend``: the attributes health and metrics read."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from mashbox.engine.info import ModelInfo
from mashbox.engine.stats import EngineStats


def engine_stats(**values: Any) -> EngineStats:
    """EngineStats with zeros, 4 slots of 512 tokens, and ``values``."""
    base: dict[str, Any] = {f.name: 0 for f in fields(EngineStats)}
    return EngineStats(**{**base, "slots": 4, "ctx": 512, "finished": {}, **values})


def model_info(**values: Any) -> ModelInfo:
    base = {"id": "tiny", "ctx": 512, "slots": 4, "weights": "/models/tiny.gguf", "bpw": 4.5, "gb": 0.1,
            "device": "cpu", "dtype": "float32", "weights_mode": "packed"}
    return ModelInfo(**{**base, **values})


@dataclass
class FakeBackend:
    state: str = "ready"
    model_id: str = "tiny"
    info: ModelInfo | None = field(default_factory=model_info)
    worker_pid: int | None = None
    worker_restarts: int = 0
    error: str | None = None
    snapshot: EngineStats | None = field(default_factory=engine_stats)

    def stats(self) -> EngineStats | None:
        return self.snapshot

    def busy(self) -> int:
        return 0
