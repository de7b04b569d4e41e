"""A GGUF file read as it is: its metadata, and each tensor a view of the memory-mapped file.

Only the header is parsed (in well under a second, however large the file); a tensor's bytes are
touched when the kernels first read them, so memory and start-up follow what a step reads and the
page cache shares the weights between processes. ``checkpoint()`` gives the model as the runner
reads it: the shape and rotary frequencies from the metadata, float tensors (norms, biases) as fp32,
and every matrix as ``Blocks`` (``quant.py``) under its HF name, which the CPU kernels multiply as
they are and other forms dequantize on first use.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mashbox.engine.load.checkpoint import GEMMA_PATTERNS, SUPPORTED, Checkpoint, Spec, Tensors, rotary, sliding
from mashbox.engine.model import quant
from mashbox.errors import ModelLoadError

log = logging.getLogger("mashbox.engine")
MAGIC = b"GGUF"
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_FLOATS = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # ggml type -> torch dtype
_LAYER = {  # GGUF tensor -> HF name, in each layer
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GEMMA3 = {**_LAYER, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
           "post_ffw_norm": "post_feedforward_layernorm"}  # Gemma 3's norms around attention and the MLP
_PHI3 = {**_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # q, k, v in one; gate, up in one
_LAYERS = {"gemma2": _GEMMA3, "gemma3": _GEMMA3, "phi3": _PHI3}  # Gemma 2: Gemma 3's norms, no q/k norms
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
PERMUTED = ("llama", "smollm3", "granite")  # llama.cpp's converter interleaves their q and k rows (_unpermute)
UNMAPPED = ("smollm3", "granite")  # families transformers' GGUF reader has no config for: the loader reads
# their tokenizer as the file's vocabulary alone
NOPE_STEP = 4  # SmolLM3: every fourth layer turns neither q nor k (llama.cpp's step, not in the file)
GEMMA3_LOCAL_BASE = 10000.0  # the sliding-window layers' rotary base where the file has none (llama.cpp's)
GEMMA2_WINDOW = 4096  # Gemma 2's window where the file has none (llama.cpp's)
GEMMA_27B = {"gemma2": 46, "gemma3": 62}  # layers of the 27B models, whose scores llama.cpp scales by
# n_embd / n_head (their query_pre_attn_scalar), not by the head size


@dataclass(frozen=True, slots=True)
class TensorInfo:
    type: int  # ggml's type number
    shape: tuple[int, ...]  # rows first (the file lists ne0, the row width, first)
    offset: int  # from the start of the file


class GGUFFile:
    """The metadata and tensors of a GGUF file (v2 or v3), the file mapped once (privately: a page
    written by mistake is copied, never written back)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: never written back
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse()
        except (struct.error, ValueError, IndexError, UnicodeDecodeError) as err:
            raise ValueError(f"not a readable GGUF file ({type(err).__name__}: {err})") from err
        self._buffer = np.frombuffer(self._map, dtype=np.uint8)

    def _parse(self) -> None:
        data, at = self._map, 0
        if data[:4] != MAGIC:
            raise ValueError("no GGUF magic at its start")
        version, tensors, fields = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (mashbox reads 2 and 3)")
        at = 24
        for _ in range(fields):
            key, at = _string(data, at)
            (kind,), at = struct.unpack_from("<I", data, at), at + 4
            self.fields[key], at = _value(data, at, kind)
        infos = []
        for _ in range(tensors):
            name, at = _string(data, at)
            (dims,), at = struct.unpack_from("<I", data, at), at + 4
            shape, at = struct.unpack_from(f"<{dims}Q", data, at), at + 8 * dims
            kind, offset = struct.unpack_from("<IQ", data, at)
            at += 12
            infos.append((name, kind, tuple(reversed(shape)), offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-at // align) * align
        self.tensors = {name: TensorInfo(kind, shape, start + offset) for name, kind, shape, offset in infos}
        self._check_regions(start)

    def _check_regions(self, start: int) -> None:
        """Every tensor's bytes lie after the header, inside the file, none over another (a type or an
        offset changed by damage would otherwise be read as another tensor's bytes)."""
        regions = sorted((info.offset, info.offset + math.prod(_layout(info)), name)
                         for name, info in self.tensors.items())
        end = (len(self._map), len(self._map), "the end of the file")
        for (at, stop, name), (after, _, following) in zip(regions, [*regions[1:], end]):
            if at < start:
                raise ValueError(f"tensor {name} begins inside the header")
            if stop > after:
                raise ValueError(f"tensor {name} runs into {following} ({stop - after} bytes over)")

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes, uint8 [rows, row bytes] (a view of the file)."""
        info = self.tensors[name]
        rows, width = _layout(info)
        return torch.from_numpy(self._buffer[info.offset : info.offset + rows * width]).view(rows, width)

    def tensor(self, name: str) -> torch.Tensor | quant.Blocks:
        """A float tensor as fp32/fp16/bf16 in its shape, or a matrix as its blocks."""
        info = self.tensors[name]
        data = self.raw(name)
        if info.type in _FLOATS:
            return data.view(-1).view(_FLOATS[info.type]).view(info.shape)
        return quant.Blocks(info.type, data, info.shape[-1])

    def release(self) -> None:
        """Let go of the pages read so far: they leave the process's resident memory (the page cache
        keeps them); a page read again comes back from the file, as none was written."""
        self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self._buffer = None
        self._map.close()


def _string(data, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", data, at)
    return bytes(data[at + 8 : at + 8 + n]).decode("utf-8"), at + 8 + n


def _value(data, at: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(data, at)
    if kind == _ARRAY:
        inner, n = struct.unpack_from("<IQ", data, at)
        at += 12
        if inner in _SCALARS:  # read at once, as numbers
            size = struct.calcsize(_SCALARS[inner])
            return list(struct.unpack_from(f"<{n}{_SCALARS[inner]}", data, at)), at + n * size
        if inner == _STRING:
            return Strings.skip(data, at, n)
        values = []
        for _ in range(n):
            value, at = _value(data, at, inner)
            values.append(value)
        return values, at
    raise ValueError(f"unknown GGUF value type {kind}")


class Strings(Sequence[str]):
    """An array of strings in the header, each decoded when read: a vocabulary's 150k tokens and merges
    are walked past at load (the cached tokenizer has them), not decoded."""

    def __init__(self, data, starts: list[int]) -> None:
        self._data, self._starts = data, starts

    @classmethod
    def skip(cls, data, at: int, n: int) -> tuple[Strings, int]:
        starts = []
        for _ in range(n):
            starts.append(at)
            at += 8 + struct.unpack_from("<Q", data, at)[0]
        if at > len(data):
            raise ValueError("a string array runs past the end of the file")
        return cls(data, starts), at

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i):  # type: ignore[override]  # ints only
        return _string(self._data, self._starts[i])[0]


def _layout(info: TensorInfo) -> tuple[int, int]:
    """A tensor's rows and the bytes of each, as the file holds them."""
    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    return rows, _row_bytes(info.type, info.shape[-1])


def _row_bytes(kind: int, width: int) -> int:
    if kind in _FLOATS:
        return width * _FLOATS[kind].itemsize
    if kind in quant.FORMATS and kind != quant.MB_Q8:  # the kernels' own formats: gguf-py (~1 s to import) is not needed
        _, values, size = quant.FORMATS[kind]
    else:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            values, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except ValueError as err:
            raise ValueError(f"unknown tensor type {kind}") from err
    if width % values:
        raise ValueError(f"a row of {width} is not whole blocks of {values}")
    return width // values * size


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    parts, layer = name.split("."), _LAYERS.get(arch, _LAYER)
    if len(parts) == 2 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{parts[3]}"
    return None


def open_model(path: Path) -> GGUFFile:
    """The GGUF file at ``path``, its header read once, refused (ModelLoadError) where it does not
    read or holds an architecture mashbox cannot run."""
    try:
        gguf = GGUFFile(path)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"Cannot read the GGUF file '{path}': {err}") from err
    try:
        _whole(gguf)
        _supported(gguf)
    except ModelLoadError:
        gguf.close()
        raise
    return gguf


