"""Who may call the server: API keys and tenants, Origin and Host, content type.

Pure functions over a request's method, path and headers; the HTTP layer turns
a ``Refusal`` into its route's error shape. Checks run in this order:

1. 403 ``Origin`` present and not the server's own origin (``null`` is foreign)
   nor one of ``--allow-origin`` (``allowed_origin``: those get CORS headers).
   Own origin: http(s) on a host name the server answers to (2.) with
   ``--port``, or exactly the name and port the request's ``Host`` names (an
   SSH tunnel changes the port; the page was served through it). Not asked of
   a GET of the chat page's files (``/ui/...``: the browser sends its Origin
   for the page's script), which hold nothing: a page behind a proxy that
   rewrote Host loads, and its first call says why it is refused.
2. 403 ``Host`` names a host the server does not answer to (DNS rebinding).
   The server answers to 127.0.0.1, localhost, ::1, ``--host`` and
   ``server_host`` (a name it is also reached by, e.g. a test client's),
   with any port. Bound to an address that is not loopback (0.0.0.0, ::, a
   LAN address) it answers to any name: the names it is reached by are unknown
   here, and Settings requires keys there, so a rebound page still has no key.
   A request without ``Host`` (HTTP/1.0) passes: browsers always send it.
3. 401 with keys, on /v1/*, /tasks/*, /metrics and /openapi.json (GET/HEAD of the
   health paths excepted) without a valid key in ``Authorization: Bearer`` or
   ``x-api-key``, whatever the route; a path is keyed when it is so as sent or
   with its ``.`` and ``..`` segments resolved (the router resolves none).
   Keys are compared in constant time with every configured key. Without keys
   no key is checked; any key sent is ignored.
4. 415 a POST with a body whose Content-Type is not application/json (parameters allowed), or whose
   body is compressed (a Content-Encoding other than identity: read as it is, it was "not valid JSON").

Keys are never logged nor put in messages; a key file line without a tenant
name makes the key its own tenant, ``key:<first 12 hex of its sha256>``.
"""

from __future__ import annotations

import hashlib
import hmac
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from mashbox.server.settings import Settings, is_loopback

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
PUBLIC_PATHS = frozenset({"/", "/health", "/v1/health"})
KEYED_PATHS = frozenset({"/v1", "/tasks", "/metrics", "/openapi.json"})
DEFAULT_TENANT = "default"
_COMMENT = re.compile(r"(^|\s)#.*")
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(slots=True, frozen=True)
class Refusal:
    """Why a request is refused: HTTP status, message, error type (OpenAI/Anthropic)."""

    status: int
    message: str
    kind: str


# -- keys -------------------------------------------------------------------


def key_tenant(key: str) -> str:
    """The tenant of a key the key file names no tenant for: its own, by hash."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:12]


def load_keys(path: str | None, env_key: str | None) -> dict[str, str]:
    """Key -> tenant from the key file at ``path`` plus ``MASHBOX_API_KEY``."""
    keys = _read_key_file(path) if path else {}
    env_key = (env_key or "").strip()
    if env_key:
        _check_sendable(env_key, "MASHBOX_API_KEY")
        keys.setdefault(env_key, key_tenant(env_key))
    return keys


def _check_sendable(key: str, where: str) -> None:
    """HTTP clients send header values as ASCII (httpx refuses others, browsers Latin-1 only)."""
    if not (key.isascii() and key.isprintable()):
        raise ValueError(f"{where}: a key holds a character other than printable ASCII, which no HTTP "
                         "client sends as it is: use letters, digits and punctuation")


def _read_key_file(path: str) -> dict[str, str]:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # Notepad's byte order mark is no part of a key
    except OSError as exc:
        raise ValueError(f"api key file {path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    except UnicodeDecodeError:
        raise ValueError(f"api key file {path}: not UTF-8 text") from None
    return parse_keys(text, path)


def parse_keys(text: str, path: str = "<keys>") -> dict[str, str]:
    """One key per line, optionally a tenant name after it; ``#`` starts a comment."""
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = _COMMENT.sub("", line).split()
        if not fields:
            continue
        if len(fields) > 2:
            raise ValueError(f"api key file {path}, line {number}: expected a key and at most one tenant name")
        key = fields[0]
        _check_sendable(key, f"api key file {path}, line {number}")
        owner = fields[1] if len(fields) == 2 else key_tenant(key)
        if keys.setdefault(key, owner) != owner:
            raise ValueError(f"api key file {path}, line {number}: this key already belongs to another tenant")
    if not keys:
        raise ValueError(f"api key file {path}: no keys in it")
    return keys


# -- checks -----------------------------------------------------------------


def check(
    settings: Settings, method: str, path: str, headers: Mapping[str, str], server_host: str | None = None
) -> Refusal | None:
    """The refusal for this request, or None when it may go on (order: module doc)."""
    lowered = _lower(headers)
    hosts = answered_hosts(settings, server_host)
    origin_free = allowed_origin(settings, lowered) or (method.upper() in ("GET", "HEAD") and path.startswith("/ui/"))
    return (
        (None if origin_free else _origin_refusal(lowered, hosts, settings.port))
        or _host_refusal(lowered, hosts)
        or _key_refusal(settings, method, path, lowered)
        or _type_refusal(method, lowered)
    )


