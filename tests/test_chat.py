"""``mashbox chat``: in a real terminal (a pty), and with piped input."""

from __future__ import annotations

import io
import os
import pty
import select
import signal
import subprocess
import sys
import time

from mashbox import chat


class Terminal:
    """``mashbox chat`` on a pseudo-terminal: what it wrote, and keys typed into it."""

    def __init__(self, *args: str) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "mashbox", "chat", *args], stdin=slave, stdout=slave,
                                     stderr=slave, close_fds=True)
        os.close(slave)
        self.seen = ""

    def wait_for(self, text: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            assert time.monotonic() < deadline, f"no {text!r} in {self.seen[-500:]!r}"
            self.read()
        return self.seen

    def read(self, timeout: float = 0.2) -> None:
        if select.select([self.master], [], [], timeout)[0]:
            try:
                self.seen += os.read(self.master, 65536).decode(errors="replace")
            except OSError:  # the program ended
                pass

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())


def test_in_a_terminal_ctrl_c_stops_the_answer_not_the_program(tiny_model_dir, own_cache):
    # sampled (the greedy answer of this random model ends within ~100 tokens): 900 tokens take seconds
    term = Terminal(str(tiny_model_dir), "--ctx", "1024", "--slots", "1", "--max-tokens", "900", "--temperature", "1")
    try:
        term.wait_for("> ")
        term.type("Tell me a very long story.\n")
        term.wait_for("Tell me a very long story.\r\n")
        start = len(term.seen)
        deadline = time.monotonic() + 60
        while len(term.seen) < start + 40:  # some of the answer is out
            assert time.monotonic() < deadline
            term.read()
        term.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        term.wait_for(" [stopped]\r\n> ")
        assert term.proc.poll() is None
        term.type("/reset\n")
        term.wait_for("mashbox: a new conversation")
        term.type("/exit\n")
        assert term.proc.wait(30) == 0
        assert "Tell me a very long story." in (own_cache / "chat_history").read_text(), "not the user's own history"
    finally:
        if term.proc.poll() is None:
            term.proc.kill()


def test_piped_questions_get_one_answer_each_and_old_turns_make_room(tiny_engine, monkeypatch, capsys):
    questions = [" ".join(["word"] * 150) + f" question {i}" for i in range(4)]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(questions) + "\n/system Be brief.\n" + questions[0] + "\n"))
    assert chat.run(tiny_engine, None, {"max_tokens": 40, "temperature": 0}, interactive=False) == 0
    out, err = capsys.readouterr()
    assert out.count(chat.SEPARATOR + "\n") == 5  # one answer per question
    assert "mashbox: the conversation outgrew the context: dropped its oldest turn" in err  # ctx 512
    assert "mashbox: system prompt set" in err


def test_a_question_too_long_alone_is_said_and_the_chat_goes_on(tiny_engine, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("word " * 2000 + "\nhi\n"))
    assert chat.run(tiny_engine, None, {"max_tokens": 4}, interactive=False) == 0
    out, err = capsys.readouterr()
    assert "mashbox: this question does not fit the context" in err and out.count(chat.SEPARATOR) == 2


def test_a_question_that_gets_no_answer_leaves_the_conversation_as_it_was(tiny_engine, monkeypatch, capsys):
    """Turns were dropped to make room before the question was found too long alone, or refused: the history
    was lost for no answer."""
    sent, chat_of = [], tiny_engine.chat
    monkeypatch.setattr(tiny_engine, "chat", lambda **kw: sent.append([m["content"] for m in kw["messages"]])
                        or chat_of(**kw))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n" + "word " * 2000 + "\nbye\n"))
    assert chat.run(tiny_engine, None, {"max_tokens": 4, "temperature": 0}, interactive=False) == 0
    out, err = capsys.readouterr()
    assert "this question does not fit the context" in err and "dropped" not in err
    assert sent[-1][0] == "hi" and sent[-1][2] == "bye" and len(sent[-1]) == 3, sent[-1]
    sent.clear()
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nthere\n"))
    assert chat.run(tiny_engine, None, {"max_tokens": 4, "temperature": 9}, interactive=False) == 0
    assert [len(m) for m in sent] == [1, 1], "a refused question leaves no turn behind"


