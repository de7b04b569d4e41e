"""Granite: a tiny random model built through transformers, its four multipliers set as Granite 3.3's
(the embeddings', the residual branches', the attention scores' and the logits' divisor), answers
token for token as transformers does from an HF directory and from a GGUF written from it, with the
same logits; on the kernels every answer is the same alone and batched."""

from __future__ import annotations

import pytest
import torch
from quants import blocks_agree, exact_gguf, gguf_runner, random_prompts
from tiny import answers_as_transformers, last_logits, logits, plain_runner
from transformers import GraniteConfig, GraniteForCausalLM

SHAPE = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             initializer_range=0.1, tie_word_embeddings=True)
MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                   logits_scaling=8.0)
WORDS = " ".join(f"{w} {i}" for i, w in enumerate(["red", "green", "blue", "gold", "grey", "pink"] * 4))


def tiny_granite(**config) -> GraniteForCausalLM:
    torch.manual_seed(0)
    return GraniteForCausalLM(GraniteConfig(**{**SHAPE, **MULTIPLIERS, **config})).eval()


def test_a_saved_granite_answers_as_transformers_does(tmp_path, smol_tokenizer):
    answers_as_transformers(tmp_path, tiny_granite(), smol_tokenizer, [WORDS, WORDS[30:] + " and"])


@pytest.mark.parametrize("scaled", ["embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                    "logits_scaling"])
def test_each_multiplier_reaches_the_logits(scaled):
    """The logits equal transformers' with all four set, and each one alone moves them (so none is
    left out unseen)."""
    model = tiny_granite()
    prompt = random_prompts((24,))[0]
    expected = logits(model, prompt)
    assert torch.allclose(last_logits(plain_runner(model), prompt), expected, rtol=1e-4, atol=1e-4)
    other = last_logits(plain_runner(tiny_granite(**{scaled: GraniteConfig().to_dict()[scaled]})), prompt)
    assert not torch.allclose(other, expected, rtol=1e-2, atol=1e-2)


def test_a_granite_gguf_runs_from_its_blocks(tmp_path, lib):
    """The GGUF llama.cpp's converter writes (q and k rows interleaved, the multipliers as
    embedding_scale, residual_scale, attention.scale and logit_scale): dequantized it answers and
    scores as transformers does; as blocks it runs in the fused layers (their logits within the
    int8 activations' error of the exact ones, and equal to the general path's), every answer the
    same alone and batched, through the general path too, and mostly the exact one."""
    path = tmp_path / "granite.gguf"
    prompts, expected, exact = exact_gguf(path, tiny_granite(), "granite", ["Q4_K", "Q6_K", "Q8_0"], lib)
    runner = gguf_runner(path, lib, "gguf")
    assert runner._fused is not None and runner.cut_anywhere
    fused = last_logits(runner, prompts[0][:40])
    assert torch.allclose(fused, exact, atol=0.01 * exact.abs().max())
    blocks_agree(runner, prompts, expected)  # leaves the general path on
    assert torch.equal(last_logits(runner, prompts[0][:40]), fused)
