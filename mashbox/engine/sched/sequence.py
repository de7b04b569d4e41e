"""One request's generation state and its small lifecycle state machine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from mashbox.engine.request import SamplingParams
from mashbox.engine.sched.draft import Drafts


class Status(enum.IntEnum):
    """WAITING -> RUNNING -> FINISHED_*; finished states sort last."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOP = 2
    FINISHED_LENGTH = 3
    FINISHED_TOOL_CALLS = 4
    FINISHED_ABORT = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= Status.FINISHED_STOP


FINISH_REASONS = {
    Status.FINISHED_STOP: "stop",
    Status.FINISHED_LENGTH: "length",
    Status.FINISHED_TOOL_CALLS: "tool_calls",
    Status.FINISHED_ABORT: "abort",
    Status.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class Sequence:
    """Prompt and output tokens of one request, and where its KV lives."""

    id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    status: Status = Status.WAITING
    slot: int | None = None
    num_computed: int = 0
    num_cached: int = 0
    differs: int | None = None  # where the prompt left a longer cached prefix (prefix_cache.Match)
    output_ids: list[int] = field(default_factory=list)
    constraint: Any = None
    forced: list[int] = field(default_factory=list)
    cache_salt: str = ""  # prefixes are shared only between requests of the same salt (a tenant)
    session: str | None = None  # whose conversation this prompt continues (PrefixCache keeps it warm)
    bias: Any = None  # its logit bias as the sampler adds it (sampler.bias), made at its first sampled token
    seed: int | None = None  # a sampled request's seed (its own, or drawn at its first token): see sampler.uniform
    drafts: Drafts | None = None  # where it speculates: its tokens indexed for proposals (draft.py)
    drafted: int = 0  # tokens proposed and checked, and of those accepted
    accepted: int = 0
    arrived: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    last_token: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def start(self, slot: int, cached: int = 0, differs: int | None = None) -> None:
        self.status = Status.RUNNING
        self.slot = slot
        self.num_computed = self.num_cached = cached
        self.differs = differs
        self.started = time.perf_counter()

    def append(self, token: int) -> None:
        now = time.perf_counter()
        self.first_token = self.first_token or now
        self.last_token = now
        self.output_ids.append(token)
        if self.drafts is not None:
            self.drafts.add(token)

    def rewind(self, n: int) -> None:
        """Take back the last ``n`` output tokens (accepted in one step, but chosen before a grammar or
        a forced token took over): the next step runs from the last one kept."""
        del self.output_ids[len(self.output_ids) - n :]
        self.num_computed = min(self.num_computed, self.num_tokens - 1)
        if self.drafts is not None:
            del self.drafts.tokens[len(self.drafts.tokens) - n :]

    def finish(self, status: Status) -> None:
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished state")
        if not self.status.is_finished:
            self.status = status
