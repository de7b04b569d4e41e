"""A checkpoint read straight from a saved directory is the model transformers builds from it:
the same tensors, shape, rotary frequencies and end ids, for each supported family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)
from tiny import tiny_config

from mashbox import Engine, EngineRequest, Finish, SamplingParams
from mashbox.engine.load import checkpoint
from mashbox.engine.load.checkpoint import Checkpoint
from mashbox.engine.load.loader import load
from mashbox.engine.model import native
from mashbox.engine.model.weights import Weights
from mashbox.errors import ConfigError

SHAPE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama, tied": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=True)),
    "llama3 rope scaling": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256})),
    "qwen2, qkv bias": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=False)),
    "qwen3, q/k norms": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=32)),
    "phi3, fused, partial rotary": lambda: Phi3ForCausalLM(Phi3Config(**SHAPE, partial_rotary_factor=0.75, pad_token_id=0)),
    "gemma3, windows": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**{**SHAPE, "num_hidden_layers": 6}, head_dim=16,
                                                                  sliding_window=8, pad_token_id=0)),
    "smollm3, NoPE layers": lambda: SmolLM3ForCausalLM(SmolLM3Config(**{**SHAPE, "num_hidden_layers": 4},
                                                                     pad_token_id=0)),
    "granite, multipliers": lambda: GraniteForCausalLM(GraniteConfig(
        **SHAPE, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
        logits_scaling=8.0)),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_read_equals_the_model_transformers_builds(family: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    model.save_pretrained(tmp_path)
    expected = Checkpoint.from_model(model)
    got = checkpoint.read(tmp_path, torch.device("cpu"), torch.float32)
    assert got is not None
    assert (got.model_type, got.spec, got.hidden_act, got.trained_ctx, got.eos_ids) == (
        expected.model_type, expected.spec, expected.hidden_act, expected.trained_ctx, expected.eos_ids)
    assert (got.embed_scale, got.rotated, got.residual_scale, got.logit_scale) == (
        expected.embed_scale, expected.rotated, expected.residual_scale, expected.logit_scale)
    assert got.rope_scale == pytest.approx(expected.rope_scale)
    assert torch.allclose(got.inv_freq, expected.inv_freq, rtol=1e-6, atol=0)
    assert got.tensors.keys() == expected.tensors.keys()
    for name, tensor in expected.tensors.items():
        assert torch.equal(got.tensors[name], tensor), name


def test_read_takes_each_tensor_on_first_use_cast_to_its_dtype_and_tied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=True)).eval()
    model.save_pretrained(tmp_path)
    eager = Checkpoint.from_model(model)
    got = checkpoint.read(tmp_path, torch.device("cpu"), torch.bfloat16)
    assert got is not None and got.tensors._loaded == {}  # sizes and shapes come from the files' headers
    assert (got.numel, got.nbytes) == (eager.numel, eager.numel * 2)
    assert got.tensors.shape("model.layers.1.mlp.down_proj.weight") == (64, 128) and got.tensors._loaded == {}
    head = got.tensors["lm_head.weight"]
    assert head is got.tensors["model.embed_tokens.weight"] and head.dtype == torch.bfloat16
    assert torch.equal(head, eager.tensors["model.embed_tokens.weight"].to(torch.bfloat16))
    assert set(got.tensors._loaded) == {"lm_head.weight", "model.embed_tokens.weight"}


@pytest.mark.parametrize("mode", ["tiled", "q8"])
def test_a_tied_lm_head_is_counted_once_unless_it_is_a_copy(mode: str) -> None:
    sizes = {}
    for tied in (True, False):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=tied)).eval()
        weights = Weights.from_checkpoint(Checkpoint.from_model(model), 64, mode, native.load())
        sizes[tied] = weights.nbytes
    head = SHAPE["vocab_size"] * SHAPE["hidden_size"]
    # tiled keeps the embedding itself as the tied lm_head; q8 keeps an int8 copy either way
    assert sizes[False] - sizes[True] == (head * 4 if mode == "tiled" else 0)


def test_rotary_tables_match_the_models_own(tmp_path: Path) -> None:
    model = FAMILIES["llama3 rope scaling"]().eval()
    positions = torch.arange(300)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    got = Checkpoint.from_model(model).cos_sin(300, torch.float32)
    assert torch.allclose(got[0], cos[0], atol=1e-6) and torch.allclose(got[1], sin[0], atol=1e-6)


def test_a_directory_of_bin_weights_is_read_through_transformers(tmp_path: Path, smol_tokenizer) -> None:
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "vocab_size": len(smol_tokenizer)})).eval()
    model.save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    assert checkpoint.read(tmp_path, torch.device("cpu"), torch.float32) is None
    loaded = load(str(tmp_path))
    assert torch.equal(loaded.checkpoint.tensors["model.layers.1.mlp.up_proj.weight"],
                       model.state_dict()["model.layers.1.mlp.up_proj.weight"])


def test_engine_on_a_saved_qwen2_answers_as_transformers_does(tmp_path: Path, smol_tokenizer) -> None:
    """The whole path: a directory read without transformers' model, greedy text equal to generate()."""
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(Qwen2Config(**{**SHAPE, "vocab_size": len(smol_tokenizer)}, initializer_range=0.3))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # transformers starts them at zero
    model.eval().save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    ids = smol_tokenizer.encode("one two three four")
    with torch.inference_mode():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    with Engine(str(tmp_path), dtype="float32", ctx=128, slots=2, quiet=True) as engine:
        request = EngineRequest(prompt="one two three four", sampling=SamplingParams(max_tokens=12))
        events = list(engine.stream(request))
    assert isinstance(events[-1], Finish)
    text = "".join(e.text for e in events if hasattr(e, "text"))
    assert len(text) > 5 and text == smol_tokenizer.decode(expected, skip_special_tokens=True)


def test_dynamic_rotary_scaling_is_refused_past_the_trained_context(tmp_path: Path, smol_tokenizer) -> None:
    """``rope_type: dynamic`` grows the rotary's base as a prompt passes max_position_embeddings; mashbox
    ran the base one there, with --allow-long-context, answers not the model's and no word. Within the
    trained context the two are one and it runs; past it, it is refused naming why."""
    config = tiny_config(len(smol_tokenizer), max_position_embeddings=64,
                         rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    LlamaForCausalLM(config).eval().save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    with Engine(str(tmp_path), dtype="float32", ctx=64, slots=1, quiet=True) as engine:
        assert engine.complete(prompt="one two", max_tokens=3, temperature=0).usage.completion_tokens == 3
    with pytest.raises(ConfigError, match="dynamic"):
        Engine(str(tmp_path), dtype="float32", ctx=128, slots=1, quiet=True, allow_long_context=True)


def test_a_qwen2_config_of_transformers_4_keeps_its_sliding_windows(tmp_path: Path) -> None:
    """Configs written before transformers had ``layer_types`` say Qwen2's windows with ``use_sliding_window`` and
    ``max_window_layers``: they were read as no window at all (answers parted from transformers' after a few tokens)."""
    import json

    config = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop("layer_types", None)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    got = checkpoint.read(tmp_path, torch.device("cpu"), torch.float32)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    assert got is not None and got.windows == (0, 8)
