"""Engine events grouped into output blocks: the one core every translator builds on.

A block is a run of text, a run of reasoning, or one tool call. A new block opens when the kind
of delta changes; ``BlockTracker.feed`` says what opened, grew and closed, so each protocol only
maps those three changes to its own stream events, and reads the blocks for its whole response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mashbox.engine.events import (
    Event,
    Finish,
    ReasoningDelta,
    Queued,
    Started,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)

BlockKind = Literal["text", "reasoning", "tool"]


@dataclass(slots=True)
class Block:
    kind: BlockKind
    index: int
    text: str = ""
    tool_id: str = ""
    name: str = ""
    tool_ordinal: int = 0
    closed: bool = False


@dataclass(slots=True, frozen=True)
class Change:
    kind: Literal["open", "delta", "close", "finish"]
    block: Block | None = None
    text: str = ""


class BlockTracker:
    """Feeds engine events in order; keeps the blocks and the Finish."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.finish: Finish | None = None
        self._open: Block | None = None
        self._tools: dict[int, Block] = {}

    def feed(self, event: Event) -> list[Change]:
        if isinstance(event, (TextDelta, ReasoningDelta)):
            kind: BlockKind = "text" if isinstance(event, TextDelta) else "reasoning"
            return self._grow(kind, event.text) if event.text else []
        if isinstance(event, ToolCallStart):
            return self._close() + self._open_tool(event)
        if isinstance(event, ToolCallDelta):
            return self._tool_delta(event)
        if isinstance(event, ToolCallEnd):
            block = self._tools.get(event.index)
            return self._close() if block is not None and block is self._open else []
        if isinstance(event, Finish):
            self.finish = event
            return [*self._close(), Change("finish")]
        if isinstance(event, (Queued, Started)):
            return []
        raise TypeError(f"not an engine event: {event!r}")

    @property
    def cut(self) -> bool:
        """Whether the answer ended by running out of tokens or failing: the block its end closes was
        cut short."""
        return self.finish is not None and self.finish.reason in ("length", "error")

    def done(self) -> Finish:
        """The Finish event; a whole answer can only be built after it."""
        if self.finish is None:
            raise RuntimeError("the answer is not finished: feed the engine's Finish event first")
        return self.finish

    def text(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "text")

    def reasoning(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "reasoning")

    def tools(self) -> list[Block]:
        return [b for b in self.blocks if b.kind == "tool"]

    def _grow(self, kind: BlockKind, text: str) -> list[Change]:
        changes: list[Change] = []
        block = self._open
        if block is None or block.kind != kind:
            changes = self._close()
            block = Block(kind, len(self.blocks))
            changes.append(self._start(block))
        block.text += text
        return [*changes, Change("delta", block, text)]

    def _open_tool(self, event: ToolCallStart) -> list[Change]:
        ordinal = len(self._tools)
        block = Block("tool", len(self.blocks), tool_id=event.id, name=event.name, tool_ordinal=ordinal)
        self._tools[event.index] = block
        return [self._start(block)]

    def _tool_delta(self, event: ToolCallDelta) -> list[Change]:
        block = self._tools.get(event.index)
        if block is None or block.closed or not event.arguments:
            return []
        block.text += event.arguments
        return [Change("delta", block, event.arguments)]

    def _start(self, block: Block) -> Change:
        self.blocks.append(block)
        self._open = block
        return Change("open", block)

    def _close(self) -> list[Change]:
        block, self._open = self._open, None
        if block is None:
            return []
        block.closed = True
        return [Change("close", block)]
