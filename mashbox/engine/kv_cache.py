"""The KV cache: one row per slot, each holding a whole context, allocated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mashbox.engine.scheduler import Work
    from mashbox.engine.weights import Spec


@dataclass(slots=True)
class KVCache:
    keys: torch.Tensor  # [layers, slots, kv_heads, ctx, head_dim]
    values: torch.Tensor

    @classmethod
    def allocate(cls, spec: Spec, slots: int, ctx: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        shape = (spec.num_layers, slots, spec.num_kv_heads, ctx, spec.head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def write(self, layer: int, work: list[Work], offsets: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' keys/values [tokens, kv_heads, head_dim] at their positions."""
        for item, start in zip(work, offsets):
            n = len(item.token_ids)
            span = slice(item.position, item.position + n)
            self.keys[layer, item.slot, :, span] = k[start : start + n].transpose(0, 1)
            self.values[layer, item.slot, :, span] = v[start : start + n].transpose(0, 1)

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer, slot, :, :length], self.values[layer, slot, :, :length]
