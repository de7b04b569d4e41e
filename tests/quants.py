"""GGUF blocks for tests: random blocks of each format the kernels read, tiny models written as GGUF
files (gguf-py's writer) whose matrices are such blocks, with the SmolLM2 tokenizer, and the checks
that such a file runs as its model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tiny import generate, greedy, last_logits, logits

from mashbox.engine.load.catalog import resolve
from mashbox.engine.load.checkpoint import rotary
from mashbox.engine.load.gguf_file import PERMUTED, checkpoint, open_model
from mashbox.engine.model import quant
from mashbox.engine.model.runner import ModelRunner

FORMATS = {name: fmt for fmt, (name, _, _) in quant.FORMATS.items() if fmt != quant.MB_Q8}
SCALE = {"Q4_0": 2e-3, "Q4_1": 2e-3, "Q5_0": 1e-3, "Q5_1": 1e-3, "Q8_0": 2e-4, "Q4_K": 1e-4, "Q5_K": 5e-5, "Q6_K": 5e-5,
         "Q2_K": 1e-3, "Q3_K": 3e-4, "IQ4_NL": 2e-3}
UNKERNELED = {"Q2_K": (80, 82), "Q3_K": (108,), "IQ4_NL": (0,)}  # formats the kernels do not read: where their
# fp16 scales are in a block (Q2_K's second, its min's, taken off)
MIDDLE = {"Q4_1": 7.5, "Q5_1": 15.5, "Q4_K": 7.5, "Q5_K": 15.5}  # the mid quant, taken off by the min


def random_blocks(name: str, rows: int, k: int, seed: int) -> quant.Blocks:
    """``rows`` x ``k`` weights in format ``name``: random quants, random scales in a sane range, and
    where the format has mins, mins that centre the weights on 0 (as a real model's are); every
    byte a valid block."""
    fmt, values, size = _format(name)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, k // values, size), generator=g, dtype=torch.uint8)
    d = (torch.rand(rows, k // values, generator=g) + 0.5) * SCALE[name]
    put = lambda at, value: raw[..., at : at + 2].copy_(value.half().unsqueeze(-1).view(torch.uint8))
    if name in UNKERNELED:
        for at, sign in zip(UNKERNELED[name], (1, -0.25)):
            put(at, sign * d)
    elif name == "Q6_K":
        put(208, d)
    elif name in ("Q4_K", "Q5_K"):  # each sub-block's 6-bit min equal to its scale: w = d sc (q - middle)
        put(0, d)
        put(2, d * MIDDLE[name])
        sc = torch.randint(1, 64, (rows, k // values, 8), generator=g, dtype=torch.uint8)
        raw[..., 4:16] = _scales_k4(sc, sc)
    else:
        put(0, d)
        if name in MIDDLE:
            put(2, -d * MIDDLE[name])
    return quant.Blocks(fmt, raw.view(rows, -1).contiguous(), k)


def _format(name: str) -> tuple[int, int, int]:
    """A format's GGML type, values and bytes a block (gguf-py's, for those the kernels do not read)."""
    if name in FORMATS:
        return FORMATS[name], *quant.FORMATS[FORMATS[name]][1:]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType[name]
    return int(kind), *GGML_QUANT_SIZES[kind]


def _scales_k4(sc: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins as Q4_K and Q5_K pack them in 12 bytes."""
    out = torch.empty(*sc.shape[:-1], 12, dtype=torch.uint8)
    out[..., 0:4] = sc[..., :4] | (sc[..., 4:] >> 4) << 6
    out[..., 4:8] = mins[..., :4] | (mins[..., 4:] >> 4) << 6
    out[..., 8:12] = (sc[..., 4:] & 15) | (mins[..., 4:] & 15) << 4
    return out


