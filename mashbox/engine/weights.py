"""A Llama-family model's weights, fused and laid out for the runner."""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from mashbox.engine import native
from mashbox.engine.blocks import Q41_BYTES
from mashbox.engine.checkpoint import SUPPORTED, Checkpoint, Spec
from mashbox.engine.loader import pick_dtype
from mashbox.engine.native import ptr
from mashbox.engine.ops import TorchOps
from mashbox.errors import ModelLoadError

TILE = 16


class Linear:
    """``x @ weight.T`` in one of five forms, chosen once per model.

    ``q41``: a GGUF's own Q4_1 blocks (``blocks.py``; 5 bits a weight), regrouped by 8 rows for
    mashbox's compiled kernel, fp32 activations. ``q8``: int8 weights in blocks of 32 with a scale each, the same
    way (a quarter of fp32's memory traffic). Both compute each row alone.
    ``packed``: fp16 weights packed for fbgemm (CPU), fp32 activations; half the
    memory traffic (fbgemm does not promise a row's bits independent of the batch).
    ``plain``: one matmul. ``tiled``: every row goes through a matmul of exactly
    ``TILE`` rows, so its result never depends on how many rows run beside it.
    """

    __slots__ = ("weight", "scales", "shape", "mode", "_packed", "_bias", "_lib")

    def __init__(self, weight: torch.Tensor | None, mode: str, lib: ctypes.CDLL | None = None,
                 blocks: torch.Tensor | None = None) -> None:
        """``weight`` may be None where the kernels take ``blocks`` (mode ``gguf`` with ``lib``): the
        blocks then give the shape and no float weight is needed."""
        if mode == "gguf":
            mode = "q8" if blocks is None else "q41"
        if weight is not None:
            shape = tuple(weight.shape)
        else:
            shape = (blocks.shape[0], blocks.shape[1] // Q41_BYTES * native.BLOCK)
        if mode in ("q8", "q41") and (lib is None or shape[1] % native.BLOCK):
            mode = "packed" if fbgemm_available() else "plain"
        self.mode = mode
        self.weight = weight
        self.shape = shape
        self.scales = self._packed = self._bias = self._lib = None
        if mode == "packed":
            self._packed = _quiet(torch.fbgemm_pack_gemm_matrix_fp16, weight.float().contiguous())
            self._bias = torch.zeros(weight.shape[0])
            self.weight = None
        elif mode == "q8":
            self._lib = lib
            self.weight, self.scales = _quantize(lib, weight.float().contiguous())
        elif mode == "q41":
            self._lib = lib
            self.weight = _repack(lib, blocks, shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._lib is not None:
            return self._native(x)
        if self.mode == "packed":
            return torch.fbgemm_linear_fp16_weight(x.contiguous(), self._packed, self._bias)
        if self.mode == "plain":
            return x @ self.weight.T
        return _tiled(x, self.weight)

    @property
    def nbytes(self) -> int:
        if self._packed is not None:
            return self.shape[0] * self.shape[1] * 2
        return sum(t.nbytes for t in (self.weight, self.scales) if t is not None)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows, k = x.shape
        out = x.new_empty(rows, self.shape[0])
        scales = None if self.scales is None else ptr(self.scales)
        self._lib.mb_linear(ptr(x), ptr(self.weight), scales, ptr(out), rows, out.shape[1], k)
        return out


def _quantize(lib: ctypes.CDLL, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 weight [N, K] as int8 blocks of 32 with one fp32 scale each, in the kernel's groups of
    8 rows (``kernels.c``): int8 [ceil(N / 8), K / 32 * 256] and scales [ceil(N / 8), K / 32 * 8]."""
    n, k = weight.shape
    q, scales = quantize_rows(lib, weight)
    groups, blocks = -(-n // 8), k // native.BLOCK
    grouped, grouped_scales = torch.empty(groups, blocks * 256, dtype=torch.int8), torch.empty(groups, blocks * 8)
    lib.mb_q8_repack(ptr(q), ptr(scales), ptr(grouped), ptr(grouped_scales), n, k)
    return grouped, grouped_scales


def quantize_rows(lib: ctypes.CDLL, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], fp32 scales [N, K / 32]) of an fp32 weight, row by row."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // native.BLOCK)
    lib.mb_q8_quantize(ptr(weight), ptr(q), ptr(scales), n, k)
    return q, scales


def _repack(lib: ctypes.CDLL, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """A GGUF's Q4_1 rows [N, K / 32 * 20] in the kernel's groups of 8 rows (``kernels.c``):
    uint8 [ceil(N / 8), K / 32 * 160], the same bytes moved (a last group padded with zeros)."""
    n = blocks.shape[0]
    out = torch.empty(-(-n // 8), k // native.BLOCK * 160, dtype=torch.uint8)
    lib.mb_q41_repack(ptr(blocks.contiguous()), ptr(out), n, k)
    return out


def _quiet(fn, *args):
    """fbgemm's fp16 functions warn that they are deprecated (called only while loading)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


def _tiled(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    pad = -rows % TILE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if x.shape[0] == TILE:
        return (x @ weight.T)[:rows]
    tiles = x.view(-1, TILE, x.shape[1])
    out = torch.bmm(tiles, weight.T.expand(tiles.shape[0], *weight.T.shape))
    return out.view(-1, weight.shape[0])[:rows]


def fbgemm_available() -> bool:
    try:
        packed = _quiet(torch.fbgemm_pack_gemm_matrix_fp16, torch.ones(2, 2))
        _quiet(torch.fbgemm_linear_fp16_weight, torch.ones(1, 2), packed, torch.zeros(2))
        return True
    except (RuntimeError, AttributeError):
        return False


INT8 = ("int8", "q8")


def weight_mode(device: torch.device, dtype: str | None, batch_invariant: bool) -> tuple[torch.dtype, str]:
    """(dtype to load the model in, Linear mode) for a device and the dtype asked for.

    On CPU the default is mashbox's own kernels (fp32 activations), where a C compiler could build
    them: a GGUF's Q4_1 blocks as the file has them, int8 for every other weight (``gguf``); else
    fp16 weights packed for fbgemm. ``int8`` asks for int8 everywhere, ``float16`` for the packed
    form, ``float32`` keeps exact fp32 weights. On CUDA the default is bfloat16.
    """
    if device.type != "cpu":
        return pick_dtype(dtype, device), "plain"
    if dtype in (None, *INT8) and native.load() is not None:
        return torch.float32, "gguf" if dtype is None else "q8"
    if dtype in INT8:
        raise ValueError("dtype: int8 weights need mashbox's CPU kernels, which could not be built here "
                         "(no C compiler, or MASHBOX_NATIVE=0); use float16 or float32")
    asked = None if dtype is None else pick_dtype(dtype, device)
    if asked in (None, torch.float16) and fbgemm_available():
        return torch.float32, "packed"
    if asked not in (None, torch.float16, torch.float32):
        raise ValueError(f"dtype: {dtype!r} is not supported on CPU; use int8, float16 (packed) or float32")
    return torch.float32, "tiled" if batch_invariant else "plain"


@dataclass(slots=True)
class Layer:
    spec: Spec
    ln_attn: torch.Tensor
    qkv_proj: Linear
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    ln_mlp: torch.Tensor
    gate_up: Linear
    down: Linear
    act: Callable[[torch.Tensor], torch.Tensor] | None  # None: SiLU, through ops.silu_mul

    def qkv(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            ops: TorchOps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [rows, heads, dim], rotated keys and values [rows, kv_heads, dim]."""
        s = self.spec
        out = self.qkv_proj(h)
        if self.qkv_bias is not None:
            out += self.qkv_bias
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        if self.q_norm is not None:
            q, k, v = out.split([q_size, kv_size, kv_size], dim=-1)
            q = ops.rms_norm(q.reshape(-1, s.head_dim), self.q_norm, s.eps).view(-1, q_size)
            k = ops.rms_norm(k.reshape(-1, s.head_dim), self.k_norm, s.eps).view(-1, kv_size)
            out = torch.cat([q, k, v], dim=-1)
        out = ops.rope(out, s.num_heads + s.num_kv_heads, s.head_dim, positions, cos, sin)
        q, k, v = out.split([q_size, kv_size, kv_size], dim=-1)
        return (q.view(-1, s.num_heads, s.head_dim), k.view(-1, s.num_kv_heads, s.head_dim),
                v.view(-1, s.num_kv_heads, s.head_dim))

    def mlp(self, h: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        if self.act is None:
            return self.down(ops.silu_mul(self.gate_up(h)))
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


@dataclass(slots=True)
class Weights:
    spec: Spec
    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    lm_head: Linear
    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def linears(self) -> list[Linear]:
        return [self.lm_head] + [lin for l in self.layers for lin in (l.qkv_proj, l.o, l.gate_up, l.down)]

    @property
    def nbytes(self) -> int:
        """Bytes the weights hold in memory (the embedding stays in full precision for lookups; a
        tied lm_head kept as the embedding itself is counted once)."""
        own = [lin for lin in self.linears if lin.weight is None or lin.weight.data_ptr() != self.embed.data_ptr()]
        return self.embed.nbytes + sum(lin.nbytes for lin in own)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, ctx: int, mode: str, lib: ctypes.CDLL | None = None) -> Weights:
        if ckpt.model_type not in SUPPORTED:
            raise ModelLoadError(
                f"model type {ckpt.model_type!r} is not supported; mashbox runs {', '.join(SUPPORTED)} models"
            )
        t = ckpt.tensors
        embed = t["model.embed_tokens.weight"]
        act = _activation(ckpt.hidden_act)
        cos, sin = ckpt.cos_sin(ctx, embed.dtype)
        return cls(
            spec=ckpt.spec,
            embed=embed,
            layers=[_layer(ckpt, f"model.layers.{i}.", act, mode, lib) for i in range(ckpt.spec.num_layers)],
            norm=t["model.norm.weight"],
            lm_head=_linear(ckpt, ["lm_head.weight"], mode, lib),
            cos=cos,
            sin=sin,
        )


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """None for SiLU (the gated MLP's fused kernel); else transformers' function of that name."""
    if name == "silu":
        return None
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _layer(ckpt: Checkpoint, at: str, act, mode: str, lib: ctypes.CDLL | None) -> Layer:
    t = ckpt.tensors
    attn, mlp = at + "self_attn.", at + "mlp."
    qkv = [f"{attn}{p}_proj.weight" for p in "qkv"]
    bias = None
    if attn + "q_proj.bias" in t:
        bias = torch.cat([t[name.removesuffix("weight") + "bias"] for name in qkv])
    return Layer(
        spec=ckpt.spec,
        ln_attn=t[at + "input_layernorm.weight"],
        qkv_proj=_linear(ckpt, qkv, mode, lib),
        qkv_bias=bias,
        q_norm=t.get(attn + "q_norm.weight"),
        k_norm=t.get(attn + "k_norm.weight"),
        o=_linear(ckpt, [attn + "o_proj.weight"], mode, lib),
        ln_mlp=t[at + "post_attention_layernorm.weight"],
        gate_up=_linear(ckpt, [mlp + "gate_proj.weight", mlp + "up_proj.weight"], mode, lib),
        down=_linear(ckpt, [mlp + "down_proj.weight"], mode, lib),
        act=act,
    )


def _linear(ckpt: Checkpoint, names: list[str], mode: str, lib: ctypes.CDLL | None) -> Linear:
    """One Linear over the named weights stacked by rows (q, k, v in one; gate and up in one),
    with the GGUF's blocks when every part has them."""
    blocks = None
    if all(name in ckpt.blocks for name in names):
        parts = [ckpt.blocks[name] for name in names]
        blocks = parts[0] if len(parts) == 1 else torch.cat(parts)
    if blocks is not None and mode == "gguf" and lib is not None:
        return Linear(None, mode, lib, blocks)  # the float weights are never read
    tensors = [ckpt.tensors[name] for name in names]
    return Linear(tensors[0] if len(tensors) == 1 else torch.cat(tensors), mode, lib, blocks)