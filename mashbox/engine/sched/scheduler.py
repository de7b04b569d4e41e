"""Which tokens run in the next device call. Pure policy: no torch here.

Every call advances all running requests: one decode token for each request
past its prompt, plus prompt chunks of new ones: up to ``step_tokens`` prompt
tokens when nothing decodes; while others decode, as many as keep the step
within a few decode steps' time (``Pace``, from the times ``update`` is given;
``RATIO``), at most ``busy_tokens``, so a long prompt does not stall their
next tokens for long; a short prompt's last few tokens go with its chunks
before them where they cost less than the decode step they would wait for.
Chunks start at multiples of ``chunk_tokens`` so a prompt is cut the same way
whatever else runs (batch invariance); one request may run
several consecutive chunks in one call. Where the runner's results do not
depend on where a prompt is cut (``cut_anywhere``: mashbox's CPU kernels), a
step beside decoding requests may also end in the middle of a chunk, at a
multiple of ``PIECE`` tokens, so that a chunk's cost never stalls them more
than the pace allows.

Prompts start in the order they came, but for one thing: while a long prompt is computed, a short one
(SHORT chunks at most) that comes starts at the next step, one a step, and short prompts being computed
go before long ones; the long ones go on beside them at the pace of decoding streams, so a "Hi" never
waits for all of someone's 7k-token prompts.

No prompt chunk is computed twice at once: a waiting request whose prompt starts
like one still prefilling waits until that prefill has computed what they share,
then starts from a copy of it.

A request given proposals (``Sequence.drafts``: the engine makes them where the runner's rows do
not depend on what runs beside them) has its decode item also carry the tokens its own text
proposes (``draft.py``), while at most SPEC_ROWS requests decode: the runner chooses a token after
each of them (as it would one step at a time), and ``update`` keeps the proposals up to the first
that differs, then that token: the same tokens one step each would give, several a step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mashbox.engine.sched.pace import Pace
from mashbox.engine.sched.prefix_cache import CacheOp, Copy, Live, Load, Persist, PrefixCache, Restore, Save
from mashbox.engine.sched.sequence import Sequence, Status
from mashbox.engine.sched.slots import SlotTable

if TYPE_CHECKING:
    from mashbox.engine.sched.disk_cache import PageStore

PIECE = 4  # the fewest prompt tokens a step beside decoding requests runs, where prompts may be cut anywhere
RATIO = 1.5  # how long a step with prompt tokens may take beside decoding requests, in decode steps
SHORT = 4  # chunks: a prompt with no more to compute beside decoding requests goes in whole chunks,
SHORT_RATIO = 4.0  # in steps of up to this many decode steps: it passes in one or two
TAIL_RATIO = 2.0  # its last tokens past the budget join its chunks if beside decoding they fit a step this long
SPEC_ROWS = 8  # requests decoding, at most, for proposals to be checked (and no prompt waiting to be computed)
PROBE = 16  # steps with proposals none of which seemed to pay, before the likeliest is checked anyway


@dataclass(slots=True, frozen=True)
class Work:
    """Tokens of one request to run at ``position`` in its slot."""

    seq: Sequence
    token_ids: tuple[int, ...]
    position: int
    sample: bool
    draft: int = 0  # a decode item's last tokens that are proposals: each of its rows then samples

    @property
    def slot(self) -> int:
        assert self.seq.slot is not None
        return self.seq.slot

    @property
    def in_prompt(self) -> bool:
        return self.position < len(self.seq.prompt_ids)


@dataclass(slots=True)
class Plan:
    """The scheduler's only contract with the runner: prefix-cache copies first, then the work."""

    work: list[Work] = field(default_factory=list)
    cache_ops: list[CacheOp] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.work)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(w.token_ids) for w in self.work if w.in_prompt)

    @property
    def decode_rows(self) -> int:
        return sum(not w.in_prompt for w in self.work)

    @property
    def draft_rows(self) -> int:
        return sum(w.draft for w in self.work)


