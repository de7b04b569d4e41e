"""The ``mashbox`` command: chat with a model in the terminal, list models."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mashbox.engine.catalog import catalog
from mashbox.errors import MashboxError

DEFAULT_MODEL = "smollm2-135m"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mashbox", description="A local LLM engine for notebooks and agents.")
    commands = parser.add_subparsers(dest="command")
    chat = commands.add_parser("chat", help="chat with a model in the terminal (the default command)")
    chat.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                      help="catalog id, HF model directory or .gguf file (default: %(default)s)")
    chat.add_argument("--ctx", type=int, default=None, help="context length per slot (default: the model's)")
    chat.add_argument("--slots", type=int, default=4, help="requests decoded together (default: %(default)s)")
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.add_argument("--max-tokens", type=int, default=512, help="most new tokens per answer (default: %(default)s)")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    commands.add_parser("models", help="list the models in the catalog")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "models":
            return list_models()
        if args.command is None:
            args = build_parser().parse_args(["chat"])
        return chat(args)
    except MashboxError as err:
        print(f"mashbox: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def list_models() -> int:
    for entry in catalog().values():
        print(f"{entry.id:22} ctx {entry.ctx:>6}  {entry.gb:5.2f} GB  {entry.description}")
    return 0


def chat(args: argparse.Namespace) -> int:
    from mashbox.engine.engine import Engine  # torch loads only when needed

    interactive = sys.stdin.isatty()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    with Engine(args.model, ctx=args.ctx, slots=args.slots, quiet=not interactive) as engine:
        if interactive:
            print(f"mashbox: chatting with {engine.model_id} (ctx {engine.ctx}); Ctrl-D to quit.", file=sys.stderr)
        for line in _prompts(interactive):
            messages.append({"role": "user", "content": line})
            answer = _answer(engine, messages, args)
            messages.append({"role": "assistant", "content": answer})
    return 0


def _prompts(interactive: bool):
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return
        if line.strip():
            yield line


def _answer(engine, messages: list[dict], args: argparse.Namespace) -> str:
    text = []
    for chunk in engine.chat(messages=messages, max_tokens=args.max_tokens, temperature=args.temperature, stream=True):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            text.append(piece)
            print(piece, end="", flush=True)
    print()
    return "".join(text)
