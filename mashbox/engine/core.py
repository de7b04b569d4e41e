"""The engine loop: one thread that owns the scheduler and the device.

Each step is three verbs: ``plan = scheduler.schedule()``,
``tokens = runner.run(plan)``, ``scheduler.update(plan, tokens, emit=...)``; each
request's new tokens pass through its text state machines into events (which may
take some back) before the scheduler checks them against the limits.
Requests and aborts arrive through an inbox and join at the next step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mashbox.engine.channel import Channel
from mashbox.engine.events import CLOSED, Event, Finish, Started, Timings, Usage
from mashbox.engine.model.runner import ModelRunner
from mashbox.engine.sched.scheduler import Plan, Scheduler
from mashbox.engine.sched.sequence import Sequence, Status
from mashbox.engine.stats import Counters, EngineStats
from mashbox.engine.text.detokenizer import Detokenizer
from mashbox.engine.text.grammar import CallGuard
from mashbox.engine.text.markup import Markup
from mashbox.engine.text.stop import StopMatcher
from mashbox.errors import EngineClosedError, InvalidRequestError

log = logging.getLogger("mashbox.engine")



@dataclass(slots=True, frozen=True)
class ThinkBudget:
    """Thinking ends when ``tokens`` are spent: the ids of ``</think>`` and a blank line are then forced, but
    for the start of the tag the model wrote already (``closes``: the ids by what of the tag is written)."""

    tokens: int
    closes: dict[str, tuple[int, ...]]

    def close_ids(self, written: str) -> tuple[int, ...]:
        return self.closes.get(written, self.closes[""])


@dataclass(slots=True)
class Stream:
    """One request's way out: its text state machines and its channel.

    Tokens pass the detokenizer, then stop strings (not inside a call: ``_marked``), then the markup machine
    (reasoning and tool calls), and leave as events, held in the channel until
    the engine wakes the readers of all of a step's streams at once. In auto mode the
    guard then constrains the rest of a call that the markup sees begun.
    """

    seq: Sequence
    detok: Detokenizer
    stop: StopMatcher
    markup: Markup
    budget: ThinkBudget | None = None
    guard: CallGuard | None = None
    started: bool = False
    pushed: int = 0  # tokens through the state machines
    reasoning_tokens: int = 0  # the thought with both its tags (the usage's)
    thought: int = 0  # the thought and its close, not an opening the model wrote (the budget's)
    channel: Channel[Event] = field(default_factory=Channel)
    replaces: Sequence | None = None  # the answer this one writes again (one request, one finish counted)

    def push(self, token: int) -> None:
        thinking = self.markup.state == "think"
        self.pushed += 1
        self._put(self._marked(self.detok.push(token)))
        if self.guard is not None:  # the answer up to this token (a step may have appended more)
            self.seq.constraint = self.guard.follow(self.markup.open_call(), self.seq.output_ids[: self.pushed])
        self.reasoning_tokens += thinking or self.markup.state == "think"
        self.thought += thinking
        budget = self.budget  # spent with thinking still open after this token (which may have closed it)
        if budget and self.markup.state == "think" and self.thought >= budget.tokens and not self.seq.forced:
            self.seq.forced.extend(budget.close_ids(self.markup.held))  # held: what of </think> came (</)

    def _marked(self, text: str) -> list[Event]:
        """``text`` through the stop strings, then the markup. A call is no text: no stop string applies inside
        its tags, nor to one begun without them once the markup knows it for one (its ``{"name"``); a token
        that may end an opening tag goes a character at a time, so that what follows the tag in it (the
        newline a forced call's grammar writes with ``>``) is the call's. (A stop such as "}" or "\n" ended
        answers mid-call, and dropped the call.)"""
        if self._in_call():
            return self.markup.push(text)
        if not self._may_open_call(text):
            return self._text(text)
        events: list[Event] = []
        for at, char in enumerate(text):
            if self._in_call():
                return events + self.markup.push(text[at:])
            events += self._text(char)
        return events

    def _text(self, text: str) -> list[Event]:
        events = self.markup.push(self.stop.push(text))
        if self._in_call():  # a call began: what the stops held back is the call's
            events += self.markup.push(self.stop.release())
        return events

    def _may_open_call(self, text: str) -> bool:
        """Whether a call may begin within ``text``: an opening tag (or a part the markup holds), or JSON where
        the markup watches for a call without tags."""
        markup, bare = self.markup, self.markup.bare
        opening = markup.calls.open if markup.calls else ""
        tagged = bool(opening) and (bool(markup.held) or opening[0] in text)
        return tagged or (bare is not None and bare.open and (bool(bare.text) or any(c in text for c in "{[`")))

    def _in_call(self) -> bool:
        return self.markup.state == "call" or self.markup.open_call() is not None

    @property
    def ended(self) -> bool:
        """A stop string matched, the answer was cut as a loop, or its one call is made (parallel calls
        off): no later token is the answer's."""
        return self.stop.matched is not None or self.markup.repeated or self.markup.done

    def finish(self, error: str | None = None) -> None:
        if self.stop.matched is None:
            self._put(self._marked(self.detok.flush()))
            self._put(self.markup.push(self.stop.flush()))
        self._put(self.markup.flush())
        seq = self.seq
        reason = seq.finish_reason or "error"
        if reason == "stop" and self.markup.num_calls:
            reason = "tool_calls"
        usage = Usage(len(seq.prompt_ids), len(seq.output_ids), seq.num_cached, self.reasoning_tokens, seq.accepted,
                      seq.drafted - seq.accepted)
        failed = seq.constraint is not None and seq.constraint.failed is not None
        param = seq.constraint.field if failed else None
        self.channel.hold(Finish(reason, usage, _timings(seq), self.stop.matched, error, param))

    def _put(self, events: list[Event]) -> None:
        for event in events:
            self.channel.hold(event)


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, tokenizer: Any) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.streams: dict[str, Stream] = {}
        self.counters = Counters()
        self.snapshot = self._stats()  # replaced, never changed: other threads read it without a lock
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._closing = threading.Lock()  # no request joins the inbox behind "close"
        self._live: set[str] = set()  # the ids of the requests submitted and not yet ended (any thread)
        self._live_lock = threading.Lock()
        self.closed = False
        self.why_closed = CLOSED
        self._thread = threading.Thread(target=self._loop, name="mashbox-engine", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence, markup: Markup | None = None, budget: ThinkBudget | None = None,
               guard: CallGuard | None = None, replaces: Sequence | None = None) -> Channel[Event]:
        markup = markup or Markup(calls=None)
        detok = Detokenizer(self.tokenizer, seq.prompt_ids[-4:], markup.tags)
        stream = Stream(seq, detok, StopMatcher(seq.sampling.stop), markup, budget, guard, replaces=replaces)
        with self._closing, self._live_lock:
            if self.closed:
                raise EngineClosedError(self.why_closed)
            self.check_new(seq.id)
            self._live.add(seq.id)
            self._inbox.put(("add", stream))
        return stream.channel

    def check_new(self, request_id: str) -> None:
        """Refuse an id that runs already: its events would go to one caller, and the other wait for good."""
        if request_id in self._live:
            raise InvalidRequestError("id", f"a request with id {request_id!r} is running; give each its own")

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def close(self) -> None:
        with self._closing:
            self.closed = True
            self._inbox.put(("close", None))
            if threading.current_thread() is not self._thread:  # a collection on the engine thread may close it
                self._thread.join(timeout=30)
        if self.scheduler.cache.disk is not None:
            self.scheduler.cache.disk.close()  # the pages computed so far reach the disk

    def _loop(self) -> None:
        status, reason = Status.FINISHED_ABORT, CLOSED
        try:
            while self._drain(block=not self.scheduler.has_work):
                if self.scheduler.has_work:
                    self.step()
                self.snapshot = self._stats()
        except Exception as exc:  # the scheduler itself failed: refuse new requests rather than hang them
            log.exception("the engine stopped")
            status, reason = Status.FINISHED_ERROR, f"the engine stopped: {type(exc).__name__}: {exc}"
            with self._closing:
                self.closed = True
                self.why_closed = f"this Engine stopped after an internal error ({reason}); make a new Engine()"
            while not self._inbox.empty():  # requests sent before it closed end too
                kind, payload = self._inbox.get()
                if kind == "add":
                    self.streams[payload.seq.id] = payload
        for stream in list(self.streams.values()):
            self._end(stream, status, reason)

    def _drain(self, block: bool) -> bool:
        """Handle inbox messages; False once asked to close."""
        while True:
            try:
                kind, payload = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "close":
                return False
            if kind == "add":
                self.streams[payload.seq.id] = payload
                self.scheduler.add(payload.seq)
            elif kind == "abort" and payload in self.streams:
                self._end(self.streams[payload], Status.FINISHED_ABORT)

    def step(self) -> None:
        plan = self.scheduler.schedule()
        stepped = {item.seq.id: self.streams.get(item.seq.id) for item in plan.work}
        try:
            self._step(plan)
        except Exception as exc:  # a fault past the device step (text, stops, markup) fails its requests only
            log.exception("step failed")
            for seq_id, stream in stepped.items():
                if stream is not None and seq_id in self.streams:
                    self._end(stream, Status.FINISHED_ERROR, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            Channel.wake_all(stream.channel for stream in stepped.values() if stream is not None)

    def _step(self, plan: Plan) -> None:
        for item in plan.work:
            stream = self.streams.get(item.seq.id)
            if stream is not None and not stream.started:  # its first step with a slot: say so at once
                stream.started = True
                self.counters.prompt_tokens += len(item.seq.prompt_ids)  # a prompt is counted once computed
                stream.channel.put(Started(item.seq.num_cached, item.seq.differs))
        try:
            start = time.perf_counter()
            tokens = self.runner.run(plan)
            seconds = time.perf_counter() - start
        except Exception as exc:  # a device fault fails the requests it ran, not the engine
            log.exception("device step failed")
            for seq in {w.seq.id: w.seq for w in plan.work}.values():
                self._end(self.streams[seq.id], Status.FINISHED_ERROR, f"device step failed: {exc}")
            for entry in self.scheduler.lost(plan):  # what it wrote may be half written: never reused
                self.runner.host.pop(entry, None)
            return
        self.scheduler.update(plan, tokens, seconds, emit=lambda seq, new: self._emit_all(self.streams[seq.id], new))
        if pages := self.scheduler.persist:
            self.scheduler.persist = []
            self.runner.keep(pages, self.scheduler.cache.disk)
        for seq in {w.seq.id: w.seq for w in plan.work}.values():
            if seq.status.is_finished and seq.id in self.streams:
                self._close(self.streams.pop(seq.id))

    def stats(self) -> EngineStats:
        """The snapshot the engine thread published after its last step (never waits on it)."""
        return self.snapshot

    def _stats(self) -> EngineStats:
        s, c = self.scheduler, self.counters
        running = list(s.running)
        return EngineStats(
            running=len(running), waiting=len(s.waiting), slots=s.slots.size, ctx=s.ctx,
            kv_cache_bytes=self.runner.kv.nbytes, kv_tokens_used=sum(q.num_computed for q in running),
            prefix_cached_tokens=s.cache.cached_tokens, host_cache_bytes=s.cache.host.bytes,
            host_cache_cap_bytes=s.cache.host.cap, host_cache_evictions=s.cache.host.evictions,
            prompt_tokens=c.prompt_tokens, generated_tokens=c.generated_tokens,
            prefix_lookup_tokens=s.lookup_tokens, prefix_hit_tokens=s.hit_tokens, prefix_diverged=s.diverged,
            preemptions=c.preemptions, finished=dict(+c.finished), draft_tokens=s.drafted, accepted_tokens=s.accepted,
        )

    def _close(self, stream: Stream, error: str | None = None) -> None:
        with self._live_lock:
            self._live.discard(stream.seq.id)
        self.counters.finished[stream.seq.finish_reason or "error"] += 1
        if stream.replaces is not None:  # the answer given up was counted when it ended
            self.counters.finished[stream.replaces.finish_reason or "error"] -= 1
        self.snapshot = self._stats()  # counted before its client can see the end
        stream.finish(error)

    def _emit_all(self, stream: Stream, tokens: list[int]) -> None:
        """A step's new tokens of one request, in order. Where one ends the answer (a stop string, a
        loop), starts a grammar (a tool call begun) or forced tokens (thinking spent), the rest
        (accepted proposals, chosen without knowing) are taken back, as if never made."""
        seq = stream.seq
        for i, token in enumerate(tokens):
            self.counters.generated_tokens += 1
            self._emit(stream, token)
            if i + 1 < len(tokens) and (stream.ended or seq.constraint is not None or seq.forced):
                seq.rewind(len(tokens) - i - 1)
                return

    def _emit(self, stream: Stream, token: int) -> None:
        if token in stream.seq.eos_ids:
            return
        stream.push(token)
        if (constraint := stream.seq.constraint) is not None and constraint.failed:
            self._end(stream, Status.FINISHED_ERROR, constraint.failed)
        elif stream.ended:
            self.scheduler.finish(stream.seq, Status.FINISHED_STOP)

    def _end(self, stream: Stream, status: Status, error: str | None = None) -> None:
        self.scheduler.finish(stream.seq, status)
        self.streams.pop(stream.seq.id, None)
        self._close(stream, error)
        Channel.wake_all([stream.channel])


def _timings(seq: Sequence) -> Timings:
    started = seq.started or seq.arrived
    first = seq.first_token or started
    return Timings(
        prompt_n=len(seq.prompt_ids) - seq.num_cached,
        prompt_ms=(first - started) * 1000,
        predicted_n=len(seq.output_ids),
        predicted_ms=((seq.last_token or first) - first) * 1000,
        cache_n=seq.num_cached,
        queue_ms=(started - seq.arrived) * 1000,
    )
