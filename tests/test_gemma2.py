"""Gemma 2: tiny random models built through transformers (every other layer attending to a sliding
window of 16 positions, the attention scores and the logits capped softly, as Gemma 2's are, here
at caps low enough to count) answer token for token as transformers does, with its logits, from an
HF directory and from a GGUF written from them; on the kernels every answer is the same alone and
batched, and the fused layers' logits are the general path's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from quants import blocks_agree, gguf_runner, random_prompts, tiny_gguf
from tiny import generate, greedy, last_logits, logits
from transformers import Gemma2Config, Gemma2ForCausalLM

from mashbox import Engine
from mashbox.engine.load.checkpoint import Checkpoint
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
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    return model


def test_a_saved_gemma2_answers_as_transformers_does(tmp_path, smol_tokenizer):
    model = tiny_gemma2()
    model.save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    with Engine(str(tmp_path), dtype="float32", ctx=256, slots=2, quiet=True) as engine:
        for prompt in (WORDS, WORDS[30:] + " and"):
            ids = smol_tokenizer.encode(prompt)
            expected = smol_tokenizer.decode(generate(model, ids, 10), skip_special_tokens=True)
            assert engine.complete(prompt=prompt, max_tokens=10, temperature=0).choices[0].text == expected


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_each_soft_cap_reaches_the_logits(cap):
    """The logits equal transformers' with both caps, and each cap alone moves them."""
    model = tiny_gemma2()
    prompt = random_prompts((40,))[0]
    expected = logits(model, prompt)
    got = last_logits(ModelRunner(Checkpoint.from_model(model), num_slots=4, ctx=512, form="plain"), prompt)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4)
    loose = tiny_gemma2(**{cap: None})
    other = last_logits(ModelRunner(Checkpoint.from_model(loose), num_slots=4, ctx=512, form="plain"), prompt)
    assert not torch.allclose(other, expected, rtol=1e-2, atol=1e-2)


def test_a_gemma2_gguf_runs_from_its_blocks(tmp_path, lib):
    """The GGUF llama.cpp's converter writes (norms as 1 + weight, the window and both caps in its
    fields): dequantized it answers and scores as transformers does; as blocks it runs in the fused
    layers (their logits moved by the scores' cap, and equal to the general path's), every answer the
    same alone and batched, and mostly the exact one."""
    model = tiny_gemma2()
    path = tiny_gguf(tmp_path / "gemma2.gguf", model, "gemma2", ["Q6_K", "Q8_0"])
    prompts = random_prompts((70, 130, 300, 90, 65, 200))
    expected = [generate(model, p) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(prompts)
    plain = gguf_runner(path, lib, "plain")
    assert greedy(plain, prompts) == expected
    exact = logits(model, prompts[0][:40])
    assert torch.allclose(last_logits(plain, prompts[0][:40]), exact, rtol=1e-4, atol=1e-4)
    runner = gguf_runner(path, lib, "gguf")
    assert runner._fused is not None and runner.cut_anywhere
    fused = last_logits(runner, prompts[0][:40])
    ckpt = checkpoint(open_model(path), torch.device("cpu"), torch.float32, lib)
    uncapped = ModelRunner(replace(ckpt, spec=replace(ckpt.spec, softcap=0.0)), num_slots=4, ctx=512, form="gguf")
    assert (last_logits(uncapped, prompts[0][:40]) - fused).abs().max() > 0.05  # the kernels cap the scores
    blocks_agree(runner, prompts, expected)  # leaves the general path on
    assert torch.equal(last_logits(runner, prompts[0][:40]), fused)
