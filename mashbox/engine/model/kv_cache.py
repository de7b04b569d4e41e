"""The KV cache: one row per slot, each holding a whole context, allocated once.

Each KV head's positions lie together ([layers, slots, kv_heads, ctx, row]), so attention reads a
head's keys as one run of memory. A row is one position of one head: ``head_dim`` floats, or
q8_0 bytes (``head_dim`` int8, then an fp16 scale for each 32), which mashbox's CPU kernels write
and read. Where those kernels attend in bf16, the fp16 keys are kept as that attention reads them
(``blocked``): each 64 positions as ``head_dim / 2`` runs of 64 pairs (one position's two values of
dims 2i, 2i + 1), so that no step transposes them again. Copies handed out (``save``) and taken in
(``restore``) are [layers, tokens, kv_heads, row], the prefix cache's page form, whatever the layout.
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
    kvq: int = 0  # the kernels' name for the rows' form: 0 fp16, 1 q8_0, 2 fp16 with blocked keys
    lib: ctypes.CDLL | None = None  # the kernels that store forms 1 and 2; form 0 is stored by torch

    @classmethod
    def allocate(cls, spec: Spec, slots: int, ctx: int, form: Form, device: torch.device) -> KVCache:
        if form.kv == "q8_0" and spec.head_dim % 32:
            raise ConfigError(f"kv_dtype: q8_0 takes heads of a multiple of 32 values; this model's have "
                             f"{spec.head_dim}: use f16")
        lib = form.lib
        blocked = (lib is not None and form.kv != "q8_0" and form.bf16_attention and lib.mb_attention_bf16()
                   and spec.head_dim % 16 == 0)
        ctx = _whole(ctx) if blocked else ctx  # whole blocks (positions past ctx are never used)
        shape = (spec.num_layers, slots, spec.num_kv_heads, ctx, form.kv_row(spec.head_dim))
        keys, values = (torch.empty(shape, dtype=form.kv_dtype, device=device) for _ in range(2))
        kvq = 1 if form.kv == "q8_0" else 2 if blocked else 0
        return cls(keys, values, kvq, lib if kvq else None)

    @property
    def blocked(self) -> bool:
        return self.kvq == 2

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store each token's keys/values [tokens, kv_heads, head_dim] at its slot and position."""
        if self.lib is None:
            self.keys[layer, slots, :, positions] = k.to(self.keys.dtype)
            self.values[layer, slots, :, positions] = v.to(self.values.dtype)
            return
        for cache, x, kvq in ((self.keys[layer], k, self.kvq), (self.values[layer], v, int(self.kvq == 1))):
            x = x.float().contiguous()
            tokens, heads, dim = x.shape
            self.lib.mb_kv_store(x.data_ptr(), heads * dim, cache.data_ptr(), slots.data_ptr(), positions.data_ptr(),
                                 tokens, heads, dim, cache.shape[2], kvq)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of keys and values one token position holds over all layers."""
        layers, _, heads, _, dim = self.keys.shape
        return 2 * layers * heads * dim * self.keys.element_size()

    def save(self, slot: int, length: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A host-memory copy of positions [``start``, ``length``) of ``slot``."""
        return tuple(t.transpose(1, 2).to("cpu", copy=True).contiguous()
                     for t in (self._key_rows(slice(None), slot, start, length), self.values[:, slot, :, start:length]))

    def restore(self, slot: int, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        keys, values = (t.to(self.keys.device).transpose(1, 2) for t in saved)  # [layers, kv_heads, tokens, row]
        self.values[:, slot, :, : values.shape[2]] = values
        if not self.blocked:
            self.keys[:, slot, :, : keys.shape[2]] = keys
            return
        tokens = keys.shape[2]  # a last part block is filled out: its positions past tokens are written before read
        whole = keys.new_zeros(*keys.shape[:2], _whole(tokens), keys.shape[3])
        whole[:, :, :tokens] = keys
        self.keys[:, slot, :, : whole.shape[2]] = _pairs(whole, BLOCK)

    def copy(self, source: int, slot: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``source`` into ``slot`` (whole blocks of keys)."""
        whole = _whole(length) if self.blocked else length
        self.keys[:, slot, :, :whole] = self.keys[:, source, :, :whole]
        self.values[:, slot, :, :length] = self.values[:, source, :, :length]

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [kv_heads, length, head_dim] of one slot (rows of floats only: the kernels
        that take q8_0 rows attend every row of a step themselves)."""
        return self._key_rows(layer, slot, 0, length), self.values[layer, slot, :, :length]

    def _key_rows(self, layer: int | slice, slot: int, start: int, end: int) -> torch.Tensor:
        """Keys of positions [start, end) as rows [..., kv_heads, end - start, row] (a copy where blocked)."""
        if not self.blocked:
            return self.keys[layer, slot, :, start:end]
        first = start // BLOCK * BLOCK
        blocks = self.keys[layer, slot, :, first : _whole(end)]
        return _rows(blocks, BLOCK)[..., start - first : end - first, :]


BLOCK = 64  # positions a block of blocked keys holds (KB in kernels.c)


def _whole(positions: int) -> int:
    """``positions`` rounded up to whole blocks."""
    return -(-positions // BLOCK) * BLOCK


def _pairs(rows: torch.Tensor, block: int) -> torch.Tensor:
    """Rows [..., positions, dim] (whole blocks) as blocked keys: each block [dim / 2][block][2]."""
    *lead, n, dim = rows.shape
    return rows.reshape(*lead, n // block, block, dim // 2, 2).transpose(-3, -2).reshape(*lead, n, dim)


def _rows(blocked: torch.Tensor, block: int) -> torch.Tensor:
    """``_pairs``'s inverse."""
    *lead, n, dim = blocked.shape
    return blocked.reshape(*lead, n // block, dim // 2, block, 2).transpose(-3, -2).reshape(*lead, n, dim)
