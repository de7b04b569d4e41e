"""Every request captured from a real client parses and translates without error.

The captures are copies of shared/clients; the POSTs to the four generating routes are used here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mashbox.api import anthropic_messages, openai_chat, openai_completions, openai_responses
from mashbox.api.base import parse
from mashbox.errors import InvalidRequestError

CLIENTS = Path(__file__).parent / "fixtures" / "clients"
ROUTES = [
    ("/v1/chat/completions", openai_chat.ChatRequest, openai_chat.to_engine),
    ("/v1/completions", openai_completions.CompletionRequest, openai_completions.to_engine),
    ("/v1/messages/count_tokens", anthropic_messages.CountTokensRequest, anthropic_messages.to_engine),
    ("/v1/messages", anthropic_messages.MessagesRequest, anthropic_messages.to_engine),
    ("/v1/responses", openai_responses.ResponsesRequest, openai_responses.to_engine),
]
REFUSED = {"schemathesis-openresponses_POST_v1_responses_example.json": "previous_response_id"}


def _captures() -> list[Path]:
    """The POST captures (HEAD / and the websocket upgrade are the server tests' business)."""
    return sorted(p for p in CLIENTS.glob("*.json") if json.loads(p.read_text())["method"] == "POST")


def _route(path: str):
    return next((r for r in ROUTES if path.startswith(r[0])), None)


def test_the_captures_are_there():
    assert len(_captures()) >= 19


@pytest.mark.parametrize("capture", _captures(), ids=lambda p: p.stem)
def test_capture_parses_and_translates(capture: Path):
    data = json.loads(capture.read_text())
    _, model_cls, to_engine = _route(data["path"])
    if capture.name in REFUSED:
        with pytest.raises(InvalidRequestError) as err:
            parse(model_cls, data["body"])
        assert err.value.param == REFUSED[capture.name]
        return
    request = parse(model_cls, data["body"])
    engine = to_engine(request)
    assert engine.messages
    assert all(m.role in ("system", "user", "assistant", "tool") for m in engine.messages)
    assert isinstance(request.ignored_fields(), list)


def _body(name: str) -> dict:
    return json.loads((CLIENTS / name).read_text())["body"]


def test_claude_code_turn_two():
    request = parse(anthropic_messages.MessagesRequest, _body("claude-code_turn2_tool_result_POST_v1_messages.json"))
    engine = anthropic_messages.to_engine(request)
    assert [m.role for m in engine.messages] == ["system", "user", "system", "assistant", "tool"]
    assert "x-anthropic-billing-header" not in engine.messages[0].content
    assert engine.messages[3].tool_calls[0].name == "Read"
    assert engine.messages[4].tool_call_id == engine.messages[3].tool_calls[0].id
    assert request.ignored_fields() == ["context_management", "messages[].content[].cache_control", "metadata",
                                        "output_config.effort", "system[].cache_control"]
    assert engine.sampling.max_tokens == 32000


def test_codex_turn_two():
    request = parse(openai_responses.ResponsesRequest, _body("codex-exec_turn2_tool_result_POST_v1_responses.json"))
    engine = openai_responses.to_engine(request)
    assert [m.role for m in engine.messages] == ["system", "system", "user", "user", "assistant", "tool"]
    assert engine.messages[4].tool_calls[0].name == "exec_command"
    names = [t.name for t in engine.tools]
    assert "close_agent" in names and "web_search" not in names
    assert "tools[web_search]" in request.ignored_fields()
    assert request.tool_map().ref("close_agent").namespace == "multi_agent_v1"


def test_pi_chat_turn_two():
    request = parse(openai_chat.ChatRequest, _body("pi-openai-completions_turn2_tool_result.json"))
    engine = openai_chat.to_engine(request)
    assert [m.role for m in engine.messages] == ["system", "user", "assistant", "tool"]
    assert engine.messages[2].tool_calls[0].arguments == '{"path":"README.md"}'
    assert engine.sampling.max_tokens == 4096
    assert request.ignored_fields() == ["store"]
