"""The MASHBOX Chat page of ``mashbox run --ui``: served right (plain HTTP), and used as a person
would in headless Chromium (Debian's ``chromium``, driven by Playwright) against real servers.

Answers that must be exact (hostile text, Markdown, thinking, tool calls, a full queue) are fixed
server-sent events fed through the real page code by routing its chat request; everything else
talks to ``mashbox run --ui`` on the embedded model. The screenshots land in docs/.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from fake_backend import FakeBackend
from playwright.sync_api import Page, Route, expect, sync_playwright
from server import serve
from test_cli_run import free_port, mashbox, poll_health

from mashbox.server.settings import Settings

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DOCS = Path(__file__).parent.parent / "docs"
KEY = "sk-ui-test"
WAIT_MS = 90_000  # a real answer on a busy 2-core machine


# -- plain HTTP: what the server sends ----------------------------------------------------------


@pytest.fixture(scope="module")
def page_server():
    """The app with --ui and a key, over a fake backend: the page and its files are open."""
    yield from serve(FakeBackend(), Settings(ui=True, api_keys={KEY: "alice"}))


@pytest.fixture(scope="module")
def api_server():
    yield from serve(FakeBackend(), Settings())


def asset_paths(html: str) -> list[str]:
    return sorted(set(re.findall(r'(?:src|href)="(ui/[0-9a-f]{16}/[\w.]+)"', html)))


def test_the_page_is_html_under_a_policy_that_allows_only_its_server(page_server):
    page = httpx.get(page_server + "/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "unsafe-inline" not in policy and "http" not in policy
    assert page.headers["cache-control"] == "no-cache"
    assert "<script" not in page.text.replace('<script type="module" src="ui/', "")  # no inline script
    assert "style=" not in page.text and "<style" not in page.text
    assert [path.rsplit("/", 1)[1] for path in asset_paths(page.text)] == ["app.css", "app.js", "icon.svg"]


def test_the_files_need_no_key_and_are_cached_for_a_year(page_server):
    paths = asset_paths(httpx.get(page_server + "/").text)
    types = {"app.css": "text/css", "app.js": "text/javascript", "icon.svg": "image/svg+xml"}
    for path in paths:
        answer = httpx.get(f"{page_server}/{path}")
        assert answer.status_code == 200, path
        assert answer.headers["content-type"].startswith(types[path.rsplit("/", 1)[1]])
        assert answer.headers["cache-control"] == "public, max-age=31536000, immutable"
    stale = re.sub(r"ui/[0-9a-f]{16}/", "ui/0000000000000000/", paths[0])
    assert httpx.get(f"{page_server}/{stale}").status_code == 404  # another release's file
    assert httpx.get(f"{page_server}/ui/{paths[0].split('/')[1]}/index.html").status_code == 404
    assert httpx.get(f"{page_server}/v1/models").status_code == 401  # the API keeps its key
    assert httpx.get(f"{page_server}/health").json()["status"] == "ok"


def test_the_page_loads_behind_a_proxy_that_rewrote_host_and_its_calls_say_why_they_are_refused(page_server):
    """nginx's plain ``proxy_pass`` sends the upstream's Host, and the browser sends the proxy's Origin with
    the page's script: that was a 403, and the page stayed at "connecting" with no word of why."""
    port = int(page_server.rsplit(":", 1)[1])
    proxied = {"Host": f"127.0.0.1:{port}", "Origin": f"http://localhost:{port + 1}"}
    for path in asset_paths(httpx.get(page_server + "/").text):
        assert httpx.get(f"{page_server}/{path}", headers=proxied).status_code == 200, path
    call = httpx.post(f"{page_server}/v1/chat/completions", headers={**proxied, "authorization": f"Bearer {KEY}"},
                      json={"messages": [{"role": "user", "content": "hi"}]})
    assert call.status_code == 403
    assert "--allow-origin" in call.json()["error"]["message"] and "Host" in call.json()["error"]["message"]


def test_without_ui_the_root_is_health_and_there_are_no_files(api_server):
    root = httpx.get(api_server + "/")
    assert root.headers["content-type"] == "application/json" and root.json()["status"] == "ok"
    assert "content-security-policy" not in root.headers
    assert httpx.get(api_server + "/ui/0000000000000000/app.js").status_code == 404


# -- the browser -------------------------------------------------------------------------------


