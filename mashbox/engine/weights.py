"""A Llama-family model's weights, fused and laid out for the runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers.activations import ACT2FN

from mashbox.errors import ModelLoadError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def linear(x: torch.Tensor, weight: torch.Tensor, tile: int) -> torch.Tensor:
    """``x @ weight.T``; with ``tile`` every row goes through a matmul of exactly
    ``tile`` rows, so its result never depends on how many rows run beside it."""
    if not tile:
        return x @ weight.T
    rows = x.shape[0]
    pad = -rows % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if x.shape[0] == tile:
        return (x @ weight.T)[:rows]
    tiles = x.view(-1, tile, x.shape[1])
    out = torch.bmm(tiles, weight.T.expand(tiles.shape[0], *weight.T.shape))
    return out.view(-1, weight.shape[0])[:rows]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass(slots=True, frozen=True)
class Spec:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


@dataclass(slots=True)
class Layer:
    spec: Spec
    ln_attn: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    ln_mlp: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor]

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tile: int):
        s = self.spec
        out = linear(h, self.qkv_weight, tile)
        if self.qkv_bias is not None:
            out = out + self.qkv_bias
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q, k, v = out.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, s.eps), rms_norm(k, self.k_norm, s.eps)
        return rotate(q, cos, sin), rotate(k, cos, sin), v.view(-1, s.num_kv_heads, s.head_dim)

    def mlp(self, h: torch.Tensor, tile: int) -> torch.Tensor:
        gate, up = linear(h, self.gate_up, tile).chunk(2, dim=-1)
        return linear(self.act(gate) * up, self.down, tile)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@dataclass(slots=True)
class Weights:
    spec: Spec
    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    lm_head: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    tile: int

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.spec.eps)

    @classmethod
    def from_model(cls, model: torch.nn.Module, ctx: int, tile: int) -> Weights:
        config = model.config
        if config.model_type not in SUPPORTED:
            raise ModelLoadError(
                f"model type {config.model_type!r} is not supported; mashbox runs {', '.join(SUPPORTED)} models"
            )
        spec = _spec(config)
        body = model.model
        cos, sin = _rope(body, ctx)
        return cls(
            spec=spec,
            embed=body.embed_tokens.weight.detach(),
            layers=[_layer(spec, layer, config) for layer in body.layers],
            norm=body.norm.weight.detach(),
            lm_head=model.lm_head.weight.detach(),
            cos=cos,
            sin=sin,
            tile=tile,
        )


def _spec(config) -> Spec:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Spec(
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        eps=config.rms_norm_eps,
    )


def _layer(spec: Spec, layer: torch.nn.Module, config) -> Layer:
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    bias = None
    if attn.q_proj.bias is not None:
        bias = torch.cat([p.bias.detach() for p in projections])
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return Layer(
        spec=spec,
        ln_attn=layer.input_layernorm.weight.detach(),
        qkv_weight=torch.cat([p.weight.detach() for p in projections]).contiguous(),
        qkv_bias=bias,
        q_norm=q_norm.weight.detach() if q_norm is not None else None,
        k_norm=k_norm.weight.detach() if k_norm is not None else None,
        o=attn.o_proj.weight.detach(),
        ln_mlp=layer.post_attention_layernorm.weight.detach(),
        gate_up=torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]).contiguous(),
        down=mlp.down_proj.weight.detach(),
        act=ACT2FN[config.hidden_act],
    )


def _rope(body: torch.nn.Module, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions 0..ctx-1 from the model's own rotary embedding."""
    embed = body.embed_tokens.weight
    positions = torch.arange(ctx, device=embed.device)[None]
    with torch.no_grad():
        cos, sin = body.rotary_emb(embed[:1][None], positions)
    return cos[0].to(embed.dtype), sin[0].to(embed.dtype)