def write_gguf(path: Path, arch: str, config, matrices: dict[str, quant.Blocks], floats: dict[str, torch.Tensor],
               numbers: dict[str, int] | None = None) -> Path:
    """A GGUF model file: ``matrices`` (GGUF names) as their blocks, ``floats`` (norms, biases) as fp32,
    the metadata of ``config`` (a transformers config), ``numbers`` (more fields: uint32, float32 for
    floats; None: left out) and the SmolLM2 tokenizer's fields."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or rope.get("full_attention", rope)["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    for key, value in (numbers or {}).items():
        if value is None:  # a field the model has not: left out, as a converter leaves it
            continue
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(key, value)
    source = GGUFReader(str(resolve("smollm2-135m").path))
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        value = field.contents()
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    for name, blocks in matrices.items():
        writer.add_tensor(name, blocks.data.numpy(), raw_dtype=GGMLQuantizationType(blocks.fmt))
    for name, tensor in floats.items():
        writer.add_tensor(name, tensor.float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GEMMA3 = {**_LAYER, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
           "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
           "post_feedforward_layernorm": "post_ffw_norm"}
_PHI3 = {**_LAYER, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_LAYERS = {"gemma2": _GEMMA3, "gemma3": _GEMMA3, "phi3": _PHI3}


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYERS.get(arch, _LAYER)[module]}.{kind}"


def tiny_gguf(path: Path, model: torch.nn.Module, arch: str, formats: list[str], seed: int = 0) -> Path:
    """Write ``model`` (a tiny transformers model of one of the families, its matrices a multiple of 256 wide)
    as a GGUF whose matrices are random blocks, cycling through ``formats`` (the embedding in Q8_0), and
    set the model's own weights to what those blocks hold, so that it is the reference for the file.
    Gemma's norms are written as llama.cpp's converter writes them (1 + weight), with its head size,
    sliding window and (Gemma 3) the window layers' rotary base; Phi-3's rotated dimensions and LongRoPE factors as its converter writes them."""
    matrices, floats, turn = {}, {}, 0
    config, numbers = model.config, {}
    if arch in ("gemma2", "gemma3"):
        numbers = {f"{arch}.attention.key_length": config.head_dim, f"{arch}.attention.value_length": config.head_dim,
                   f"{arch}.attention.sliding_window": config.sliding_window}
    if arch == "gemma3":  # its window layers' rotary base, as the converter writes it
        numbers[f"{arch}.rope.freq_base_swa"] = float(config.rope_parameters["sliding_attention"]["rope_theta"])
    if arch == "gemma2":  # its soft caps, where it has them
        numbers |= {f"gemma2.{cap}": float(getattr(config, cap)) for cap in ("attn_logit_softcapping",
                    "final_logit_softcapping") if getattr(config, cap)}
    if arch == "phi3":
        numbers = _phi3_fields(model, floats)
    if arch == "granite":  # its multipliers, under the names llama.cpp's converter gives them
        numbers = {"granite.embedding_scale": config.embedding_multiplier, "granite.residual_scale":
                   config.residual_multiplier, "granite.attention.scale": config.attention_multiplier,
                   "granite.logit_scale": config.logits_scaling}
    with torch.no_grad():
        for hf, param in model.state_dict().items():
            if hf == "lm_head.weight" and config.tie_word_embeddings:
                continue
            name = gguf_name(hf, arch)
            if param.dim() == 1:
                floats[name] = param + 1 if arch in ("gemma2", "gemma3") and "norm" in name else param.clone()
                continue
            fmt = "Q8_0" if hf == "model.embed_tokens.weight" else formats[turn % len(formats)]
            turn += hf != "model.embed_tokens.weight"
            blocks = random_blocks(fmt, param.shape[0], param.shape[1], seed + turn)
            param.copy_(quant.dequantize(blocks, None))
            if arch in PERMUTED and name.split(".")[-2] in ("attn_q", "attn_k"):  # the file's rotary order
                heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
                blocks = blocks.select(_permute(param.shape[0], heads))
            matrices[name] = blocks
        scaled = model.model.rotary_emb
        if getattr(scaled, "rope_type", "default") == "llama3":  # the converter's per-frequency factors
            plain = rotary(config.rope_parameters["rope_theta"], config.hidden_size // config.num_attention_heads)
            floats["rope_freqs.weight"] = plain / scaled.inv_freq
    return write_gguf(path, arch, config, matrices, floats, numbers)


def random_prompts(lengths: tuple[int, ...], seed: int = 3) -> list[list[int]]:
    """Prompts of these lengths, random ids of the SmolLM2 vocabulary (past its first specials)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


PROMPTS = (70, 130, 300, 90, 65, 200)  # prompt lengths of exact_gguf's answers


def exact_gguf(path: Path, model: torch.nn.Module, arch: str, formats: list[str], lib) -> tuple[
        list[list[int]], list[list[int]], torch.Tensor]:
    """``model`` written as a GGUF at ``path`` (``tiny_gguf``), and checked: dequantized (the plain form)
    it answers random prompts of ``PROMPTS``'s lengths as transformers does, each answer its own, and
    gives its logits after the first prompt's first 40 tokens. Returns (prompts, transformers'
    answers, those logits)."""
    tiny_gguf(path, model, arch, formats)
    prompts = random_prompts(PROMPTS)
    expected = [generate(model, p) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(prompts)
    plain = gguf_runner(path, lib, "plain")
    assert greedy(plain, prompts) == expected
    exact = logits(model, prompts[0][:40])
    assert torch.allclose(last_logits(plain, prompts[0][:40]), exact, rtol=1e-4, atol=1e-4)
    return prompts, expected, exact


def gguf_runner(path: Path, lib, form: str) -> ModelRunner:
    """The model of a GGUF file in 4 slots of 512, as ``form`` runs it: ``plain`` (dequantized, the
    exact float form) or ``gguf`` (its blocks, the kernels' form)."""
    return ModelRunner(checkpoint(open_model(path), torch.device("cpu"), torch.float32, lib), num_slots=4, ctx=512,
                       form=form)


def blocks_agree(runner: ModelRunner, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """A runner of the kernels' form: every answer the same alone and batched (prompts cut beside
    decoding rows), the same through the general path as through the fused layers, and mostly the
    exact form's (``expected``: the first 4 tokens of 4 answers of 6)."""
    batched = greedy(runner, prompts)
    assert [greedy(runner, [p])[0] for p in prompts] == batched
    runner._fused = None
    assert greedy(runner, prompts) == batched
    assert sum(a[:4] == b[:4] for a, b in zip(batched, expected)) >= 4


def _phi3_fields(model, floats: dict[str, torch.Tensor]) -> dict[str, int | float]:
    """Phi-3's rotated dimensions and, for LongRoPE, its factors (into ``floats``), attention factor and
    original context, as llama.cpp's converter writes them."""
    rope = model.config.rope_parameters
    numbers: dict[str, int | float] = {"phi3.rope.dimension_count": 2 * model.model.rotary_emb.inv_freq.numel()}
    if rope.get("rope_type") == "longrope":
        floats["rope_factors_long.weight"] = torch.tensor(rope["long_factor"])
        floats["rope_factors_short.weight"] = torch.tensor(rope["short_factor"])
        numbers["phi3.rope.scaling.attn_factor"] = float(model.model.rotary_emb.attention_scaling)
        numbers["phi3.rope.scaling.original_context_length"] = rope["original_max_position_embeddings"]
    return numbers


def _permute(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp's converter's order of q or k rows: each head's rotary halves interleaved."""
    return torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
