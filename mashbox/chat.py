"""``mashbox chat``: a conversation with the model in the terminal.

In a terminal: line editing and history (readline; kept in the mashbox cache), Ctrl-C stops the
answer being written (not the program), Ctrl-D or ``/exit`` quits, ``/reset`` starts over,
``/system TEXT`` sets the system prompt. When the conversation outgrows the context, leaving the answer
less than its room (``--max-tokens``, else a quarter of the context; at most half), its oldest turns are
dropped, with a notice; an answer cut by ``--max-tokens`` says so, and a question the
engine refuses is said and the chat goes on. A model's thinking is shown dimmed before its answer.
A question of many lines (pasted code) goes between two ``\"\"\"``, as in Ollama's chat. Piped in, each line (or
such a block) is one question; its answer (without the thinking) is followed by a separator line.
"""

from __future__ import annotations

import io
import signal
import sys
from collections.abc import Iterator
from typing import Any

from mashbox.errors import ContextLengthError, MashboxError

HELP = ('/reset starts over, /system TEXT sets the system prompt, /help says this, /exit quits (or Ctrl-D); '
        'Ctrl-C stops an answer; """ begins and ends a question of many lines')
QUOTES = '"""'
SEPARATOR = "---"
DIM, PLAIN = "\x1b[2m", "\x1b[0m"  # thinking's look, and back


class Conversation:
    def __init__(self, system: str | None) -> None:
        self.system = system
        self.turns: list[dict[str, str]] = []

    @property
    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def drop_oldest(self) -> bool:
        """Drop the oldest question and its answer; False when only the last question is left."""
        if len(self.turns) <= 1:
            return False
        del self.turns[: 2 if len(self.turns) > 2 else 1]
        return True


def run(engine: Any, system: str | None, options: dict[str, Any], interactive: bool) -> int:
    conversation = Conversation(system)
    _tolerant_streams()
    if interactive:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C works even if our parent ignored it
        signal.signal(signal.SIGTERM, _terminated)
        _line_editing()
        _say(f"chatting with {engine.model_id} (ctx {engine.ctx}). {HELP}.")
    for line, quoted in _lines(interactive):
        if line.startswith("/") and not quoted:  # a block is a question, whatever it begins with (// in code)
            if _command(line, conversation) == "exit":
                break
            continue
        conversation.turns.append({"role": "user", "content": line})
        answer = _answer(engine, conversation, options, interactive)
        if answer is not None:
            conversation.turns.append({"role": "assistant", "content": answer})
        if not interactive:
            print(SEPARATOR, flush=True)
    return 0


def _tolerant_streams() -> None:
    """Streams are strict where PYTHONIOENCODING names no error handler: bytes of another encoding
    read are said (``_lines``), and a character the output's encoding lacks is written escaped."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")


def _lines(interactive: bool) -> Iterator[tuple[str, bool]]:
    """The questions: a line each, or the lines between two QUOTES as one (pasted code, say), and whether
    it was quoted so."""
    block: list[str] | None = None  # the lines of a question begun with QUOTES, until a line ends with them
    while True:
        try:
            line = input(("... " if block is not None else "> ") if interactive else "")
        except EOFError:
            if interactive:
                print()  # the prompt's line ends cleanly
            if block is not None and (question := _joined(block)):
                yield question, True  # a block left open at the end is still a question
            return
        except KeyboardInterrupt:  # at the prompt: a new prompt, as in a shell (a block begun is dropped)
            print()
            block = None
            continue
        text = _decoded(line.encode("utf-8", "surrogateescape"))  # UTF-8 bytes read in a narrower encoding
        if block is None and text.lstrip().startswith(QUOTES):
            block, text = [], text.lstrip()[len(QUOTES):]
        if block is None:
            if text.strip():
                yield text.strip(), False
            continue
        ends = text.rstrip().endswith(QUOTES)
        block.append(text.rstrip()[: -len(QUOTES)] if ends else text)
        if ends:
            question, block = _joined(block), None
            if question:
                yield question, True


def _joined(lines: list[str]) -> str:
    """A block's question: its lines, their indents kept, without blank lines around them ("" if all are)."""
    return "\n".join(line.rstrip() for line in lines).strip("\n")


