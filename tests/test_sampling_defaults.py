"""``mashbox run --sampling``: what a request that leaves a sampling field out gets; its own values win."""

import subprocess
import sys

import httpx
import pytest
from server import serve

from mashbox.api.protocols import PROTOCOLS, prepare
from mashbox.server.backend import InProcessBackend
from mashbox.server.settings import Settings

QWEN = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
ASK = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("method, body", [
    ("chat", {"messages": ASK}), ("message", {"messages": ASK, "max_tokens": 4}), ("respond", {"input": "Hi"})])
def test_fields_left_out_take_the_defaults_and_sent_ones_win(method, body):
    sampling = prepare(PROTOCOLS[method], body, "m", QWEN).engine.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    sent = prepare(PROTOCOLS[method], {**body, "temperature": 0, "top_p": None}, "m", QWEN)
    assert (sent.engine.sampling.temperature, sent.engine.sampling.top_p) == (0, 0.8)
    assert sent.ignored == [] and prepare(PROTOCOLS[method], body, "m").engine.sampling.temperature == 0


@pytest.fixture(scope="module")
def url(tiny_engine):
    yield from serve(InProcessBackend.of(tiny_engine), Settings(sampling={"temperature": 0.7, "top_p": 0.8}))


def test_the_server_answers_with_its_defaults(url):
    """The Responses object says the sampling it ran with: the server's where the request sent none."""
    body = {"input": "Hi", "max_output_tokens": 2}
    answer = httpx.post(url + "/v1/responses", json=body, timeout=60).raise_for_status()
    assert (answer.json()["temperature"], answer.json()["top_p"]) == (0.7, 0.8)
    assert "x-mashbox-ignored-fields" not in answer.headers
    answer = httpx.post(url + "/v1/responses", json={**body, "temperature": 0.2}, timeout=60).raise_for_status()
    assert (answer.json()["temperature"], answer.json()["top_p"]) == (0.2, 0.8)


@pytest.mark.parametrize("value, words", [("temperature=9", "temperature: must be between 0 and 4"),
                                          ("heat=1", "must be NAME=VALUE pairs of temperature"),
                                          ("top_k=2.5", "top_k: must be a whole number")])
def test_a_bad_default_is_refused_at_start(value, words):
    done = subprocess.run([sys.executable, "-m", "mashbox", "run", "--sampling", value], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and words in done.stderr.splitlines()[-1], done.stderr
