"""A Llama-family model's weights, fused and laid out for the runner (Gemma 3's too: its norms after
attention and around the MLP, its sliding-window layers with their own rotary; Phi-3's: q, k and v in
one matrix, gate and up in one, a rotary over part of each head)."""

from __future__ import annotations

import ctypes
import logging
import warnings
from dataclasses import dataclass

import torch

from mashbox.engine.load.checkpoint import SUPPORTED, Checkpoint, Spec
from mashbox.engine.model import quant
from mashbox.engine.model.native import ptr
from mashbox.engine.model.ops import TorchOps
from mashbox.engine.model.packed import Packer
from mashbox.errors import ModelLoadError

TILE = 16
GATED = {"silu": "silu_mul", "gelu_pytorch_tanh": "gelu_mul"}  # activations with an op of their own (ops.py)
log = logging.getLogger("mashbox.engine")


class Linear:
    """``x @ weight.T`` in one of four forms, chosen once per model.

    ``blocks``: mashbox's CPU kernels over ``Blocks`` (``quant.py``): a GGUF's own, or int8 blocks
    made from float weights, packed for the kernels (the same bytes rearranged); up to three
    matrices stacked by rows (q, k and v; gate and up), each of its own format; fp32 activations,
    each row computed alone.
    ``packed``: fp16 weights packed for fbgemm (CPU), fp32 activations; half the
    memory traffic (fbgemm does not promise a row's bits independent of the batch).
    ``plain``: one matmul. ``tiled``: every row goes through a matmul of exactly
    ``TILE`` rows, so its result never depends on how many rows run beside it.
    """

    __slots__ = ("weight", "parts", "shape", "mode", "_packed", "_bias", "_lib", "_struct")

    def __init__(self, mode: str, weight: torch.Tensor | None = None, lib: ctypes.CDLL | None = None,
                 parts: list[quant.Blocks] | None = None) -> None:
        self.mode = mode
        self.weight = weight
        self.parts = parts or []
        self._packed = self._bias = self._lib = self._struct = None
        if mode == "blocks":
            self._lib = lib
            self.parts = [quant.pack(p, lib) for p in self.parts]
            self._struct = quant.Parts.of(self.parts)
            self.shape = (sum(p.rows for p in self.parts), self.parts[0].k)
            return
        self.shape = tuple(weight.shape)
        if mode == "packed":
            self._packed = _quiet(torch.fbgemm_pack_gemm_matrix_fp16, weight.float().contiguous())
            self._bias = torch.zeros(weight.shape[0])
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._struct is not None:
            x = x.contiguous()
            out = x.new_empty(x.shape[0], self.shape[0])
            self._lib.mb_matmul(ptr(x), self.address, ptr(out), x.shape[0], self.shape[1])
            return out
        if self.mode == "packed":
            return torch.fbgemm_linear_fp16_weight(x.contiguous(), self._packed, self._bias)
        if self.mode == "plain":
            return x @ self.weight.T
        return _tiled(x, self.weight)

    @property
    def address(self) -> int:
        """Where ``mb_matmul``'s description of the blocks lies (for ``mb_layer``)."""
        return ctypes.addressof(self._struct)

    @property
    def formats(self) -> list[str]:
        return [p.name for p in self.parts]

    @property
    def storages(self) -> dict[int, int]:
        """Bytes by storage (a tied lm_head's blocks are the embedding's)."""
        if self.parts:
            return {p.data.data_ptr(): p.data.nbytes for p in self.parts}
        if self._packed is not None:
            return {id(self._packed): self.shape[0] * self.shape[1] * 2}
        return {self.weight.data_ptr(): self.weight.nbytes}