def chromium() -> str:
    if CHROMIUM.exists():
        return str(CHROMIUM)
    reason = f"the browser tests need Debian's chromium at {CHROMIUM}: `make test` installs it as root"
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    executable = chromium()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def run_ui(*args, env=None):
    """``mashbox run --ui`` on a free port, until it answers health with 200."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = mashbox(*args, "--ui", "--port", str(port), env=env)
    try:
        poll_health(url, process, timeout=240)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert "Traceback" not in err, err


@pytest.fixture(scope="module")
def smol():
    """The embedded model, as `make run` serves it (fewer slots: less memory)."""
    yield from run_ui("--slots", "2", "--ctx", "2048")


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    yield from run_ui(str(tiny_model_dir), "--ctx", "512", "--slots", "1", env={"MASHBOX_API_KEY": KEY})


class Tab:
    """A fresh browser context and page; what its console said; no uncaught errors allowed."""

    def __init__(self, browser, width: int = 1280, height: int = 860) -> None:
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page: Page = self.context.new_page()
        self.console: list[str] = []
        self.crashes: list[str] = []
        self.page.on("console", lambda message: self.console.append(f"{message.type}: {message.text}"))
        self.page.on("pageerror", lambda error: self.crashes.append(str(error)))

    def errors(self) -> list[str]:
        return [line for line in self.console if line.startswith("error")]

    def open(self, url: str, model: str | None = "smollm2-135m") -> Page:
        self.page.goto(url + "/")
        if model:
            expect(self.page.locator("#model-id")).to_have_text(model, timeout=WAIT_MS)
        return self.page


@pytest.fixture
def tab(browser):
    tab = Tab(browser)
    yield tab
    tab.context.close()
    assert not tab.crashes


def ask(page: Page, text: str) -> None:
    page.locator("#prompt").fill(text)
    page.locator("#prompt").press("Enter")


def answered(page: Page, n: int = 1):
    """The n-th answer, once it is finished (its Regenerate button shows)."""
    answer = page.locator(".msg.assistant").nth(n - 1)
    expect(answer.get_by_role("button", name="Regenerate")).to_be_visible(timeout=WAIT_MS)
    return answer


def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-fixed", "object": "chat.completion.chunk", "created": 0, "model": "fixed",
            "choices": choices, **extra}


def events(*chunks: dict) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def pieces(text: str) -> list[str]:
    """``text`` cut as a model streams it: a word at a time, spaces and newlines kept."""
    return re.findall(r"\s*\S+", text) + re.findall(r"\s+$", text)


def answer_with(text: str, reasoning: str = "", tools=(), finish="stop") -> str:
    timings = {"prompt_n": 12, "prompt_ms": 80.0, "prompt_per_second": 150.0, "predicted_n": 42,
               "predicted_ms": 1400.0, "predicted_per_second": 29.3, "cache_n": 0, "queue_ms": 0.5}
    usage = {"prompt_tokens": 12, "completion_tokens": 42, "total_tokens": 54,
             "prompt_tokens_details": {"cached_tokens": 0}}
    return events(
        chunk({"role": "assistant", "content": ""}),
        *(chunk({"reasoning_content": part, "reasoning": part}) for part in pieces(reasoning)),
        *(chunk({"content": piece}) for piece in pieces(text)),
        *(chunk({"tool_calls": [call]}) for call in tools),
        chunk({}, finish, timings=timings),
        chunk(None, usage=usage, timings=timings),
    )


def fixed(page: Page, body: str, requests: list | None = None) -> None:
    """Answer the page's chat requests with ``body`` (server-sent events); keep what it sent."""

    def fulfil(route: Route) -> None:
        if requests is not None:
            requests.append(route.request.post_data_json)
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body)

    page.route("**/v1/chat/completions", fulfil)


def test_a_question_gets_a_streamed_answer_that_a_reload_keeps(smol, tab):
    page = tab.open(smol)
    assert tab.errors() == [], tab.console
    expect(page.locator("#model-facts")).to_have_text("ctx 2048 · 2 slots")
    ask(page, "Describe the eight planets of the solar system, one paragraph each.")  # long enough to watch
    expect(page.locator("#prompt")).to_be_focused()
    reply = page.locator(".msg.assistant .content")
    page.wait_for_function("() => document.querySelector('.msg.assistant .content')?.textContent.length > 0"
                           " && !document.querySelector('#stop').hidden", timeout=WAIT_MS)  # text while it streams
    answer = answered(page)
    assert reply.inner_text().strip()
    expect(answer.locator(".facts")).to_contain_text("tok/s")
    expect(answer.locator(".facts")).to_contain_text("prompt")
    text = reply.inner_text()
    page.reload()
    expect(page.locator(".msg.user")).to_contain_text("Describe the eight planets")
    expect(page.locator(".msg.assistant .content")).to_have_text(text, use_inner_text=True)
    expect(page.locator("#chats li")).to_have_count(1)
    assert tab.errors() == [], tab.console


def test_stop_ends_the_answer_and_frees_the_slot(smol, tab):
    page = tab.open(smol)
    ask(page, "Write a very long story about a dragon who learns to bake bread, in ten chapters.")
    page.wait_for_function("() => document.querySelector('.msg.assistant .content')?.textContent.length > 20",
                           timeout=WAIT_MS)
    page.locator("#stop").click()
    expect(page.locator(".msg.assistant .note")).to_have_text("Stopped.")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#prompt")).to_be_focused()
    deadline = page.evaluate("Date.now()") + 10_000
    while (health := httpx.get(smol + "/health").json())["live_rows"] != 0:
        assert page.evaluate("Date.now()") < deadline, health
        page.wait_for_timeout(100)