def _whole(gguf: GGUFFile) -> None:
    """A file that is one part of a model split by llama.cpp's gguf-split is refused, saying how to merge it."""
    parts = int(gguf.fields.get("split.count", 1))
    if parts > 1:
        part = int(gguf.fields.get("split.no", 0)) + 1
        raise ModelLoadError(f"'{gguf.path}' is part {part} of a model split in {parts} files (split.count); merge "
                             "them into one with llama.cpp's `llama-gguf-split --merge FIRST-PART.gguf MODEL.gguf` and "
                             "load MODEL.gguf")


def _supported(gguf: GGUFFile) -> str:
    arch = gguf.fields.get("general.architecture")
    if arch not in SUPPORTED:
        raise ModelLoadError(f"'{gguf.path}' holds a {arch!r} model; mashbox runs {', '.join(SUPPORTED)} models")
    return arch


def checkpoint(gguf: GGUFFile, device: torch.device, dtype: torch.dtype, lib: ctypes.CDLL | None) -> Checkpoint:
    """The model in a GGUF file (from ``open_model``), its matrices as blocks (``lib``: the kernels
    that dequantize them on first use as floats, where a form needs floats; gguf-py's numpy code
    without them)."""
    arch = _supported(gguf)
    meta = lambda key, default=None: gguf.fields.get(f"{arch}.{key}", default)
    heads, layers, width = (_needed(gguf, f"{arch}.{key}") for key in ("attention.head_count", "block_count",
                                                                         "embedding_length"))
    head_dim = int(meta("attention.key_length", width // heads))
    spec = Spec(num_layers=layers, num_heads=heads,
                num_kv_heads=int(meta("attention.head_count_kv", heads)), head_dim=head_dim,
                eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
                scale_dim=width // heads if GEMMA_27B.get(arch) == layers else 0,
                attn_scale=float(meta("attention.scale", 0.0)), softcap=float(meta("attn_logit_softcapping", 0.0)))
    inv_freq, long, original = _rotary(gguf, arch, meta, head_dim)  # what mashbox cannot run, said first
    _check_shapes(gguf, arch, spec, width, int(meta("attention.value_length", head_dim)))
    floats, found = _tensors(gguf, arch, spec)
    eos = [gguf.fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in gguf.fields]
    gemma = arch in GEMMA_PATTERNS  # its norms' weights were written as 1 + weight, as they multiply
    windows = _windows(meta, arch, spec.num_layers) if gemma else ()  # Phi-3's: unused, as in llama.cpp
    local_base = meta("rope.freq_base_swa", GEMMA3_LOCAL_BASE if arch == "gemma3" else None)
    local = rotary(float(local_base), head_dim).to(device) if windows and local_base else None
    rotated = tuple((i + 1) % NOPE_STEP != 0 for i in range(spec.num_layers)) if arch == "smollm3" else ()
    embed_scale = float(meta("embedding_length")) ** 0.5 if gemma else float(meta("embedding_scale", 1.0))
    return Checkpoint(arch, spec, "gelu_pytorch_tanh" if gemma else "silu", meta("context_length"),
                      inv_freq.to(device), float(meta("rope.scaling.attn_factor", 1.0)), tuple(int(i) for i in eos),
                      Tensors.of(floats, found, dtype, device, lib), found, gguf.release,
                      embed_scale=embed_scale, windows=windows, local_inv_freq=local,
                      long_inv_freq=None if long is None else long.to(device), original_ctx=original,
                      rotated=rotated, residual_scale=float(meta("residual_scale", 1.0)),
                      logit_scale=float(meta("logit_scale", 1.0)),
                      logit_softcap=float(meta("final_logit_softcapping", 0.0)))


def _needed(gguf: GGUFFile, key: str) -> int:
    value = gguf.fields.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"'{gguf.path}' lacks the metadata {key} (a whole number above 0; it has "
                             f"{value!r}): the file is damaged, or was written by a tool that left it out")
    return value


MODEL_TENSORS = ("token_embd.weight", "output_norm.weight")


def _layer_tensors(arch: str, fused: bool) -> list[str]:
    """The tensors each layer of ``arch`` must have (``fused``: q, k and v in one, ``attn_qkv``)."""
    return ["attn_norm", "ffn_norm", "attn_output", "ffn_up", "ffn_down",
            *([] if fused else ["attn_k", "attn_v"]),
            *([] if arch == "phi3" else ["ffn_gate"]),  # Phi-3's ffn_up holds gate and up
            *(["post_attention_norm", "post_ffw_norm"] if arch in GEMMA_PATTERNS else [])]


def _check_shapes(gguf: GGUFFile, arch: str, spec: Spec, width: int, v_dim: int) -> None:
    """The layers' tensors as the metadata describes them: each layer's attention there, none past the
    layer count, and the attention matrices of the heads it says (the kernels trust the head counts: a
    wrong one made them read and write past their buffers)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads
    rows = {"attn_q": q, "attn_k": kv * spec.head_dim, "attn_v": kv * v_dim,
            "attn_qkv": q + kv * (spec.head_dim + v_dim)}
    cols = {**dict.fromkeys(rows, width), "attn_output": spec.num_heads * v_dim}
    refuse = lambda why: ModelLoadError(f"'{gguf.path}' does not hold the {arch} model its metadata describes: "
                                        f"{why}; the file is damaged")
    for layer in range(spec.num_layers):
        if not any(f"blk.{layer}.{n}.weight" in gguf.tensors for n in ("attn_q", "attn_qkv")):
            raise refuse(f"it has no attention for layer {layer} of the {spec.num_layers} its block_count says")
        if missing := next((n for n in _layer_tensors(arch, f"blk.{layer}.attn_qkv.weight" in gguf.tensors)
                            if f"blk.{layer}.{n}.weight" not in gguf.tensors), None):  # one missing crashed a step
            raise refuse(f"it has no tensor blk.{layer}.{missing}.weight (layer {layer} of {spec.num_layers})")
    if missing := next((n for n in MODEL_TENSORS if n not in gguf.tensors), None):
        raise refuse(f"it has no tensor {missing}")
    for name, info in gguf.tensors.items():
        parts = name.split(".")
        if parts[0] != "blk" or len(parts) != 4 or parts[3] != "weight":
            continue
        if not parts[1].isdigit() or int(parts[1]) >= spec.num_layers:
            raise refuse(f"it has tensor {name}, past the {spec.num_layers} layers its block_count says")
        want = (rows.get(parts[2], info.shape[0]), cols.get(parts[2], info.shape[-1]))
        if len(info.shape) == 2 and info.shape != want:
            raise refuse(f"tensor {name} is {info.shape[0]} x {info.shape[1]}, where its head counts and sizes "
                         f"make it {want[0]} x {want[1]}")


def _windows(meta, arch: str, layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: none) of a Gemma: the file's window (Gemma 2's 4096 where it has
    none; a Gemma 3 without one has none) and pattern where it has one (a list, true: sliding; or n: every
    n-th layer global, 0: all sliding), else the family's n."""
    window = int(meta("attention.sliding_window", GEMMA2_WINDOW if arch == "gemma2" else 0))
    pattern = meta("attention.sliding_window_pattern", GEMMA_PATTERNS[arch])
    kinds = pattern if isinstance(pattern, list) else sliding(layers, int(pattern))
    return tuple(window if s else 0 for s in kinds) if window else ()


def _tensors(gguf: GGUFFile, arch: str, spec: Spec) -> tuple[dict[str, torch.Tensor], dict[str, quant.Blocks]]:
    """(float tensors, matrices as blocks) by HF name; a tied output is the embedding under both names."""
    floats, found = {}, {}
    for name in gguf.tensors:
        hf = hf_name(name, arch)
        if hf is None:
            continue
        value = gguf.tensor(name)
        if arch in PERMUTED and name.split(".")[-2] in ("attn_q", "attn_k"):  # the converter's rotary order undone
            value = _unpermute(value, spec.num_heads if "attn_q" in name else spec.num_kv_heads)
        (found if isinstance(value, quant.Blocks) else floats)[hf] = value
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    for table in (found, floats):
        if embed in table and head not in found and head not in floats:
            table[head] = table[embed]
    return floats, found


def _rotary(gguf: GGUFFile, arch: str, meta, head_dim: int) -> tuple[torch.Tensor, torch.Tensor | None, int | None]:
    """The rotary inverse frequencies (of the rotated part of a head), llama 3's per-frequency factors
    and linear scaling applied; LongRoPE's (Phi-3): those of the short factors, those of the long ones
    and the original context."""
    dims = int(meta("rope.dimension_count", head_dim))
    if dims != head_dim and arch in PERMUTED:  # its converter interleaves the rotated pairs: not undone here
        raise ModelLoadError(f"'{gguf.path}' rotates part of each head (partial rotary) of a {arch} model, "
                             "which mashbox does not run yet")
    inv_freq = rotary(float(meta("rope.freq_base", 10000.0)), dims)
    if "rope_freqs.weight" in gguf.tensors:  # llama 3's long-context factors, per frequency
        inv_freq = inv_freq / gguf.tensor("rope_freqs.weight").float()
    if "rope_factors_short.weight" in gguf.tensors:  # LongRoPE
        factors = lambda kind: gguf.tensor(f"rope_factors_{kind}.weight").float()
        original = int(meta("rope.scaling.original_context_length", meta("context_length")))
        return inv_freq / factors("short"), inv_freq / factors("long"), original
    scaling = meta("rope.scaling.type", "none")
    if scaling == "linear":
        return inv_freq / float(meta("rope.scaling.factor", 1.0)), None, None
    if scaling not in ("none", None):
        raise ModelLoadError(f"'{gguf.path}' uses {scaling} rotary scaling, which mashbox does not run yet")
    return inv_freq, None, None


def _unpermute(value: torch.Tensor | quant.Blocks, heads: int) -> torch.Tensor | quant.Blocks:
    """llama.cpp's converter interleaves each head's rotary halves of q and k: put the rows back (as
    transformers' LlamaTensorProcessor does)."""
    rows = value.rows if isinstance(value, quant.Blocks) else value.shape[0]
    order = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return value.select(order) if isinstance(value, quant.Blocks) else value[order].contiguous()