class Embedding:
    """The token embedding, looked up by id: a GGUF's blocks dequantized a step's rows at a time (the
    table is never widened whole) where the kernels read them, else a float table."""

    def __init__(self, ckpt: Checkpoint, lib: ctypes.CDLL | None) -> None:
        blocks = ckpt.blocks.get(EMBED)
        floats = ckpt.tensors.dtype in (None, torch.float32) and ckpt.inv_freq.device.type == "cpu"
        self.blocks = blocks if lib is not None and blocks is not None and blocks.readable and floats else None
        self.table = None if self.blocks is not None else ckpt.tensors[EMBED]
        self._lib = lib

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            return self.table.index_select(0, ids)
        return quant.dequantize(self.blocks, self._lib, ids)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.blocks is not None else self.table.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.blocks is not None else self.table.dtype

    @property
    def storages(self) -> dict[int, int]:
        data = self.table if self.blocks is None else self.blocks.data
        return {data.data_ptr(): data.nbytes}


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
    act: str  # the MLP's activation by transformers' name (silu and gelu_pytorch_tanh: one op each, GATED)
    cos: torch.Tensor  # the layer's rotary tables [ctx, head_dim] (cos 1, sin 0 where it turns nothing: SmolLM3)
    sin: torch.Tensor
    post_attn: torch.Tensor | None = None  # norms of the attention's and the MLP's outputs (Gemma)
    post_mlp: torch.Tensor | None = None
    window: int = 0  # a sliding window: each position attends to its last ``window`` (0: to all)

    def qkv(self, h: torch.Tensor, positions: torch.Tensor,
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
        out = ops.rope(out, s.num_heads + s.num_kv_heads, s.head_dim, positions, self.cos, self.sin)
        q, k, v = out.split([q_size, kv_size, kv_size], dim=-1)
        return (q.view(-1, s.num_heads, s.head_dim), k.view(-1, s.num_kv_heads, s.head_dim),
                v.view(-1, s.num_kv_heads, s.head_dim))

    def mlp(self, h: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        gate_up = self.gate_up(h)
        if self.act in GATED:
            return self.down(getattr(ops, GATED[self.act])(gate_up))
        from transformers.activations import ACT2FN

        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(ACT2FN[self.act](gate) * up)


@dataclass(slots=True)
class Weights:
    spec: Spec
    embed: Embedding
    layers: list[Layer]
    norm: torch.Tensor
    lm_head: Linear
    cos: torch.Tensor
    sin: torch.Tensor
    embed_scale: float = 1.0  # the embedding's rows are multiplied by it
    residual_scale: float = 1.0  # each layer's attention and MLP outputs are multiplied by it before they are added
    logit_scale: float = 1.0  # the logits are divided by it
    logit_softcap: float = 0.0  # then each becomes logit_softcap tanh(logit / logit_softcap) (Gemma 2); 0: not

    @property
    def linears(self) -> list[Linear]:
        return [self.lm_head] + [lin for l in self.layers for lin in (l.qkv_proj, l.o, l.gate_up, l.down)]

    @property
    def nbytes(self) -> int:
        """Bytes the weights hold in memory, or map from the GGUF (each storage once: a tied lm_head
        is the embedding)."""
        storages = dict(self.embed.storages)
        for lin in self.linears:
            storages.update(lin.storages)
        return sum(storages.values())

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, ctx: int, mode: str, lib: ctypes.CDLL | None = None,
                        packer: Packer | None = None) -> Weights:
        """``packer``: where the kernels' packed matrices come from (by default packed in memory)."""
        if ckpt.model_type not in SUPPORTED:
            raise ModelLoadError(
                f"model type {ckpt.model_type!r} is not supported; mashbox runs {', '.join(SUPPORTED)} models"
            )
        t = ckpt.tensors
        act = ckpt.hidden_act
        _check_runs(ckpt)
        dtype = t.dtype or t["model.norm.weight"].dtype
        tables = [ckpt.cos_sin(ctx, dtype)] * 2  # all layers', then the sliding-window layers' where theirs differs
        if ckpt.local_inv_freq is not None:
            tables[1] = ckpt.cos_sin(ctx, dtype, local=True)
        windows = ckpt.windows or (0,) * ckpt.spec.num_layers
        rotated = ckpt.rotated or (True,) * ckpt.spec.num_layers
        still = (torch.ones_like(tables[0][0]), torch.zeros_like(tables[0][1])) if not all(rotated) else None
        packer = packer or (Packer(lib) if lib is not None else None)
        weights = cls(
            spec=ckpt.spec,
            embed=Embedding(ckpt, lib),
            layers=[_layer(ckpt, f"model.layers.{i}.", act, mode, packer, windows[i],
                           tables[bool(windows[i])] if rotated[i] else still) for i in range(ckpt.spec.num_layers)],
            norm=_norm(ckpt, "model.norm.weight"),
            lm_head=_linear(ckpt, [LM_HEAD], mode, packer),
            cos=tables[0][0],
            sin=tables[0][1],
            embed_scale=ckpt.embed_scale,
            residual_scale=ckpt.residual_scale,
            logit_scale=ckpt.logit_scale,
            logit_softcap=ckpt.logit_softcap,
        )
        if packer is not None:
            packer.save()
        if ckpt.release is not None and any(p.packed for lin in weights.linears for p in lin.parts):
            ckpt.release()  # the kernels read packed copies: the pages they were made from are let go
        widened = sorted({ckpt.blocks[n].name for n in ckpt.blocks if not ckpt.blocks[n].readable})
        if widened and mode == "gguf":
            log.info("weights in %s have no kernel here: widened to int8 blocks at load", ", ".join(widened))
        floated = [n for n in ckpt.tensors if n not in ckpt.blocks and (n.endswith("_proj.weight") or n == LM_HEAD)]
        if floated and mode == "gguf":  # an F16, BF16 or F32 file's matrices (dtype="float32" keeps them exact)
            log.info("%d matrices stored as floats have no kernel here: quantized to int8 blocks at load",
                     len(floated))
        return weights


EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
UNAPPLIED = ("self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias",
             "mlp.gate_up_proj.bias")  # biases no layer of mashbox's adds


def _check_runs(ckpt: Checkpoint) -> None:
    """Refuse, at load, what mashbox would run wrong rather than not at all: an activation it does not
    know, or biases its layers do not add (o_proj's, the MLP's; all-zero ones are no change)."""
    if ckpt.hidden_act not in GATED:
        from transformers.activations import ACT2FN  # (imported only for activations without an op of their own)

        if ckpt.hidden_act not in ACT2FN:
            raise ModelLoadError(f"the activation {ckpt.hidden_act!r} (hidden_act) is not one mashbox knows")
    t = ckpt.tensors
    for i in range(ckpt.spec.num_layers):
        for name in (f"model.layers.{i}.{b}" for b in UNAPPLIED):
            if name in t and bool(t[name].any()):
                raise ModelLoadError(f"{name}: mashbox adds no bias there (attention_bias on o_proj, mlp_bias), "
                                     "so it would answer wrong; this checkpoint is not supported")


def _layer(ckpt: Checkpoint, at: str, act, mode: str, packer: Packer | None, window: int,
           rotary: tuple[torch.Tensor, torch.Tensor]) -> Layer:
    t = ckpt.tensors
    attn, mlp = at + "self_attn.", at + "mlp."
    fused = attn + "qkv_proj.weight" in t  # Phi-3: q, k and v stacked in one matrix, gate and up in another
    qkv = [attn + "qkv_proj.weight"] if fused else [f"{attn}{p}_proj.weight" for p in "qkv"]
    gate_up = [mlp + "gate_up_proj.weight"] if mlp + "gate_up_proj.weight" in t else [
        mlp + "gate_proj.weight", mlp + "up_proj.weight"]
    rows, head = rotary_rows(ckpt)
    bias = None
    if attn + "q_proj.bias" in t:
        bias = torch.cat([t[name.removesuffix("weight") + "bias"] for name in qkv])
        bias = bias if rows is None else bias[rows]
    sandwich = at + "pre_feedforward_layernorm.weight" in t  # Gemma: a norm before and after each part
    norm = lambda name: _norm(ckpt, at + name + ".weight") if at + name + ".weight" in t else None
    by_head = lambda w: w if w is None or head is None else w[head]
    return Layer(
        spec=ckpt.spec,
        ln_attn=norm("input_layernorm"),
        qkv_proj=_linear(ckpt, qkv, mode, packer, rows),
        qkv_bias=bias,
        q_norm=by_head(norm("self_attn.q_norm")),
        k_norm=by_head(norm("self_attn.k_norm")),
        o=_linear(ckpt, [attn + "o_proj.weight"], mode, packer),
        ln_mlp=norm("pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"),
        gate_up=_linear(ckpt, gate_up, mode, packer),
        down=_linear(ckpt, [mlp + "down_proj.weight"], mode, packer),
        act=act,
        cos=rotary[0],
        sin=rotary[1],
        post_attn=norm("post_attention_layernorm") if sandwich else None,
        post_mlp=norm("post_feedforward_layernorm"),
        window=window,
    )


def rotary_rows(ckpt: Checkpoint) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Where a rotary turns only the first r of a head's D dimensions (pairs i, i + r/2), the order of
    the stacked q, k and v rows, and of one head's dimensions, that makes it a whole-head rotary (pairs
    j, j + D/2) whose other pairs turn by angle 0 (``Checkpoint.cos_sin``): q and k rows move alike,
    so every score is the same. (None, None) for a whole-head rotary."""
    s, r = ckpt.spec, ckpt.rotary_dim
    if r >= s.head_dim:
        return None, None
    d, rest = s.head_dim, (s.head_dim - r) // 2
    head = torch.cat([torch.arange(r // 2), torch.arange(r, r + rest), torch.arange(r // 2, r),
                      torch.arange(r + rest, d)])
    turned = s.num_heads + s.num_kv_heads
    qk = (torch.arange(turned)[:, None] * d + head).reshape(-1)
    return torch.cat([qk, torch.arange(turned * d, (turned + s.num_kv_heads) * d)]), head


def _norm(ckpt: Checkpoint, name: str) -> torch.Tensor:
    """A norm's weight as the runner multiplies by it (Gemma's 1 + weight, where the checkpoint has the weight)."""
    return ckpt.tensors[name] + ckpt.norm_shift if ckpt.norm_shift else ckpt.tensors[name]


def _linear(ckpt: Checkpoint, names: list[str], mode: str, packer: Packer | None,
            rows: torch.Tensor | None = None) -> Linear:
    """One Linear over the named weights stacked by rows (q, k, v in one; gate and up in one), the
    stacked rows in the order ``rows`` where given. With the kernels (``packer``): each a GGUF's own
    blocks where the kernels read them (mode ``gguf``), else int8 blocks made from its floats (their
    float weights then never read), packed by ``packer``."""
    if mode in ("gguf", "q8") and packer is not None and ckpt.tensors.shape(names[0])[1] % 32 == 0:
        parts = [_blocks(ckpt, name, mode, packer.lib) for name in names]
        parts = parts if rows is None else _reorder(parts, rows)
        return Linear("blocks", lib=packer.lib, parts=[packer.pack(p) for p in parts])
    if mode in ("gguf", "q8"):
        mode = "packed" if fbgemm_available() else "plain"
    tensors = [ckpt.tensors[name] for name in names]
    weight = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    return Linear(mode, weight if rows is None else weight[rows])


def _reorder(parts: list[quant.Blocks], rows: torch.Tensor) -> list[quant.Blocks]:
    """Blocks stacked by rows, the stacked rows taken in the order ``rows`` (each within its own part)."""
    out, start = [], 0
    for part in parts:
        out.append(part.select(rows[start : start + part.rows] - start))
        start += part.rows
    return out


def _blocks(ckpt: Checkpoint, name: str, mode: str, lib: ctypes.CDLL) -> quant.Blocks:
    found = ckpt.blocks.get(name)
    if mode == "gguf" and found is not None and found.readable:
        return found
    return quant.quantize(lib, ckpt.tensors[name].float())
