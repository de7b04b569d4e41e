"""How a model runs on its device, decided in one place: ``Form``.

The device, the dtype its floats are read in, the form of its matrices (``mode``), the KV cache's
form (``kv``) and what follows from them: whether mashbox's CPU kernels run it, the per-row ops,
the KV cache's dtype and rows, whether attention multiplies in bf16, and how the info names the
weights. ``decide()`` takes what a user asked for (``EngineConfig.dtype``, ``kv_dtype``,
``batch_invariant``); the runner and the engine read the rest from the ``Form``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from mashbox.engine.model import native, ops
from mashbox.errors import ConfigError

if TYPE_CHECKING:
    from mashbox.engine.model.weights import Weights

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
INT8 = ("int8", "q8")
NATIVE_MODES = ("gguf", "q8", "packed")  # modes whose models run on mashbox's CPU kernels (NativeOps)


@dataclass(frozen=True, slots=True)
class Form:
    """``mode``: ``gguf``, a GGUF's blocks as the file has them and int8 blocks for every other
    weight (mashbox's CPU kernels); ``q8``, int8 blocks for all; ``packed``, fp16 packed for fbgemm;
    ``plain``, one torch matmul; ``tiled``, torch matmuls of fixed tiles (batch invariant).
    ``kv``: the KV cache's form asked for: None (the default below), ``f16`` or ``q8_0``."""

    device: torch.device
    dtype: torch.dtype
    mode: str
    kv: str | None = None

    @property
    def lib(self) -> ctypes.CDLL | None:
        """mashbox's CPU kernels, where this form runs on them."""
        return native.load() if self.device.type == "cpu" and self.mode in NATIVE_MODES else None

    def ops(self) -> ops.TorchOps:
        lib = self.lib
        return ops.NativeOps(lib) if lib is not None else ops.TorchOps()

    @property
    def kv_dtype(self) -> torch.dtype:
        """float16 beside mashbox's CPU kernels or where asked, else the floats' dtype; q8_0 rows
        are bytes."""
        if self.kv == "q8_0":
            return torch.uint8
        return torch.float16 if self.lib is not None or self.kv == "f16" else self.dtype

    @property
    def kv_name(self) -> str:
        """The KV cache's form as a user names it: q8_0, or its floats' dtype."""
        return "q8_0" if self.kv == "q8_0" else str(self.kv_dtype).removeprefix("torch.")

    def kv_row(self, head_dim: int) -> int:
        """Elements of ``kv_dtype`` that one position of one KV head takes: ``head_dim``, or for
        q8_0 ``head_dim`` int8 and an fp16 scale for each 32 (as ggml's q8_0 blocks)."""
        return head_dim + head_dim // 16 if self.kv == "q8_0" else head_dim

    @property
    def bf16_attention(self) -> int:
        """1 where attention may multiply in bf16 pairs: the quantized forms, whose weights round far
        more; the float16 form keeps fp32 attention, like its reference (fp16 weights)."""
        return int(self.mode in ("gguf", "q8"))

    def describe(self, weights: Weights) -> tuple[str, str]:
        """(what the weights are, the weights mode) for the info: block formats from the most bytes
        (e.g. "Q4_K + Q6_K blocks, float32 activations"), or a float form's dtype."""
        counts: dict[str, int] = {}
        for lin in weights.linears:
            for part in lin.parts:
                counts[part.name] = counts.get(part.name, 0) + part.data.nbytes
        modes = {lin.mode for lin in weights.linears}
        if counts:
            names = sorted(counts, key=lambda name: -counts[name])
            what = " + ".join(names) + " blocks" + ("" if modes == {"blocks"} else " (float elsewhere)")
            return what + ", float32 activations", "blocks"
        if modes == {"packed"}:
            return "float16 (packed) weights, float32 activations", "packed"
        return str(self.dtype).removeprefix("torch."), weights.linears[0].mode


def decide(device: torch.device, dtype: str | None, batch_invariant: bool, kv_dtype: str | None = None) -> Form:
    """The form for a device, the dtype and the KV cache's form asked for (q8_0 only where
    mashbox's CPU kernels run the model: they write and read its rows)."""
    form = replace(_weights(device, dtype, batch_invariant), kv=kv_dtype)
    if kv_dtype == "q8_0" and form.lib is None:
        raise ConfigError("kv_dtype: q8_0 needs mashbox's CPU kernels (a CPU device, and int8 or GGUF weights)"
                          f"{_kernels_off(device)}; use f16")
    return form


def _weights(device: torch.device, dtype: str | None, batch_invariant: bool) -> Form:
    """The form of the weights for a device and the dtype asked for.

    On CPU the default is mashbox's own kernels (fp32 activations), where a C compiler could build
    them: a GGUF's blocks as the file has them, int8 blocks for every other weight (``gguf``); else
    fp16 weights packed for fbgemm. ``int8`` asks for int8 blocks everywhere (``q8``), ``float16``
    for the packed form, ``float32`` keeps exact fp32 weights. On CUDA the default is bfloat16.
    """
    if device.type != "cpu":
        if dtype in INT8:  # it named int8 among the dtypes it knows
            raise ConfigError(f"dtype: {dtype} weights need mashbox's CPU kernels; on {device.type} use bfloat16, "
                              "float16 or float32")
        return Form(device, pick_dtype(dtype, device), "plain")
    if dtype in (None, *INT8) and native.load() is not None:
        return Form(device, torch.float32, "gguf" if dtype is None else "q8")
    if dtype in INT8:
        raise ConfigError(f"dtype: int8 weights need mashbox's CPU kernels{_kernels_off(device)}; use float16 "
                          "or float32")
    from mashbox.engine.model.weights import fbgemm_available

    asked = None if dtype is None else pick_dtype(dtype, device)
    if asked in (None, torch.float16) and fbgemm_available():
        return Form(device, torch.float32, "packed")
    if asked not in (None, torch.float16, torch.float32):
        choices = "int8, float16 (packed)" if native.load() is not None else "float16 (packed)"
        raise ConfigError(f"dtype: {dtype!r} is not supported on CPU; use {choices} or float32")
    return Form(device, torch.float32, "tiled" if batch_invariant else "plain")


def _kernels_off(device: torch.device) -> str:
    """Why mashbox's CPU kernels are not there, for a refusal that needs them ("" where they are)."""
    if device.type != "cpu" or native.load() is not None:
        return ""
    return f", which are off here ({native.off() or 'their build failed: the log says why'})"


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The given dtype, else bfloat16 on CUDA and float32 elsewhere."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.lower().removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not one mashbox knows; use one of {', '.join([*_DTYPES, *INT8])}")
    return _DTYPES[name]
