"""SmolLM3: a tiny random model built through transformers, every fourth layer without a rotary
(NoPE), answers token for token as transformers does from an HF directory and from a GGUF written
from it (llama.cpp's files do not name those layers: every fourth, as llama.cpp takes them); on the
kernels every answer is the same alone and batched."""

from __future__ import annotations

import torch
from quants import blocks_agree, exact_gguf, gguf_runner, tiny_gguf
from tiny import answers_as_transformers, greedy
from transformers import SmolLM3Config, SmolLM3ForCausalLM

from mashbox import Engine

SHAPE = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             initializer_range=0.1, tie_word_embeddings=True)
WORDS = " ".join(f"{w} {i}" for i, w in enumerate(["red", "green", "blue", "gold", "grey", "pink"] * 4))


def tiny_smollm3() -> SmolLM3ForCausalLM:
    torch.manual_seed(0)
    model = SmolLM3ForCausalLM(SmolLM3Config(**SHAPE)).eval()
    assert model.config.no_rope_layers == [1, 1, 1, 0]  # the last of the four layers turns nothing
    return model


def test_a_saved_smollm3_answers_as_transformers_does(tmp_path, smol_tokenizer):
    answers_as_transformers(tmp_path, tiny_smollm3(), smol_tokenizer, [WORDS, WORDS[30:] + " and"])


def test_a_smollm3_gguf_runs_from_its_blocks(tmp_path, lib):
    """The GGUF llama.cpp's converter writes (q and k rows interleaved; no field for the NoPE
    layers): dequantized it answers and scores as transformers does; as blocks it runs in the fused
    layers, every answer the same alone and batched, through the general path too, and mostly the
    exact one."""
    path = tmp_path / "smollm3.gguf"
    prompts, expected, _ = exact_gguf(path, tiny_smollm3(), "smollm3", ["Q4_K", "Q5_0", "Q8_0"], lib)
    runner = gguf_runner(path, lib, "gguf")
    assert runner._fused is not None and runner.cut_anywhere
    blocks_agree(runner, prompts, expected)


def test_the_engine_reads_a_smollm3_gguf_and_its_tokenizer(tmp_path, monkeypatch, lib, smol_tokenizer):
    """transformers has no GGUF config for SmolLM3 (nor Granite): the loader reads the file's tokenizer
    as its vocabulary alone, and the engine answers as the file's runner does."""
    monkeypatch.setenv("MASHBOX_CACHE", str(tmp_path / "cache"))  # its tokenizer copy lands there
    path = tiny_gguf(tmp_path / "smollm3.gguf", tiny_smollm3(), "smollm3", ["Q4_K", "Q8_0"])
    ids = smol_tokenizer.encode(WORDS)
    with Engine(str(path), slots=2, ctx=256, quiet=True) as engine:
        answer = engine.complete(prompt=WORDS, max_tokens=10, temperature=0)
        text = "def f(x):\n    return x ** 2  # ünïcode 你好"
        assert engine.tokenizer.encode(text) == smol_tokenizer.encode(text)
    expected = greedy(gguf_runner(path, lib, "gguf"), [ids], 10)[0]
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 10
    # the random model writes bytes of no whole character: a last one left incomplete is not sent
    assert answer.choices[0].text == smol_tokenizer.decode(expected, skip_special_tokens=True).removesuffix("\ufffd")
