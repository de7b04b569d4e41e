"""Schemathesis over the server's own /openapi.json: bodies that fit the schema and bodies that do
not, with hostile shapes (deep nesting, lists longer than the context, odd scalars) put into any
field now and then. No answer is a 5xx; every error is in its route's shape. Bounded: a few dozen
cases per operation and mode, drawn the same way every run."""

from __future__ import annotations

import json

import httpx
import hypothesis.strategies as st
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.core import NotSet

EXAMPLES = 25


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


class Deep(str):
    """A placeholder for JSON nested ``depth`` arrays deep, spliced into the body as text (Python's
    own JSON encoder, like the server's decoder, stops at about 1,000 levels)."""


def deep(depth: int) -> Deep:
    return Deep(f"<deep {depth}>")


HOSTILE = st.one_of(
    st.integers(10, 400).map(_nested),
    st.sampled_from([2_000, 100_000]).map(deep),
    st.integers(1, 3).map(lambda n: [{"role": "user", "content": "hi"}] * (600 * n)),  # past the context
    st.sampled_from(["\ud800", None, 10**30, -1, {"": {}}, [], "x" * 20_000]),
)


def hostile(case):
    """Now and then one field of the drawn body (or a new one) becomes a hostile value."""
    if not isinstance(case.body, dict):
        return st.just(case)
    keys = st.sampled_from(sorted(case.body) + ["messages", "input", "prompt", "tools", "metadata"])

    def with_field(kv):
        case.body = {**case.body, kv[0]: kv[1]}
        return case

    return st.one_of(st.just(case), st.tuples(keys, HOSTILE).map(with_field))


def send(case, url: str) -> httpx.Response:
    """The case over HTTP, with any Deep placeholder written out in full."""
    content = None
    if isinstance(case.body, bytes):  # the negative mode sends bodies that are not JSON too
        content = case.body
    elif not isinstance(case.body, NotSet):
        content = json.dumps(case.body)
        for depth in (2_000, 100_000):
            content = content.replace(json.dumps(deep(depth)), "[" * depth + "]" * depth)
    headers = {**(case.headers or {}), **({"content-type": "application/json"} if content is not None else {})}
    return httpx.request(case.method, url + case.formatted_path, params=case.query or None, headers=headers,
                         content=content, timeout=60)


def operations(url: str):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_gets_a_server_error(fuzz_server, mode):
    found = operations(fuzz_server.url)
    # POSTs with a body (a task's cancel, pause and resume have none that could be made invalid)
    posts = [op for op in found
             if op.method.upper() == "POST" and not op.path.endswith(("/cancel", "/pause", "/resume"))]
    assert len(posts) >= 5, [op.label for op in found]
    for operation in found if mode == GenerationMode.POSITIVE else posts:  # only bodies can be made invalid
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode).flatmap(hostile))
        def check(case):
            response = send(case, fuzz_server.url)
            assert response.status_code < 500, (case.method, case.path, response.text[:300])
            if response.status_code >= 400:  # every error is JSON in its route's shape
                body = response.json()
                if case.path.startswith("/v1/messages"):
                    assert body["type"] == "error" and body["error"]["message"], body
                elif case.path.startswith("/v1/tasks"):  # the JSON-RPC envelope
                    assert body["jsonrpc"] == "2.0" and body["error"]["message"] and body["error"]["code"], body
                else:
                    assert body["error"]["message"] and body["error"]["type"], body

        check()