def test_lines_between_triple_quotes_are_one_question(tiny_engine, monkeypatch, capsys):
    """Pasted code was a question a line (Ollama's chat takes a block between \"\"\" too); /help is a command."""
    sent, chat_of = [], tiny_engine.chat
    monkeypatch.setattr(tiny_engine, "chat", lambda **kw: sent.append(kw["messages"][-1]["content"]) or chat_of(**kw))
    lines = ['"""', "Fix this:", "", "def f(x):", "    return x+  ", '"""', "/help", "hi", '  """one"""',
             '"""  two', "lines", 'x"""', '"""', "   ", '"""', '"""// a comment', 'code"""', '"""', "  left open"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    assert chat.run(tiny_engine, None, {"max_tokens": 2, "temperature": 0}, interactive=False) == 0
    out, err = capsys.readouterr()
    assert sent == ["Fix this:\n\ndef f(x):\n    return x+", "hi", "one", "  two\nlines\nx", "// a comment\ncode",
                    "  left open"]  # a block is a question whatever it begins with: not the command //
    assert out.count(chat.SEPARATOR + "\n") == 6 and f"mashbox: {chat.HELP}" in err and "unknown" not in err


def test_a_refused_question_is_said_and_a_cut_answer_says_so(tiny_engine, monkeypatch, capsys):
    """A question the engine refuses (here a temperature the protocol does not take) does not end the
    chat; an answer that ran out of max_tokens is marked."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert chat.run(tiny_engine, None, {"max_tokens": 4, "temperature": 9}, interactive=False) == 0
    out, err = capsys.readouterr()
    assert "mashbox: this question was refused: temperature" in err and out.count(chat.SEPARATOR) == 1
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nhello\n"))
    assert chat.run(tiny_engine, None, {"max_tokens": 3}, interactive=False) == 0
    out, _ = capsys.readouterr()
    assert out.count("[cut: --max-tokens 3]") == 2 and out.count(chat.SEPARATOR) == 2


def test_an_empty_answer_is_said_not_left_a_blank_line(tiny_engine, monkeypatch, capsys):
    """An answer the model ended at once (here, a stop string its first character) printed as a blank line."""
    first = tiny_engine.chat(messages=[{"role": "user", "content": "hi"}], max_tokens=4).choices[0].message.content
    assert first
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert chat.run(tiny_engine, None, {"max_tokens": 4, "stop": [first[0]]}, interactive=False) == 0
    out, err = capsys.readouterr()
    assert "mashbox: the model answered nothing (it ended its answer at once)" in err, (out, err)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert chat.run(tiny_engine, None, {"max_tokens": 4}, interactive=False) == 0
    assert "answered nothing" not in capsys.readouterr().err


def test_an_answer_cut_by_the_context_says_so_not_max_tokens(tiny_engine, monkeypatch, capsys):
    """ctx 512: a question that leaves a few tokens of room is answered up to the end of the context, which
    is what cut it, not --max-tokens."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("word " * 480 + "\n"))
    assert chat.run(tiny_engine, None, {"max_tokens": 400, "temperature": 0}, interactive=False) == 0
    out, _ = capsys.readouterr()
    assert "[cut: the context is full; /reset, or a larger --ctx]" in out and "--max-tokens" not in out


def test_sigterm_at_the_prompt_leaves_the_terminal_as_it_was(tiny_model_dir):
    """readline holds the terminal raw at the prompt: killed there, the chat left it without echo."""
    import termios

    term = Terminal(str(tiny_model_dir), "--ctx", "512", "--slots", "1")
    before = termios.tcgetattr(term.master)
    try:
        term.wait_for("> ")
        time.sleep(0.5)  # in readline's wait: a signal between its prompt and its wait is only seen at the next
        # key (CPython's readline; a busy machine made that window 1 run in 4 here)
        term.proc.send_signal(signal.SIGTERM)
        assert term.proc.wait(30) == 128 + signal.SIGTERM
        assert termios.tcgetattr(term.master)[3] == before[3]  # lflag: echo and line editing back
    finally:
        if term.proc.poll() is None:
            term.proc.kill()


class InterruptedOnce:
    """The engine, but Ctrl-C lands in its first chat() call: right after Enter, before the answer began
    (as when the prompt is still being tokenized)."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def chat(self, **fields):
        self.calls += 1
        if self.calls == 1:
            raise KeyboardInterrupt
        return self.engine.chat(**fields)


def test_ctrl_c_before_the_answer_begins_stops_that_answer_not_the_chat(tiny_engine, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("first\nsecond\n"))
    assert chat.run(InterruptedOnce(tiny_engine), None, {"max_tokens": 4}, interactive=False) == 0
    out, _ = capsys.readouterr()
    assert " [stopped]" in out and out.count(chat.SEPARATOR) == 2


def test_a_line_that_is_not_utf8_is_read_with_replacement_characters(tiny_engine, monkeypatch, capsys):
    """Latin-1 bytes (read by Python as lone surrogates) were refused as "a half of a UTF-16 pair"."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("Repeat: caf\udce9 \udcff\n"))
    assert chat.run(tiny_engine, None, {"max_tokens": 4}, interactive=False) == 0
    out, err = capsys.readouterr()
    assert "not UTF-8 text" in err and "refused" not in err and out.count(chat.SEPARATOR) == 1


def test_bytes_of_another_encoding_are_said_also_where_stdin_is_strict(tiny_model_dir):
    """With PYTHONIOENCODING=utf-8 stdin decodes strictly: a Latin-1 line ended the chat in a traceback."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run([sys.executable, "-m", "mashbox", "chat", str(tiny_model_dir), "--max-tokens", "2"],
                          input=b"caf\xe9 \xe6\x97\xa5\n", capture_output=True, env=env, timeout=300)
    assert done.returncode == 0 and b"not UTF-8 text" in done.stderr, done.stderr[-2000:]


def test_utf8_is_read_and_any_text_written_where_the_streams_are_ascii(tiny_engine, monkeypatch, capsys):
    """With PYTHONIOENCODING=ascii a UTF-8 line was said to be "not UTF-8 text", and an answer's first
    character outside ASCII ended the chat in a UnicodeEncodeError."""
    out = io.BytesIO()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("Repeat: café 日本\n".encode()), encoding="ascii"))
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, encoding="ascii", write_through=True))
    assert chat.run(tiny_engine, None, {"max_tokens": 2}, interactive=False) == 0
    print("café", end="", flush=True)
    assert "not UTF-8 text" not in capsys.readouterr().err
    assert out.getvalue().endswith(rb"caf\xe9")


def test_an_output_that_cannot_be_written_is_said_in_one_line(tiny_model_dir, own_cache):
    """A full disk (``> /dev/full``) or stdout closed: a traceback from input() or print()."""
    base = [sys.executable, "-m", "mashbox", "chat", str(tiny_model_dir), "--ctx", "256", "--max-tokens", "4"]
    with open("/dev/full", "w") as full:
        done = subprocess.run(base, input=b"hi\n", stdout=full, stderr=subprocess.PIPE, timeout=300)
    err = done.stderr.decode()
    assert done.returncode == 1 and "the output cannot be written: No space left on device" in err, err
    assert "Traceback" not in err
    done = subprocess.run(["bash", "-c", 'exec "$@" >&-', "-", *base], input=b"hi\n", stderr=subprocess.PIPE,
                          timeout=300)
    assert done.returncode == 2 and "writes its answers to stdout, and there is none" in done.stderr.decode()


def test_old_turns_make_room_for_the_answer_not_only_for_the_question(tiny_engine, monkeypatch, capsys):
    """ctx 512: turns were dropped only until the question fitted, with a token or two to spare, so an answer
    near the context's end was cut to a few tokens ("the context is full"); each gets its --max-tokens now."""
    questions = [" ".join(["word"] * 190) + f" question {i}" for i in range(3)]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(questions) + "\n"))
    assert chat.run(tiny_engine, None, {"max_tokens": 60, "temperature": 0}, interactive=False) == 0
    out, err = capsys.readouterr()
    assert "dropped its oldest turn" in err
    assert out.count("[cut: --max-tokens 60]") == 3 and "the context is full" not in out, out
