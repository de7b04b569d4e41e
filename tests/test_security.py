"""Keys, tenants, Origin/Host and content-type checks: pure, no server."""

from __future__ import annotations

import pytest

from mashbox.server.security import Refusal, check, key_tenant, load_keys, needs_key, parse_keys, tenant
from mashbox.server.settings import Settings

JSON = {"Content-Type": "application/json"}
KEYS = {"sk-alpha": "team-a", "sk-beta": "team-a", "sk-solo": key_tenant("sk-solo")}


def keyed(**options) -> Settings:
    return Settings(api_keys=dict(KEYS), **options)


def status(settings: Settings, method: str, path: str, headers: dict[str, str], **kw) -> int | None:
    refusal = check(settings, method, path, headers, **kw)
    return refusal.status if refusal else None


# -- key file -----------------------------------------------------------------


def test_key_file_tenants_comments_and_unnamed_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text(
        "# team keys\n"
        "sk-alpha team-a\n"
        "\n"
        "sk-beta\tteam-a   # second key, same tenant\n"
        "   sk-solo\n"
        "sk-hash#tag  other\n"
    )
    keys = load_keys(str(path), None)
    assert keys["sk-alpha"] == keys["sk-beta"] == "team-a"
    assert keys["sk-solo"] == key_tenant("sk-solo")
    assert keys["sk-hash#tag"] == "other"  # '#' inside a key is part of it
    assert len(keys) == 4


def test_unnamed_key_tenant_never_contains_the_key():
    name = key_tenant("sk-secret-value")
    assert name.startswith("key:") and "secret" not in name
    assert name != key_tenant("sk-other-value")


def test_env_key_is_its_own_tenant(tmp_path):
    assert load_keys(None, " sk-env \n") == {"sk-env": key_tenant("sk-env")}
    assert load_keys(None, None) == {} == load_keys(None, "")
    path = tmp_path / "keys"
    path.write_text("sk-env named\n")
    assert load_keys(str(path), "sk-env") == {"sk-env": "named"}  # the file names it


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "no keys"),
        ("# only a comment\n\n", "no keys"),
        ("sk-a team extra\n", "line 1"),
        ("sk-a one\nsk-a two\n", "line 2"),
    ],
)
def test_bad_key_files(text, error):
    with pytest.raises(ValueError, match=error) as info:
        parse_keys(text, "keys.txt")
    assert "keys.txt" in str(info.value)
    assert "sk-a" not in str(info.value)


def test_a_byte_order_mark_is_no_part_of_the_first_key(tmp_path):
    """A key file saved by Notepad (BOM, CRLF) refused its first key, silently."""
    path = tmp_path / "keys"
    path.write_bytes(b"\xef\xbb\xbfsk-first\r\nsk-second\r\n")
    assert set(load_keys(str(path), None)) == {"sk-first", "sk-second"}


@pytest.mark.parametrize("key", ["sk-üml", "sk-bob€", "sk-\x7f"])
def test_a_key_no_client_can_send_is_refused_at_start(tmp_path, key):
    """A non-ASCII key was taken, then refused to every client (httpx cannot send it, curl's UTF-8 was
    read as Latin-1)."""
    path = tmp_path / "keys"
    path.write_text(f"sk-fine\n{key} team\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 2: a key holds a character other than printable ASCII"):
        load_keys(str(path), None)
    with pytest.raises(ValueError, match="MASHBOX_API_KEY: a key holds"):
        load_keys(None, key)


def test_missing_key_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.keys")
    with pytest.raises(ValueError, match="nope.keys"):
        load_keys(missing, "sk-env")


# -- 401 ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, 401),
        ({"Authorization": "Bearer sk-wrong"}, 401),
        ({"x-api-key": "sk-alph"}, 401),
        ({"Authorization": "sk-alpha"}, 401),  # no scheme
        ({"Authorization": "Basic sk-alpha"}, 401),
        ({"Authorization": "Bearer sk-alpha"}, None),
        ({"authorization": "bearer   sk-beta "}, None),
        ({"Authorization": "Bearer\tsk-beta"}, None),
        ({"X-Api-Key": "sk-solo"}, None),
        ({"Authorization": "Bearer sk-wrong", "x-api-key": "sk-alpha"}, None),
    ],
)
def test_keys_on_v1_routes(headers, expected):
    assert status(keyed(), "GET", "/v1/models", headers) == expected


