"""A model as the runner reads it: its shape, its rotary frequencies and its tensors by name.

``read()`` takes it straight from an HF directory's ``config.json`` and safetensors files
(each tensor read on first use; no model object built: a fraction of a second, where building the
transformers model costs over a second of imports alone); ``from_model()`` takes it from a
transformers model already in memory (a directory of ``.bin`` files, the tests' tiny models);
``gguf_file.checkpoint()`` from a GGUF, its matrices as ``blocks`` whose floats are read only where
a form needs them. Tensor names are the HF ones (``model.layers.0.self_attn.q_proj.weight``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch

from mashbox.engine.model import quant
from mashbox.errors import ModelLoadError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "granite")
TYPES = {"gemma3_text": "gemma3"}  # transformers' model type -> the GGUF architecture it is
GEMMA_PATTERNS = {"gemma2": 2, "gemma3": 6}  # every n-th layer attends to all positions, the others to a window
_NEEDED = ("model.embed_tokens.weight", "model.norm.weight")
_QUERIES = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.qkv_proj.weight")  # one of them


@dataclass(slots=True, frozen=True)
class Spec:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale_dim: int = 0  # attention scores are scaled by its inverse square root (0: head_dim's)
    attn_scale: float = 0.0  # or by this, where the model names it (Granite's attention multiplier)
    softcap: float = 0.0  # scaled scores s become softcap tanh(s / softcap) (Gemma 2); 0: as they are

    @property
    def scale(self) -> float:
        return self.attn_scale or (self.scale_dim or self.head_dim) ** -0.5


@dataclass(slots=True, frozen=True)
class Checkpoint:
    model_type: str
    spec: Spec
    hidden_act: str
    trained_ctx: int | None  # max_position_embeddings
    inv_freq: torch.Tensor  # rotary inverse frequencies [head_dim / 2], fp32
    rope_scale: float  # applied to cos and sin
    eos_ids: tuple[int, ...]  # from the generation config
    tensors: Tensors
    blocks: dict[str, quant.Blocks] = field(default_factory=dict)  # a GGUF's matrices as the file has them
    release: Callable[[], None] | None = None  # lets go of the file's pages read so far (a GGUF's mapping)
    embed_scale: float = 1.0  # the embedding's rows are multiplied by it (Gemma: the square root of the width)
    norm_shift: float = 0.0  # added to every norm's weight (Gemma's RMSNorm multiplies by 1 + weight)
    windows: tuple[int, ...] = ()  # each layer's sliding window (0: it attends to every position); ()
    local_inv_freq: torch.Tensor | None = None  # the rotary of the sliding-window layers, where theirs differs
    long_inv_freq: torch.Tensor | None = None  # LongRoPE: the rotary for a context past ``original_ctx``
    original_ctx: int | None = None
    rotated: tuple[bool, ...] = ()  # whether each layer turns q and k (SmolLM3's every fourth does not); (): all
    residual_scale: float = 1.0  # each layer's attention and MLP outputs are multiplied by it (Granite)
    logit_scale: float = 1.0  # the logits are divided by it (Granite)
    logit_softcap: float = 0.0  # then capped softly to it as the scores are (Gemma 2); 0: not
    dynamic_rope: bool = False  # its rotary scales itself past trained_ctx (rope_type dynamic): not done here

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> Checkpoint:
        """The checkpoint of a transformers causal LM (its tensors are shared, not copied)."""
        rotary = model.model.rotary_emb
        eos = getattr(model.generation_config, "eos_token_id", None)
        tensors = Tensors({name: t.detach() for name, t in model.state_dict().items()})
        config = model.config.to_dict()
        if hasattr(rotary, "inv_freq"):
            return _build(config, tensors, rotary.inv_freq.float(), float(rotary.attention_scaling), _ids(eos),
                          long=_long(model.config, config, rotary.inv_freq.device))
        # one rotary per layer type (Gemma 3: full and sliding attention; a model of two layers has only the latter)
        kind = "full_attention" if hasattr(rotary, "full_attention_inv_freq") else "sliding_attention"
        return _build(config, tensors, getattr(rotary, f"{kind}_inv_freq").float(),
                      float(getattr(rotary, f"{kind}_attention_scaling")), _ids(eos),
                      rotary.sliding_attention_inv_freq.float())

    @property
    def nbytes(self) -> int:
        return self.tensors.nbytes

    @property
    def numel(self) -> int:
        return self.tensors.numel

    @property
    def rotary_dim(self) -> int:
        """How many of a head's dimensions rotate (all but where the rotary is partial: Phi-4-mini's 3/4)."""
        return 2 * self.inv_freq.numel()

    def cos_sin(self, ctx: int, dtype: torch.dtype, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [ctx, head_dim] for positions 0..ctx-1, as the model's rotary embedding makes them
        (``local``: the sliding-window layers' one, where it differs; LongRoPE's long one for a ``ctx``
        past the original, as llama.cpp chooses). A partial rotary's other dimensions pass unchanged
        (cos 1, sin 0, unscaled): the runner's weights put them where a whole-head rotary would turn them
        (``weights.rotary_rows``)."""
        inv_freq = self.local_inv_freq if local and self.local_inv_freq is not None else self.inv_freq
        if self.long_inv_freq is not None and ctx > (self.original_ctx or ctx):
            inv_freq = self.long_inv_freq
        positions = torch.arange(ctx, device=inv_freq.device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        passed = self.spec.head_dim // 2 - inv_freq.numel()
        pad = lambda half, value: torch.nn.functional.pad(half * self.rope_scale, (0, passed), value=value)
        cos, sin = pad(freqs.cos(), 1.0), pad(freqs.sin(), 0.0)
        return (torch.cat([cos, cos], dim=-1).to(dtype).contiguous(),
                torch.cat([sin, sin], dim=-1).to(dtype).contiguous())


def read(path: Path, device: torch.device, dtype: torch.dtype) -> Checkpoint | None:
    """The checkpoint in HF directory ``path``; None when it has no safetensors weights under the
    usual names (the caller then loads it through transformers, which knows every layout)."""
    files = _weight_files(path)
    if not files:
        return None
    tensors = Tensors.read(files, device, dtype)
    if any(name not in tensors for name in _NEEDED) or not any(name in tensors for name in _QUERIES):
        return None
    config = json.loads((path / "config.json").read_text())
    layered = "full_attention" in (config.get("rope_parameters") or {})  # a rotary per layer type
    inv_freq, scale, long = _rope(path, config, device, "full_attention" if layered else None)
    local = _rope(path, config, device, "sliding_attention")[0] if layered else _local_rope(config, device)
    generation = path / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    eos = config.get("eos_token_id") if eos is None else eos  # as transformers falls back
    return _build(config, tensors, inv_freq, scale, _ids(eos), local, long)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = path / "model.safetensors"
    return [single] if single.is_file() else []


def _build(config: dict[str, Any], tensors: Tensors, inv_freq: torch.Tensor, scale: float,
           eos_ids: tuple[int, ...], local_inv_freq: torch.Tensor | None = None,
           long: tuple[torch.Tensor, int] | None = None) -> Checkpoint:
    heads = config["num_attention_heads"]
    kind = config.get("model_type", "llama")
    model_type = TYPES.get(kind, kind)
    gemma = model_type in ("gemma2", "gemma3")
    spec = Spec(
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=_head_dim(config),
        eps=config.get("rms_norm_eps", 1e-6),
        scale_dim=config.get("query_pre_attn_scalar") or 0,
        attn_scale=config.get("attention_multiplier") or 0.0,
        # Gemma 3's config may carry Gemma 2's score cap, which its attention (in transformers) leaves unused
        softcap=config.get("attn_logit_softcapping") or 0.0 if model_type == "gemma2" else 0.0,
    )
    window = config.get("sliding_window") or 0
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in _layer_types(config, model_type))
    embed_scale = config["hidden_size"] ** 0.5 if gemma else config.get("embedding_multiplier") or 1.0
    return Checkpoint(model_type, spec, config.get("hidden_act") or config.get("hidden_activation") or "silu",
                      config.get("max_position_embeddings"), inv_freq, scale, eos_ids, tensors,
                      embed_scale=embed_scale, norm_shift=1.0 if gemma else 0.0,
                      windows=windows if any(windows) else (), local_inv_freq=local_inv_freq,
                      long_inv_freq=long[0] if long else None, original_ctx=long[1] if long else None,
                      rotated=tuple(bool(r) for r in config.get("no_rope_layers") or ()),
                      residual_scale=config.get("residual_multiplier") or 1.0,
                      logit_scale=config.get("logits_scaling") or 1.0,
                      logit_softcap=config.get("final_logit_softcapping") or 0.0,
                      dynamic_rope=_kind(config) == "dynamic")


