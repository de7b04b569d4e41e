"""GET /v1/models: the one model this server runs, in OpenAI's shape or Anthropic's."""

from __future__ import annotations

from pathlib import PurePath
from typing import Literal

from mashbox.api.base import OutModel
from mashbox.engine.info import ModelInfo
from mashbox.server.settings import Settings

EPOCH = "1970-01-01T00:00:00Z"


class Model(OutModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: Literal["mashbox-labs"] = "mashbox-labs"
    created: int = 0
    max_model_len: int
    weights: str
    gb: float
    bpw: float
    prefix_cache: bool = True
    slots: int
    cache_ram_mib: int

    @classmethod
    def of(cls, info: ModelInfo, settings: Settings) -> Model:
        # the file's name only: its path would tell every client how this machine's disk is laid out
        return cls(id=info.id, max_model_len=info.ctx, weights=PurePath(info.weights).name, gb=round(info.gb, 3),
                   bpw=info.bpw, slots=info.slots, cache_ram_mib=settings.cache_ram_mib)


class ModelList(OutModel):
    object: Literal["list"] = "list"
    data: list[Model]


class AnthropicModel(OutModel):
    """Anthropic's ModelInfo, for clients that send ``anthropic-version``."""

    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str = EPOCH
    lifecycle: Literal["active"] = "active"
    max_input_tokens: int

    @classmethod
    def of(cls, info: ModelInfo) -> AnthropicModel:
        return cls(id=info.id, display_name=info.id, max_input_tokens=info.ctx - 1)  # one is the answer's


class AnthropicModelList(OutModel):
    data: list[AnthropicModel]
    has_more: bool = False
    first_id: str
    last_id: str

    @classmethod
    def of(cls, info: ModelInfo) -> AnthropicModelList:
        return cls(data=[AnthropicModel.of(info)], first_id=info.id, last_id=info.id)
