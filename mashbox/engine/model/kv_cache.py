"""The KV cache: one row per slot, each holding a whole context, allocated once.

Each KV head's positions lie together ([layers, slots, kv_heads, ctx, head_dim]), so attention reads a
head's keys as one run of memory. Copies handed out (``save``) and taken in (``restore``) are
[layers, tokens, kv_heads, head_dim], the prefix cache's page form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mashbox.engine.load.checkpoint import Spec


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

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store each token's keys/values [tokens, kv_heads, head_dim] at its slot and position."""
        self.keys[layer, slots, :, positions] = k.to(self.keys.dtype)
        self.values[layer, slots, :, positions] = v.to(self.values.dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of keys and values one token position holds over all layers."""
        layers, _, heads, _, dim = self.keys.shape
        return 2 * layers * heads * dim * self.keys.element_size()

    def save(self, slot: int, length: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A host-memory copy of positions [``start``, ``length``) of ``slot``."""
        return tuple(t[:, slot, :, start:length].transpose(1, 2).to("cpu", copy=True).contiguous()
                     for t in (self.keys, self.values))

    def restore(self, slot: int, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        for cache, t in zip((self.keys, self.values), saved):
            cache[:, slot, :, : t.shape[1]] = t.to(cache.device).transpose(1, 2)

    def copy(self, source: int, slot: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``source`` into ``slot``."""
        for cache in (self.keys, self.values):
            cache[:, slot, :, :length] = cache[:, source, :, :length]

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [kv_heads, length, head_dim] of one slot."""
        return self.keys[layer, slot, :, :length], self.values[layer, slot, :, :length]
