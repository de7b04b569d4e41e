"""Runs a plan on the device: one forward over every scheduled token.

The runner reads the weights of a Llama-family transformers model (Llama,
Mistral, Qwen2, Qwen3) and runs its own forward over fixed KV slots
allocated once. Prompt chunks and decode rows of all running requests go
through every layer together; attention runs per request over exactly its
own keys. It makes no policy decisions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mashbox.engine import sampler
from mashbox.engine.kv_cache import KVCache
from mashbox.engine.prefix_cache import CacheOp, Restore, Save
from mashbox.engine.scheduler import Plan, Work
from mashbox.engine.weights import Weights


@dataclass(slots=True)
class Batch:
    """Device tensors of one plan."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    offsets: list[int]
    masks: list[torch.Tensor | None]
    sample_rows: torch.Tensor


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_slots: int, ctx: int, mode: str = "tiled") -> None:
        self.weights = Weights.from_model(model, ctx, mode)
        self.device = self.weights.embed.device
        self.kv = KVCache.allocate(self.weights.spec, num_slots, ctx, self.weights.embed.dtype, self.device)
        self.generators: list[torch.Generator | None] = [None] * num_slots
        self.host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.inference_mode()
    def run(self, plan: Plan) -> list[int]:
        """Forward every token of ``plan``; one sampled token per sampling work item."""
        for op in plan.cache_ops:
            self._move(op)
        batch = self._batch(plan)
        hidden = self.forward(plan.work, batch)
        logits = self.weights.lm_head(hidden[batch.sample_rows])
        sampling = [w.seq for w in plan.work if w.sample]
        for row, seq in zip(logits, sampling):
            if seq.constraint is not None:
                seq.constraint.mask(row)
        tokens = sampler.sample(
            logits,
            [s.sampling for s in sampling],
            [(s.prompt_ids, s.output_ids) for s in sampling],
            [self._generator(w) for w in plan.work if w.sample],
        )
        return [self._follow(seq, token) for seq, token in zip(sampling, tokens)]

    def _move(self, op: CacheOp) -> None:
        """Carry out one prefix-cache copy between a slot and host memory."""
        if isinstance(op, Save):
            self.host[op.entry] = self.kv.save(op.slot, op.tokens)
        elif isinstance(op, Restore):
            self.kv.restore(op.slot, self.host[op.entry])
        else:
            self.host.pop(op.entry, None)

    @staticmethod
    def _follow(seq, token: int) -> int:
        """A forced token (thinking budget spent) wins; a grammar follows what was chosen."""
        if seq.forced:
            token = seq.forced.pop(0)
        if seq.constraint is not None:
            seq.constraint.accept(token)
        return token

    def forward(self, work: list[Work], batch: Batch) -> torch.Tensor:
        w = self.weights
        x = w.embed[batch.ids]
        cos, sin = w.cos[batch.positions], w.sin[batch.positions]
        for i, layer in enumerate(w.layers):
            q, k, v = layer.qkv(w.rms_norm(x, layer.ln_attn), cos, sin)
            self.kv.write(i, batch.slots, batch.positions, k, v)
            attn = self._attention(i, work, batch, q)
            x = x + layer.o(attn)
            x = x + layer.mlp(w.rms_norm(x, layer.ln_mlp))
        return w.rms_norm(x, w.norm)

    def _attention(self, layer: int, work: list[Work], batch: Batch, q: torch.Tensor) -> torch.Tensor:
        out = []
        for item, start, mask in zip(work, batch.offsets, batch.masks):
            n = len(item.token_ids)
            keys, values = self.kv.read(layer, item.slot, item.position + n)
            query = q[start : start + n].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                query, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, enable_gqa=True,
                scale=self.weights.spec.scale,
            )
            out.append(o.squeeze(0).transpose(0, 1).reshape(n, -1))
        return torch.cat(out)

    def _batch(self, plan: Plan) -> Batch:
        ids, positions, slots, offsets, rows = [], [], [], [], []
        for item in plan.work:
            n = len(item.token_ids)
            offsets.append(len(ids))
            ids.extend(item.token_ids)
            positions.extend(range(item.position, item.position + n))
            slots.extend([item.slot] * n)
            if item.sample:
                rows.append(len(ids) - 1)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        masks = [self._causal_mask(w) for w in plan.work]
        return Batch(as_tensor(ids), as_tensor(positions), as_tensor(slots), offsets, masks, as_tensor(rows))

    def _causal_mask(self, item: Work) -> torch.Tensor | None:
        """Prompt chunk rows see the cache before them and the chunk up to themselves."""
        n = len(item.token_ids)
        if n == 1:
            return None
        rows = torch.arange(item.position, item.position + n, device=self.device)[:, None]
        return torch.arange(item.position + n, device=self.device)[None, :] <= rows

    def _generator(self, item: Work) -> torch.Generator | None:
        if item.seq.sampling.greedy:
            return None
        if item.fresh or self.generators[item.slot] is None:
            seed = item.seq.sampling.seed
            g = torch.Generator(device=self.device)
            g.manual_seed(seed if seed is not None else random.getrandbits(63))
            self.generators[item.slot] = g
        return self.generators[item.slot]
