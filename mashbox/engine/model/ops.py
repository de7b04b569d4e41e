"""The per-token operations of a layer, in two interchangeable forms.

``TorchOps`` runs them as torch tensor ops (any device, the reference). ``NativeOps`` runs them
through mashbox's compiled CPU kernels (``native.py``): one call each instead of several torch ops,
which is what a decode step on a small model spends its time on. Each op treats every row on its
own, so a row's result never depends on the rows beside it.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from mashbox.engine.model.native import ptr


class TorchOps:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def rope(self, x: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, >= heads * head_dim] with its first ``heads`` heads rotated (a new tensor)."""
        rotated = _rotate(x[:, : heads * head_dim].view(-1, heads, head_dim), cos[positions], sin[positions])
        return torch.cat([rotated.flatten(1), x[:, heads * head_dim :]], dim=1)

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Each row's first index of its largest value."""
        return torch.argmax(logits, -1).tolist()

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GELU's tanh form (``gelu_pytorch_tanh``) of the gate times the up half."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class NativeOps(TorchOps):
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        self.lib.mb_rms_norm(ptr(x), ptr(weight), ptr(out), x.shape[0], x.shape[1], eps)
        return out

    def rope(self, x: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates in place: ``x`` must be contiguous rows."""
        self.lib.mb_rope(ptr(x), x.shape[1], ptr(positions), ptr(cos), ptr(sin), x.shape[0], heads, head_dim)
        return x

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """As torch's, in one pass over the rows on the kernels' threads (a NaN is never the largest)."""
        logits = logits.float().contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.long)
        self.lib.mb_argmax(ptr(logits), logits.shape[0], logits.shape[1], ptr(out))
        return out.tolist()

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._gated(self.lib.mb_silu_mul, gate_up)

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._gated(self.lib.mb_gelu_mul, gate_up)

    @staticmethod
    def _gated(fn, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        fn(ptr(gate_up.contiguous()), ptr(out), rows, width // 2)
        return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]

