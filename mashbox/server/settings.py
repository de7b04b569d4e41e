"""Server settings: fixed at start, checked in ``__post_init__``."""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

ORIGIN = re.compile(r"null|[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s?#]+")  # what a browser's Origin header holds


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class KeyRing(Mapping[str, str]):
    """Key -> tenant, replaced whole when the key file is read again: a reader sees the old keys or
    the new ones, never a mix."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._keys = dict(keys)

    def replace(self, keys: Mapping[str, str]) -> None:
        self._keys = dict(keys)

    def items(self):  # the current dict's own view, however long the caller iterates
        return self._keys.items()

    def __getitem__(self, key: str) -> str:
        return self._keys[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


HANG_S = 120.0  # a worker silent this long with requests to answer is hung (a step of a 7B model on 2 cores: ~20 s)


@dataclass(slots=True, frozen=True)
class Settings:
    """How the server answers. ``api_keys`` maps each key to its tenant; ``key_file`` is where
    they were read from (read again on SIGHUP)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: Mapping[str, str] = field(default_factory=dict)
    key_file: str | None = None
    ui: bool = False
    max_waiting_per_tenant: int = 32
    max_waiting: int = 256
    idle_timeout_s: float = 30.0
    keepalive_s: float = 5.0  # a stream with no output yet sends a keep-alive this often
    allow_origins: tuple[str, ...] = ()  # web origins that may call the API (CORS); "*": any
    retry_after_s: int = 1
    cache_ram_mib: int = 0
    tasks_db: str | None = None  # the agent tasks' SQLite file (default: tasks.sqlite3 in the mashbox cache)
    tasks_ttl_s: float = 24 * 3600  # a task untouched this long expires (unfinished) or is deleted (finished)
    sampling: Mapping[str, float] = field(default_factory=dict)  # what a request that leaves a field out gets
    hang_s: float = HANG_S  # a worker's silence with requests to answer that has it killed and started again; 0: never

    def __post_init__(self) -> None:
        object.__setattr__(self, "host", self.host.strip().removeprefix("[").removesuffix("]"))  # [::1] as in a URL
        if not isinstance(self.api_keys, KeyRing):
            object.__setattr__(self, "api_keys", KeyRing(self.api_keys))
        if not is_loopback(self.host) and not self.api_keys:
            raise ValueError(
                f"host: {self.host} is not a loopback address, so API keys are required; "
                "pass --api-key-file or set MASHBOX_API_KEY"
            )
        if not 0 < self.tasks_ttl_s < math.inf:
            raise ValueError(f"tasks_ttl_s: must be > 0 and finite (got {self.tasks_ttl_s})")
        for origin in self.allow_origins:
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise ValueError(f"allow_origin: {origin!r} is no origin: give scheme://host[:port], or * for any")
        if not 0 <= self.hang_s < math.inf:
            raise ValueError(f"hang_timeout: must be 0 (never) or a number of seconds (got {self.hang_s})")
        if not 0 < self.port < 65536:
            raise ValueError(f"port: must be between 1 and 65535 (got {self.port})")

    @property
    def auth_required(self) -> bool:
        return bool(self.api_keys)
