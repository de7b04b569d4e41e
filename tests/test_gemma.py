"""Gemma 3: tiny random models built through transformers (a few layers, most of them attending to a
sliding window of 16 positions) answer token for token as transformers does, from an HF directory and
from a GGUF written from them; the kernels keep each row's result whatever runs beside it and however
much of the prompt came from the prefix cache (a cached prefix longer than the window); and the real
Gemma 3 270M (the catalog's gemma3-270m) answers a question."""

from __future__ import annotations

import json

import pytest
import torch
from quants import blocks_agree, exact_gguf, gguf_runner, random_prompts, tiny_gguf
from tiny import generate, greedy, last_logits, logits, plain_runner, random_norms
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from mashbox import Engine
from mashbox.engine.request import Message
from mashbox.engine.text.template import ChatTemplate

SHAPE = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, sliding_window=16,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1, tie_word_embeddings=False)
WORDS = " ".join(f"{w} {i}" for i, w in enumerate(["red", "green", "blue", "gold", "grey", "pink"] * 6))


def tiny_gemma(**config) -> Gemma3ForCausalLM:
    """Five sliding-window layers and one global (Gemma 3's pattern), its norms set at random:
    transformers starts them at 0, a weight of 1 + 0, which would hide a norm read without its shift.
    Its lm_head is its own (a tied one, beside the embedding's scale, answers one token whatever came
    before, which would hide a wrong window)."""
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**SHAPE, **config})).eval()
    random_norms(model)
    assert model.config.layer_types.count("full_attention") == 1
    return model


def test_a_saved_gemma3_answers_as_transformers_does(tmp_path, smol_tokenizer):
    """An HF directory (model type gemma3_text, read without transformers' model): the embedding scale,
    the norms around attention and the MLP, q/k norms, GELU, the attention scale of
    query_pre_attn_scalar, two rotary bases and the window give transformers' greedy tokens, on prompts
    longer than the window."""
    model = tiny_gemma(query_pre_attn_scalar=48)
    model.save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    prompts = [WORDS, "one two three four", WORDS[:90]]
    with Engine(str(tmp_path), dtype="float32", ctx=256, slots=3, quiet=True) as engine:
        for prompt in prompts:
            ids = smol_tokenizer.encode(prompt)
            expected = smol_tokenizer.decode(generate(model, ids, 10), skip_special_tokens=True)
            answer = engine.complete(prompt=prompt, max_tokens=10, temperature=0)
            assert answer.usage.prompt_tokens == len(ids)
            assert answer.choices[0].text == expected
    assert len(smol_tokenizer.encode(WORDS)) > 4 * SHAPE["sliding_window"]


def test_gemma2s_score_cap_in_a_gemma3_config_is_left_unused_as_transformers_leaves_it(smol_tokenizer):
    """``attn_logit_softcapping`` in a Gemma 3 config (a Gemma 2 field its attention never reads): capping
    the scores by it changed every logit (by 0.4 at a cap of 2) with no word."""
    model = tiny_gemma(query_pre_attn_scalar=48, attn_logit_softcapping=2.0)
    ids = smol_tokenizer.encode(WORDS)
    assert torch.allclose(last_logits(plain_runner(model), ids), logits(model, ids), atol=1e-4)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 8.0}])
def test_a_config_written_before_layer_types_answers_the_same(tmp_path, smol_tokenizer, scaling):
    """config.json as the Gemma 3 checkpoints on the hub have it (gemma-3-1b-it, 4b-it and 270m were saved
    before transformers wrote ``layer_types`` and ``rope_parameters``): the window's layers from
    ``sliding_window_pattern``, their rotary base from ``rope_local_base_freq``, the global layers'
    scaling (4B's linear 8) from ``rope_scaling``; transformers reads it as the model it saved."""
    model = tiny_gemma(query_pre_attn_scalar=48, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6, **(scaling or {})},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    model.save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["layer_types"], config["rope_parameters"]
    config.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6, rope_scaling=scaling)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with Engine(str(tmp_path), dtype="float32", ctx=256, slots=2, quiet=True) as engine:
        for prompt in (WORDS, WORDS[:90]):
            expected = smol_tokenizer.decode(generate(model, smol_tokenizer.encode(prompt), 10))
            assert engine.complete(prompt=prompt, max_tokens=10, temperature=0).choices[0].text == expected


