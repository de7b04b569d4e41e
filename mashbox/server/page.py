"""The MASHBOX Chat page of ``mashbox run --ui``: ``GET /`` and its assets, read from ``mashbox/ui/``.

The assets live under ``/ui/<version>/``, the version being a hash of their bytes: a browser keeps
them for a year and fetches a changed release at once. The page itself is revalidated on every
load and allows scripts, styles, images and requests from its own server only (no inline code).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.resources import files

from litestar import Response

from mashbox.server.errors import ApiError

ASSETS = {"app.js": "text/javascript", "app.css": "text/css", "icon.svg": "image/svg+xml"}
CSP = "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'; object-src 'none'"
PAGE_HEADERS = {"content-security-policy": CSP, "cache-control": "no-cache", "x-content-type-options": "nosniff",
                "referrer-policy": "no-referrer"}
ASSET_HEADERS = {"cache-control": "public, max-age=31536000, immutable", "x-content-type-options": "nosniff"}


@dataclass(frozen=True, slots=True)
class Page:
    html: bytes
    version: str
    assets: Mapping[str, bytes]

    @classmethod
    def load(cls) -> Page:
        folder = files("mashbox") / "ui"
        assets = {name: (folder / name).read_bytes() for name in ASSETS}
        version = hashlib.sha256(b"\0".join(assets.values())).hexdigest()[:16]
        html = (folder / "index.html").read_text(encoding="utf-8").replace("{version}", version)
        return cls(html.encode(), version, assets)

    def index(self) -> Response[bytes]:
        return Response(self.html, media_type="text/html", headers=PAGE_HEADERS)

    def asset(self, version: str, name: str) -> Response[bytes]:
        if version != self.version or name not in self.assets:
            raise ApiError(404, f"no such file of this page: /ui/{version}/{name}")
        return Response(self.assets[name], media_type=ASSETS[name], headers=ASSET_HEADERS)