def test_a_prompt_longer_than_the_context_shows_the_servers_message(smol, tab):
    page = tab.open(smol)
    ask(page, "planet " * 3000)
    expect(page.locator(".msg.assistant .note.error")).to_contain_text("context", timeout=WAIT_MS)


def test_a_conversation_that_outgrew_the_context_goes_on_without_its_oldest_turns(smol, tab):
    page = tab.open(smol)
    page.get_by_role("button", name="Settings").click()
    page.locator("#max_tokens").fill("4")
    sent: list[dict] = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    ask(page, "planet " * 1200)  # ~1,200 of the 2,048 tokens: two of them do not fit
    answered(page)
    ask(page, "moon " * 1200)
    second = answered(page, 2)
    expect(second.locator(".note")).to_contain_text("its 1 oldest turn was left out")
    assert [len(body["messages"]) for body in sent] == [1, 3, 1]  # the second request refused, sent again
    assert len({body["prompt_cache_key"] for body in sent}) == 1  # one session: kept warm, on one replica
    expect(page.locator(".msg")).to_have_count(4)  # the conversation itself keeps every turn


def test_a_setting_the_server_refuses_is_named(smol, tab):
    page = tab.open(smol)
    page.get_by_role("button", name="Settings").click()
    page.locator("#temperature").fill("9")
    ask(page, "Hi")
    expect(page.locator(".msg.assistant .note.error")).to_contain_text("(Settings: temperature)", timeout=WAIT_MS)
    page.locator("#temperature").fill("")
    sent = []
    fixed(page, answer_with("Hello."), sent)
    ask(page, "Hi again")
    answered(page, 2)
    assert sent[0]["messages"] == [{"role": "user", "content": "Hi again"}], "the question with no answer left out"


def test_on_a_touch_screen_enter_starts_a_new_line_and_the_button_sends(smol, browser):
    """A phone's keyboard has no Shift+Enter: Enter sent, so no question could have two lines."""
    context = browser.new_context(viewport={"width": 390, "height": 844}, has_touch=True, is_mobile=True)
    try:
        page = context.new_page()
        page.goto(smol + "/")
        sent = []
        fixed(page, answer_with("Two lines."), sent)
        prompt = page.locator("#prompt")
        prompt.fill("line one")
        prompt.press("Enter")
        prompt.press_sequentially("line two")
        expect(prompt).to_have_value("line one\nline two")
        assert not sent
        page.locator("#send").tap()
        expect(page.locator(".msg.user .content")).to_have_text("line one\nline two", timeout=WAIT_MS)
        assert sent[0]["messages"][-1]["content"] == "line one\nline two"
    finally:
        context.close()


def test_model_output_never_becomes_html(smol, tab):
    page = tab.open(smol)
    hostile = ("Look: <img src=x onerror=\"window.pwned=1\"> and <script>window.pwned=2</script>\n\n"
               "[click](javascript:window.pwned=3) or [docs](https://example.org/a?b=1)\n\n"
               "```html\n<img src=x onerror=\"window.pwned=4\">\n```\n")
    fixed(page, answer_with(hostile))
    ask(page, "Say something dangerous.")
    answer = answered(page)
    log = page.locator("#log")
    expect(log.locator("img")).to_have_count(0)
    expect(log.locator("script")).to_have_count(0)
    assert page.evaluate("window.pwned") is None
    expect(answer.locator(".content")).to_contain_text('<img src=x onerror="window.pwned=1">')
    expect(answer.locator(".content")).to_contain_text("<script>window.pwned=2</script>")
    expect(answer.locator("a")).to_have_count(1)
    link = answer.locator("a")
    assert link.get_attribute("href") == "https://example.org/a?b=1"
    assert link.get_attribute("rel") == "noopener noreferrer"
    expect(answer.locator("pre code")).to_have_text('<img src=x onerror="window.pwned=4">')


def test_a_title_is_cut_between_characters(smol, tab):
    """The first 60 UTF-16 units of "x" * 59 + "😀" left half of the emoji's pair: a broken title, kept."""
    page = tab.open(smol)
    fixed(page, answer_with("Hi."))
    ask(page, "x" * 59 + "😀 and more words")
    answered(page)
    titles = page.evaluate("() => JSON.parse(localStorage.getItem('mashbox.chats')).map((c) => c.title)")
    assert titles == ["x" * 59 + "😀"]


