"""Agent sessions kept warm: the conversation a session goes on with keeps its cached prefix past
the one-off side requests agents make (titles, summaries, quota checks), and the session is read
from what the real agents send."""

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from mashbox import Engine, EngineRequest, SamplingParams, Started
from mashbox.api.anthropic_messages import MessagesRequest
from mashbox.api.openai_responses import ResponsesRequest
from mashbox.engine.sched.prefix_cache import Session
from mashbox.server.generation import _field, session_of

CLIENTS = Path(__file__).parent / "fixtures" / "clients"  # copies of shared/clients


def _cached(engine: Engine, prompt: str, session: str | None) -> int:
    """The prompt tokens that came from the cache; read to its end (a request left at its Started event
    is aborted, its prompt cached as far as it got: how far, the machine's speed said)."""
    request = EngineRequest(prompt=prompt, sampling=SamplingParams(max_tokens=1), session=session)
    return next(e.cached for e in list(engine.stream(request)) if isinstance(e, Started))


def _line(name: str, turns: int) -> str:
    return " ".join(f"{name} said thing {i} in turn {t}." for t in range(turns) for i in range(12))


def _run(engine: Engine, sessions: bool) -> list[int]:
    """Two sessions of two turns, twenty side requests (half of them with a session's id), then
    each session's third turn: how many of its prompt tokens came from the cache."""
    ids = {"alpha": "s-alpha" if sessions else None, "beta": "s-beta" if sessions else None}
    for turns in (1, 2):
        for name in ids:
            _cached(engine, _line(name, turns), ids[name])
    for n in range(20):
        _cached(engine, f"Write a title for chat {n}: " + "word " * 280, ids["alpha"] if n % 2 else None)
    return [_cached(engine, _line(name, 3), ids[name]) for name in ids]


def test_a_session_keeps_its_conversation_past_side_requests(tiny_model_dir):
    options = {"ctx": 1024, "slots": 2, "cache_ram_mib": 1, "quiet": True}  # room for ~4k tokens
    with Engine(str(tiny_model_dir), **options) as engine:
        second_turn = len(engine.encode(EngineRequest(prompt=_line("alpha", 2)))) // 32 * 32
        assert _run(engine, sessions=True) == [second_turn, second_turn]  # both from host memory
        assert engine.stats().host_cache_evictions > 0  # the side requests did push entries out
    with Engine(str(tiny_model_dir), **options) as engine:
        assert _run(engine, sessions=False) == [0, 0]  # without sessions: least recently used went first


def _asides(engine: Engine, session: str) -> None:
    for n in range(20):  # each evicts: one-off titles of the session, and other clients' prompts
        _cached(engine, f"Write a title for chat {n}: " + "word " * 280, session if n % 2 else None)


def test_a_session_whose_history_was_rewritten_keeps_its_new_conversation(tiny_model_dir):
    """A compaction: the session's next turns go on with a new history, not its old line, and were taken for
    side requests (evicted first, the dead line kept) until the line came back, which it never does."""
    with Engine(str(tiny_model_dir), ctx=1024, slots=2, cache_ram_mib=1, quiet=True) as engine:
        for turns in (1, 2, 3):
            _cached(engine, _line("alpha", turns), "s")
        for turns in (1, 2):  # the history rewritten: it shares nothing with the old line
            _cached(engine, _line("omega", turns), "s")
        _asides(engine, "s")
        second_turn = len(engine.encode(EngineRequest(prompt=_line("omega", 2)))) // 32 * 32
        assert _cached(engine, _line("omega", 3), "s") == second_turn


def test_a_session_that_went_back_a_turn_keeps_it(tiny_model_dir):
    """A turn sent again (regenerated, edited after): the line is that turn now, whose KV only the longer
    entry of the turn after it held, and that entry was no session's: evicted by side requests (one slot: no
    slot keeps the turn)."""
    with Engine(str(tiny_model_dir), ctx=1024, slots=1, cache_ram_mib=1, quiet=True) as engine:
        for turns in (1, 2, 3, 2):
            _cached(engine, _line("alpha", turns), "s")
        _asides(engine, "s")
        second_turn = len(engine.encode(EngineRequest(prompt=_line("alpha", 2)))) // 32 * 32
        assert _cached(engine, _line("alpha", 2) + " Then something else.", "s") >= second_turn


def test_a_sessions_side_requests_that_share_its_tools_leave_its_conversation_warm(tiny_model_dir):
    """An agent's side requests carry its tools (and its session id): sharing half of the line, each was
    taken for a turn sent again and became the line, and the conversation went cold (worse than with no
    session id). The line it replaced is kept warm beside it."""
    tools = " ".join(f"Tool {i} reads a file by its path and returns its lines." for i in range(24))
    with Engine(str(tiny_model_dir), ctx=1024, slots=1, cache_ram_mib=1, quiet=True) as engine:
        for turns in (1, 2):
            _cached(engine, f"{tools} {_line('alpha', turns)}", "s")
        for n in range(12):  # each evicts: the session's own sub-agent calls, with the same tools
            _cached(engine, f"{tools} You are a sub-agent {n}: " + "word " * 120, "s")
        second_turn = len(engine.encode(EngineRequest(prompt=f"{tools} {_line('alpha', 2)}"))) // 32 * 32
        assert 2 * len(engine.encode(EngineRequest(prompt=tools))) >= second_turn  # the tools: half the line
        assert _cached(engine, f"{tools} {_line('alpha', 3)}", "s") == second_turn