def _layer_types(config: dict[str, Any], model_type: str) -> list[str]:
    """Each layer's attention: the config's list, else (Gemma configs written before transformers had
    one: its ``sliding_window_pattern``) the family's pattern, every n-th layer global; Phi-3's all
    sliding (its window unused, as in llama.cpp); Mistral's all sliding where it has a window (v0.1's 4096);
    Qwen2's (configs transformers 4 wrote: ``use_sliding_window``) from layer ``max_window_layers`` on."""
    layers = config["num_hidden_layers"]
    if config.get("layer_types"):
        return config["layer_types"]
    if model_type == "phi3" or model_type == "mistral" and config.get("sliding_window"):
        return ["sliding_attention"] * layers
    if config.get("use_sliding_window") and config.get("sliding_window"):  # Qwen2's, from its max_window_layers on
        first = config.get("max_window_layers", layers)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    every = config.get("sliding_window_pattern") or GEMMA_PATTERNS.get(model_type)
    return ["sliding_attention" if s else "full_attention" for s in sliding(layers, every)] if every else []


def sliding(layers: int, every: int) -> list[bool]:
    """Whether each layer attends to a window where every ``every``-th one attends to all positions (0:
    none does)."""
    return [every == 0 or (i + 1) % every != 0 for i in range(layers)]


