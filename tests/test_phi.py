"""Phi-3 / Phi-4-mini: tiny random models built through transformers (q, k and v in one matrix, gate
and up in one, a rotary over 3/4 of each head as Phi-4-mini's, LongRoPE factors, a sliding window)
answer token for token as transformers does, from an HF directory and from a GGUF written from them;
on the kernels every answer is the same alone and batched."""

from __future__ import annotations

import pytest
import torch
from quants import blocks_agree, gguf_runner, random_prompts, tiny_gguf
from tiny import generate, greedy
from transformers import Phi3Config, Phi3ForCausalLM

from mashbox import Engine

SHAPE = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, partial_rotary_factor=0.75, sliding_window=None,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1, tie_word_embeddings=False)
ROTATED = 24  # pairs: 3/4 of a head of 64
LONGROPE = dict(original_max_position_embeddings=64, rope_scaling={
    "type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(ROTATED)],
    "long_factor": [1.0 + 0.5 * i for i in range(ROTATED)]})
WORDS = " ".join(f"{w} {i}" for i, w in enumerate(["red", "green", "blue", "gold", "grey", "pink"] * 6))


def tiny_phi(**config) -> Phi3ForCausalLM:
    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(**{**SHAPE, **config})).eval()
    assert model.model.rotary_emb.inv_freq.numel() == ROTATED
    return model


@pytest.mark.parametrize("config", [dict(sliding_window=16), LONGROPE], ids=["window", "longrope"])
def test_a_saved_phi3_answers_as_transformers_does(tmp_path, smol_tokenizer, config):
    """An HF directory: fused q/k/v and gate/up, the partial rotary, and a sliding window over every
    layer, or LongRoPE past its original 64 positions (its long factors: every prompt here is longer)."""
    model = tiny_phi(**config)
    model.save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    with Engine(str(tmp_path), dtype="float32", ctx=256, slots=2, quiet=True) as engine:
        for prompt in (WORDS, WORDS[40:] + " and"):
            ids = smol_tokenizer.encode(prompt)
            assert len(ids) > 64
            expected = smol_tokenizer.decode(generate(model, ids, 10), skip_special_tokens=True)
            assert engine.complete(prompt=prompt, max_tokens=10, temperature=0).choices[0].text == expected


@pytest.mark.parametrize("config,formats", [({}, ["Q4_K", "Q6_K", "Q8_0"]), (LONGROPE, ["Q5_K", "Q4_0", "Q8_0"])],
                         ids=["plain", "longrope"])
def test_a_phi3_gguf_runs_from_its_blocks(tmp_path, lib, config, formats):
    """The GGUF llama.cpp's converter writes (attn_qkv, ffn_up holding gate and up, the rotated
    dimensions, LongRoPE's factors and attention factor): dequantized it answers token for token as
    transformers does; as blocks it runs in the fused layers, every answer the same alone and
    batched, through the general path too, and mostly the exact one."""
    model = tiny_phi(**config)
    path = tiny_gguf(tmp_path / "phi3.gguf", model, "phi3", formats)
    prompts = random_prompts((70, 130, 300, 90, 65, 200))  # each past LongRoPE's original 64
    expected = [generate(model, p) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(prompts)
    assert greedy(gguf_runner(path, lib, "plain"), prompts) == expected
    runner = gguf_runner(path, lib, "gguf")
    assert runner._fused is not None and runner.cut_anywhere
    blocks_agree(runner, prompts, expected)


def test_a_longrope_model_stays_within_its_original_context_by_default(tmp_path, smol_tokenizer):
    """Past the original context every position turns by the long factors (as llama.cpp chooses by its
    context); the default ctx (the trained 1024 here, Phi-4-mini's 8192 cap) gave short prompts the long
    ones, where transformers gives them the short: answers differed from the first token."""
    model = tiny_phi(**LONGROPE)
    model.save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    with Engine(str(tmp_path), dtype="float32", slots=2, quiet=True) as engine:
        assert engine.ctx == 64
        ids = smol_tokenizer.encode(WORDS[:60])
        expected = smol_tokenizer.decode(generate(model, ids, 10), skip_special_tokens=True)
        assert engine.complete(prompt=WORDS[:60], max_tokens=10, temperature=0).choices[0].text == expected


def test_pages_of_longropes_short_table_are_not_read_past_its_original_context(tmp_path, smol_tokenizer):
    """Past its original context LongRoPE turns every position by its long factors: the keys differ, so
    the disk pages of a server within that context are no one's past it (a context of its own only
    for such a model: the pages' namespace holds the rotary tables, not the context)."""
    model = tiny_phi(**{**LONGROPE, "original_max_position_embeddings": 256})
    model.save_pretrained(tmp_path / "model")
    smol_tokenizer.save_pretrained(tmp_path / "model")
    options = {"dtype": "float32", "slots": 1, "quiet": True, "chunk_tokens": 16, "cache_disk_gib": 1,
               "cache_dir": str(tmp_path / "pages")}  # pages of 8 chunks: 128 tokens
    prompt = WORDS  # 134 tokens
    assert 128 < len(smol_tokenizer.encode(prompt)) < 190

    def cached(ctx: int) -> int:
        with Engine(str(tmp_path / "model"), ctx=ctx, **options) as engine:
            return engine.complete(prompt=prompt, max_tokens=1).usage.prompt_tokens_details.cached_tokens

    assert [cached(256), cached(256), cached(200), cached(512)] == [0, 128, 128, 0]
