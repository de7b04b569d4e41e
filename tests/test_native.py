"""mashbox's compiled CPU kernels against torch references, and the batch invariance they promise."""

import ctypes
import logging
import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tiny import greedy, tiny_config
from transformers import LlamaForCausalLM

from mashbox import SamplingParams
from mashbox.engine.load.checkpoint import Checkpoint, Tensors
from mashbox.engine.model import native
from mashbox.engine.model.form import Form, decide
from mashbox.errors import ConfigError
from mashbox.engine.model.kv_cache import BLOCK, KVCache, _pairs, _rows
from mashbox.engine.model.ops import NativeOps, TorchOps
from mashbox.engine.model.packed import Packer
from mashbox.engine.model.runner import ModelRunner
from mashbox.engine.model.weights import _linear
from mashbox.engine.sched.scheduler import Scheduler
from mashbox.engine.sched.sequence import Sequence


def test_float_weights_are_int8_blocks_and_a_width_off_32_falls_back(lib):
    ckpt = SimpleNamespace(tensors=Tensors({"a": torch.randn(64, 64), "b": torch.randn(8, 40)}), blocks={})
    packer = Packer(lib)
    assert _linear(ckpt, ["a"], "gguf", packer).formats == ["int8"]
    assert _linear(ckpt, ["a"], "q8", packer).formats == ["int8"]
    assert _linear(ckpt, ["b"], "q8", packer).mode in ("packed", "plain")


