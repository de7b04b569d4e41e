"""Loading progress, wherever a person looks.

``loading(model, quiet)`` yields ``step(what)``, called as each step of a load begins. A Jupyter
cell (an IPython kernel is running) gets one output that updates in place, listing the steps and
their times (IPython's display updates: no widget, so no ipywidgets and no ``TqdmWarning``); a
terminal (stderr is a tty) gets a transient rich line whose clock runs; anywhere else, or with
``quiet``, nothing. Both views end on one line: the model ready, in how long, and what took it (in a
cell, a load that fails ends on a line saying so, at which step).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

View = Callable[["Steps"], contextlib.AbstractContextManager[Callable[[], None]]]


class Steps:
    """The steps of one load and how long each took: what every view shows."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._start = time.perf_counter()
        self._done: list[tuple[str, float]] = []
        self._current: tuple[str, float] | None = None

    def begin(self, what: str) -> None:
        self._close()
        self._current = (what, time.perf_counter())

    def finish(self) -> None:
        self._close()

    def now(self) -> str:
        return f"{self.model}: {self._current[0] if self._current else 'loading'}"

    def table(self) -> str:
        """Loading: each step so far with its time, the current one last."""
        rows = [f"  {what:<36} {secs:5.1f} s" for what, secs in self._done]
        if self._current:
            rows.append(f"  {self._current[0]:<36}   ...")
        return "\n".join([f"{self.model}: loading", *rows])

    def summary(self) -> str:
        took = ", ".join(f"{what} {secs:.1f} s" for what, secs in self._done)
        return f"{self.model} ready in {time.perf_counter() - self._start:.1f} s ({took})"

    def failed(self, err: BaseException) -> str:
        where = f" while {self._current[0]}" if self._current else ""
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"{self.model}: not loaded{where}, after {time.perf_counter() - self._start:.1f} s: {why}"

    def _close(self) -> None:
        if self._current is not None:
            what, since = self._current
            self._done.append((what, time.perf_counter() - since))
            self._current = None


@contextlib.contextmanager
def loading(model: str, quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """Show the load of ``model`` where a person looks; yield ``step(what)`` to name each step."""
    steps = Steps(model)
    view = None if quiet else _view()
    if view is None:
        yield steps.begin
        return
    with view(steps) as show:

        def step(what: str) -> None:
            steps.begin(what)
            show()

        yield step
        steps.finish()


def _view() -> View | None:
    if in_kernel():
        return _cell
    if sys.stderr.isatty():
        return _terminal
    return None


def in_kernel() -> bool:
    """Whether this code runs in a Jupyter kernel (IPython already imported, with a kernel)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


@contextlib.contextmanager
def _cell(steps: Steps) -> Iterator[Callable[[], None]]:
    from IPython.display import display

    handle = display({"text/plain": steps.table()}, raw=True, display_id=True)
    try:
        yield lambda: handle.update({"text/plain": steps.table()}, raw=True)
    except BaseException as err:  # the output says so, rather than stay on a step that never ends
        handle.update({"text/plain": steps.failed(err)}, raw=True)
        raise
    handle.update({"text/plain": steps.summary()}, raw=True)


@contextlib.contextmanager
def _terminal(steps: Steps) -> Iterator[Callable[[], None]]:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    # Bind the real stderr now: the loader redirects sys.stderr to swallow transformers' bars.
    console = Console(file=sys.stderr)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(steps.now(), total=None)
        yield lambda: bar.update(task, description=steps.now(), refresh=True)
    console.print(steps.summary(), highlight=False)
