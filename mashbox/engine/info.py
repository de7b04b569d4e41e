"""What a loaded model is: a plain record, importable without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ModelInfo:
    id: str
    ctx: int
    slots: int
    weights: str
    bpw: float
    gb: float
    device: str
    dtype: str
    weights_mode: str