@pytest.mark.parametrize("formats", [["Q4_K", "Q6_K", "Q5_0", "Q8_0"], ["Q4_0", "Q5_K", "Q4_1"]])
def test_a_gemma3_gguf_runs_from_its_blocks(tmp_path, lib, formats):
    """The GGUF llama.cpp's converter would write (norms as 1 + weight, head size and window in the
    metadata): dequantized it answers token for token as transformers does; as blocks, in the fused
    layers, every answer is the same alone and batched (prompts cut anywhere beside decoding rows),
    the same through the general path, and mostly the exact one."""
    model = tiny_gemma(query_pre_attn_scalar=64)  # llama.cpp scales by the head size
    path = tiny_gguf(tmp_path / "gemma.gguf", model, "gemma3", formats)
    prompts = random_prompts((1, 5, 40, 130, 300, 17))
    exact = gguf_runner(path, lib, "plain")
    assert [layer.window for layer in exact.weights.layers] == [16] * 5 + [0]
    expected = [generate(model, p) for p in prompts]
    assert greedy(exact, prompts) == expected
    runner = gguf_runner(path, lib, "gguf")
    assert runner._fused is not None and runner.cut_anywhere  # the window runs in the attention kernels
    blocks_agree(runner, prompts, expected)


def test_a_gemma3_gguf_keeps_its_window_layers_rotary_base(tmp_path, lib):
    """The base the converter writes for the window layers (``rope.freq_base_swa``), not llama.cpp's
    10000 for a file without one."""
    model = tiny_gemma(query_pre_attn_scalar=64, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})
    exact_gguf(tmp_path / "gemma.gguf", model, "gemma3", ["Q8_0"], lib)


def test_a_cached_prefix_longer_than_the_window_gives_the_same_answer(tmp_path, smol_tokenizer):
    """On the kernels (int8 blocks): a prompt whose first 100+ tokens come from the prefix cache answers
    as it does computed whole in a fresh engine."""
    tiny_gemma().save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    prompt = WORDS + " and then"
    with Engine(str(tmp_path), ctx=512, slots=2, quiet=True) as fresh:
        expected = fresh.complete(prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    with Engine(str(tmp_path), ctx=512, slots=2, quiet=True) as engine:
        assert engine.info.weights_mode == "blocks"
        engine.complete(prompt=WORDS, max_tokens=1, temperature=0)
        before = engine.stats().prefix_hit_tokens
        answer = engine.complete(prompt=prompt, max_tokens=12, temperature=0)
        assert engine.stats().prefix_hit_tokens - before > 4 * SHAPE["sliding_window"]
    assert answer.choices[0].text == expected and len(expected) > 5


@pytest.fixture(scope="module")
def gemma():
    with Engine("gemma3-270m", ctx=2048, slots=2, quiet=True) as engine:
        yield engine


def test_the_real_gemma3_270m_answers_a_question(gemma):
    """The pretrained 270M model (not instruction-tuned), asked in the form it was trained on."""
    assert gemma.info.dtype.startswith("Q8_0 + Q5_0 + Q4_K + Q6_K blocks")
    prompt = ("Q: What is the capital of Italy?\nA: Rome\nQ: What is the capital of Japan?\nA: Tokyo\n"
              "Q: What is the capital of France?\nA:")
    answer = gemma.complete(prompt=prompt, max_tokens=4, temperature=0)
    assert answer.choices[0].text.split("\n")[0].strip() == "Paris"


def test_gemma3_chat_is_rendered_in_gemma_turns_and_ends_at_end_of_turn(gemma):
    """Its GGUF holds no chat template: Gemma's turns are used, the system text opening the first user
    turn; an answer ends at ``<end_of_turn>`` as at ``<eos>``."""
    text = ChatTemplate(gemma.tokenizer).render((Message("system", "Be brief."), Message("user", "Hi"),
                                                   Message("assistant", "Hello."), Message("user", "Bye")))
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello."
                    "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    end = gemma.tokenizer.backend_tokenizer.token_to_id("<end_of_turn>")
    assert {end, gemma.tokenizer.eos_token_id} <= gemma.eos_ids
    out = gemma.chat(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
    assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")
