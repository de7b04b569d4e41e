"""The KV cache: one row per slot, each holding a whole context, allocated once.

Each KV head's positions lie together ([layers, slots, kv_heads, ctx, row]), so attention reads a
head's keys as one run of memory. A row is one position of one head: ``head_dim`` floats, or
q8_0 bytes (``head_dim`` int8, then an fp16 scale for each 32), which mashbox's CPU kernels write
and read. Copies handed out (``save``) and taken in (``restore``) are [layers, tokens, kv_heads,
row], the prefix cache's page form.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mashbox.errors import ConfigError

if TYPE_CHECKING:
    from mashbox.engine.load.checkpoint import Spec
    from mashbox.engine.model.form import Form


@dataclass(slots=True)
class KVCache:
    keys: torch.Tensor  # [layers, slots, kv_heads, ctx, row]
    values: torch.Tensor
    q8: ctypes.CDLL | None = None  # rows in q8_0, stored by these kernels; None: rows of floats

    @classmethod
    def allocate(cls, spec: Spec, slots: int, ctx: int, form: Form, device: torch.device) -> KVCache:
        if form.kv == "q8_0" and spec.head_dim % 32:
            raise ConfigError(f"kv_dtype: q8_0 takes heads of a multiple of 32 values; this model's have "
                             f"{spec.head_dim}: use f16")
        shape = (spec.num_layers, slots, spec.num_kv_heads, ctx, form.kv_row(spec.head_dim))
        keys, values = (torch.empty(shape, dtype=form.kv_dtype, device=device) for _ in range(2))
        return cls(keys, values, form.lib if form.kv == "q8_0" else None)

    @property
    def kvq(self) -> int:
        """The kernels' name for the rows' form: 1 for q8_0, 0 for fp16."""
        return int(self.q8 is not None)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store each token's keys/values [tokens, kv_heads, head_dim] at its slot and position."""
        if self.q8 is None:
            self.keys[layer, slots, :, positions] = k.to(self.keys.dtype)
            self.values[layer, slots, :, positions] = v.to(self.values.dtype)
            return
        for cache, x in ((self.keys[layer], k), (self.values[layer], v)):
            x = x.float().contiguous()
            tokens, heads, dim = x.shape
            self.q8.mb_kv_store(x.data_ptr(), heads * dim, cache.data_ptr(), slots.data_ptr(), positions.data_ptr(),
                                tokens, heads, dim, cache.shape[2], 1)

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
        """Keys and values [kv_heads, length, head_dim] of one slot (rows of floats only: the kernels
        that take q8_0 rows attend every row of a step themselves)."""
        return self.keys[layer, slot, :, :length], self.values[layer, slot, :, :length]
