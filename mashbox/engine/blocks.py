"""A GGUF's own quantized blocks, kept as the file has them, for the CPU kernels.

Dequantizing a GGUF to fp32 and quantizing it again to int8 reads more bytes per token (8.5 bits a
weight against Q4_1's 5) and adds a second rounding. So the Q4_1 matrices of a GGUF are read as
raw blocks (fp16 d and m, 32 four-bit q), renamed to the HF names, with llama's q/k rows put
back in HF order as transformers does, and kept only where they dequantize to exactly the
checkpoint's fp32 tensor. Reading a GGUF's index takes seconds, so the blocks are saved once
beside the converted copy (``blocks.safetensors``) and memory-mapped from there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mashbox.engine.checkpoint import Checkpoint

FILE = "blocks.safetensors"
Q41_BYTES = 20  # bytes of one Q4_1 block of 32 weights
_NAMES = {  # GGUF tensor -> HF module, in each layer
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def cached(gguf: Path, converted: Path, ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The Q4_1 blocks of ``gguf`` by HF weight name, from ``converted`` (saved there on first use)."""
    from safetensors.torch import load_file, save_file

    path = converted / FILE
    if path.is_file():
        return load_file(path)
    found = read(gguf, ckpt)
    try:
        tmp = path.with_suffix(".tmp")
        save_file(found, tmp)
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs the next load the same seconds
    return found


def read(gguf: Path, ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Each Q4_1 matrix of ``gguf`` as uint8 [rows, K / 32 * 20], under its HF name, where it
    dequantizes to exactly ``ckpt``'s tensor of that name."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(gguf))
    arch = reader.fields["general.architecture"].contents()
    found = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if tensor.tensor_type != GGMLQuantizationType.Q4_1 or name not in ckpt.tensors:
            continue
        rows = torch.from_numpy(np.array(tensor.data))
        if arch == "llama" and tensor.name.split(".")[2] in ("attn_q", "attn_k"):
            rows = _unpermute(rows, ckpt.spec.num_heads if "attn_q" in tensor.name else ckpt.spec.num_kv_heads)
        if torch.equal(dequantize(rows), ckpt.tensors[name].float()):
            found[name] = rows
    return found


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, K] of Q4_1 blocks, computed as gguf-py does (d * q + m in fp32)."""
    blocks = rows.view(rows.shape[0], -1, Q41_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    packed = blocks[..., 4:]
    q = torch.cat([packed & 15, packed >> 4], dim=-1).float()
    return (d * q + m).view(rows.shape[0], -1)


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _NAMES:
        return f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves each head's rotary halves; put the rows back (as
    transformers' LlamaTensorProcessor does for the fp32 tensors)."""
    n = rows.shape[0]
    return rows.view(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(n, -1).contiguous()
