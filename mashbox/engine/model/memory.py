"""Memory a KV cache needs and memory the device has free: checked before the cache is allocated,
so that a context too large for the machine is one clear error, not minutes of allocation."""

from __future__ import annotations

from pathlib import Path

import torch

from mashbox.engine.load.checkpoint import Spec
from mashbox.engine.model.form import Form
from mashbox.errors import ConfigError


def kv_bytes_per_token(spec: Spec, form: Form) -> int:
    """Bytes of keys and values one token position holds over all layers."""
    return 2 * spec.num_layers * spec.num_kv_heads * form.kv_row(spec.head_dim) * form.kv_dtype.itemsize


def available(device: torch.device, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes free for a new allocation on ``device``; None where that cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    found = [int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")]
    return found[0] if found else None


def check_fits(ctx: int, slots: int, per_token: int, free: int | None, where: str) -> None:
    """Refuse a KV cache of ``ctx`` x ``slots`` tokens that needs more than ``free`` bytes."""
    need = ctx * slots * per_token
    if free is None or need <= free:
        return
    fits = free // (slots * per_token)
    lower = f"lower ctx (at most {fits} fits with {slots} slots) or slots" if fits >= 16 else "lower slots and ctx"
    raise ConfigError(f"ctx {ctx} x {slots} slots needs {_gib(need)} of KV cache but {where} has "
                      f"{_gib(free)} free; {lower}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
