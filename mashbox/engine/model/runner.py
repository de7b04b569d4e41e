"""Runs a plan on the device: one forward over every scheduled token.

The runner reads the weights of a Llama-family transformers model (Llama,
Mistral, Qwen2, Qwen3) and runs its own forward over fixed KV slots
allocated once. Prompt chunks and decode rows of all running requests go
through every layer together; attention runs per request over exactly its
own keys: with mashbox's CPU kernels, one native call per layer for all
one-token rows and one for all prompt chunks; on CUDA, one masked SDPA call
per layer for all one-token rows, and a step of one-token rows only replayed
as a CUDA graph (``graphs.py``). On the CPU with weights as blocks (a GGUF's own,
or int8), a step whose rows the kernels attend runs each layer as one native call
(``FusedLayers``), the same kernels in the same order as the general path.
It makes no policy decisions.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from mashbox.engine.load.checkpoint import Checkpoint, Spec
from mashbox.engine.model import ops, sampler
from mashbox.engine.model.form import Form
from mashbox.engine.model.graphs import DecodeGraphs
from mashbox.engine.model.kv_cache import KVCache
from mashbox.engine.model.memory import HeapTrim
from mashbox.engine.model.packed import Packer
from mashbox.engine.model.weights import GATED, Weights
from mashbox.engine.sched.prefix_cache import CacheOp, Copy, Load, Persist, Restore, Save
from mashbox.engine.sched.scheduler import Plan, Work
from mashbox.engine.sched.sequence import Sequence

if TYPE_CHECKING:
    from mashbox.engine.sched.disk_cache import PageStore

log = logging.getLogger("mashbox.engine")


@dataclass(slots=True)
class Batch:
    """Device tensors of one plan."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    sample_rows: torch.Tensor
    single: torch.Tensor  # [3, n]: row, slot and attended length of each one-token item (one call a layer)
    longest: int  # the most positions a one-token item attends to
    chunks: torch.Tensor  # [4, n]: first row, length, slot and first position of each chunk (native)
    rest: list[tuple[Work, int, torch.Tensor | None]]  # item, first row, mask: attended by SDPA