def test_markdown_thinking_tool_calls_and_a_cut_answer_render(smol, tab):
    page = tab.open(smol)
    text = ("## Planets\n\n1. **Mercury** is *small*\n2. Venus has `CO2`\n   - hot\n\n"
            "| planet | moons |\n|---|--:|\n| Earth | 1 |\n| Mars | 2 |\n\n"
            "```python\ndef moons(planet):  # count\n    return {'Mars': 2}[planet]\n```\n")
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    fixed(page, answer_with(text, "First I recall the planets.", tools=[call], finish="length"))
    page.locator("#settings-toggle").click()
    page.locator("#max_tokens").fill("42")
    page.keyboard.press("Escape")
    ask(page, "Tell me about planets.")
    answer = answered(page)
    expect(answer.locator("h2")).to_have_text("Planets")
    expect(answer.locator("ol > li")).to_have_count(2)
    expect(answer.locator("ol strong")).to_have_text("Mercury")
    expect(answer.locator("ol li ul li")).to_have_text("hot")
    expect(answer.locator("table tbody tr")).to_have_count(2)
    expect(answer.locator("td").nth(3)).to_have_css("text-align", "right")
    expect(answer.locator(".code .tk-k").first).to_have_text("def")
    expect(answer.locator(".code .tk-c")).to_have_text("# count")
    expect(answer.get_by_role("button", name="Copy").first).to_be_visible()
    thinking = answer.locator("details.thinking")
    expect(thinking.locator("summary")).to_have_text("Thought")
    expect(thinking.locator(".thinking-text")).to_be_hidden()
    thinking.locator("summary").click()
    expect(thinking.locator(".thinking-text")).to_have_text("First I recall the planets.")
    expect(answer.locator(".tool-name")).to_have_text("Tool call: get_weather")
    expect(answer.locator(".tool pre")).to_have_text('{"city": "Paris"}')
    expect(answer.locator(".note")).to_have_text("Cut by max tokens (42).")
    expect(answer.locator(".facts")).to_have_text("42 tokens · 29.3 tok/s · prompt 12 · first token in 0.08 s")


def test_turns_regenerate_edit_new_chat_delete_and_export(smol, tab):
    page = tab.open(smol)
    sent: list[dict] = []
    fixed(page, answer_with("Noted."), sent)
    ask(page, "My name is Ada.")
    answered(page)
    ask(page, "What is my name?")
    answered(page, 2)
    assert [m["content"] for m in sent[1]["messages"]] == ["My name is Ada.", "Noted.", "What is my name?"]
    assert sent[1]["stream"] is True and sent[1]["stream_options"] == {"include_usage": True}
    page.locator(".msg.assistant").nth(1).get_by_role("button", name="Regenerate").click()
    answered(page, 2)
    assert sent[2]["messages"] == sent[1]["messages"]
    page.locator(".msg.user").nth(1).get_by_role("button", name="Edit").click()
    page.get_by_label("Edit your message").fill("What is my name, again?")
    page.get_by_label("Edit your message").press("Enter")
    answered(page, 2)
    assert sent[3]["messages"][-1]["content"] == "What is my name, again?" and len(sent[3]["messages"]) == 3
    expect(page.locator(".msg")).to_have_count(4)
    page.get_by_role("button", name="New chat").click()
    expect(page.locator(".msg")).to_have_count(0)
    ask(page, "Hello")
    answered(page)
    expect(page.locator("#chats li")).to_have_count(2)
    with page.expect_download() as download:
        page.get_by_role("button", name="Export all (JSON)").click()
    exported = json.loads(Path(download.value.path()).read_text())
    assert [chat["title"] for chat in exported] == ["Hello", "My name is Ada."]
    page.get_by_role("button", name="Delete “Hello”").click()
    expect(page.locator("#chats li")).to_have_count(1)
    expect(page.locator(".msg.user .content").first).to_have_text("My name is Ada.")


def test_conversations_of_two_tabs_are_all_kept_and_a_delete_holds(smol, tab):
    """Two tabs share one list in localStorage: each saves the others' conversations with its own (it
    once wrote back the list it read at load, so the last tab to save lost the first's), and a
    conversation deleted in one is not saved back by another."""
    first = tab.open(smol)
    second = tab.context.new_page()
    second.goto(smol + "/")
    for page, text in ((first, "Alpha."), (second, "Beta.")):
        fixed(page, answer_with(text))
    first.get_by_role("button", name="New chat").click()
    ask(first, "Conversation ALPHA")
    answered(first)
    second.get_by_role("button", name="New chat").click()
    ask(second, "Conversation BETA")
    answered(second)
    expect(first.locator("#chats li")).to_have_count(2)  # told by the other tab's save
    third = tab.context.new_page()
    third.goto(smol + "/")
    expect(third.locator("#chats li")).to_have_count(2)
    first.get_by_role("button", name="Delete “Conversation BETA”").click()
    expect(second.locator("#chats li")).to_have_count(1)  # and BETA, shown there, gives way
    expect(second.locator(".msg.user .content")).to_have_text(["Conversation ALPHA"])
    ask(second, "And again")
    answered(second, 2)
    third.reload()
    expect(third.locator("#chats li")).to_have_count(1)
    expect(third.locator(".msg.user .content")).to_have_text(["Conversation ALPHA", "And again"])