def _rope(path: Path, config: dict[str, Any], device: torch.device,
          layer_type: str | None = None) -> tuple[torch.Tensor, float, tuple[torch.Tensor, int] | None]:
    """(inverse frequencies, scale, LongRoPE's long ones and original context or None) of the model's
    rotary embedding (of the layers of ``layer_type``, where the config has one for each). The plain
    kind is computed here; scaled kinds (llama3, yarn, linear, longrope, ...) go through transformers'
    own functions, on its config read once."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    params = params[layer_type] if layer_type else params
    kind = _kind(params)
    if kind == "default":
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        dim = _head_dim(config)
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        return rotary(theta, int(dim * partial)).to(device), 1.0, None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"the rotary scaling {kind!r} (rope_type) is not one mashbox knows; it knows "
                         f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    hf = _hf_config(path)
    if layer_type is None and "full_attention" in (getattr(hf, "rope_parameters", None) or {}):
        layer_type = "full_attention"  # an older config.json's one scaling, which transformers gives its global layers
    by_type = {"layer_type": layer_type} if layer_type else {}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](hf, device, **by_type)
    return inv_freq.float(), float(scale), _long(hf, config, device)


def _local_rope(config: dict[str, Any], device: torch.device) -> torch.Tensor | None:
    """The sliding-window layers' rotary where a config written before ``rope_parameters`` names its
    base (Gemma 3's ``rope_local_base_freq``); None: theirs is the global one."""
    base = config.get("rope_local_base_freq")
    return rotary(base, _head_dim(config)).to(device) if base else None


def _head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _kind(params: dict[str, Any]) -> str:
    """The rotary's kind in a config (or its rope parameters): default, llama3, longrope, ..."""
    params = params.get("rope_parameters") or params.get("rope_scaling") or params
    return params.get("rope_type", params.get("type", "default"))


def _hf_config(path: Path):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(path, local_files_only=True)
    return getattr(hf, "text_config", hf)


def _long(hf, config: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, int] | None:
    """LongRoPE's rotary for a context past the original one, and that length; None for other kinds."""
    if _kind(config) != "longrope":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = config.get("rope_parameters") or config.get("rope_scaling")
    original = params.get("original_max_position_embeddings") or config["original_max_position_embeddings"]
    return ROPE_INIT_FUNCTIONS["longrope"](hf, device, seq_len=original + 1)[0].float(), original


def rotary(theta: float, dim: int) -> torch.Tensor:
    """The plain rotary embedding's inverse frequencies [dim / 2], fp32."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if v is not None)


class Stored(NamedTuple):
    """A tensor not read yet: how to read it, its shape, and what it is stored as (tied names share one)."""

    read: Callable[[], torch.Tensor]
    shape: tuple[int, ...]
    key: object


class MissingTensor(ModelLoadError, KeyError):
    """A tensor the model's config needs that its weights lack (a KeyError still, as a Mapping's ``get`` expects)."""

    def __str__(self) -> str:
        return (f"the weights have no tensor {self.args[0]!r}: their files are incomplete, or not of the model their "
                "config.json describes (its layers, its family's layout)")


class Tensors(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by name, tied embeddings under both their names. Stored ones (in
    safetensors files, or a GGUF's blocks) are read on first use, floating ones cast to the
    checkpoint's dtype and moved to its device, and kept."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                 stored: dict[str, Stored] | None = None, device: torch.device | None = None) -> None:
        self._loaded = dict(tensors)
        self._stored = dict(stored or {})
        self._read: dict[object, torch.Tensor] = {}  # by what they are stored as: tied names read once
        self._dtype = dtype  # what floating tensors read from files are cast to
        self._device = device
        self._tie()

    @classmethod
    def read(cls, files: list[Path], device: torch.device, dtype: torch.dtype) -> Tensors:
        from safetensors import safe_open

        stored = {}
        for file in files:
            handle = safe_open(file, framework="pt", device=str(device))
            for name in handle.keys():  # noqa: SIM118 (not a dict)
                stored[name] = Stored(partial(handle.get_tensor, name), tuple(handle.get_slice(name).get_shape()),
                                      (file, name))
        return cls({}, dtype, stored)

    @classmethod
    def of(cls, floats: dict[str, torch.Tensor], blocks: dict[str, quant.Blocks], dtype: torch.dtype,
           device: torch.device, lib) -> Tensors:
        """A GGUF's tensors: ``floats`` as they are, ``blocks`` dequantized on first use (``lib``: the
        kernels that do it, else gguf-py's numpy code)."""
        stored = {name: Stored(partial(t.float), tuple(t.shape), id(t)) for name, t in floats.items()}
        stored.update({name: Stored(partial(quant.dequantize, b, lib), (b.rows, b.k), id(b))  # a tied head: one
                       for name, b in blocks.items()})
        return cls({}, dtype, stored, device)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._loaded:
            return self._loaded[name]
        stored = self._stored.get(name)
        if stored is None:
            raise MissingTensor(name)
        tensor = self._read.get(stored.key)
        if tensor is None:
            tensor = stored.read()
            tensor = tensor.to(self._dtype) if tensor.is_floating_point() and self._dtype else tensor
            tensor = tensor.to(self._device) if self._device is not None else tensor
        self._loaded[name] = self._read[stored.key] = tensor
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter({**self._stored, **self._loaded})

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._loaded or name in self._stored)

    @property
    def dtype(self) -> torch.dtype | None:
        """What floating tensors are cast to as they are read (None: as stored)."""
        return self._dtype

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, without reading it."""
        if name in self._stored:
            return self._stored[name].shape
        if name not in self._loaded:
            raise MissingTensor(name)
        return tuple(self._loaded[name].shape)

    @property
    def numel(self) -> int:
        return sum(math.prod(self.shape(name)) for name in self._unique())

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor once read, at the checkpoint's dtype (each storage once: a tied lm_head
        shares the embedding's)."""
        size = lambda name: self._loaded[name].element_size() if name in self._loaded else self._dtype.itemsize
        return sum(math.prod(self.shape(name)) * size(name) for name in self._unique())

    def _unique(self) -> list[str]:
        seen: dict[object, str] = {}
        for name in self:
            seen.setdefault(self._stored[name].key if name in self._stored else self._loaded[name].data_ptr(), name)
        return list(seen.values())

    def _tie(self) -> None:
        """Tied embeddings are saved under one of their two names: give them both."""
        embed, head = "model.embed_tokens.weight", "lm_head.weight"
        for table in (self._loaded, self._stored):
            if head in table and embed not in self:
                table[embed] = table[head]
            elif embed in table and head not in self:
                table[head] = table[embed]
