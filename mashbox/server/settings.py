"""Server settings: fixed at start, checked in ``__post_init__``."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(slots=True, frozen=True)
class Settings:
    """How the server answers. ``api_keys`` maps each key to its tenant."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: dict[str, str] = field(default_factory=dict)
    ui: bool = False
    max_waiting_per_tenant: int = 32
    max_waiting: int = 256
    idle_timeout_s: float = 30.0
    retry_after_s: int = 1
    cache_ram_mib: int = 0

    def __post_init__(self) -> None:
        if not is_loopback(self.host) and not self.api_keys:
            raise ValueError(
                f"host: {self.host} is not a loopback address, so API keys are required; "
                "pass --api-key-file or set MASHBOX_API_KEY"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"port: must be between 1 and 65535 (got {self.port})")

    @property
    def auth_required(self) -> bool:
        return bool(self.api_keys)