def test_backslash_escapes_and_addresses_with_parentheses(smol, tab):
    page = tab.open(smol)
    text = (r"Call it with \*args and define \_\_init\_\_; 5 \* 3 \* 2 = 30" "\n\n"
            "[Python (language)](https://en.wikipedia.org/wiki/Python_(programming_language)) and "
            "https://en.wikipedia.org/wiki/Rust_(programming_language).")
    fixed(page, answer_with(text))
    ask(page, "Markdown, please.")
    answer = answered(page)
    expect(answer.locator("p").first).to_have_text("Call it with *args and define __init__; 5 * 3 * 2 = 30")
    expect(answer.locator("em")).to_have_count(0)
    links = answer.locator("a")
    expect(links).to_have_text(["Python (language)", "https://en.wikipedia.org/wiki/Rust_(programming_language)"])
    assert links.nth(0).get_attribute("href") == "https://en.wikipedia.org/wiki/Python_(programming_language)"


def test_a_stream_that_ends_before_its_answer_is_said_to_be_cut(smol, tab):
    page = tab.open(smol)
    fixed(page, f"data: {json.dumps(chunk({'content': 'partial then cut'}))}\n\n")  # no finish, no [DONE]
    ask(page, "Hello")
    answer = answered(page)
    expect(answer.locator(".content")).to_have_text("partial then cut")
    expect(answer.locator(".note.error")).to_have_text("The answer was cut off: its stream ended early.")


def test_a_failed_save_stays_said_until_a_save_works(smol, tab):
    """The health check that follows every answer cleared the banner, so a full store lost every later
    conversation unsaid."""
    page = tab.open(smol)
    page.evaluate("""() => { // fill this origin's storage up to the last few characters
        for (let size = 1 << 20, i = 0; size >= 1; size >>= 1) {
            try { for (;;) localStorage.setItem(`junk${i++}`, "x".repeat(size)); } catch {}
        }
    }""")
    fixed(page, answer_with("Noted."))
    ask(page, "Will this be kept?")
    answered(page)
    banner = page.locator("#banner")
    expect(banner).to_contain_text("cannot be saved")
    page.wait_for_timeout(2000)  # the health check after the answer has come and gone
    expect(banner).to_contain_text("cannot be saved")
    page.evaluate("() => Object.keys(localStorage).filter((k) => k.startsWith('junk')).forEach((k) => localStorage.removeItem(k))")
    ask(page, "And now?")
    answered(page, 2)
    expect(banner).to_be_hidden()
    assert len(json.loads(page.evaluate("localStorage.getItem('mashbox.chats')"))[0]["messages"]) == 4


