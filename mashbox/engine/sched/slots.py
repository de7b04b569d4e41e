"""Fixed KV slots behind a free-list: a slot is one row of the KV tensors."""

from __future__ import annotations


class SlotTable:
    """Hands out slot ids ``0 .. n-1``; lowest free id first."""

    def __init__(self, n: int) -> None:
        self.size = n
        self._free = list(range(n - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> list[int]:
        return list(reversed(self._free))

    def allocate(self, slot: int | None = None) -> int:
        """Take ``slot``, or the lowest free one."""
        if not self._free or (slot is not None and slot not in self._free):
            raise RuntimeError(f"slot {slot} is not free" if self._free else "no free slot")
        if slot is None:
            return self._free.pop()
        self._free.remove(slot)
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.size or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)
        self._free.sort(reverse=True)
