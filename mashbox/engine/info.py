"""What a loaded model is: a plain record, importable without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ModelInfo:
    id: str
    ctx: int
    slots: int
    weights: str  # the file (or directory) name, not its path: notebooks and clients see it
    bpw: float
    gb: float
    device: str
    dtype: str
    weights_mode: str
    kv_dtype: str = "float16"  # the KV cache's form: q8_0, or its floats' dtype
    source: str = ""  # a hash of the weights' path and each of their files' stamps: which bytes were loaded
