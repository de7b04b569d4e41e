"""Prompt prefixes kept for reuse by requests that start the same way.

Each slot remembers the tokens whose KV it still holds. A new request takes
the free slot sharing the longest prefix with its prompt and prefills only the
rest. When a slot's prefix is about to be overwritten it is saved to host RAM
(capped, least recently used out first), and restored from there into a slot
when a later prompt starts with it. The conversation a client session (an agent's) goes on
with is kept warm: its slots are reused, and its host entries dropped, only after those of
one-off prompts (an agent's side requests: titles, summaries, quota checks). A prompt computed
in a busy slot (``Live``: another request running, still prefilling or already decoding) is
copied from there. Only whole prompt chunks (multiples of
``block`` tokens, prefilled as chunks) are reused, so a cached prefix holds
exactly the KV a cold prefill would compute: answers do not depend on what ran
before. The cache decides; the runner moves the bytes (``Save``, ``Restore``,
``Drop`` in the plan).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mashbox.engine.sched.disk_cache import PageStore


@dataclass(slots=True, frozen=True)
class Match:
    """``tokens`` of the prompt cached in ``slot``; ``differs``: where the prompt first differs
    from the cached prefix that agrees with it longest, when that prefix goes on past that token
    (None: every prefix agreeing longest ends within the prompt, or nothing agrees)."""

    slot: int
    tokens: int
    differs: int | None = None


@dataclass(slots=True, frozen=True)
class Save:
    """Copy the first ``tokens`` positions of ``slot`` to host entry ``entry``."""

    slot: int
    entry: int
    tokens: int


@dataclass(slots=True, frozen=True)
class Restore:
    """Copy host entry ``entry`` into the first ``tokens`` positions of ``slot``."""

    entry: int
    slot: int
    tokens: int


@dataclass(slots=True, frozen=True)
class Copy:
    """Copy the first ``tokens`` positions of busy slot ``source`` into ``slot``."""

    source: int
    slot: int
    tokens: int


@dataclass(slots=True, frozen=True)
class Drop:
    entry: int


@dataclass(slots=True, frozen=True, eq=False)
class Load:
    """Write KV read from disk ([layers, tokens, kv_heads, head_dim]) into the first positions of ``slot``."""

    slot: int
    keys: Any
    values: Any


@dataclass(slots=True, frozen=True)
class Persist:
    """Keep positions [start, end) of ``slot`` on disk as page ``key`` (``tokens`` are its prompt tokens)."""

    slot: int
    start: int
    end: int
    key: str
    tokens: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class Live:
    """A busy slot's prompt: its first ``computed`` tokens hold their KV already."""

    slot: int
    prompt: tuple[int, ...] | list[int]
    computed: int
    salt: str = ""


CacheOp = Save | Restore | Copy | Drop | Load
SESSIONS = 64  # sessions whose conversation is kept warm, the most recently seen
ASIDES = 4  # a session's latest prompts off its line: one a later prompt goes on with becomes the line


@dataclass(slots=True)
class Session:
    """The conversation a client session goes on with (its ``line``: the prompt of its latest turn), the
    line before it, and its latest prompts off the line (``asides``: side requests, or a conversation
    begun anew)."""

    line: tuple[int, ...] = ()
    before: tuple[int, ...] = ()  # kept warm too: a side request may have been taken for a new line
    asides: list[tuple[int, ...]] = field(default_factory=list)
    grown: bool = False  # whether the line holds a line before it whole (a conversation's next turn)

    def follow(self, prompt: tuple[int, ...], block: int) -> None:
        """A prompt that goes on with the line (shares at least half of it: the next turn, or a turn
        again) is the line now; so is one that holds the line before, or an aside, whole (the next turn
        after side requests; a history rewritten, then its next turn); any other is an aside. A grown
        line that the new one does not hold whole (a turn again, or a side request that shares the
        line's long start: the agent's tools) is kept warm as ``before``: which of the two the session
        goes on with, its next turn says (side requests in a row leave it there)."""
        if not self.line or _goes_on(self.line, prompt, block):
            grows = not self.line or _holds(prompt, self.line) or _holds(prompt, self.before)
            if not grows and self.grown:
                self.before = self.line
            self.line, self.grown = prompt, grows
        elif _holds(prompt, self.before):  # the conversation's next turn after side requests
            self.line, self.grown = prompt, True
        elif moved := next((a for a in self.asides if len(prompt) > len(a) and _holds(prompt, a)), ()):
            self.asides.remove(moved)
            self.before, self.line, self.grown = self.line, prompt, True
        else:
            self.asides = [*self.asides, prompt][-ASIDES:]

    def holds(self, tokens: tuple[int, ...]) -> bool:
        """Whether ``tokens`` are a start of a line, or go on from one (they hold all its KV)."""
        return any(line and (line[: len(tokens)] == tokens or tokens[: len(line)] == line)
                   for line in (self.line, self.before))