def test_matmuls_use_the_tile_unit_where_the_cpu_has_one(lib):
    """On a CPU with AMX (int8 tiles) Linux lets a process use, matmuls of 16 rows and more sum on it
    (tests/test_quant.py checks their bits against the vector tiles'); elsewhere they do not try."""
    flags = next((line.split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    assert lib.mb_amx() == int({"amx_tile", "amx_int8"} <= set(flags))


def test_attention_multiplies_on_the_tile_unit_where_the_cpu_has_one(lib):
    """With AMX's bf16 products, attention's dot products run on the tile unit for every row of every call
    (the chunk tests below check a row's bits in any chunking and alone); elsewhere on the vector unit."""
    flags = next((line.split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    assert lib.mb_attention_amx() == int({"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags))


def test_elementwise_ops_match_torch(lib):
    g = torch.Generator().manual_seed(0)
    native_ops, torch_ops = NativeOps(lib), TorchOps()
    x, w = torch.randn(5, 64, generator=g), torch.randn(64, generator=g)
    assert torch.allclose(native_ops.rms_norm(x, w, 1e-5), torch_ops.rms_norm(x, w, 1e-5), atol=1e-5)
    gate_up = torch.randn(5, 128, generator=g)
    assert torch.allclose(native_ops.silu_mul(gate_up), torch_ops.silu_mul(gate_up), atol=1e-6)
    wide = torch.randn(3, 2 * 70, generator=g) * 30  # a tail past the vector width; exp(-g) past fp32's range
    wide[0, :4] = torch.tensor([-200.0, 200.0, -88.0, 90.0])
    assert torch.allclose(native_ops.silu_mul(wide), torch_ops.silu_mul(wide), rtol=1e-5, atol=1e-6)
    positions = torch.tensor([0, 3, 7, 2, 9])
    cos, sin = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    qkv = torch.randn(5, 6 * 16, generator=g)
    expected = torch_ops.rope(qkv, 4, 16, positions, cos, sin)
    assert torch.allclose(native_ops.rope(qkv.clone(), 4, 16, positions, cos, sin), expected, atol=1e-5)


@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, 1000), (16, 49152 + 37)])
def test_argmax_is_torchs_first_largest_index(lib, rows, vocab):
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=g) * 10
    top = logits.max()
    logits[0, vocab // 3] = logits[0, vocab - 1] = top + 1  # a tie: the first index wins
    logits[-1, : vocab // 2] = -float("inf")  # a constraint's mask
    logits[-1, vocab - 1] = top + 2  # the largest in the tail past the last whole block
    if rows > 1:
        logits[1] = -float("inf")  # everything masked: index 0, as torch's
    assert NativeOps(lib).argmax(logits) == TorchOps().argmax(logits)
    assert NativeOps(lib).argmax(logits.to(torch.bfloat16)) == TorchOps().argmax(logits.to(torch.bfloat16).float())


def _as_read(lib, bf16, q, keys, values, scale):
    """What the attention kernel multiplies, and how close it must come to fp32 math on those: in
    bf16 pairs (asked for, and built with AVX512-BF16) the scaled queries, keys and values rounded to
    bf16, and as its softmax weights are rounded to bf16 too (relative error <= 2^-9), an output may
    be off by 2^-9 of the largest value (twice that allowed); else the inputs as they are, to fp32
    rounding."""
    if bf16 and lib.mb_attention_bf16():
        round_ = lambda t: t.to(torch.bfloat16).float()
        atol = 2**-8 * values.float().abs().max().item()
        return round_(q * scale), round_(keys.float()), round_(values.float()), atol
    return q * scale, keys.float(), values.float(), 1e-5


def _cache(lib, kvq, floats):
    """A cache [slots, kv_heads, ctx, row] holding ``floats`` [slots, kv_heads, ctx, dim] as the
    kernels store it (fp16, or q8_0 by ``mb_kv_store``), and the values it holds, read back by
    torch: the fp16 values, or each int8 times its block's fp16 scale."""
    if not kvq:
        return floats.half(), floats.half().float()
    slots, heads, ctx, dim = floats.shape
    rows = floats.transpose(1, 2).reshape(slots * ctx, heads * dim).contiguous()
    which, positions = torch.arange(slots).repeat_interleave(ctx), torch.arange(ctx).repeat(slots)
    cache = torch.zeros(slots, heads, ctx, dim + dim // 16, dtype=torch.uint8)
    lib.mb_kv_store(rows.data_ptr(), heads * dim, cache.data_ptr(), which.data_ptr(), positions.data_ptr(),
                    slots * ctx, heads, dim, ctx, 1)
    ints = cache[..., :dim].contiguous().view(torch.int8).float()
    scales = cache[..., dim:].contiguous().view(torch.float16).float()
    return cache, ints * scales.repeat_interleave(32, dim=-1)


def test_q8_kv_rows_are_ggml_q8_0_blocks(lib):
    g = torch.Generator().manual_seed(4)
    floats = torch.randn(2, 3, 50, 64, generator=g) * torch.rand(2, 3, 50, 64, generator=g) * 8
    floats[0, 0, 0, :32] = 0  # a block of zeros has scale 0 and no NaN
    floats[0, 0, 1, :32] = 127 * torch.arange(32) / 31 - 63.5  # halves: rounded to even
    cache, read = _cache(lib, 1, floats)
    blocks = floats.reshape(2, 3, 50, 2, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    ints = torch.round(blocks * torch.where(scale > 0, 1 / scale, 0)).reshape(2, 3, 50, 64)
    assert torch.equal(cache[..., :64].contiguous().view(torch.int8).float(), ints)
    assert torch.equal(cache[..., 64:].contiguous().view(torch.float16), scale.squeeze(-1).half())
    assert not read.isnan().any() and torch.equal(read[0, 0, 0, :32], torch.zeros(32))
    # off by half a step, and by up to 127 steps times the scale's fp16 rounding (2^-11 of it)
    assert ((read - floats).abs() <= scale.repeat_interleave(32, -1).reshape(read.shape) * (0.5 + 127 * 2**-11)).all()


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("bf16", [0, 1])
@pytest.mark.parametrize("kvq,dim", [(0, 16), (1, 64)])
def test_decode_attention_matches_sdpa(lib, bf16, kvq, dim, window):
    g = torch.Generator().manual_seed(1)
    slots, ctx, kv_heads, heads = 3, 40, 2, 4
    keys, key_values = _cache(lib, kvq, torch.randn(slots, kv_heads, ctx, dim, generator=g))
    values, value_values = _cache(lib, kvq, torch.randn(slots, kv_heads, ctx, dim, generator=g))
    q = torch.randn(2, heads, dim, generator=g)
    rows, which, lens = torch.tensor([0, 1]), torch.tensor([2, 0]), torch.tensor([17, 40])
    out = torch.empty(2, heads * dim)
    lib.mb_decode_attention(q.data_ptr(), heads * dim, keys.data_ptr(), values.data_ptr(), rows.data_ptr(),
                            which.data_ptr(), lens.data_ptr(), out.data_ptr(), 2, heads, kv_heads, dim, ctx,
                            dim**-0.5, bf16, kvq, window, 0.0)
    q, keys, values, atol = _as_read(lib, bf16, q, key_values, value_values, dim**-0.5)
    for r in range(2):
        first = max(0, int(lens[r]) - window) if window else 0  # a sliding window: the last `window` only
        k = keys[which[r], :, first : lens[r]][None]
        v = values[which[r], :, first : lens[r]][None]
        ref = F.scaled_dot_product_attention(q[r][None, :, None], k, v, enable_gqa=True, scale=1.0)
        assert torch.allclose(out[r], ref.reshape(-1), atol=atol)


def _chunk_reference(q, keys, values, chunks, heads, dim, window=0):
    """Each chunk's rows over their slot's cache, causally (within ``window`` positions where it is not
    0), by SDPA in fp32 (q already scaled)."""
    out = torch.empty(q.shape[0], heads * dim)
    for row, n, slot, start in chunks:
        end = start + n
        k, v = (t[slot, :, :end][None] for t in (keys, values))
        offset = torch.arange(start, end)[:, None] - torch.arange(end)[None, :]
        mask = (offset >= 0) & ((offset < window) if window else True)
        query = q[row : row + n].view(n, heads, dim).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, enable_gqa=True, scale=1.0)
        out[row : row + n] = o[0].transpose(0, 1).reshape(n, -1)
    return out


def _chunk_attention(lib, bf16, kvq, q, keys, values, chunks, heads, kv_heads, dim, window=0, softcap=0.0):
    out = torch.full((q.shape[0], heads * dim), float("nan"))
    rows, ns, slots, starts = torch.tensor(chunks).T.contiguous()
    lib.mb_chunk_attention(q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), rows.data_ptr(),
                           ns.data_ptr(), slots.data_ptr(), starts.data_ptr(), out.data_ptr(), len(chunks), heads,
                           kv_heads, dim, keys.shape[2], dim**-0.5, bf16, kvq, window, softcap)
    return out


@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("bf16", [0, 1])
@pytest.mark.parametrize("kvq,heads,kv_heads,dim", [(0, 4, 2, 16), (0, 9, 3, 64), (0, 14, 2, 64), (1, 9, 3, 64),
                                                    (1, 14, 2, 128)])
def test_chunk_attention_matches_sdpa_and_a_row_is_the_same_in_any_chunking(lib, kvq, heads, kv_heads, dim, bf16,
                                                                            window):
    """Also with a sliding window (each row sees its last 100 positions), shorter and longer than chunks."""
    g = torch.Generator().manual_seed(2)
    slots, ctx = 3, 900
    keys, key_values = _cache(lib, kvq, torch.randn(slots, kv_heads, ctx, dim, generator=g))
    values, value_values = _cache(lib, kvq, torch.randn(slots, kv_heads, ctx, dim, generator=g))
    q = torch.randn(450, heads * dim, generator=g)
    chunks = [(0, 37, 0, 0), (37, 300, 1, 129), (337, 5, 2, 800), (342, 108, 0, 37)]
    out = _chunk_attention(lib, bf16, kvq, q, keys, values, chunks, heads, kv_heads, dim, window)
    *read, atol = _as_read(lib, bf16, q, key_values, value_values, dim**-0.5)
    assert torch.allclose(out, _chunk_reference(*read, chunks, heads, dim, window), atol=atol)
    # slot 1's 300 rows again, as three chunks of other sizes in one call with slot 2's
    again = [(0, 64, 1, 129), (64, 5, 2, 800), (69, 100, 1, 193), (169, 136, 1, 293)]
    rows = torch.cat([q[37:101], q[337:342], q[101:337]])
    split = _chunk_attention(lib, bf16, kvq, rows, keys, values, again, heads, kv_heads, dim, window)
    assert torch.equal(torch.cat([split[:64], split[69:]]), out[37:337])
    assert torch.equal(split[64:69], out[337:342])


def _capped_reference(q, keys, values, chunks, heads, dim, cap):
    """_chunk_reference with each score (q already scaled) capped softly: cap tanh(score / cap)."""
    out = torch.empty(q.shape[0], heads * dim)
    for row, n, slot, start in chunks:
        end = start + n
        k, v = (t[slot, :, :end].repeat_interleave(heads // t.shape[1], dim=0) for t in (keys, values))
        query = q[row : row + n].view(n, heads, dim).transpose(0, 1)
        scores = torch.tanh(query @ k.transpose(-1, -2) / cap) * cap
        causal = torch.arange(start, end)[:, None] >= torch.arange(end)[None, :]
        weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out[row : row + n] = (weights @ v).transpose(0, 1).reshape(n, -1)
    return out


@pytest.mark.parametrize("bf16", [0, 1])
def test_chunk_attention_caps_scores_softly_in_any_chunking(lib, bf16):
    """Gemma 2's soft cap on the scores: as written out in torch, and a row's bits whatever its chunk."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, slots, ctx = 8, 4, 64, 2, 300
    keys, key_values = _cache(lib, 0, 3 * torch.randn(slots, kv_heads, ctx, dim, generator=g))
    values, value_values = _cache(lib, 0, torch.randn(slots, kv_heads, ctx, dim, generator=g))
    q = 3 * torch.randn(200, heads * dim, generator=g)
    chunks = [(0, 120, 0, 0), (120, 80, 1, 50)]
    out = _chunk_attention(lib, bf16, 0, q, keys, values, chunks, heads, kv_heads, dim, softcap=2.0)
    *read, atol = _as_read(lib, bf16, q, key_values, value_values, dim**-0.5)
    atol = max(atol, 1e-3)  # scores of up to ~60 before the cap: torch's own result moves by 2e-4 between runs
    assert torch.allclose(out, _capped_reference(*read, chunks, heads, dim, 2.0), atol=atol)
    assert not torch.allclose(out, _chunk_reference(*read, chunks, heads, dim), atol=0.1)  # the cap counts here
    again = [(0, 50, 0, 0), (50, 70, 0, 50), (120, 80, 1, 50)]
    assert torch.equal(_chunk_attention(lib, bf16, 0, q, keys, values, again, heads, kv_heads, dim, softcap=2.0), out)


def test_decode_attention_of_narrow_heads_caps_scores_softly(lib):
    """Heads of 16 values attend one head at a time (fp32): capped as the chunks are."""
    g = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, slots, ctx = 4, 2, 16, 2, 40
    keys, key_values = _cache(lib, 0, 4 * torch.randn(slots, kv_heads, ctx, dim, generator=g))
    values, value_values = _cache(lib, 0, torch.randn(slots, kv_heads, ctx, dim, generator=g))
    q = 4 * torch.randn(2, heads * dim, generator=g)
    rows, which, lens = torch.tensor([0, 1]), torch.tensor([1, 0]), torch.tensor([17, 40])
    out = torch.empty(2, heads * dim)
    lib.mb_decode_attention(q.data_ptr(), heads * dim, keys.data_ptr(), values.data_ptr(), rows.data_ptr(),
                            which.data_ptr(), lens.data_ptr(), out.data_ptr(), 2, heads, kv_heads, dim, ctx,
                            dim**-0.5, 0, 0, 0, 1.5)
    chunks = [(r, 1, int(which[r]), int(lens[r]) - 1) for r in range(2)]
    expected = _capped_reference(q * dim**-0.5, key_values, value_values, chunks, heads, dim, 1.5)
    assert torch.allclose(out, expected, atol=1e-3)  # torch's own result moves by up to 2e-4 between runs
    assert not torch.allclose(out, _chunk_reference(q * dim**-0.5, key_values, value_values, chunks, heads, dim),
                              atol=0.1)  # the cap counts here


def _stored(lib, floats, kvq):
    """``floats`` [slots, kv_heads, ctx, dim] written into a cache by ``mb_kv_store`` in form ``kvq``."""
    slots, heads, ctx, dim = floats.shape
    rows = floats.transpose(1, 2).reshape(slots * ctx, heads * dim).contiguous()
    which, positions = torch.arange(slots).repeat_interleave(ctx), torch.arange(ctx).repeat(slots)
    cache = torch.full((slots, heads, ctx, dim), float("nan"), dtype=torch.float16)
    lib.mb_kv_store(rows.data_ptr(), heads * dim, cache.data_ptr(), which.data_ptr(), positions.data_ptr(),
                    slots * ctx, heads, dim, ctx, kvq)
    return cache


@pytest.mark.parametrize("bf16", [0, 1])
@pytest.mark.parametrize("window", [0, 100])
def test_blocked_keys_attend_exactly_as_rows_do(lib, bf16, window):
    """kvq 2 keeps the keys of each 64 positions as dim pairs (the bf16 attention's form): stored by
    mb_kv_store as kv_cache lays them out, and attended to with the same bits as fp16 rows, in chunks and
    one row at a time, positions past a row's own (a last part block) never read."""
    g = torch.Generator().manual_seed(9)
    slots, kv_heads, heads, dim, ctx = 2, 3, 9, 64, 960
    floats = torch.randn(slots, kv_heads, ctx, dim, generator=g)
    floats[1, :, 330:] = float("nan")  # past slot 1's last row, in its block and after
    rows, blocked = _stored(lib, floats, 0), _stored(lib, floats, 2)
    assert torch.equal(rows.nan_to_num(7.0), floats.half().nan_to_num(7.0))
    assert torch.equal(_pairs(rows, BLOCK).view(torch.int16), blocked.view(torch.int16))
    assert torch.equal(_rows(blocked, BLOCK).view(torch.int16), rows.view(torch.int16))
    values = floats.flip(-1).half().contiguous()
    q = torch.randn(300, heads * dim, generator=g)
    chunks = [(0, 37, 0, 0), (37, 200, 1, 130), (237, 63, 0, 700)]
    for chunk in (chunks, [(r + i, 1, slot, start + i) for r, n, slot, start in chunks for i in range(n)]):
        out = [_chunk_attention(lib, bf16, kvq, q, keys, values, chunk, heads, kv_heads, dim, window)
               for kvq, keys in ((0, rows), (2, blocked))]
        assert not out[0].isnan().any() and torch.equal(out[0], out[1])


def test_blocked_kv_cache_hands_out_and_takes_in_rows():
    """save, restore, copy and read of a cache with blocked keys give and take rows, as with fp16 rows."""
    spec = SimpleNamespace(num_layers=2, num_kv_heads=3, head_dim=32)
    forms = [Form(torch.device("cpu"), torch.float16, mode, None) for mode in ("q8", "plain")]
    blocked, plain = (KVCache.allocate(spec, 3, 200, form, torch.device("cpu")) for form in forms)
    assert blocked.kvq == (2 if native.load().mb_attention_bf16() else 0) and plain.kvq == 0
    assert blocked.keys.shape[3] == (256 if blocked.kvq == 2 else 200)
    g = torch.Generator().manual_seed(2)
    saved = (torch.randn(2, 150, 3, 32, generator=g).half(), torch.randn(2, 150, 3, 32, generator=g).half())
    for cache in (blocked, plain):
        cache.restore(1, saved)
        cache.copy(1, 2, 150)
        for slot in (1, 2):
            assert all(torch.equal(a, b) for a, b in zip(cache.save(slot, 150), saved))
            assert all(torch.equal(a, b[:, 70:130]) for a, b in zip(cache.save(slot, 130, 70), saved))
            keys, values = cache.read(1, slot, 99)
            assert torch.equal(keys, saved[0][1, :99].transpose(0, 1))
            assert torch.equal(values, saved[1][1, :99].transpose(0, 1))


@pytest.mark.parametrize("kv", [None, "q8_0"])
def test_q8_runner_is_batch_invariant_and_its_fused_layers_equal_the_general_path(lib, kv):
    torch.manual_seed(7)
    model = LlamaForCausalLM(tiny_config(1000, head_dim=32)).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1, 5, 40, 130, 300, 17)]
    form = Form(torch.device("cpu"), torch.float32, "q8", kv)
    runner = ModelRunner(Checkpoint.from_model(model), num_slots=4, ctx=512, form=form)
    assert runner._fused is not None and runner.cut_anywhere
    assert runner.kv.keys.dtype == (torch.uint8 if kv else torch.float16)
    assert {f for layer in runner.weights.layers for f in layer.gate_up.formats} == {"int8"}
    batched = greedy(runner, prompts)
    assert [greedy(runner, [p])[0] for p in prompts] == batched
    runner._fused = None
    assert greedy(runner, prompts) == batched
    assert len({tuple(b) for b in batched}) == len(prompts)


@pytest.mark.parametrize("kv", [None, "q8_0"])
def test_q8_forward_stays_close_to_fp32(lib, kv):
    torch.manual_seed(7)
    model = LlamaForCausalLM(tiny_config(1000, head_dim=32)).eval()
    ids = torch.randint(3, 1000, (1, 48), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = model(ids).logits[0, -1]
    form = Form(torch.device("cpu"), torch.float32, "q8", kv)
    runner = ModelRunner(Checkpoint.from_model(model), num_slots=1, ctx=64, form=form)
    scheduler = Scheduler(num_slots=1, ctx=64, chunk_tokens=64)
    seq = Sequence("a", ids[0].tolist(), SamplingParams(), 1)
    scheduler.add(seq)
    plan = scheduler.schedule()
    with torch.inference_mode():
        hidden = runner.forward(runner._batch(plan))[-1:]
        logits = runner.weights.lm_head(runner.ops.rms_norm(hidden, runner.weights.norm, runner.weights.spec.eps))[0]
    assert F.cosine_similarity(logits, expected, dim=0) > 0.99


def test_gguf_blocks_are_the_cpu_default_and_the_fallback_works_without_kernels(lib, monkeypatch):
    cpu = torch.device("cpu")
    assert (decide(cpu, None, batch_invariant=True).mode, decide(cpu, None, True).dtype) == ("gguf", torch.float32)
    assert decide(cpu, "int8", batch_invariant=True).mode == "q8"
    assert decide(cpu, "int8", True).kv_dtype == torch.float16 and decide(cpu, "int8", True).bf16_attention
    monkeypatch.setenv("MASHBOX_NATIVE", "0")
    native.load.cache_clear()
    try:
        assert native.load() is None
        assert decide(cpu, None, batch_invariant=True).mode in ("packed", "tiled")
        assert decide(cpu, "float32", batch_invariant=True).kv_dtype == torch.float32
        with pytest.raises(ConfigError, match=r"dtype: int8 .* which are off here \(MASHBOX_NATIVE=0\)"):
            decide(cpu, "int8", batch_invariant=True)  # a ValueError, "no C compiler" where there was one
        with pytest.raises(ConfigError, match=r"kv_dtype: q8_0 .* off here \(MASHBOX_NATIVE=0\); use f16"):
            decide(cpu, None, True, "q8_0")
        with pytest.raises(ConfigError, match=r"use float16 \(packed\) or float32$"):  # not int8, refused above
            decide(cpu, "bfloat16", True)
    finally:
        monkeypatch.delenv("MASHBOX_NATIVE")
        native.load.cache_clear()


def test_kernels_off_say_why_in_the_log(monkeypatch, caplog):
    """Off Linux (a Mac) or with MASHBOX_NATIVE=0 nothing said the kernels were off: only a missing compiler did."""
    monkeypatch.setattr(native.platform, "system", lambda: "Darwin")
    native.load.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="mashbox.engine"):
            assert native.load() is None
        assert "CPU kernels are off (they are built on Linux only, not Darwin): torch's are used" in caplog.text
    finally:
        monkeypatch.undo()
        native.load.cache_clear()


def test_a_decode_step_starts_no_torch_parallel_region(lib):
    """A step's own torch ops stay on the calling thread: advanced indexing (``aten::index``) starts
    torch's OpenMP team at any size, which costs a decode step 0.5-8 ms on two busy cores and, when
    torch was imported before mashbox (its threads then spin), slows the kernels' pool beside it."""
    torch.manual_seed(7)
    model = LlamaForCausalLM(tiny_config(1000, head_dim=32)).eval()
    form = Form(torch.device("cpu"), torch.float32, "q8")
    runner = ModelRunner(Checkpoint.from_model(model), num_slots=4, ctx=128, form=form)
    scheduler = Scheduler(num_slots=4, ctx=128, chunk_tokens=64)
    for i in range(3):
        scheduler.add(Sequence(str(i), list(range(5 + i, 20 + 2 * i)), SamplingParams(), 8))
    while any(s.in_prefill or not s.output_ids for s in [*scheduler.running, *scheduler.waiting]):
        plan = scheduler.schedule()
        scheduler.update(plan, runner.run(plan))
    plan = scheduler.schedule()
    assert plan.decode_rows == 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        scheduler.update(plan, runner.run(plan))
    names = {event.name for event in prof.events()}
    assert "aten::index_select" in names and "aten::index" not in names


def test_a_kernels_file_cut_short_is_built_again(tmp_path, monkeypatch):
    """A kernels file cut short (a power loss after its rename, a full disk, a copy cut off) was loaded, and
    every start died of SIGBUS at the first call, until someone found and removed it."""
    compiler = native.find_compiler()
    whole = native._build(compiler)  # the test session's own
    monkeypatch.setenv("MASHBOX_CACHE", str(tmp_path))
    cut = tmp_path / "kernels" / whole.name
    cut.parent.mkdir()
    cut.write_bytes(whole.read_bytes()[:1000])
    left, building = cut.parent / "tmpk2j9x0a1.so", cut.parent / "tmpm3n8y1b2.so"  # a killed build's, and one now
    left.write_bytes(b"x"), building.write_bytes(b"x")
    os.utime(left, (time.time() - 3600,) * 2)
    assert not native._whole(cut) and native._whole(whole)
    assert native._build(compiler) == cut and native._whole(cut)
    native.bind(ctypes.CDLL(str(cut)))
    assert not left.exists() and building.exists()


def test_a_failed_build_says_the_compilers_words():
    import subprocess

    err = subprocess.CalledProcessError(1, ["cc"], stderr=b"kernels.c:3:10: fatal error: omp.h: No such file\n")
    assert "fatal error: omp.h: No such file" in native._why(err)


def test_weights_named_in_bytes_that_are_not_utf8_get_their_packed_name():
    """A model file named ``caf\\xe9.gguf`` (Latin-1 bytes) failed its load: UnicodeEncodeError."""
    from pathlib import Path

    from mashbox.engine.model.packed import _prefix

    assert _prefix(Path(os.fsdecode(b"/models/caf\xe9.gguf"))).startswith("caf")