class Scheduler:
    def __init__(self, num_slots: int, ctx: int, chunk_tokens: int, host_cache_bytes: int = 0,
                 kv_bytes_per_token: int = 0, step_tokens: int | None = None, busy_tokens: int | None = None,
                 disk: PageStore | None = None, cut_anywhere: bool = False) -> None:
        self.slots = SlotTable(num_slots)
        self.cache = PrefixCache(num_slots, chunk_tokens, host_cache_bytes, kv_bytes_per_token, disk)
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.diverged = 0  # prompts that left a longer cached prefix before its end
        self.drafted = self.accepted = 0  # proposals checked, and accepted, over all requests
        self.ctx = ctx
        self.chunk_tokens = chunk_tokens
        self.step_tokens = step_tokens or chunk_tokens
        self.busy_tokens = busy_tokens or chunk_tokens
        self.cut_anywhere = cut_anywhere
        self._unchecked = 0  # steps since proposals were last checked, while some were made
        self.pace = Pace()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.persist: list[Persist] = []  # pages computed by the last update, to keep on disk

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if len(seq.prompt_ids) >= self.ctx:
            raise ValueError(f"prompt of {len(seq.prompt_ids)} tokens does not fit ctx {self.ctx}")
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: Status) -> None:
        """End ``seq`` now (stop string, abort, error) and free its slot."""
        seq.finish(status)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.cache.insert(seq.slot, seq.prompt_ids[: seq.num_computed], seq.cache_salt)
            self.slots.free(seq.slot)

    def lost(self, plan: Plan) -> set[int]:
        """Forget what the slots and host entries that a failed step wrote hold (its requests ended
        first); the host entries to drop."""
        ops = plan.cache_ops
        entries = {op.entry for op in ops if isinstance(op, Save)}
        slots = {w.slot for w in plan.work} | {
            op.slot for op in ops if isinstance(op, Load | Copy | Restore)}
        self.cache.lost(slots, entries)
        return entries

    def schedule(self) -> Plan:
        decoding = [s for s in self.running if not s.in_prefill]
        prompts = self.waiting or len(decoding) < len(self.running)  # their first tokens come before proposals
        drafts = [()] * len(decoding) if prompts or len(decoding) > SPEC_ROWS else self._afford(decoding)
        plan = Plan([Work(s, (s.output_ids[-1], *d), s.num_tokens - 1, sample=True, draft=len(d))
                     for s, d in zip(decoding, drafts)])
        prefilling = sorted((s for s in self.running if s.in_prefill), key=lambda s: not self._short(s))
        short = self._short(prefilling[0] if prefilling else next(iter(self.waiting), None))
        unit = self.chunk_tokens if short or not self.cut_anywhere else PIECE
        ratio = SHORT_RATIO if short else RATIO
        rows = len(plan.work) + plan.draft_rows
        budget = self.pace.budget(rows, unit, self.busy_tokens, ratio, self.chunk_tokens) if plan else self.step_tokens
        tail = self.pace.budget(rows, 1, self.chunk_tokens, TAIL_RATIO, 1) if plan and short else 0
        if prefilling and not short and (jumping := self._short_waiting()):  # before the long prompt's next chunks
            self.waiting.remove(jumping)
            plan.cache_ops += self._admit(jumping)
            budget -= self._prefill(plan, jumping, budget, unit, tail)
        for seq in prefilling:
            budget -= self._prefill(plan, seq, budget, unit, tail)
        for seq in list(self.waiting):
            fits = budget >= min(unit, len(seq.prompt_ids)) if plan else budget > 0
            if not self.slots.num_free or not fits:
                break
            if self._behind(seq):
                continue
            self.waiting.remove(seq)
            plan.cache_ops += self._admit(seq)
            budget -= self._prefill(plan, seq, budget, unit, tail)
        return plan

    def update(self, plan: Plan, sampled: list[int], seconds: float | None = None,
               emit: Callable[[Sequence, list[int]], None] | None = None) -> list[tuple[Sequence, list[int]]]:
        """Record what ran (in ``seconds``, if timed); ``sampled`` holds one token per sampling row (one
        per work item, 1 + its draft for a decode item with proposals). Returns each request's new
        tokens, each first given to ``emit`` (which may take some back: a stop string, a grammar begun),
        and only then checked against the end of text and the limits. Prompt pages it completed are
        added to ``persist``."""
        if seconds is not None:
            self.pace.record(plan.decode_rows + plan.draft_rows, plan.prompt_tokens, seconds)
        tokens = iter(sampled)
        new: list[tuple[Sequence, list[int]]] = []
        for w in plan.work:
            done, prompt = w.seq.num_computed, w.seq.prompt_ids
            w.seq.num_computed += len(w.token_ids)
            if done < len(prompt):
                self.persist += self.cache.persist(w.slot, prompt, w.seq.cache_salt, done,
                                                   min(w.seq.num_computed, len(prompt)))
            rows = [next(tokens) for _ in range(1 + w.draft)] if w.sample else []
            if rows and not w.seq.status.is_finished:
                kept, proposals = self._accept(w, rows)
                if emit is not None:
                    length = len(w.seq.output_ids)
                    emit(w.seq, kept)  # the tokens it takes back end the step's: its own choice (if kept) first
                    self._withdraw(w.seq, length - len(w.seq.output_ids) - (len(kept) - proposals))
                self._check_limits(w.seq)
                new.append((w.seq, kept))
        return new

    def _accept(self, w: Work, rows: list[int]) -> tuple[list[int], int]:
        """The tokens a decode item gives: its proposals up to the first that differs from the token
        its row before chose, then that row's token (cut after an end of text); and how many of them
        are proposals."""
        seq, proposed = w.seq, w.token_ids[len(w.token_ids) - w.draft :]
        accepted = next((i for i, (p, t) in enumerate(zip(proposed, rows)) if p != t), len(proposed))
        if w.draft:
            seq.num_computed -= w.draft - accepted  # the keys of rejected proposals are written over later
            seq.drafts.record(w.draft, accepted)
        kept = []
        for token in rows[: accepted + 1]:
            seq.append(token)
            kept.append(token)
            if token in seq.eos_ids:
                break
        taken = min(len(kept), accepted)
        checked = w.draft if len(kept) > accepted else taken  # past an end of text they are no part of the answer
        seq.drafted, seq.accepted = seq.drafted + checked, seq.accepted + taken
        self.drafted, self.accepted = self.drafted + checked, self.accepted + taken
        return kept, taken

    def _withdraw(self, seq: Sequence, proposals: int) -> None:
        """Forget ``proposals`` accepted proposals that were taken back (after a stop string, a grammar
        begun, forced tokens): no part of the answer, they count as neither accepted nor rejected."""
        if proposals > 0:
            seq.drafted, seq.accepted = seq.drafted - proposals, seq.accepted - proposals
            self.drafted, self.accepted = self.drafted - proposals, self.accepted - proposals

    def _short(self, seq: Sequence | None) -> bool:
        """Whether ``seq``'s prompt is short (at most SHORT chunks not found in the prefix cache): short
        prompts being computed go before long ones; where the first in line is short, beside decoding
        requests it runs in whole chunks, one at least, in longer steps (a quick first token); a longer
        one is spread in pieces where prompts may be cut anywhere, its last chunks too."""
        return seq is not None and len(seq.prompt_ids) - seq.num_cached <= SHORT * self.chunk_tokens

    def _short_waiting(self) -> Sequence | None:
        """The first short prompt waiting (SHORT chunks at most) that may start now, where a long one is
        being computed: it goes first, one a step, rather than wait for all of the long one (a "Hi" waited
        35 s behind a 7k-token prompt); the long one goes on beside it at the pace of decoding streams."""
        if not self.slots.num_free:
            return None
        return next((s for s in self.waiting if self._short(s) and not self._behind(s)), None)

    def _live(self) -> list[Live]:
        return [Live(s.slot, s.prompt_ids, min(s.num_computed, len(s.prompt_ids)), s.cache_salt)
                for s in self.running if s.slot is not None]

    def _behind(self, seq: Sequence) -> bool:
        """Whether a running prefill is computing chunks of ``seq``'s prompt it has not yet reached."""
        return any(b.computed < self.cache.shared(b, seq.prompt_ids, seq.cache_salt) for b in self._live())

    def _admit(self, seq: Sequence) -> list[CacheOp]:
        """Start ``seq`` in the free slot holding the longest prefix of its prompt, or copy that
        prefix in from host memory or a busy slot."""
        match, ops = self.cache.admit(seq.prompt_ids, self.slots.free_slots, seq.cache_salt, self._live(),
                                      seq.session)
        seq.start(self.slots.allocate(match.slot), cached=match.tokens, differs=match.differs)
        self.lookup_tokens += len(seq.prompt_ids)
        self.hit_tokens += match.tokens
        self.diverged += match.differs is not None
        self.running.append(seq)
        return ops

    def _check_limits(self, seq: Sequence) -> None:
        """End ``seq`` at an end of text, or once it used its tokens or the context: judged on the tokens
        it kept (a step's later proposals taken back by a stop string, say, do not count)."""
        if seq.status.is_finished or not seq.output_ids:
            return
        if seq.output_ids[-1] in seq.eos_ids:
            self.finish(seq, Status.FINISHED_STOP)
        elif len(seq.output_ids) >= seq.max_new_tokens or seq.num_tokens >= self.ctx:
            self.finish(seq, Status.FINISHED_LENGTH)

    def _draft(self, seq: Sequence) -> tuple[int, ...]:
        """Tokens ``seq``'s own text proposes, none where a grammar or forced tokens choose, and never
        more than its limits leave room for after them."""
        if seq.drafts is None or seq.constraint is not None or seq.forced:
            return ()
        room = min(seq.max_new_tokens - len(seq.output_ids), self.ctx - seq.num_tokens) - 1
        return seq.drafts.propose(room)

    def _afford(self, decoding: list[Sequence]) -> list[tuple[int, ...]]:
        """Each decoding request's proposals cut to what pays: its j-th is taken with about
        ``taken``^j (its record), a step of n rows costs what ``Pace`` measured, and the count of
        proposals checked, most likely first, is the one that gives the most tokens a second (none
        until steps of two sizes are known); after PROBE steps of none, the likeliest one is checked,
        which measures that step size again."""
        rows, proposals = len(decoding), [self._draft(s) for s in decoding]
        if not any(proposals) or len(self.pace.sizes) < 2:
            return [()] * rows
        likely = sorted(((s.drafts.taken ** j, i) for i, (s, p) in enumerate(zip(decoding, proposals))
                         for j in range(1, len(p) + 1)), reverse=True)
        tokens, best, rate = float(rows), 0, rows / self.pace.step(rows)
        for extra, (chance, _) in enumerate(likely, 1):
            tokens += chance
            if (now := tokens / self.pace.step(rows + extra)) > rate:
                best, rate = extra, now
        self._unchecked = 0 if best else self._unchecked + 1
        if self._unchecked >= PROBE:  # a step time measured when the machine was busy is not kept forever
            best, self._unchecked = 1, 0
        keep = [0] * rows
        for _, i in likely[:best]:
            keep[i] += 1
        return [p[:k] for p, k in zip(proposals, keep)]

    def _chunk_len(self, seq: Sequence, position: int) -> int:
        """Tokens of ``seq``'s prompt chunk that starts at ``position`` (up to the next boundary)."""
        return min(len(seq.prompt_ids) - position, self.chunk_tokens - position % self.chunk_tokens)

    def _prefill(self, plan: Plan, seq: Sequence, budget: int, unit: int, tail: int) -> int:
        """Add ``seq``'s next chunks that fit ``budget`` (at least one if the plan is empty), the last
        one cut short where the step's ``unit`` is less than a chunk; the prompt's last chunk also where
        it passes the budget by at most ``tail`` tokens."""
        start = position = seq.num_computed
        prompt = len(seq.prompt_ids)
        while position < prompt:
            n, left = self._chunk_len(seq, position), budget - (position - start)
            if plan and n > left and not (position + n == prompt and n - left <= tail):
                if left <= 0 or unit == self.chunk_tokens:
                    break
                n = left
            end = position + n
            plan.work.append(Work(seq, tuple(seq.prompt_ids[position:end]), position, sample=end == prompt))
            position = end
        return position - start