def allowed_origin(settings: Settings, headers: Mapping[str, str]) -> str | None:
    """The request's ``Origin`` when ``--allow-origin`` names it (CORS answers go to it), else None."""
    origin = _lower(headers).get("origin")
    if origin is None:
        return None
    return origin if "*" in settings.allow_origins or origin.rstrip("/") in settings.allow_origins else None


def tenant(settings: Settings, headers: Mapping[str, str]) -> str:
    """The tenant of the request's key; ``default`` without keys (or without a valid key)."""
    if not settings.auth_required:
        return DEFAULT_TENANT
    return _matching_tenant(settings.api_keys, _sent_keys(_lower(headers))) or DEFAULT_TENANT


def needs_key(method: str, path: str) -> bool:
    """Whether ``path`` is one of those a key guards (when keys are configured)."""
    sent = re.sub(r"/+", "/", "/" + path).lower().rstrip("/") or "/"
    return any(_keyed(method, form) for form in (sent, posixpath.normpath(sent)))


def _keyed(method: str, path: str) -> bool:
    if method.upper() in ("GET", "HEAD") and path in PUBLIC_PATHS:
        return False
    return path in KEYED_PATHS or path.startswith(("/v1/", "/tasks/"))


def answered_hosts(settings: Settings, server_host: str | None = None) -> frozenset[str] | None:
    """Host names the server answers to; None for any (bound to a wildcard address)."""
    bound = _hostname(settings.host)
    if not is_loopback(bound):
        return None
    named = _host_port(server_host) if server_host else None
    return LOOPBACK_NAMES | {bound} | ({named[0]} if named else set())


def _origin_refusal(headers: dict[str, str], hosts: frozenset[str] | None, port: int) -> Refusal | None:
    origin = headers.get("origin")
    if origin is None or _same_origin(origin, headers.get("host"), hosts, port):
        return None
    message = (f"requests from a web page of another origin are refused (Origin: {origin[:100]}): let it call with "
               "--allow-origin, or, behind a proxy, forward the Host header the browser sent")
    return Refusal(403, message, "permission_error")


def _same_origin(origin: str, host: str | None, hosts: frozenset[str] | None, port: int) -> bool:
    site = _site(origin)
    if site is None:
        return False
    name, origin_port, default_port = site
    if hosts is not None and name not in hosts:
        return False
    if hosts is not None and origin_port == port:
        return True
    parsed = _host_port(host) if host is not None else None
    return parsed is not None and parsed[0] == name and (parsed[1] or default_port) == origin_port


def _site(origin: str) -> tuple[str, int, int] | None:
    """(host name, port, scheme's default port) of an http(s) Origin; None for ``null`` and others."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/"):
        return None
    if parts.query or parts.username is not None:
        return None
    default = _DEFAULT_PORTS[parts.scheme]
    return _hostname(parts.hostname), port or default, default


def _host_refusal(headers: dict[str, str], hosts: frozenset[str] | None) -> Refusal | None:
    host = headers.get("host")
    if host is None or hosts is None:
        return None
    parsed = _host_port(host)
    if parsed is not None and parsed[0] in hosts:
        return None
    return Refusal(403, f"this server does not answer to the host name {host[:100]!r}", "permission_error")


def _host_port(host: str) -> tuple[str, int | None] | None:
    """(host name, port or None) of a Host header; None when it is not one."""
    try:
        parts = urlsplit("//" + host.strip())
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or parts.path or parts.query or parts.fragment or parts.username is not None:
        return None
    return _hostname(parts.hostname), port


def _key_refusal(settings: Settings, method: str, path: str, headers: dict[str, str]) -> Refusal | None:
    if not settings.auth_required or not needs_key(method, path):
        return None
    sent = _sent_keys(headers)
    if _matching_tenant(settings.api_keys, sent) is not None:
        return None
    if sent:
        return Refusal(401, "invalid API key", "authentication_error")
    message = "an API key is required: send Authorization: Bearer <key> or x-api-key: <key>"
    return Refusal(401, message, "authentication_error")


def _type_refusal(method: str, headers: dict[str, str]) -> Refusal | None:
    if method.upper() != "POST":
        return None
    if headers.get("content-length", "0").strip() == "0" and "transfer-encoding" not in headers:
        return None  # no body (cancel, pause, resume): nothing to read as JSON
    media_type = headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        return Refusal(415, "the request body must be JSON (Content-Type: application/json)", "invalid_request_error")
    coding = headers.get("content-encoding", "identity").strip().lower()
    if coding not in ("identity", ""):
        return Refusal(415, f"Content-Encoding {coding} is not read here: send the body uncompressed",
                       "invalid_request_error")
    return None


def _sent_keys(headers: dict[str, str]) -> list[str]:
    parts = headers.get("authorization", "").split(None, 1)
    sent = [parts[1].strip()] if len(parts) == 2 and parts[0].lower() == "bearer" else []
    sent.append(headers.get("x-api-key", "").strip())
    return [key for key in sent if key]


def _matching_tenant(keys: Mapping[str, str], sent: list[str]) -> str | None:
    """The tenant of the first sent key that matches; every comparison runs, in constant time."""
    found: str | None = None
    for key, owner in keys.items():
        for candidate in sent:
            if hmac.compare_digest(candidate.encode(), key.encode()) and found is None:
                found = owner
    return found


def _hostname(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}
