"""Gemma 2: tiny random models built through transformers (every other layer attending to a sliding
window of 16 positions, the attention scores and the logits capped softly, as Gemma 2's are, here
at caps low enough to count) answer token for token as transformers does, with its logits, from an
HF directory and from a GGUF written from them; on the kernels every answer is the same alone and
batched, and the fused layers' logits are the general path's."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from quants import blocks_agree, exact_gguf, gguf_runner, random_prompts, tiny_gguf
from tiny import answers_as_transformers, last_logits, logits, plain_runner, random_norms
from transformers import Gemma2Config, Gemma2ForCausalLM

from mashbox.engine.load.gguf_file import checkpoint, open_model
from mashbox.engine.model.runner import ModelRunner

SHAPE = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, sliding_window=16,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1, tie_word_embeddings=False,
             attn_logit_softcapping=1.5, final_logit_softcapping=30.0, query_pre_attn_scalar=64,
             attn_implementation="eager")  # scores scaled by the head size, as llama.cpp does for 2B and 9B
WORDS = " ".join(f"{w} {i}" for i, w in enumerate(["red", "green", "blue", "gold", "grey", "pink"] * 4))


def tiny_gemma2(**config) -> Gemma2ForCausalLM:
    """Its norms set at random (transformers starts them at 0: a weight of 1 + 0, which would hide a
    norm read without its shift), its lm_head its own."""
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(**{**SHAPE, **config})).eval()
    random_norms(model)
    assert model.config.layer_types[:4] == ["sliding_attention", "full_attention"] * 2
    return model


def test_a_saved_gemma2_answers_as_transformers_does(tmp_path, smol_tokenizer):
    answers_as_transformers(tmp_path, tiny_gemma2(), smol_tokenizer, [WORDS, WORDS[30:] + " and"])


def test_a_config_without_layer_types_has_its_windows(tmp_path, smol_tokenizer):
    """config.json as gemma-2-2b-it's on the hub (written before transformers had ``layer_types``):
    every other layer still attends to the window."""
    model = tiny_gemma2()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = [WORDS, WORDS[30:] + " and"]
    assert all(len(smol_tokenizer.encode(p)) > 2 * SHAPE["sliding_window"] for p in prompts)
    answers_as_transformers(tmp_path, model, smol_tokenizer, prompts, save=False)


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_each_soft_cap_reaches_the_logits(cap):
    """The logits equal transformers' with both caps, and each cap alone moves them."""
    model = tiny_gemma2()
    prompt = random_prompts((40,))[0]
    expected = logits(model, prompt)
    assert torch.allclose(last_logits(plain_runner(model), prompt), expected, rtol=1e-4, atol=1e-4)
    other = last_logits(plain_runner(tiny_gemma2(**{cap: None})), prompt)
    assert not torch.allclose(other, expected, rtol=1e-2, atol=1e-2)


def test_a_gemma2_gguf_runs_from_its_blocks(tmp_path, lib):
    """The GGUF llama.cpp's converter writes (norms as 1 + weight, the window and both caps in its
    fields): dequantized it answers and scores as transformers does; as blocks it runs in the fused
    layers (their logits moved by the scores' cap, and equal to the general path's), every answer the
    same alone and batched, and mostly the exact one."""
    path = tmp_path / "gemma2.gguf"
    prompts, expected, _ = exact_gguf(path, tiny_gemma2(), "gemma2", ["Q6_K", "Q8_0"], lib)
    runner = gguf_runner(path, lib, "gguf")
    assert runner._fused is not None and runner.cut_anywhere
    fused = last_logits(runner, prompts[0][:40])
    ckpt = checkpoint(open_model(path), torch.device("cpu"), torch.float32, lib)
    uncapped = ModelRunner(replace(ckpt, spec=replace(ckpt.spec, softcap=0.0)), num_slots=4, ctx=512, form="gguf")
    assert (last_logits(uncapped, prompts[0][:40]) - fused).abs().max() > 0.05  # the kernels cap the scores
    blocks_agree(runner, prompts, expected)  # leaves the general path on
    assert torch.equal(last_logits(runner, prompts[0][:40]), fused)


def test_a_gemma2_gguf_without_a_window_gets_llama_cpps(tmp_path, lib):
    """A file without ``attention.sliding_window`` (as converters before it wrote) attends on every
    other layer to llama.cpp's default window, Gemma 2's 4096."""
    path = tiny_gguf(tmp_path / "gemma2.gguf", tiny_gemma2(sliding_window=None), "gemma2", ["Q8_0"])
    assert checkpoint(open_model(path), torch.device("cpu"), torch.float32, lib).windows == (4096, 0) * 2


def test_the_27b_shape_scales_scores_as_llama_cpp_does(tmp_path, lib):
    """At 27B's 46 layers llama.cpp scales the scores by n_embd / n_head (27B's query_pre_attn_scalar,
    144 there), not by the head size, and the GGUF does not hold it: the file answers as transformers
    does with it."""
    model = tiny_gemma2(num_hidden_layers=46, head_dim=128, query_pre_attn_scalar=64)  # 256 / 4 heads
    exact_gguf(tmp_path / "gemma2.gguf", model, "gemma2", ["Q8_0"], lib)
