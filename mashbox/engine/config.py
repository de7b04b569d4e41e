"""Engine configuration: fixed at construction, checked in ``__post_init__``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from os import PathLike

from mashbox.errors import ConfigError

KV_DTYPES = (None, "f16", "q8_0")
DEVICE = re.compile(r"cpu|cuda(:\d+)?")
MOST_CACHE_GIB = 2**20  # 1 PiB: a cache's size past it is a typo (past 2**33 its bytes overflowed)


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """How the engine runs a model.

    ``ctx`` is the context length of every slot (``None``: the model's
    default), ``slots`` the number of requests decoded together,
    ``chunk_tokens`` the unit prompts are cut into (at fixed boundaries; also
    the prefix cache's unit), ``step_tokens`` the most prompt tokens one device
    call runs when nothing decodes, ``busy_tokens`` while other requests decode:
    fewer where the steps' measured times say more would delay their next token
    past 1.5 decode steps, 4 for a short prompt (``Pace``; whole chunks, one at
    least, or 4-token pieces of a long prompt where the CPU kernels let a prompt
    be cut anywhere).
    ``cache_ram_mib`` caps the host memory that keeps evicted prompt prefixes;
    ``cache_disk_gib`` the disk that keeps prompt pages across restarts, in
    ``cache_dir`` (default ``<mashbox cache>/prefixes``; 0 GiB: none).
    ``dtype`` on CPU: unset (default where mashbox's kernels build: a GGUF's
    Q4_1 blocks as the file has them, int8 blocks elsewhere, fp32 activations),
    ``int8`` (int8 blocks everywhere), ``float16`` (fp16 weights packed for
    fbgemm; the default without a C compiler) or ``float32`` (exact weights);
    on CUDA: ``bfloat16`` (default). A greedy request's tokens never depend on
    what runs beside it with mashbox's kernels; with ``float32`` that takes
    ``batch_invariant`` (fixed-shape matmul tiles, slower alone); fbgemm's fp16
    kernel does not promise it on every CPU.
    ``kv_dtype``: how the KV cache keeps keys and values: unset (fp16 beside mashbox's CPU kernels,
    else the activations' dtype: float32 on CPU, bfloat16 on CUDA), ``f16``, or ``q8_0`` (int8 with
    an fp16 scale for each 32, as llama.cpp's ``-ctk/-ctv q8_0``: ~0.53x the memory; mashbox's CPU
    kernels only).
    ``cuda_graphs``: on CUDA, steps of one-token rows run at fixed shapes, each
    shape captured once as a CUDA graph and replayed (one launch a step).
    ``verbatim_template``: render the model's chat template exactly as written; by default, where the
    template puts the tools right after the system text in the system turn (Qwen, Hermes), the tools
    come first, so that an agent's tools stay a cached prefix when its system text changes.
    ``constrain_calls``: in ``tool_choice`` ``auto``, once the model begins a tool call, the rest of it
    is held to the declared tools' names and parameter schemas (text answers stay free); an answer that
    opens with a call to a tool the request lacks is written again as a call to one of its tools, and a
    model that made one call twice with one result is told so (see ``Runtime._out_of_loop``).
    ``speculation``: a request's answer proposes its next tokens from its own prompt and text
    (where its last tokens occurred before), checked together in its next step: the same tokens
    (greedy, or sampled with the same seed), several a step where the answer copies (an agent
    re-writing a file). With mashbox's CPU kernels only, where a row's result never depends on the
    rows beside it.
    A ``ctx`` above the context the model was trained on is refused unless
    ``allow_long_context`` (answers degrade past it); one whose KV cache
    (``ctx`` x ``slots``) needs more memory than the device has free is refused.
    """

    model: str = "smollm2-135m"
    ctx: int | None = None
    slots: int = 16
    device: str | None = None
    dtype: str | None = None
    kv_dtype: str | None = None
    chunk_tokens: int = 32
    step_tokens: int = 256
    busy_tokens: int = 256
    cache_ram_mib: int = 1024
    cache_disk_gib: float = 0.0
    cache_dir: str | None = None
    batch_invariant: bool = True
    cuda_graphs: bool = True
    quiet: bool = False
    allow_long_context: bool = False
    verbatim_template: bool = False
    constrain_calls: bool = True
    speculation: bool = True

    def __post_init__(self) -> None:
        for name in ("ctx", "slots", "chunk_tokens", "step_tokens", "busy_tokens", "cache_ram_mib"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) or value is None and name == "ctx"):
                raise ConfigError(f"{name}: must be a whole number (got {value!r})")
        for name in ("batch_invariant", "cuda_graphs", "quiet", "allow_long_context", "verbatim_template",
                     "constrain_calls", "speculation"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: must be True or False (got {getattr(self, name)!r})")
        if self.cache_dir is not None and not isinstance(self.cache_dir, str | PathLike):
            raise ConfigError(f"cache_dir: must be a folder's path (got {self.cache_dir!r})")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype: must be one of {', '.join(map(str, KV_DTYPES[1:]))} (got {self.kv_dtype!r})")
        if self.device is not None and not DEVICE.fullmatch(str(self.device)):
            raise ConfigError(f"device: must be cpu, cuda or cuda:N (got {self.device!r})")
        if self.ctx is not None and self.ctx < 16:
            raise ConfigError(f"ctx: must be >= 16 (got {self.ctx})")
        if not 1 <= self.slots <= 1024:
            raise ConfigError(f"slots: must be between 1 and 1024 (got {self.slots})")
        disk = self.cache_disk_gib
        if not isinstance(disk, int | float) or isinstance(disk, bool) or not 0 <= disk <= MOST_CACHE_GIB:
            raise ConfigError(f"cache_disk_gib: must be a number from 0 to {MOST_CACHE_GIB} (got {disk!r})")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError(f"model: must be a catalog id or a path (got {self.model!r})")
        if self.dtype is not None and not isinstance(self.dtype, str):
            raise ConfigError(f"dtype: must be a name such as float16 or int8 (got {self.dtype!r})")
        if not 0 <= self.cache_ram_mib <= MOST_CACHE_GIB * 1024:
            raise ConfigError(f"cache_ram_mib: must be from 0 to {MOST_CACHE_GIB * 1024} (got {self.cache_ram_mib})")
        if self.chunk_tokens < 16:
            raise ConfigError(f"chunk_tokens: must be >= 16 (got {self.chunk_tokens})")
        for name in ("step_tokens", "busy_tokens"):
            if getattr(self, name) < self.chunk_tokens:
                raise ConfigError(f"{name}: must be >= chunk_tokens ({self.chunk_tokens}), got {getattr(self, name)}")