class ModelRunner:
    """``graphs``: run steps of one-token rows at fixed shapes (``DecodeGraphs``), captured as CUDA
    graphs on a GPU; the KV cache gets one spare slot for the padding rows. Not with the CPU kernels."""

    def __init__(self, ckpt: Checkpoint, num_slots: int, ctx: int, form: Form | str = "tiled",
                 graphs: bool = False, packer: Packer | None = None) -> None:
        """``form``: how the model runs (``form.decide``), or only its mode on the checkpoint's device.
        ``packer``: where the kernels' packed matrices come from (by default packed in memory)."""
        if isinstance(form, str):
            form = Form(ckpt.inv_freq.device, ckpt.tensors.dtype or ckpt.tensors["model.norm.weight"].dtype, form)
        lib = form.lib
        self.weights = Weights.from_checkpoint(ckpt, ctx, form.mode, lib, packer)
        self.device = self.weights.embed.device
        self.ops = form.ops()
        native_ops = isinstance(self.ops, ops.NativeOps)
        graphs = graphs and not native_ops
        self.kv = KVCache.allocate(self.weights.spec, num_slots + graphs, ctx, form, self.device)
        self._graphs = DecodeGraphs(self._padded_step, self.device, ctx, num_slots,
                                    capture=self.device.type == "cuda") if graphs else None
        self._bf16 = form.bf16_attention  # where the kernels have bf16 dot products
        fused = FusedLayers.fits(self.weights)
        self._fused = FusedLayers(self.weights, self.kv, lib, self._bf16) if fused else None
        self._native_rows, self._native_chunks = native_ops, native_ops and self.weights.spec.head_dim % 16 == 0
        # every row computed alone (block matmuls, native attention): where a prompt is cut never matters
        self.cut_anywhere = self._native_chunks and fused
        # one-token rows attend in one call a layer: the native kernel, or on CUDA one masked SDPA call
        self._rows_at_once = native_ops or self.device.type == "cuda"
        self.host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._trim = HeapTrim()

    @torch.inference_mode()
    def run(self, plan: Plan) -> list[int]:
        """Forward every token of ``plan``; one sampled token per sampling row: a sampling work item's
        last row, or each of its rows where it carries proposals (``Work.draft``)."""
        for op in plan.cache_ops:
            self._move(op)
        logits = self._replayed(plan) if self._graphs is not None and self._graphs.takes(plan) else None
        if logits is None:
            batch = self._batch(plan)
            logits = self._logits(self.forward(batch).index_select(0, batch.sample_rows))
        rows = [(w, j) for w in plan.work if w.sample for j in range(1 + w.draft)]
        sampling = [w.seq for w, _ in rows]
        for row, seq in zip(logits, sampling):
            if seq.constraint is not None:
                seq.constraint.mask(row)
        tokens = sampler.sample(
            logits,
            [s.sampling for s in sampling],
            [(w.seq.prompt_ids, _output(w, j)) for w, j in rows],
            [None if w.seq.sampling.greedy else sampler.uniform(_seed(w.seq), len(w.seq.output_ids) + j)
             for w, j in rows],
            self.ops.argmax,
            [_bias(seq, logits) for seq in sampling],
        )
        return [self._follow(seq, token) for seq, token in zip(sampling, tokens)]

    def _replayed(self, plan: Plan) -> torch.Tensor | None:
        """The sampled items' logits after a padded step (a CUDA graph); None, and every later step
        eager, where a step cannot be captured on this device."""
        try:
            hidden = self._graphs.hidden(plan)
        except RuntimeError as err:
            log.warning("CUDA graphs off, every step runs eagerly: capturing a decode step failed (%s)", err)
            self._graphs = None
            return None
        return self._logits(hidden[[i for i, item in enumerate(plan.work) if item.sample]])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.weights
        logits = w.lm_head(self.ops.rms_norm(hidden, w.norm, w.spec.eps))
        if w.logit_scale != 1.0:
            logits.div_(w.logit_scale)
        return logits if not w.logit_softcap else capped(logits, w.logit_softcap)

    def _padded_step(self, inputs: torch.Tensor, longest: int) -> torch.Tensor:
        """The forward of a step of one-token rows as ``DecodeGraphs`` pads them: ``inputs`` [5, rows]
        holds each row's token, position, row, slot and attended length; no row attends past ``longest``."""
        ids, positions, rows, slots, _ = inputs
        return self.forward(Batch(ids, positions, slots, rows, inputs[2:], longest, inputs.new_empty(4, 0), []))

    def _move(self, op: CacheOp) -> None:
        """Carry out one prefix-cache copy between slots and host memory."""
        if isinstance(op, Save):
            self.host[op.entry] = self.kv.save(op.slot, op.tokens)
        elif isinstance(op, Restore):
            self.kv.restore(op.slot, self.host[op.entry])
        elif isinstance(op, Copy):
            self.kv.copy(op.source, op.slot, op.tokens)
        elif isinstance(op, Load):
            self.kv.restore(op.slot, (op.keys, op.values))
        else:
            self.host.pop(op.entry, None)
            self._trim.freed()

    def keep(self, pages: list[Persist], disk: PageStore) -> None:
        """Hand a copy of each page to ``disk``, which writes it in the background."""
        for page in pages:
            disk.save(page.key, list(page.tokens), *self.kv.save(page.slot, page.end, page.start))

    @staticmethod
    def _follow(seq, token: int) -> int:
        """A forced token (thinking budget spent) wins; a grammar follows what was chosen."""
        if seq.forced:
            token = seq.forced.pop(0)
        if seq.constraint is not None:
            seq.constraint.accept(token)
        return token

    def forward(self, batch: Batch) -> torch.Tensor:
        w, eps = self.weights, self.weights.spec.eps
        x = w.embed(batch.ids)
        if w.embed_scale != 1.0:
            x *= w.embed_scale
        if self._fused is not None and not batch.rest:  # every row attended by the kernels
            return self._fused(x, batch)
        norm = lambda h, weight: h if weight is None else self.ops.rms_norm(h, weight, eps)
        scaled = lambda h: h if w.residual_scale == 1.0 else h.mul_(w.residual_scale)
        for i, layer in enumerate(w.layers):
            h = self.ops.rms_norm(x, layer.ln_attn, eps)
            q, k, v = layer.qkv(h, batch.positions, self.ops)
            self.kv.write(i, batch.slots, batch.positions, k, v)
            x += scaled(norm(layer.o(self._attention(i, batch, q)), layer.post_attn))
            x += scaled(norm(layer.mlp(self.ops.rms_norm(x, layer.ln_mlp, eps), self.ops), layer.post_mlp))
        return x

    def _attention(self, layer: int, batch: Batch, q: torch.Tensor) -> torch.Tensor:
        """Each work item attends over exactly its own keys: natively, all one-token items in one
        call and all prompt chunks in another; on CUDA all one-token items in one masked SDPA call;
        by SDPA per item otherwise, each slot's cache read (and widened to ``q``'s dtype) once for
        all its items."""
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        spec, keys, values = self.weights.spec, self.kv.keys[layer], self.kv.values[layer]
        window = self.weights.layers[layer].window
        shape = (spec.num_heads, spec.num_kv_heads, spec.head_dim, keys.shape[2], spec.scale, self._bf16, self.kv.kvq,
                 window, spec.softcap)
        if batch.single.shape[1] and not self._native_rows:
            self._rows_attention(layer, batch, q, out, window)
        elif batch.single.shape[1]:
            rows, slots, lens = batch.single
            self.ops.lib.mb_decode_attention(
                q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), rows.data_ptr(), slots.data_ptr(),
                lens.data_ptr(), out.data_ptr(), batch.single.shape[1], *shape)
        if batch.chunks.shape[1]:
            rows, lens, slots, starts = batch.chunks
            self.ops.lib.mb_chunk_attention(
                q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), rows.data_ptr(), lens.data_ptr(),
                slots.data_ptr(), starts.data_ptr(), out.data_ptr(), batch.chunks.shape[1], *shape)
        ends: dict[int, int] = {}
        for item, _, _ in batch.rest:
            ends[item.slot] = max(ends.get(item.slot, 0), item.position + len(item.token_ids))
        cache = {slot: [t.to(q.dtype) for t in self.kv.read(layer, slot, end)] for slot, end in ends.items()}
        for item, start, mask in batch.rest:
            n, (keys, values) = len(item.token_ids), cache[item.slot]
            end = item.position + n
            mask = self._causal_mask(item, window) if window else mask
            query = q[start : start + n].transpose(0, 1).unsqueeze(0)
            o = attend(query, keys[:, :end].unsqueeze(0), values[:, :end].unsqueeze(0), mask, spec)
            out[start : start + n] = o.squeeze(0).transpose(0, 1).reshape(n, -1)
        return out

    def _rows_attention(self, layer: int, batch: Batch, q: torch.Tensor, out: torch.Tensor, window: int) -> None:
        """All one-token rows in one SDPA call: each row's slot read up to the longest, the positions
        past its own length (and before its window) masked out (and zeroed: the cache there may hold anything)."""
        spec, (rows, slots, lens), longest = self.weights.spec, batch.single, batch.longest
        at = torch.arange(longest, device=self.device)[None, :]
        mask = (at < lens[:, None]) & ((at >= lens[:, None] - window) if window else True)
        mask = mask[:, None, None, :]
        keys, values = (t[layer, :, :, :longest][slots].to(q.dtype).masked_fill(~mask.transpose(-1, -2), 0)
                        for t in (self.kv.keys, self.kv.values))  # a masked NaN never written still gives NaN
        o = attend(q[rows].unsqueeze(2), keys, values, mask, spec)
        out[rows] = o.reshape(rows.shape[0], -1)

    def _batch(self, plan: Plan) -> Batch:
        ids, positions, slots, rows, single, chunks, rest = [], [], [], [], [], [], []
        for item in plan.work:
            n = len(item.token_ids)
            if n == 1 and self._rows_at_once:
                single.append((len(ids), item.slot, item.position + 1))
            elif n > 1 and self._native_chunks:
                _add_chunk(chunks, (len(ids), n, item.slot, item.position))
            else:
                rest.append((item, len(ids), self._causal_mask(item)))
            ids.extend(item.token_ids)
            positions.extend(range(item.position, item.position + n))
            slots.extend([item.slot] * n)
            if item.sample:
                rows.extend(range(len(ids) - 1 - item.draft, len(ids)))
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
        columns = lambda xs, k: as_tensor(xs).reshape(-1, k).T.contiguous()
        return Batch(as_tensor(ids), as_tensor(positions), as_tensor(slots), as_tensor(rows), columns(single, 3),
                     max((length for *_, length in single), default=0), columns(chunks, 4), rest)

    def _causal_mask(self, item: Work, window: int = 0) -> torch.Tensor | None:
        """Prompt chunk rows see the cache before them and the chunk up to themselves (of those, the
        last ``window`` where it is not 0)."""
        n = len(item.token_ids)
        if n == 1 and not window:
            return None
        rows = torch.arange(item.position, item.position + n, device=self.device)[:, None]
        offset = rows - torch.arange(item.position + n, device=self.device)[None, :]
        return (offset >= 0) & (offset < window) if window else offset >= 0


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           spec: Spec) -> torch.Tensor:
    """SDPA (query heads grouped over the key heads), or where the model caps its scores (Gemma 2) the
    same steps written out: scaled scores capped, masked, softmax, values."""
    if not spec.softcap:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True, scale=spec.scale)
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = capped(q @ keys.transpose(-1, -2) * spec.scale, spec.softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values


def capped(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap tanh(x / cap), as transformers writes Gemma 2's soft caps."""
    return torch.tanh(x / cap) * cap


def _output(item: Work, row: int) -> list[int]:
    """The output before a sampling row of ``item``: its request's, then the proposals before that row."""
    if row == 0:
        return item.seq.output_ids
    return [*item.seq.output_ids, *item.token_ids[len(item.token_ids) - item.draft :][:row]]


def _bias(seq: Sequence, logits: torch.Tensor) -> sampler.Bias | None:
    """A request's logit bias as the sampler adds it: made at its first sampled token, then kept."""
    if seq.sampling.logit_bias and seq.bias is None:
        seq.bias = sampler.bias(seq.sampling, logits.shape[-1], logits.device)
    return seq.bias


def _seed(seq: Sequence) -> int:
    """A sampled request's seed: its own, else one drawn at its first token and kept for the rest."""
    if seq.seed is None:
        seq.seed = seq.sampling.seed if seq.sampling.seed is not None else random.getrandbits(63)
    return seq.seed


def _add_chunk(chunks: list[tuple[int, int, int, int]], chunk: tuple[int, int, int, int]) -> None:
    """Add a prompt chunk (first row, length, slot, first position) for native attention, joined to
    the one before where it continues it: the kernel's rows do not depend on how a prompt is cut, and
    one long chunk reads the slot's earlier keys once instead of once per chunk."""
    row, n, slot, position = chunk
    if chunks:
        first, length, before, start = chunks[-1]
        if before == slot and first + length == row and start + length == position:
            chunks[-1] = (first, length + n, slot, start)
            return
    chunks.append(chunk)


class FusedLayers:
    """Every layer for a step's rows, each layer in one native call (``mb_layer``): one-token rows
    and, where the kernels attend them, prompt chunks.

    The call runs the same kernels in the same order as ``ModelRunner.forward`` does with
    native ops, so a row's result does not depend on which path ran it.
    """

    def __init__(self, weights: Weights, kv: KVCache, lib, bf16: int) -> None:
        s = weights.spec
        self.fn = lib.mb_layer
        self.kv = kv
        self.residual, self.softcap = weights.residual_scale, s.softcap
        self.layers = [self._args(layer, i) for i, layer in enumerate(weights.layers)]
        self.shape = (s.num_heads, s.num_kv_heads, s.head_dim, s.eps, s.scale)
        self.bf16 = bf16

    @staticmethod
    def fits(weights: Weights) -> bool:
        return all({layer.qkv_proj.mode, layer.o.mode, layer.gate_up.mode, layer.down.mode} == {"blocks"}
                   and layer.act in GATED for layer in weights.layers)

    def _args(self, layer, i: int) -> tuple:
        p = lambda t: None if t is None else t.data_ptr()
        return (*layer.down.shape, p(layer.ln_attn), layer.qkv_proj.address, p(layer.qkv_bias), layer.o.address,
                p(layer.ln_mlp), layer.gate_up.address, layer.down.address, p(layer.cos), p(layer.sin),
                p(self.kv.keys[i]), p(self.kv.values[i]), layer.window, p(layer.q_norm), p(layer.k_norm),
                p(layer.post_attn), p(layer.post_mlp), int(layer.act != "silu"), self.residual, self.softcap)

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        heads, kv_heads, head_dim, eps, scale = self.shape
        rows, ctx = x.shape[0], self.kv.keys.shape[3]
        slots, positions = batch.slots.data_ptr(), batch.positions.data_ptr()
        for dim, inter, ln_attn, qkv, bias, o, ln_mlp, gate_up, down, cos, sin, k, v, window, *rest in self.layers:
            self.fn(x.data_ptr(), rows, dim, inter, heads, kv_heads, head_dim, eps, scale, ln_attn, qkv, bias, o,
                    ln_mlp, gate_up, down, slots, positions, cos, sin, k, v, ctx, self.bf16, self.kv.kvq, window,
                    *rest)  # Gemma's norms, the activation, Granite's residual scale, Gemma 2's score cap
        return x