def test_a_sessions_line_outlives_side_requests_in_a_row_longer_than_it():
    """Each side request sharing the tools became the line, and the second pushed the conversation
    out of ``before`` where both were longer than it."""
    tools = tuple(range(768))
    line = tools + tuple(range(1000, 1576))
    session = Session()
    session.follow(tools + tuple(range(1000, 1300)), 32)
    session.follow(line, 32)  # the next turn
    for n in range(3):
        session.follow(tools + tuple(range(5000 + 1000 * n, 5700 + 1000 * n)), 32)
        assert session.holds(line)
    session.follow(line + (7, 8, 9), 32)  # the conversation's next turn, then another side request
    session.follow(tools + tuple(range(9000, 9700)), 32)
    assert session.holds(line + (7, 8, 9))


@pytest.mark.parametrize("order", ["T1 S1 S2 T2 S3 T3", "T1 T2 S0 T2 S1 S2 T3", "T1 S1 S2 S3 S4 T2 S5 S6 T3"])
def test_a_sessions_turns_between_long_side_requests_stay_warm(order):
    """Side requests longer than the conversation, sharing its tools: a next turn after them was taken
    for an aside, and a later side request for a rewritten history (the conversation dropped)."""
    tools = tuple(range(768))
    turns = {f"T{n}": tools + tuple(range(1000, 1000 + 300 * n)) for n in (1, 2, 3)}
    session = Session()
    for step, name in enumerate(order.split()):
        if name.startswith("T"):
            if seen := [t for t in order.split()[:step] if t.startswith("T")]:
                assert session.holds(turns[max(seen)]), (order, step)  # the latest turn is warm
            session.follow(turns[name], 32)
        else:
            session.follow(tools + tuple(range(5000 + 2000 * step, 6500 + 2000 * step)), 32)
    assert session.holds(turns["T3"])


def _captured(name: str) -> tuple[dict, dict]:
    capture = json.loads((CLIENTS / name).read_text())
    return {k.lower(): v for k, v in capture["headers"].items()}, capture["body"]


@pytest.mark.parametrize(("name", "model"), [
    ("claude-code_POST_v1_messages.json", MessagesRequest),
    ("codex-exec_POST_v1_responses.json", ResponsesRequest),
    ("pi-openai-responses_POST_v1_responses.json", ResponsesRequest),
])
def test_the_session_is_read_from_what_each_agent_sends(name, model):
    headers, body = _captured(name)
    req = model.model_validate(body)
    session = next(v for k, v in headers.items() if "session" in k)
    assert session_of(headers, req) == session
    assert session_of({}, req) == (body.get("prompt_cache_key") or session)  # from the body alone too
    assert session_of({"x-session-id": "mine"}, req) == "mine"


def test_claude_code_1s_user_id_names_its_session():
    user = "user_5f3a_account_0d9e-11_session_6c2b-77"
    assert session_of({}, SimpleNamespace(metadata={"user_id": user})) == "6c2b-77"


@pytest.mark.parametrize("metadata", [["a"], "text", {"user_id": "[1]"}, {"user_id": "user_1_session_"}, {"user_id": "{not json"},
                                      {"user_id": '{"session_id": {"deep": 1}}'}, {"user_id": 7}, None])
def test_metadata_that_holds_no_session_is_no_session(metadata):
    assert session_of({}, SimpleNamespace(metadata=metadata)) is None


def test_a_session_id_is_one_printable_line_in_the_log():
    """Ids are written in the request's log line: a newline in one forged a line of its own, an escape coloured
    the terminal; a UTF-8 header read as Latin-1 named the session other than its prompt_cache_key."""
    forged = "abc\n2026-12-06 02:30:00,000 INFO mashbox.server: FORGED\x1b[31m\x00"
    assert session_of({}, SimpleNamespace(prompt_cache_key=forged)) == \
        "abc\\n2026-12-06 02:30:00,000 INFO mashbox.server: FORGED\\x1b[31m\\x00"
    claude = {"user_id": json.dumps({"session_id": "a\r\nX: y"})}
    assert session_of({}, SimpleNamespace(metadata=claude)) == "a\\r\\nX: y"
    header = "セッション".encode().decode("latin-1")  # what the ASGI server hands on
    assert session_of({"x-session-id": header}, SimpleNamespace()) == "セッション"
    assert len(session_of({}, SimpleNamespace(prompt_cache_key="\x00" * 500))) == 200


@pytest.mark.parametrize("session", ['x\\" tenant=admin note=\\', "abc tenant=admin", 'a"b', "-", "a\\"])
def test_a_session_id_is_one_field_of_the_log_line(session):
    """A backslash before the quote ended the quoted id early, and ``tenant=admin`` read as a field of its own."""
    line = f"chat session={_field(session)} tenant=default"
    assert shlex.split(line) == ["chat", f"session={session}", "tenant=default"]
