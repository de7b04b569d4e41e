"""What the engine can tell about itself: a snapshot for health and metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace


@dataclass(slots=True)
class Counters:
    """Running totals the engine thread keeps (tokens, finishes)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    finished: Counter[str] = field(default_factory=Counter)


TOTALS = ("prompt_tokens", "generated_tokens", "prefix_lookup_tokens", "prefix_hit_tokens", "preemptions",
          "host_cache_evictions", "prefix_diverged", "draft_tokens", "accepted_tokens")  # counted up from start


@dataclass(slots=True, frozen=True)
class EngineStats:
    running: int
    waiting: int
    slots: int
    ctx: int
    kv_cache_bytes: int
    kv_tokens_used: int
    prefix_cached_tokens: int
    host_cache_bytes: int
    host_cache_cap_bytes: int
    host_cache_evictions: int
    prompt_tokens: int
    generated_tokens: int
    prefix_lookup_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    finished: dict[str, int]
    prefix_diverged: int = 0  # prompts that left a longer cached prefix before its end
    draft_tokens: int = 0  # tokens proposed by speculation and checked, and of those accepted
    accepted_tokens: int = 0

    def after(self, earlier: EngineStats | None) -> EngineStats:
        """These stats with their running totals going on from ``earlier``'s (those of the worker
        before this one: a new worker counts from 0)."""
        if earlier is None:
            return self
        return replace(self, finished=dict(Counter(earlier.finished) + Counter(self.finished)),
                       **{name: getattr(earlier, name) + getattr(self, name) for name in TOTALS})

    @property
    def prefix_miss_tokens(self) -> int:
        """Prompt tokens looked up in the prefix cache and computed, not served from it."""
        return self.prefix_lookup_tokens - self.prefix_hit_tokens

    @property
    def kv_usage(self) -> float:
        """Share of KV token positions held by running requests (0..1)."""
        return self.kv_tokens_used / (self.slots * self.ctx)
