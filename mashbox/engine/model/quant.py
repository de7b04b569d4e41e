"""Weights as blocks: a GGUF's own quantized rows, which mashbox's CPU kernels multiply as they are.

A ``Blocks`` is one matrix as the file has it: uint8 [rows, row bytes], each row its blocks in
order, in one of ggml's formats (Q4_0 ... Q6_K; a view of the memory-mapped file) or
``MB_Q8``, mashbox's int8 blocks (an fp32 scale, then 32 int8), for weights that come as floats or
in a format the kernels do not read. ``pack`` rearranges a matrix's blocks for the kernels (the same
bytes, a group of rows at a time: ``mb_pack`` in kernels.c), which multiply them without transposing.
``dequantize`` gives fp32 rows of any unpacked blocks (the kernels' ``mb_dequantize``, else gguf-py's
numpy code): the embedding's rows for a step, or whole matrices where a device or form needs floats.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from dataclasses import dataclass

import numpy as np
import torch

MB_Q8 = 100
PACKED = 256  # added to a format's number: its blocks packed for the kernels
FORMATS = {  # ggml type -> (name, weights a block, bytes a block): the ones the kernels read
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), MB_Q8: ("int8", 32, 36),
}


@dataclass(frozen=True, slots=True)
class Blocks:
    """A matrix of ``rows`` x ``k`` weights as blocks of format ``fmt`` (a ggml type number)."""

    fmt: int
    data: torch.Tensor  # uint8 [rows, row bytes]; packed: [rows rounded up to a group, packed row bytes]
    k: int
    count: int | None = None  # packed: the rows (data repeats the last one up to a whole group)

    @property
    def rows(self) -> int:
        return self.data.shape[0] if self.count is None else self.count

    @property
    def name(self) -> str:
        fmt = self.fmt % PACKED
        return FORMATS[fmt][0] if fmt in FORMATS else _ggml_name(fmt)

    @property
    def readable(self) -> bool:
        """Whether mashbox's kernels multiply this format as it is."""
        return self.fmt % PACKED in FORMATS

    @property
    def packed(self) -> bool:
        return self.fmt >= PACKED

    def select(self, rows: torch.Tensor) -> Blocks:
        """These rows, in this order (a copy)."""
        return Blocks(self.fmt, self.data[rows].contiguous(), self.k)


def dequantize(blocks: Blocks, lib: ctypes.CDLL | None, ids: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [len(ids) or rows, k]: the rows ``ids`` (all by default), exactly as the file defines them."""
    n = blocks.rows if ids is None else ids.shape[0]
    if blocks.packed:
        raise ValueError("packed blocks are read by mb_matmul only")
    if lib is not None and blocks.readable:
        out = torch.empty(n, blocks.k)
        ids = None if ids is None else ids.to(torch.long).contiguous()
        lib.mb_dequantize(blocks.data.data_ptr(), blocks.fmt, None if ids is None else ids.data_ptr(), n, blocks.k,
                          out.data_ptr())
        return out
    data = blocks.data if ids is None else blocks.data[ids]
    if blocks.fmt == MB_Q8:
        raw = data.view(data.shape[0], -1, 36)
        scales = raw[..., :4].contiguous().view(torch.float32)
        return (raw[..., 4:].contiguous().view(torch.int8).float() * scales).view(n, blocks.k)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return torch.from_numpy(gguf_dequantize(data.numpy(), GGMLQuantizationType(blocks.fmt)).astype(np.float32))


def pack(blocks: Blocks, lib: ctypes.CDLL) -> Blocks:
    """The blocks packed for the kernels (a copy of the same size, or 1.03x with an odd count of
    paired blocks a row); as they are where the kernels do not pack (no AVX2) or already packed."""
    size = packed_bytes(blocks, lib)
    if not size:
        return blocks
    out = _huge(size)
    lib.mb_pack(blocks.data.data_ptr(), blocks.fmt, blocks.rows, blocks.k, out.data_ptr())
    return as_packed(blocks, out, lib)


def _huge(size: int) -> torch.Tensor:
    """``size`` bytes of fresh memory in 2 MB pages where the kernel gives them (Linux's transparent huge
    pages, asked for: often only given when asked): a decode step reading the weights misses the TLB less
    (qwen2.5-coder-0.5b's layers at one row, the start that packs them: 13.8 -> 12 ms a step)."""
    pages = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without them
            pages.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pages, dtype=torch.uint8)  # which keeps the mapping


def packed_bytes(blocks: Blocks, lib: ctypes.CDLL) -> int:
    """Bytes of ``blocks`` packed; 0 where the kernels do not pack them (no AVX2) or they are packed."""
    return 0 if blocks.packed else lib.mb_packed_bytes(blocks.fmt, blocks.rows, blocks.k)


def as_packed(blocks: Blocks, data: torch.Tensor, lib: ctypes.CDLL) -> Blocks:
    """``blocks`` as the packed bytes ``data`` (``packed_bytes`` of them, as ``mb_pack`` writes them)."""
    rows = -(-blocks.rows // lib.mb_group_rows()) * lib.mb_group_rows()
    return Blocks(blocks.fmt + PACKED, data.view(rows, -1), blocks.k, blocks.rows)


def quantize(lib: ctypes.CDLL, weight: torch.Tensor) -> Blocks:
    """An fp32 weight [N, K] (K a multiple of 32) as MB_Q8 blocks, each block of 32 scaled by its
    largest magnitude / 127 as activation rows are."""
    n, k = weight.shape
    out = torch.empty(n, k // 32 * 36, dtype=torch.uint8)
    lib.mb_q8_quantize(weight.float().contiguous().data_ptr(), out.data_ptr(), n, k)
    return Blocks(MB_Q8, out, k)


class Parts(ctypes.Structure):
    """What ``mb_matmul`` takes: up to 3 matrices stacked by rows (``struct weight`` in kernels.c)."""

    _fields_ = [("data", ctypes.c_void_p * 3), ("fmt", ctypes.c_int64 * 3), ("n", ctypes.c_int64 * 3),
                ("parts", ctypes.c_int64)]

    @classmethod
    def of(cls, parts: list[Blocks]) -> Parts:
        if not 1 <= len(parts) <= 3 or len({p.k for p in parts}) != 1:
            raise ValueError("a matmul takes 1 to 3 parts of the same width")
        s = cls()
        for i, p in enumerate(parts):
            s.data[i], s.fmt[i], s.n[i] = p.data.data_ptr(), p.fmt, p.rows
        s.parts = len(parts)
        return s


def _ggml_name(fmt: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(fmt).name
    except ValueError:
        return f"type {fmt}"