class Trickle(BaseHTTPRequestHandler):
    """Chat chunks a few milliseconds apart, as a fast model writes them: the last user message says how
    many (``N words``) and how far apart (``every S s``)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        asked = json.loads(self.rfile.read(int(self.headers["content-length"])))["messages"][-1]["content"]
        words, every = re.search(r"(\d+) words every ([\d.]+)", asked).groups()
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        try:
            for i in range(int(words)):
                piece = f"## Part {i}\n\nword{i} " if i % 5 == 0 else f"word{i}\n\n"
                self.wfile.write(f"data: {json.dumps(chunk({'content': piece}))}\n\n".encode())
                self.wfile.flush()
                time.sleep(float(every))
            self.wfile.write(events(chunk({}, "stop")).encode())
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture(scope="module")
def trickle():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"
    server.shutdown()


def trickled(page: Page, url: str) -> None:
    page.route("**/v1/chat/completions", lambda route: route.continue_(url=url))


def test_the_view_follows_a_fast_answer_to_its_end(smol, tab, trickle):
    """A smooth scroll still under way at the next frame read as the reader scrolling up: the view stopped
    following an answer that grew 80 px a frame or more."""
    page = tab.open(smol)
    trickled(page, trickle)
    ask(page, "400 words every 0.006")
    gaps = []
    while page.locator("#stop").is_visible():
        gaps.append(page.evaluate("(l => l.scrollHeight - l.scrollTop - l.clientHeight)(document.querySelector('#log'))"))
        page.wait_for_timeout(150)
    assert len(gaps) > 5 and max(gaps[2:]) < 400, gaps


def test_a_reload_while_answering_keeps_what_had_come(smol, tab, trickle):
    page = tab.open(smol)
    trickled(page, trickle)
    ask(page, "500 words every 0.02")
    expect(page.locator(".msg.assistant .content")).to_contain_text("word20", timeout=WAIT_MS)
    page.reload()
    answer = page.locator(".msg.assistant")
    expect(answer.locator(".content")).to_contain_text("word20")
    expect(answer.locator(".note")).to_have_text("Stopped.")


def test_another_tabs_save_leaves_an_edit_and_a_deleted_answer_is_left(smol, tab, trickle):
    """Another tab's save rebuilt this tab's view (an edit under way lost, the reader sent to the bottom); a
    conversation deleted by another tab while it was answered here took later turns that were never kept."""
    first = tab.open(smol)
    fixed(first, answer_with("Noted."))
    ask(first, "First conversation")
    answered(first)
    first.locator(".msg.user").get_by_role("button", name="Edit").click()
    first.get_by_label("Edit your message").fill("half-typed edit")
    second = tab.context.new_page()
    second.goto(smol + "/")
    fixed(second, answer_with("Beta."))
    second.get_by_role("button", name="New chat").click()
    ask(second, "Second conversation")
    answered(second)
    expect(first.locator("#chats li")).to_have_count(2)
    expect(first.get_by_label("Edit your message")).to_have_value("half-typed edit")
    first.get_by_label("Edit your message").press("Escape")
    first.get_by_role("button", name="New chat").click()
    trickled(first, trickle)
    ask(first, "300 words every 0.05")
    expect(first.locator(".msg.assistant .content")).to_contain_text("word3", timeout=WAIT_MS)
    expect(second.locator("#chats li")).to_have_count(3)
    second.get_by_role("button", name="Delete “300 words every 0.05”").click()
    expect(first.locator("#stop")).to_be_hidden(timeout=3000)  # deleted there: it stops here, not in 15 s
    expect(first.locator(".msg.user .content")).not_to_have_text(["300 words every 0.05"])
    expect(first.locator("#chats li")).to_have_count(2)


def test_an_answer_written_in_another_tab_holds_the_composer_and_no_turn_is_lost(smol, tab, trickle):
    """Another tab's answer, still being written, showed here as a finished empty one (Regenerate, Copy), and a
    question sent here meanwhile, with its answer, vanished when that answer ended: its tab saved over them."""
    first = tab.open(smol)
    trickled(first, trickle)
    ask(first, "200 words every 0.05")
    expect(first.locator(".msg.assistant .content")).to_contain_text("word3", timeout=WAIT_MS)
    second = tab.context.new_page()
    second.goto(smol + "/")
    fixed(second, answer_with("Paris."))
    written = second.locator(".msg.assistant")
    expect(written.locator(".note")).to_have_text("Being written in another tab…")
    expect(written.get_by_role("button")).to_have_count(0)
    expect(second.locator("#held")).to_be_visible()
    ask(second, "What is the capital of France?")
    expect(second.locator("#prompt")).to_have_value("What is the capital of France?")  # held, not sent
    expect(second.locator(".msg")).to_have_count(2)
    expect(first.locator("#send")).to_be_visible(timeout=WAIT_MS)  # the answer ended there
    expect(written.get_by_role("button", name="Regenerate")).to_be_visible()  # and here
    expect(second.locator("#held")).to_be_hidden()
    second.locator("#prompt").press("Enter")
    answered(second, 2)
    expect(first.locator(".msg.user .content")).to_have_text(["200 words every 0.05", "What is the capital of France?"])
    stored = first.evaluate("JSON.parse(localStorage.getItem('mashbox.chats'))")
    assert [m["content"] for m in stored[0]["messages"]][2:] == ["What is the capital of France?", "Paris."]


def test_a_conversation_another_tab_saves_while_answered_here_is_kept_with_the_answer_apart(smol, tab, trickle):
    """A tab that saved a conversation after another tab began an answer in it (one that took that answer for one
    left by a closed tab, or sent at the same moment) lost its turns when the answer ended."""
    page = tab.open(smol)
    trickled(page, trickle)
    ask(page, "100 words every 0.05")
    expect(page.locator(".msg.assistant .content")).to_contain_text("word3", timeout=WAIT_MS)
    other = tab.context.new_page()
    other.goto(smol + "/health")  # the same origin, and its storage
    other.evaluate("""() => {
        const chats = JSON.parse(localStorage.getItem("mashbox.chats"));
        Object.assign(chats[0].messages.at(-1), { pending: false, stopped: true });
        chats[0].messages.push({ role: "user", content: "Sent in the other tab" },
                               { role: "assistant", content: "Kept." });
        chats[0].updated = Date.now();
        localStorage.setItem("mashbox.chats", JSON.stringify(chats));
    }""")
    expect(page.locator("#chats li")).to_have_count(2)
    answer = page.locator(".msg.assistant")
    expect(answer.locator(".note")).to_contain_text("Another tab wrote in this conversation", timeout=WAIT_MS)
    expect(answer.get_by_role("button", name="Regenerate")).to_be_visible(timeout=WAIT_MS)
    expect(answer.locator(".content")).to_contain_text("word99")
    stored = {chat["title"]: [m["content"] for m in chat["messages"]]
              for chat in page.evaluate("JSON.parse(localStorage.getItem('mashbox.chats'))")}
    assert stored["100 words every 0.05"][2:] == ["Sent in the other tab", "Kept."]
    assert "word99" in stored["100 words every 0.05 (copy)"][1]


def test_an_answer_left_by_a_killed_tab_ends_as_stopped(smol, tab):
    """A killed tab leaves its answer marked as being written: it must not hold the conversation for good."""
    page = tab.open(smol)
    other = tab.context.new_page()
    other.goto(smol + "/health")
    other.evaluate("""() => localStorage.setItem("mashbox.chats", JSON.stringify([{
        id: "left", title: "Left mid-answer", created: new Date().toISOString(), updated: Date.now(),
        messages: [{ role: "user", content: "Left mid-answer" },
                   { role: "assistant", content: "Half an", reasoning: "", tools: [], pending: true, tab: "killed" }],
    }]))""")
    page.get_by_role("button", name="Left mid-answer", exact=True).click()
    answer = page.locator(".msg.assistant")
    expect(answer.locator(".note")).to_have_text("Being written in another tab…")
    expect(page.locator("#held")).to_be_visible()
    expect(answer.locator(".note")).to_have_text("Stopped.", timeout=30_000)  # not saved again for 10 s
    expect(answer.get_by_role("button", name="Regenerate")).to_be_visible()
    expect(page.locator("#held")).to_be_hidden()


def test_a_conversation_left_while_its_answer_is_written_keeps_its_buttons(smol, tab, trickle):
    """The conversation shown next, or left after a delete, was drawn while the answer left behind was still ending:
    without its Edit, Regenerate and Copy buttons."""
    page = tab.open(smol)
    fixed(page, answer_with("Hi."))
    ask(page, "Say hi.")
    answered(page)
    trickled(page, trickle)
    page.get_by_role("button", name="New chat").click()
    ask(page, "300 words every 0.05")
    expect(page.locator(".msg.assistant .content")).to_contain_text("word3", timeout=WAIT_MS)
    page.get_by_role("button", name="Say hi.", exact=True).click()
    expect(page.get_by_role("button", name="Regenerate")).to_be_visible()
    expect(page.get_by_role("button", name="Edit")).to_be_visible()
    page.get_by_role("button", name="300 words every 0.05", exact=True).click()
    expect(page.locator(".msg.assistant .note")).to_have_text("Stopped.")  # leaving it stopped it
    page.get_by_role("button", name="Regenerate").click()
    expect(page.locator(".msg.assistant .content")).to_contain_text("word3", timeout=WAIT_MS)
    page.get_by_role("button", name="Delete “300 words every 0.05”").click()
    expect(page.locator(".msg.user .content")).to_have_text(["Say hi."])
    expect(page.get_by_role("button", name="Regenerate")).to_be_visible()
    expect(page.get_by_role("button", name="Edit")).to_be_visible()


def test_the_view_keeps_the_readers_place_when_an_answer_ends(smol, tab, trickle):
    page = tab.open(smol)
    trickled(page, trickle)
    ask(page, "200 words every 0.05")
    expect(page.locator(".msg.assistant .content")).to_contain_text("word60", timeout=WAIT_MS)
    log = page.locator("#log")
    log.evaluate("log => log.scrollTo({ top: 0, behavior: 'instant' })")
    assert page.locator("#stop").is_visible()  # the reader went up while it was written
    answered(page)
    assert log.evaluate("log => [log.scrollTop, log.scrollHeight - log.clientHeight > 1000]") == [0, True]


def test_an_answer_cut_by_the_context_says_so_when_max_tokens_is_set(smol, tab):
    """Any answer cut for its length was said to be cut by max tokens once they were set, though it had 42 of 2,000."""
    page = tab.open(smol)
    fixed(page, answer_with("Once upon a time", finish="length"))
    page.locator("#settings-toggle").click()
    page.locator("#max_tokens").fill("2000")
    page.keyboard.press("Escape")
    ask(page, "A long story, please.")
    expect(answered(page).locator(".note")).to_have_text("Cut: the answer reached the end of the context.")


def test_a_long_line_of_marks_that_never_close_renders_at_once(smol, tab):
    """One pattern for all inline spans looked for a closing mark from each opening one: a line of 60,000 "**a "
    took half a minute, the page frozen."""
    page = tab.open(smol)
    fixed(page, events(chunk({"content": "**a " * 80_000 + "\n\n**bold** and `code`"}), chunk({}, "stop")))
    ask(page, "Marks.")
    answer = page.locator(".msg.assistant")
    expect(answer.get_by_role("button", name="Regenerate")).to_be_visible(timeout=10_000)
    expect(answer.locator("strong")).to_have_text("bold")
    expect(answer.locator("code")).to_have_text("code")
    expect(answer.locator("p").first).to_contain_text("**a **a")


def test_a_full_queue_is_said_and_the_request_sent_again(smol, tab):
    page = tab.open(smol)
    tries = []

    def busy_once(route: Route) -> None:
        tries.append(1)
        if len(tries) == 1:
            full = {"error": {"message": "queue full", "type": "rate_limit_error"}}
            route.fulfill(status=429, headers={"retry-after": "1"}, json=full)
        else:
            route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=answer_with("Finally."))

    page.route("**/v1/chat/completions", busy_once)
    ask(page, "Hello?")
    expect(page.locator("#banner")).to_contain_text("queue is full")
    expect(answered(page).locator(".content")).to_have_text("Finally.")
    expect(page.locator("#banner")).to_be_hidden()
    assert len(tries) == 2


def test_a_loading_model_shows_a_notice_that_turns_into_the_chat(smol, tab):
    page = tab.page
    loading = {"status": "loading", "live_rows": None, "waiting": 0}
    page.route("**/health", lambda route: route.fulfill(status=503, json=loading))
    tab.open(smol, model=None)
    expect(page.locator("#banner")).to_contain_text("The model is loading")
    expect(page.locator("#status-dot")).to_have_attribute("data-state", "loading")
    page.unroute("**/health")
    expect(page.locator("#model-id")).to_have_text("smollm2-135m", timeout=10_000)
    expect(page.locator("#banner")).to_be_hidden()


def test_a_gone_server_shows_a_banner_until_it_is_back(smol, tab):
    page = tab.open(smol)
    for path in ("**/health", "**/v1/chat/completions"):
        page.route(path, lambda route: route.abort())
    ask(page, "Are you there?")
    expect(answered(page).locator(".note.error")).to_have_text("The connection to the server was lost.")
    expect(page.locator("#banner")).to_contain_text("The server is not answering")
    expect(page.locator("#status-dot")).to_have_attribute("data-state", "gone")
    page.unroute("**/health")
    page.get_by_role("button", name="Retry now").click()
    expect(page.locator("#banner")).to_be_hidden()
    expect(page.locator("#status-dot")).to_have_attribute("data-state", "ready")


def test_a_server_with_keys_asks_for_one_once(keyed, tab):
    page = tab.open(keyed, model=None)
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text("This server needs an API key")
    page.get_by_label("API key", exact=True).fill("sk-wrong")
    page.get_by_label("API key", exact=True).press("Enter")
    expect(dialog).to_contain_text("invalid API key")
    page.get_by_label("API key", exact=True).fill(KEY)
    page.get_by_role("button", name="Use this key").click()
    expect(dialog).to_be_hidden()
    expect(page.locator("#model-id")).not_to_have_text("connecting…", timeout=WAIT_MS)
    page.locator("#settings-toggle").click()
    page.locator("#max_tokens").fill("4")
    page.locator("#settings-close").click()
    ask(page, "Hello")
    expect(answered(page).locator(".note")).to_have_text("Cut by max tokens (4).")
    page.reload()
    expect(page.locator("#model-id")).not_to_have_text("connecting…", timeout=WAIT_MS)
    expect(dialog).to_be_hidden()
    assert page.evaluate("sessionStorage.getItem('mashbox.key')") == KEY


SAMPLE = """Here is a quick way to **reverse a string** in Python: slice it with a step of `-1`.