def _holds(prompt: tuple[int, ...], line: tuple[int, ...]) -> bool:
    """Whether ``prompt`` goes on from all of ``line`` (none from an empty one)."""
    return bool(line) and prompt[: len(line)] == line


def _goes_on(line: tuple[int, ...], prompt: tuple[int, ...], block: int) -> bool:
    return 2 * _agreement(line, prompt, block) >= len(line)


def _agreement(cached: tuple[int, ...], prompt: Sequence[int], block: int) -> int:
    """How many first tokens ``cached`` and ``prompt`` share (compared a block at a time, then
    token by token in the first block that differs)."""
    n, limit = 0, min(len(cached), len(prompt))
    while n + block <= limit and cached[n : n + block] == tuple(prompt[n : n + block]):
        n += block
    while n < limit and cached[n] == prompt[n]:
        n += 1
    return n


class PrefixCache:
    def __init__(self, num_slots: int, block: int, host_bytes: int = 0, bytes_per_token: int = 0,
                 disk: PageStore | None = None) -> None:
        self.block = block
        self.disk = disk
        self._tokens: list[tuple[int, ...]] = [()] * num_slots
        self._salts: list[str] = [""] * num_slots  # whose prefix each slot holds: no other salt hits it
        self._used: list[int] = [0] * num_slots
        self._clock = 0
        self.host = HostTier(host_bytes, bytes_per_token)
        self._sessions: OrderedDict[tuple[str, str], Session] = OrderedDict()  # by (salt, session id)

    def admit(self, prompt: list[int], free: list[int], salt: str = "",
              live: list[Live] = (), session: str | None = None) -> tuple[Match, list[CacheOp]]:  # type: ignore[assignment]
        """The free slot to run ``prompt`` in, how many of its tokens are cached there,
        and the copies that make it so: from the slot itself, host memory or a busy slot
        (``live``), whichever holds the most. With no hit, the least recently used free slot
        that holds no session's conversation (``warm``), else the least recently used.
        Only prefixes cached under the same ``salt`` (a tenant) hit."""
        if session is not None:
            self._follow(salt, session, prompt)
        slot = max(free, key=lambda s: (self._hit(self._tokens[s], prompt, self._salts[s] == salt),
                                        -self.warm(self._salts[s], self._tokens[s]), -self._used[s]))
        tokens = self._hit(self._tokens[slot], prompt, self._salts[slot] == salt)
        entry, stored = max(((e, self._hit(t, prompt, s == salt)) for e, s, t in self.host.entries()),
                            key=lambda x: x[1], default=(None, 0))
        source, running = max(((b.slot, self.shared(b, prompt, salt, computed=True)) for b in live),
                              key=lambda x: x[1], default=(None, 0))
        if (loaded := self._from_disk(prompt, salt, max(tokens, stored, running))) is not None:
            ops = [*self._evict(slot, 0, keep=None), Load(slot, *loaded)]
            tokens = loaded[0].shape[1]
        elif running > max(tokens, stored):
            ops = [*self._evict(slot, 0, keep=None), Copy(source, slot, running)]
            tokens = running
        elif stored > tokens:
            ops = [*self._evict(slot, 0, keep=entry), Restore(entry, slot, stored)]
            tokens = stored
        else:
            ops = self._evict(slot, tokens, keep=None)
        differs = self._differs(prompt, salt, live, tokens)
        self.insert(slot, prompt[:tokens], salt)
        return Match(slot, tokens, differs), ops

    def _follow(self, salt: str, session: str, prompt: list[int]) -> None:
        """``prompt``'s whole blocks, followed by ``session`` (see ``Session.follow``)."""
        key = (salt, session)
        held = self._sessions.pop(key, None) or Session()
        held.follow(tuple(prompt[: len(prompt) // self.block * self.block]), self.block)
        self._sessions[key] = held
        while len(self._sessions) > SESSIONS:
            self._sessions.popitem(last=False)

    def warm(self, salt: str, tokens: tuple[int, ...]) -> bool:
        """Whether ``tokens`` hold a session's line, or some of it (held under the same salt)."""
        return len(tokens) > 0 and any(s == salt and held.holds(tokens) for (s, _), held in self._sessions.items())

    def _differs(self, prompt: list[int], salt: str, live: list[Live], served: int) -> int | None:
        """Where ``prompt`` leaves the cached prefix (slots, host memory, busy slots) that agrees
        with it longest, if that prefix goes on and the prompt got no more than it from the cache (its
        ``served`` tokens: disk pages, known by hash alone and not asked, may have given more). None for a
        prompt no cache could serve (no whole block before its last token): it missed nothing."""
        if len(prompt) <= self.block:
            return None
        held = [t for t, s in zip(self._tokens, self._salts) if s == salt]
        held += [t for _, s, t in self.host.entries() if s == salt]
        held += [tuple(b.prompt[: b.computed]) for b in live if b.salt == salt]
        agreed = [(_agreement(t, prompt, self.block), len(t)) for t in held]
        longest = max((a for a, _ in agreed), default=0)
        diverged = any(a == longest < min(n, len(prompt)) for a, n in agreed)
        return longest if diverged and longest >= served else None

    def _from_disk(self, prompt: list[int], salt: str, beat: int) -> tuple[Any, Any] | None:
        """The KV of the pages of ``prompt`` on disk, when they hold more than ``beat`` tokens."""
        if self.disk is None:
            return None
        keys = self.disk.keys(prompt, salt, limit=len(prompt) - 1)
        pages = self.disk.stored(keys)
        if pages * self.disk.page <= beat:  # memory serves it: its pages are of use all the same
            self.disk.touch(keys[:pages])
            return None
        loaded = self.disk.read(keys[:pages], prompt)
        return loaded if loaded is not None and loaded[0].shape[1] > beat else None

    def persist(self, slot: int, prompt: list[int], salt: str, done: int, now: int) -> list[Persist]:
        """Ops that keep on disk the pages of ``prompt`` completed between ``done`` and ``now``
        computed tokens."""
        if self.disk is None or now // self.disk.page == done // self.disk.page:
            return []
        page = self.disk.page
        keys = self.disk.keys(prompt, salt, limit=now)
        return [Persist(slot, i * page, (i + 1) * page, key, tuple(prompt[i * page:(i + 1) * page]))
                for i, key in enumerate(keys) if i >= done // page]

    def shared(self, busy: Live, prompt: list[int], salt: str, computed: bool = False) -> int:
        """Tokens of ``prompt`` (whole blocks) that ``busy`` holds, or will once its prefill
        reaches them (``computed``: only those it holds now)."""
        held = busy.prompt[: busy.computed] if computed else busy.prompt
        return self._hit(tuple(held), prompt, busy.salt == salt)

    def insert(self, slot: int, tokens: list[int], salt: str = "") -> None:
        """Record that ``slot`` holds the KV of ``tokens`` (whole blocks only are kept)."""
        keep = len(tokens) // self.block * self.block
        self._salts[slot] = salt
        self._tokens[slot] = tuple(tokens[:keep])
        self._clock += 1
        self._used[slot] = self._clock

    def lost(self, slots: set[int], entries: set[int]) -> None:
        """A step failed: what ``slots`` and host ``entries`` hold is not known, so none of it is reused."""
        for slot in slots:
            self._tokens[slot] = ()
        self.host.forget(entries)

    @property
    def cached_tokens(self) -> int:
        return sum(len(t) for t in self._tokens)

    def check_integrity(self) -> None:
        for tokens in [*self._tokens, *(t for _, _, t in self.host.entries())]:
            if len(tokens) % self.block:
                raise AssertionError("a cached prefix holds a partial block")
        if self.host.bytes > self.host.cap:
            raise AssertionError("the host cache is over its cap")

    def _evict(self, slot: int, kept: int, keep: int | None) -> list[CacheOp]:
        """Save what ``slot`` holds beyond ``kept`` tokens before it is overwritten
        (never pushing out host entry ``keep``, which is about to be restored)."""
        if keep is not None:
            self.host.touch(keep)
        tokens = self._tokens[slot]
        if len(tokens) <= kept:
            return []
        return self.host.store(slot, tokens, keep, self._salts[slot], self.warm)

    def _hit(self, cached: tuple[int, ...], prompt: list[int], same_salt: bool = True) -> int:
        """The whole blocks of ``prompt`` that ``cached`` holds, short of its last token."""
        if not same_salt:
            return 0
        return min(_agreement(cached, prompt, self.block), len(prompt) - 1) // self.block * self.block


class HostTier:
    """The index of prefixes saved in host RAM: LRU, capped in bytes."""

    def __init__(self, cap: int, bytes_per_token: int) -> None:
        self.cap = cap
        self.bytes_per_token = bytes_per_token
        self.evictions = 0
        self._entries: OrderedDict[int, tuple[str, tuple[int, ...]]] = OrderedDict()  # entry -> (salt, tokens)
        self._tokens = 0  # of all entries: summing them at each entry a store drops made storing quadratic
        self._ids = itertools.count()

    @property
    def bytes(self) -> int:
        return self._tokens * self.bytes_per_token

    def entries(self) -> list[tuple[int, str, tuple[int, ...]]]:
        """(entry, salt, tokens), least recently used first."""
        return [(e, salt, t) for e, (salt, t) in self._entries.items()]

    def touch(self, entry: int) -> None:
        self._entries.move_to_end(entry)

    def forget(self, entries: set[int]) -> None:
        for entry in entries:
            self._drop(entry)

    def store(self, slot: int, tokens: tuple[int, ...], keep: int | None = None, salt: str = "",
              warm: Callable[[str, tuple[int, ...]], bool] = lambda salt, tokens: False) -> list[CacheOp]:
        """Ops that save ``tokens`` from ``slot``, dropping entries of its salt it supersedes and
        what no longer fits: entries no session goes on with (not ``warm``) first, each kind least
        recently used first; nothing when it cannot fit beside ``keep``."""
        size = len(tokens) * self.bytes_per_token
        pinned = len(self._entries.get(keep, ("", ()))[1]) * self.bytes_per_token
        if size + pinned > self.cap or any(s == salt and t[: len(tokens)] == tokens for s, t in self._entries.values()):
            return []
        ops: list[CacheOp] = [Drop(e) for e, s, t in self.entries() if e != keep and s == salt and tokens[: len(t)] == t]
        for op in ops:
            self._drop(op.entry)
        for entry in sorted((e for e in self._entries if e != keep), key=lambda e: warm(*self._entries[e])):
            if self.bytes + size <= self.cap:
                break
            self._drop(entry)
            self.evictions += 1
            ops.append(Drop(entry))
        entry = next(self._ids)
        self._entries[entry] = (salt, tokens)
        self._tokens += len(tokens)
        return [Save(slot, entry, len(tokens)), *ops]

    def _drop(self, entry: int) -> None:
        self._tokens -= len(self._entries.pop(entry, ("", ()))[1])