@pytest.mark.parametrize(
    ("method", "path", "keyed_path"),
    [
        ("GET", "/v1/models", True),
        ("POST", "/v1/chat/completions", True),
        ("POST", "/v1/messages", True),
        ("GET", "/metrics", True),
        ("GET", "/openapi.json", True),
        ("GET", "/v1", True),
        ("GET", "//v1//models", True),
        ("GET", "/v1/../metrics", True),
        ("GET", "/METRICS", True),
        ("HEAD", "/v1/models", True),
        ("POST", "/v1/health", True),
        ("GET", "/v1/health", False),
        ("HEAD", "/v1/health", False),
        ("GET", "/v1/health/", False),
        ("GET", "/health", False),
        ("GET", "/", False),
        ("HEAD", "/", False),
        ("GET", "/ui/app.js", False),
        ("GET", "/tasks/..", True),  # the router takes ".." for a task id: keyed as sent
        ("DELETE", "/tasks/..", True),
        ("POST", "/tasks/../cancel", True),
        ("GET", "/v1/tasks/./x", True),
    ],
)
def test_which_paths_need_a_key(method, path, keyed_path):
    assert needs_key(method, path) is keyed_path
    headers = JSON if method == "POST" else {}
    assert (status(keyed(), method, path, headers) == 401) is keyed_path


def test_refusal_messages_never_carry_the_key():
    refusal = check(keyed(), "GET", "/v1/models", {"Authorization": "Bearer sk-alphX"})
    assert refusal == Refusal(401, "invalid API key", "authentication_error")
    missing = check(keyed(), "GET", "/metrics", {})
    assert missing is not None and missing.kind == "authentication_error" and "x-api-key" in missing.message


def test_loopback_without_keys_ignores_any_key():
    settings = Settings()
    assert status(settings, "GET", "/v1/models", {"Authorization": "Bearer anything"}) is None
    assert status(settings, "GET", "/metrics", {}) is None
    assert tenant(settings, {"x-api-key": "sk-alpha"}) == "default"


def test_tenant_of_the_key():
    assert tenant(keyed(), {"Authorization": "Bearer sk-alpha"}) == "team-a"
    assert tenant(keyed(), {"X-API-KEY": "sk-beta"}) == "team-a"
    assert tenant(keyed(), {"x-api-key": "sk-solo"}) == key_tenant("sk-solo")


# -- 403 ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Host": "127.0.0.1:8000"}, None),
        ({"Host": "localhost:8000"}, None),
        ({"Host": "LOCALHOST"}, None),
        ({"Host": "[::1]:8000"}, None),
        ({"Host": "localhost:9000"}, None),  # an SSH tunnel's local port
        ({}, None),  # HTTP/1.0
        ({"Host": "evil.example:8000"}, 403),  # DNS rebinding
        ({"Host": "127.0.0.1.evil.example"}, 403),
        ({"Host": "evil.example@127.0.0.1"}, 403),
        ({"Host": "localhost:notaport"}, 403),
        ({"Host": "localhost:8000?x"}, 403),
        ({"Origin": "http://127.0.0.1:8000", "Host": "127.0.0.1:8000"}, None),
        ({"Origin": "http://localhost:8000", "Host": "127.0.0.1:8000"}, None),
        ({"Origin": "http://[::1]:8000"}, None),
        ({"Origin": "http://localhost:9000", "Host": "localhost:9000"}, None),  # page served through a tunnel
        ({"Origin": "http://localhost", "Host": "localhost"}, None),
        ({"Origin": "http://localhost:3000", "Host": "localhost:8000"}, 403),  # another local web app
        ({"Origin": "https://evil.example", "Host": "127.0.0.1:8000"}, 403),
        ({"Origin": "http://evil.example:8000", "Host": "evil.example:8000"}, 403),
        ({"Origin": "null", "Host": "127.0.0.1:8000"}, 403),
        ({"Origin": "file://", "Host": "127.0.0.1:8000"}, 403),
        ({"Origin": "http://localhost:3000"}, 403),
    ],
)
def test_origin_and_host_on_loopback(headers, expected):
    refusal = check(Settings(), "GET", "/v1/health", headers)
    assert (refusal.status if refusal else None) == expected
    if refusal:
        assert refusal.kind == "permission_error"


def test_forbidden_comes_before_unauthorized():
    assert status(keyed(), "GET", "/v1/models", {"Host": "evil.example"}) == 403
    assert status(keyed(), "GET", "/v1/models", {"Origin": "https://evil.example"}) == 403


def test_named_host_and_server_host_are_answered():
    settings = Settings(host="127.0.0.1")
    ok = {"Host": "127.0.0.1:8000"}
    assert status(settings, "GET", "/v1/models", ok) is None
    assert status(settings, "GET", "/v1/models", {**ok, "Origin": "http://127.0.0.1:8000"}) is None
    assert status(settings, "GET", "/v1/models", {**ok, "Host": "other.example"}) == 403
    assert status(settings, "GET", "/v1/models", {**ok, "Host": "api.example"}, server_host="api.example") is None
    with_port = {**ok, "Host": "API.example:443"}
    assert status(settings, "GET", "/v1/models", with_port, server_host="api.example:443") is None