```python
def reverse(text: str) -> str:
    return text[::-1]  # a step of -1 walks from the end

print(reverse("mashbox"))  # xobhsam
```

| way | cost |
|---|---|
| `text[::-1]` | one copy |
| `"".join(reversed(text))` | one copy, slower |
"""


def test_screenshots_at_desktop_and_phone_widths(smol, browser):
    tab = Tab(browser, 1280, 800)
    page = tab.open(smol)
    fixed(page, answer_with(SAMPLE, reasoning="The user wants a one-liner; slicing is the idiom."))
    ask(page, "How do I reverse a string in Python?")
    answered(page)
    page.locator("#prompt").blur()
    DOCS.mkdir(exist_ok=True)
    page.screenshot(path=DOCS / "ui-1280.png")
    page.emulate_media(color_scheme="dark", reduced_motion="reduce")  # no sliding panel mid-shot
    page.set_viewport_size({"width": 390, "height": 844})
    page.locator("#log").evaluate("log => { log.style.scrollBehavior = 'auto'; log.scrollTop = 0; }")
    page.screenshot(path=DOCS / "ui-390.png")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than a phone
    tab.context.close()
    assert not tab.crashes


def test_a_key_that_cannot_be_sent_is_asked_for_again(keyed, tab):
    """A key with a character outside Latin-1 made fetch throw: the page said "the server is not answering"
    for good (the key kept in sessionStorage), and the key dialog never came back."""
    page = tab.open(keyed, model=None)
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text("This server needs an API key")
    page.get_by_label("API key", exact=True).fill("sk-bob€")
    page.get_by_label("API key", exact=True).press("Enter")
    expect(dialog).to_be_visible()  # the field refuses it
    page.evaluate("sessionStorage.setItem('mashbox.key', 'sk-bob€')")  # kept by a page from before
    page.reload()
    expect(dialog).to_contain_text("printable ASCII")
    expect(page.locator("#status-dot")).not_to_have_attribute("data-state", "gone")
    page.get_by_label("API key", exact=True).fill(KEY)
    page.get_by_role("button", name="Use this key").click()
    expect(page.locator("#model-id")).not_to_have_text("connecting…", timeout=WAIT_MS)


def test_the_page_works_where_the_browser_gives_no_random_uuid(smol, tab):
    """crypto.randomUUID exists only in a secure context: a server on the LAN (--host with keys), its page over
    plain http, had the page stop at its first line (every tab and conversation id came from it)."""
    tab.context.add_init_script("delete Crypto.prototype.randomUUID")
    page = tab.open(smol)
    ask(page, "Say hi.")
    assert answered(page).locator(".content").inner_text().strip()
    expect(page.locator("#chats li")).to_have_count(1)
