"""Decode steps at fixed shapes, replayed as CUDA graphs.

On a GPU a small model's decode step is mostly kernel launches: ten or so per layer, each a few
microseconds of work. ``DecodeGraphs`` runs a step whose every item is one token at a fixed shape
(its rows padded to the next of a few sizes, the attended length to the next power of two) and on
CUDA captures the forward of each shape once, on first use, as one graph that later steps of that
shape replay with a single launch (the final norm and lm_head then run on the rows that sample
only, not on the padding). A padding row writes its key and value at position 0 of a spare KV
slot no request holds and attends to that one position, so no request's cache changes. Without
capture the same padded step runs eagerly (how the CPU tests check it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mashbox.engine.sched.scheduler import Plan, Work

SHORTEST = 128  # the fewest positions a shape attends to
LONGEST = 4096  # the most: a longer step runs eagerly (its time is attention, not launches, and a
# graph pool keeps the scratch of the largest shape it captured for good)


@dataclass(slots=True)
class Shape:
    """One padded step: the inputs a replay reads and the hidden states it writes."""

    inputs: torch.Tensor  # [5, rows]: token id, position, row, slot, attended length
    hidden: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """``step(inputs, length)``: the last hidden states of a padded step's rows (``Shape.inputs``),
    each row attending to at most ``length`` positions."""

    def __init__(self, step: Callable[[torch.Tensor, int], torch.Tensor], device: torch.device, ctx: int,
                 spare: int, capture: bool) -> None:
        self.step = step
        self.device = device
        self.ctx = ctx
        self.spare = spare  # the KV slot padding rows write to
        self.capture = capture
        self.row_sizes = row_sizes(spare)
        self.shapes: dict[tuple[int, int], Shape] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.stream = torch.cuda.Stream(device) if capture else None  # every capture into the pool on one stream

    def takes(self, plan: Plan) -> bool:
        """A step of one-token items only (decode rows, one-token prompt pieces), at most one a slot,
        none past ``LONGEST`` positions."""
        return (0 < len(plan.work) <= self.row_sizes[-1] and all(len(item.token_ids) == 1 for item in plan.work)
                and max(item.position for item in plan.work) < LONGEST)

    def hidden(self, plan: Plan) -> torch.Tensor:
        """The last hidden state of each item of ``plan`` (every one a single token), in order; valid
        until the next call."""
        with torch.cuda.device(self.device) if self.capture else contextlib.nullcontext():
            n = len(plan.work)
            rows = next(size for size in self.row_sizes if size >= n)
            key = (rows, attended(max(item.position + 1 for item in plan.work), self.ctx))
            shape = self.shapes.get(key) or self._shape(*key)
            shape.inputs.copy_(self._inputs(plan.work, rows, "cpu"), non_blocking=True)
            if shape.graph is not None:
                shape.graph.replay()
            else:
                shape.hidden = self.step(shape.inputs, key[1])
            return shape.hidden[:n]

    def _inputs(self, work: list[Work], rows: int, device: torch.device | str) -> torch.Tensor:
        """``Shape.inputs`` for ``work``'s one-token items, padded to ``rows`` with rows of the spare slot."""
        pad = rows - len(work)
        return torch.tensor([[item.token_ids[0] for item in work] + [0] * pad,
                             [item.position for item in work] + [0] * pad,
                             list(range(rows)),
                             [item.slot for item in work] + [self.spare] * pad,
                             [item.position + 1 for item in work] + [1] * pad], dtype=torch.long, device=device)

    def _shape(self, rows: int, length: int) -> Shape:
        shape = Shape(self._inputs([], rows, self.device))
        if self.capture:  # the inputs name the spare slot only: the warm-up writes nowhere else
            self._capture(shape, length)
        self.shapes[rows, length] = shape
        return shape

    def _capture(self, shape: Shape, length: int) -> None:
        """A warm-up on a side stream (lazy set-up, cuBLAS workspaces, happens outside the capture),
        then the capture."""
        current = torch.cuda.current_stream()
        warm = torch.cuda.Stream(self.device)
        warm.wait_stream(current)
        with torch.cuda.stream(warm):
            self.step(shape.inputs, length)
        current.wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                shape.hidden = self.step(shape.inputs, length)
        except RuntimeError:
            self._abandon(current)
            raise
        shape.graph = graph

    def _abandon(self, stream: torch.cuda.Stream) -> None:
        """Undo what ``torch.cuda.graph`` leaves where its ``capture_end`` raises (torch 2.13): its
        capture stream current, the allocator still allocating to and holding the graph pool. (Where
        the step itself raised, the capture ended and the stream is back: nothing to undo.)"""
        if torch.cuda.current_stream() == stream:
            return
        torch.cuda.set_stream(stream)
        index = torch.cuda.current_device()
        for undo in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
            with contextlib.suppress(RuntimeError, AttributeError):  # a torch without them: graphs go off all the same
                getattr(torch._C, undo)(index, self.pool)


def row_sizes(slots: int) -> list[int]:
    """The padded row counts: powers of two below ``slots``, then ``slots``."""
    return [1 << i for i in range(slots.bit_length()) if 1 << i < slots] + [slots]


def attended(longest: int, ctx: int) -> int:
    """The positions a padded step reads: the next power of two from ``SHORTEST``, at most ``ctx``."""
    return min(ctx, max(SHORTEST, 1 << (longest - 1).bit_length()))