def test_a_lan_address_answers_the_names_it_is_reached_by():
    """Bound to one LAN address, requests by the machine's DNS name were refused (403) where 0.0.0.0
    took them: keys are required on both."""
    settings = keyed(host="192.0.2.2")
    ok = {"Host": "box.lan:8000", "x-api-key": "sk-alpha"}
    assert status(settings, "GET", "/v1/models", ok) is None
    assert status(settings, "GET", "/v1/models", {"Host": "box.lan:8000"}) == 401
    assert status(settings, "GET", "/v1/models", {**ok, "Origin": "http://evil.example"}) == 403
    assert status(Settings(), "GET", "/v1/models", {"Host": "box.lan:8000"}) == 403  # loopback: rebinding


def test_a_bracketed_address_is_the_address():
    assert Settings(host="[::1]").host == "::1"


def test_wildcard_bind_answers_any_host_but_needs_keys():
    settings = keyed(host="0.0.0.0")
    assert status(settings, "GET", "/v1/models", {"Host": "box.lan:8000"}) == 401
    ok = {"Host": "box.lan:8000", "x-api-key": "sk-alpha"}
    assert status(settings, "GET", "/v1/models", ok) is None
    assert status(settings, "GET", "/v1/models", {**ok, "Origin": "http://box.lan:8000"}) is None
    assert status(settings, "GET", "/v1/models", {**ok, "Origin": "http://evil.example"}) == 403


# -- 415 ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("application/json", None),
        ("application/json; charset=utf-8", None),
        ("Application/JSON;charset=UTF-8", None),
        (None, 415),
        ("", 415),
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        ("application/jsonx", 415),
    ],
)
def test_post_bodies_must_be_json(content_type, expected):
    headers = {"content-length": "12"} | ({} if content_type is None else {"content-type": content_type})
    refusal = check(Settings(), "POST", "/v1/chat/completions", headers)
    assert (refusal.status if refusal else None) == expected
    if refusal:
        assert refusal.kind == "invalid_request_error"


@pytest.mark.parametrize("headers", [{}, {"content-length": "0"}])
def test_a_post_without_a_body_needs_no_content_type(headers):
    assert check(Settings(), "POST", "/v1/tasks/task_1/cancel", headers) is None
    chunked = {"transfer-encoding": "chunked", "content-type": "text/plain"}
    assert check(Settings(), "POST", "/v1/chat/completions", chunked).status == 415


def test_get_needs_no_content_type():
    assert check(Settings(), "GET", "/v1/models", {}) is None


def test_unauthorized_comes_before_unsupported_type():
    assert status(keyed(), "POST", "/v1/chat/completions", {"content-type": "text/plain"}) == 401


def test_an_allowed_origin_passes_and_others_are_still_refused():
    settings = Settings(allow_origins=("http://localhost:3000",))
    page = {"host": "127.0.0.1:8000", "origin": "http://localhost:3000"}
    assert status(settings, "POST", "/v1/chat/completions", {**page, "content-type": "application/json"}) is None
    assert status(settings, "GET", "/v1/models", {**page, "origin": "http://evil.example"}) == 403
    assert status(Settings(), "GET", "/v1/models", page) == 403  # closed by default
    assert status(Settings(allow_origins=("*",)), "GET", "/v1/models", {**page, "origin": "https://x.example"}) is None


def test_cors_over_http_preflight_and_answers_name_the_allowed_origin(tiny_engine):
    import httpx
    from server import serve

    from mashbox.server.backend import InProcessBackend

    server = serve(InProcessBackend.of(tiny_engine), Settings(allow_origins=("http://localhost:3000",)))
    url = next(server)
    origin = {"origin": "http://localhost:3000"}
    preflight = httpx.options(f"{url}/v1/chat/completions", headers={
        **origin, "access-control-request-method": "POST", "access-control-request-headers": "content-type"})
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == origin["origin"]
    assert "POST" in preflight.headers["access-control-allow-methods"]
    answer = httpx.post(f"{url}/v1/chat/completions", headers=origin, timeout=60,
                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == origin["origin"]
    assert "x-request-id" in answer.headers["access-control-expose-headers"]
    foreign = httpx.get(f"{url}/v1/models", headers={"origin": "http://evil.example"})
    assert foreign.status_code == 403 and "access-control-allow-origin" not in foreign.headers
    server.close()