def _decoded(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        _say("this line is not UTF-8 text: the bytes that are not were read as \ufffd")
        return data.decode("utf-8", "replace")


def _terminated(*_: object) -> None:
    """SIGTERM at the prompt: out through the readline call (which restores the terminal) and close."""
    raise SystemExit(128 + signal.SIGTERM)


def _command(line: str, conversation: Conversation) -> str | None:
    name, _, rest = line.partition(" ")
    if name == "/exit":
        return "exit"
    if name == "/reset":
        conversation.turns.clear()
        _say("a new conversation")
    elif name == "/system":
        conversation.system = rest.strip() or None
        _say("system prompt set" if conversation.system else "system prompt removed")
    elif name == "/help":
        _say(HELP)
    else:
        _say(f"unknown command {name}: {HELP}")
    return None


def _answer(engine: Any, conversation: Conversation, options: dict[str, Any], thinking: bool) -> str | None:
    """Stream one answer (its ``thinking`` too, dimmed); the text written (all of it, or up to Ctrl-C), None
    if it did not fit."""
    try:
        stream = _fitting(engine, conversation, options)
    except KeyboardInterrupt:  # right after Enter, before the answer began
        print(" [stopped]", flush=True)
        return ""
    if stream is None:
        return None
    text: list[str] = []
    cut = thought = stopped = False
    try:
        for chunk in stream:
            choice = chunk.choices[0] if chunk.choices else None
            if thinking and choice and choice.delta.reasoning_content:
                print(DIM + choice.delta.reasoning_content + PLAIN, end="", flush=True)
                thought = True
            if choice and choice.delta.content:
                if thought and not text:
                    print()  # the answer on a line of its own
                text.append(choice.delta.content)
                print(choice.delta.content, end="", flush=True)
            cut = cut or bool(choice and choice.finish_reason == "length")
            if cut and chunk.usage:  # the last chunk: what cut the answer
                print(_cut(chunk.usage.completion_tokens, options.get("max_tokens")), end="")
    except KeyboardInterrupt:
        stream.close()  # the request stops and its slot is freed
        print(" [stopped]", end="")
        stopped = True
    except MashboxError as err:  # the answer failed: said, and the chat goes on
        print(flush=True)
        _say(f"the answer failed: {err}")
        stopped = True
    print(flush=True)
    if not (text or thought or stopped):  # else a blank line, as if nothing had happened
        _say("the model answered nothing (it ended its answer at once)")
    return "".join(text)


def _cut(written: int, most: int | None) -> str:
    """What cut an answer of ``written`` tokens: --max-tokens where it reached ``most``, else the context."""
    if most and written >= most:
        return f" [cut: --max-tokens {most}]"
    return " [cut: the context is full; /reset, or a larger --ctx]"


def _fitting(engine: Any, conversation: Conversation, options: dict[str, Any]) -> Iterator[Any] | None:
    """The answer's stream, once the conversation fits the context with room for the answer (oldest turns
    dropped first); a question that gets no answer leaves the conversation as it was before it."""
    before = conversation.turns[:-1]
    room = min(options.get("max_tokens") or engine.ctx // 4, engine.ctx // 2)
    dropped = 0
    while _tokens(engine, conversation) + room > engine.ctx and conversation.drop_oldest():
        dropped += 1
    while True:
        try:
            stream = engine.chat(messages=conversation.messages, stream=True, stream_options={"include_usage": True},
                                 **options)
        except ContextLengthError as err:
            if conversation.drop_oldest():
                dropped += 1
                continue
            refusal = f"this question does not fit the context: {err.message}"
        except MashboxError as err:  # refused (the template's rules, say): said, and the chat goes on
            refusal = f"this question was refused: {err}"
        else:
            if dropped:
                _say(f"the conversation outgrew the context: dropped its {_oldest(dropped)}")
            return stream
        conversation.turns[:] = before
        _say(refusal)
        return None


def _oldest(turns: int) -> str:
    return "oldest turn" if turns == 1 else f"{turns} oldest turns"


def _tokens(engine: Any, conversation: Conversation) -> int:
    """The conversation's prompt tokens (0 where the engine refuses to count them: the answer's request says why)."""
    try:
        return engine.count_tokens(messages=conversation.turns, system=conversation.system).input_tokens
    except MashboxError:
        return 0


def _line_editing() -> None:
    """Arrow keys and history for input(), kept across sessions (where readline exists)."""
    import atexit

    from mashbox.engine.load.catalog import cache_dir

    try:
        import readline
    except ImportError:  # not on every platform
        return
    history = cache_dir() / "chat_history"
    try:
        history.parent.mkdir(parents=True, exist_ok=True)
        readline.read_history_file(history)
    except OSError:
        pass
    readline.set_history_length(1000)
    atexit.register(_save_history, readline, history)


def _save_history(readline: Any, history: Any) -> None:
    try:
        readline.write_history_file(history)
    except OSError:
        pass


def _say(text: str) -> None:
    print(f"mashbox: {text}", file=sys.stderr, flush=True)
