"""The kernels over a GGUF's own blocks: each format against gguf-py's dequantization, the batch
invariance they promise, and whole models read straight from a GGUF file."""


import ctypes
import logging

import pytest
import torch
from quants import FORMATS, blocks_agree, gguf_runner, random_blocks, random_prompts, tiny_gguf, write_gguf
from tiny import generate, greedy
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mashbox import Engine
from mashbox.engine.load.gguf_file import GGUFFile, checkpoint, open_model
from mashbox.engine.model import quant
from mashbox.engine.model.runner import ModelRunner
from mashbox.engine.model.weights import Linear
from mashbox.errors import ModelLoadError


def int8_rows(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x as the kernels see it: each block of 32 (of 256 against the K-quants, as llama.cpp's Q8_K) as
    int8 times max |x| / 127."""
    xb = x.view(x.shape[0], -1, block)
    xs = xb.abs().amax(-1) / 127
    return (torch.round(xb / torch.where(xs > 0, xs, 1)[..., None]) * xs[..., None]).view_as(x)


@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_is_gguf_pys_to_the_bit(lib, name):
    blocks = random_blocks(name, 37, 512, seed=1)
    ours = quant.dequantize(blocks, lib)
    assert torch.equal(ours, quant.dequantize(blocks, None)), "the kernels and gguf-py disagree"
    rows = torch.tensor([36, 0, 5, 5])
    assert torch.equal(quant.dequantize(blocks, lib, rows), ours[rows])


SHAPES = [(37, 256), (64, 512), (203, 1536), (24, 96)]  # partial groups of rows, long rows, an odd count of blocks


@pytest.mark.parametrize("name,n,k", [(name, n, k) for name, fmt in FORMATS.items() for n, k in SHAPES
                                      if k % quant.FORMATS[fmt][1] == 0])
def test_matmul_over_blocks_is_exact_and_each_row_stands_alone(lib, name, n, k):
    blocks = random_blocks(name, n, k, seed=n + k)
    weight = quant.dequantize(blocks, lib)
    linear = Linear("blocks", lib=lib, parts=[blocks])
    assert linear.shape == (n, k) and linear.formats == [name]
    x = torch.randn(57, k, generator=torch.Generator().manual_seed(k))
    out = linear(x)
    expected = (int8_rows(x, quant.FORMATS[FORMATS[name]][1]).double() @ weight.double().T).float()
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
    # tiles of 8 rows, 4 and fewer; as loaded up to 16 or 32; on AMX 16 rows a tile from 16 or 48 on, fewer left
    for rows in (*range(1, 10), 12, 16, 17, 32, 33, 48, 55):
        assert torch.equal(linear(x[:rows]), out[:rows]), f"a row changed with {rows} rows"
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(linear(x), out), f"the output changed on {t} threads"
    finally:
        torch.set_num_threads(threads)


def test_parts_of_several_formats_are_one_matmul(lib):
    parts = [random_blocks("Q5_0", 24, 256, 1), random_blocks("Q4_K", 13, 256, 2), random_blocks("Q6_K", 8, 256, 3)]
    linear = Linear("blocks", lib=lib, parts=parts)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    alone = torch.cat([Linear("blocks", lib=lib, parts=[p])(x) for p in parts], dim=1)
    assert linear.shape == (45, 256) and torch.equal(linear(x), alone)


def test_float_weights_become_int8_blocks_close_to_them(lib):
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
    blocks = quant.quantize(lib, weight)
    assert blocks.name == "int8" and blocks.data.shape == (40, 96 // 32 * 36)
    back = quant.dequantize(blocks, lib)
    assert torch.equal(back, quant.dequantize(blocks, None))
    assert (back - weight).abs().max() <= weight.abs().max() / 127
    out = Linear("blocks", lib=lib, parts=[blocks])(weight[:3])
    assert torch.allclose(out, int8_rows(weight[:3]) @ back.T, rtol=1e-4, atol=1e-3)


def test_a_gguf_tensor_is_a_view_of_the_file(tmp_path):
    model = _tiny(LlamaConfig, LlamaForCausalLM)
    path = tiny_gguf(tmp_path / "m.gguf", model, "llama", ["Q4_K"])
    f = GGUFFile(path)
    info = f.tensors["blk.0.ffn_down.weight"]
    assert info.type == FORMATS["Q4_K"] and info.shape == (256, 512)
    blocks = f.tensor("blk.0.ffn_down.weight")
    assert blocks.data.data_ptr() == f._buffer.ctypes.data + info.offset  # mapped, not copied
    assert f.fields["general.architecture"] == "llama" and f.fields["llama.block_count"] == 2


def _tiny(config_cls, model_cls, **extra):
    torch.manual_seed(0)
    config = config_cls(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, **extra)
    return model_cls(config).eval()


LLAMA3 = dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
MODELS = {"llama": lambda: _tiny(LlamaConfig, LlamaForCausalLM), "qwen2": lambda: _tiny(Qwen2Config, Qwen2ForCausalLM),
          "llama3": lambda: _tiny(LlamaConfig, LlamaForCausalLM, **LLAMA3)}  # Llama 3.2 1B's form, tied


@pytest.mark.parametrize("name,formats", [("llama", ["Q4_K", "Q6_K", "Q5_K", "Q8_0"]),
                                          ("qwen2", ["Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q6_K"]),
                                          ("llama3", ["Q4_K", "Q6_K", "Q8_0"])])
def test_a_gguf_model_runs_from_its_blocks(tmp_path, lib, name, formats):
    """Read straight from the file: dequantized (the exact float form) it answers token for token as
    transformers does on the same weights (names, llama's rotary order, biases, the tied embedding,
    the metadata, Llama 3's rotary factors); as blocks, the kernels' form, every answer is the same
    alone and batched, fused or not, and mostly the exact form's."""
    model, arch = MODELS[name](), "qwen2" if name == "qwen2" else "llama"
    path = tiny_gguf(tmp_path / f"{name}.gguf", model, arch, formats)
    assert ("rope_freqs.weight" in GGUFFile(path).tensors) == (name == "llama3")
    prompts = random_prompts((1, 5, 40, 130, 300, 17))
    expected = [generate(model, p) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(prompts)
    assert greedy(gguf_runner(path, lib, "plain"), prompts) == expected

    ckpt = checkpoint(open_model(path), torch.device("cpu"), torch.float32, lib)
    assert ckpt.blocks["lm_head.weight"] is ckpt.blocks["model.embed_tokens.weight"]
    runner = ModelRunner(ckpt, num_slots=4, ctx=512, form="gguf")
    assert {f for layer in runner.weights.layers for lin in (layer.qkv_proj, layer.o, layer.gate_up, layer.down)
            for f in lin.formats} == set(formats)
    assert runner.weights.lm_head.formats == ["Q8_0"] and runner.weights.embed.blocks is not None
    assert runner._fused is not None and runner.cut_anywhere
    assert not [n for n in ckpt.tensors._loaded if n in ckpt.blocks], "a float copy of the blocks was made"
    blocks_agree(runner, prompts, expected)


def test_formats_without_kernels_run_widened_and_are_named(tmp_path, lib, caplog):
    """A Q3_K_M or Q2_K file (common where memory is short) or an IQ4_NL one: the matrices the kernels do not read
    are widened to int8 blocks, said in the log, and the model answers as its exact form does."""
    model = MODELS["llama"]()
    path = tiny_gguf(tmp_path / "low.gguf", model, "llama", ["Q3_K", "Q2_K", "Q4_K", "IQ4_NL", "Q6_K"])
    prompts = random_prompts((1, 5, 40, 130, 300, 17))
    expected = [generate(model, p) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(prompts)
    assert greedy(gguf_runner(path, lib, "plain"), prompts) == expected
    with caplog.at_level(logging.INFO, logger="mashbox.engine"):
        runner = gguf_runner(path, lib, "gguf")
    assert "weights in IQ4_NL, Q2_K, Q3_K have no kernel here: widened to int8 blocks at load" in caplog.text
    blocks_agree(runner, prompts, expected)


def test_a_gguf_matrix_stored_as_floats_is_said_to_be_quantized_at_load(tmp_path, lib, monkeypatch, caplog):
    """An F16/BF16/F32 file's matrices were quantized to int8 blocks without a word (a fallback the log
    names for every other format)."""
    import quants

    def floated(path, arch, config, matrices, floats, numbers=None):
        floats = {**floats, "blk.0.ffn_down.weight": quant.dequantize(matrices.pop("blk.0.ffn_down.weight"), None)}
        return write_gguf(path, arch, config, matrices, floats, numbers)

    monkeypatch.setattr(quants, "write_gguf", floated)
    path = tiny_gguf(tmp_path / "floats.gguf", _tiny(LlamaConfig, LlamaForCausalLM), "llama", ["Q4_K"])
    with caplog.at_level(logging.INFO, logger="mashbox.engine"):
        ModelRunner(checkpoint(open_model(path), torch.device("cpu"), torch.float32, lib), 1, 256, "gguf")
    assert "1 matrices stored as floats have no kernel here: quantized to int8 blocks at load" in caplog.text


def test_the_engine_runs_a_gguf_it_was_given(tmp_path, monkeypatch):
    monkeypatch.setenv("MASHBOX_CACHE", str(tmp_path / "cache"))  # its tokenizer copy lands there
    model = _tiny(Qwen2Config, Qwen2ForCausalLM)
    path = tiny_gguf(tmp_path / "tiny.gguf", model, "qwen2", ["Q4_K", "Q6_K"])
    with Engine(str(path), slots=2, ctx=256, quiet=True) as engine:
        names, _, rest = engine.info.dtype.partition(" blocks")
        assert set(names.split(" + ")) == {"Q4_K", "Q6_K", "Q8_0"} and rest == ", float32 activations"
        assert engine.info.weights_mode == "blocks"
        answer = engine.complete(prompt="The three largest planets are", max_tokens=8, temperature=0)
        assert answer.usage.completion_tokens == 8
    assert [p.name.endswith("-tokenizer") for p in (tmp_path / "cache" / "converted").iterdir()] == [True]


REFUSED = "'mamba' model; mashbox runs llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, smollm3, granite"


@pytest.mark.parametrize("arch,numbers,says", [
    ("mamba", {}, REFUSED),
    ("llama", {"llama.rope.dimension_count": 32}, "partial rotary"),
])
def test_a_gguf_mashbox_cannot_run_is_refused_before_loading(tmp_path, arch, numbers, says):
    model = _tiny(LlamaConfig, LlamaForCausalLM)
    path = write_gguf(tmp_path / "m.gguf", arch, model.config, {}, {}, numbers)
    with pytest.raises(ModelLoadError, match=says):
        checkpoint(open_model(path), torch.device("cpu"), torch.float32, None)


def test_a_gguf_of_another_architecture_is_refused_before_its_tokenizer_is_read(tmp_path, monkeypatch):
    """Engine("mamba.gguf") says the architecture and the supported ones, and makes no tokenizer copy."""
    monkeypatch.setenv("MASHBOX_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "mamba.gguf", "mamba", _tiny(LlamaConfig, LlamaForCausalLM).config, {}, {}, {})
    with pytest.raises(ModelLoadError, match=REFUSED):
        Engine(str(path), slots=1, ctx=64, quiet=True)
    assert not (tmp_path / "cache" / "converted").exists()


@pytest.mark.parametrize("name", ["Q8_0", "Q6_K"])
def test_an_output_too_large_for_the_caches_has_the_bits_of_a_small_one(lib, name):
    """An lm_head's logits for 16 rows (8 MB and more) are stored past the caches: the same bits as each
    row alone, whose output is stored as usual; the last group partial."""
    blocks = random_blocks(name, 2 ** 17 + 5, 256, seed=3)
    linear = Linear("blocks", lib=lib, parts=[blocks])
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    out = linear(x)
    assert out.nbytes >= 8 << 20
    for r in (0, 7, 15):
        assert torch.equal(out[r], linear(x[r : r + 1])[0]), f"row {r} differs from the row alone"


@pytest.mark.parametrize("name", FORMATS)
def test_packed_blocks_give_the_bits_of_the_files_blocks(lib, name):
    """The kernels read a packed copy (the same bytes rearranged, ``quant.pack``): every output bit is
    what the blocks as the file has them give, at 1 to 4, 16, 17, 32 and 33 rows (a tile at a time as loaded,
    or a decoded group), on partial groups and odd block counts."""
    fmt = FORMATS[name]
    for n, k in [(37, 256), (9, 768), (24, 96)]:
        if k % quant.FORMATS[fmt][1]:
            continue
        blocks = random_blocks(name, n, k, seed=n)
        packed = quant.pack(blocks, lib)
        if not lib.mb_packed_bytes(fmt, n, k):  # kernels built without AVX2 read the file's layout only
            assert packed is blocks
            continue
        assert packed.packed and packed.rows == n and packed.name == name
        assert packed.data.nbytes <= blocks.data.nbytes * 1.2 + 16 * quant.FORMATS[fmt][2] * k
        x = torch.randn(57, k, generator=torch.Generator().manual_seed(k))
        for rows in (1, 2, 3, 4, 16, 17, 32, 33, 57):
            out = [torch.empty(rows, n) for _ in range(2)]
            for b, y in zip((blocks, packed), out):
                parts = quant.Parts.of([b])
                lib.mb_matmul(x[:rows].data_ptr(), ctypes.addressof(parts), y.data_ptr(), rows, k)
            assert torch.equal(out[0], out[1]), f"{name} {n}x{k}: packed differs at {rows} rows"
