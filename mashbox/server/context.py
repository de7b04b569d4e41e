"""What every handler of one app shares: the backend, the settings and the server's own books."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mashbox.errors import NotReadyError
from mashbox.server.admission import Admission
from mashbox.server.backend import Backend
from mashbox.server.metrics import Metrics
from mashbox.server.page import Page
from mashbox.server.settings import Settings
from mashbox.server.task_runs import TaskRuns
from mashbox.server import task_store
from mashbox.server.task_store import TaskStore


@dataclass(slots=True)
class Context:
    backend: Backend
    settings: Settings
    openapi: dict[str, Any]
    admission: Admission = field(init=False)
    metrics: Metrics = field(init=False)
    page: Page | None = field(init=False)  # the chat page, with --ui
    tasks: TaskRuns = field(init=False)  # agent tasks (/v1/tasks)

    def __post_init__(self) -> None:
        s = self.settings
        self.admission = Admission(s.max_waiting_per_tenant, s.max_waiting, s.retry_after_s, slots=self._slots)
        self.metrics = Metrics(self.backend.model_id)
        self.page = Page.load() if s.ui else None
        store = TaskStore(task_store.path_of(s.tasks_db), s.tasks_ttl_s)
        self.tasks = TaskRuns(self.backend, self.admission, store, salted=s.auth_required, metrics=self.metrics)

    def _slots(self) -> int:
        """The engine's slots (0 while it loads: nothing is on its way to one)."""
        info = self.backend.info
        return info.slots if info is not None and self.backend.state == "ready" else 0

    def served(self) -> str:
        """The model id, once the backend takes requests."""
        if self.backend.state != "ready":
            detail = f": {self.backend.error}" if self.backend.error else ""
            raise NotReadyError(f"the model is still loading{detail}; retry shortly")
        return self.backend.model_id
