"""Mistakes a type checker must catch: each line marked ``# E: <code>`` must get exactly that
mypy error, and no other line any (tests/test_typing.py)."""

from mashbox import Engine

HI = [{"role": "user", "content": "hi"}]


def wrong_fields(engine: Engine) -> None:
    engine.chat(messages=HI, max_new_tokens=16)  # E: call-overload
    engine.chat(max_tokens=16)  # E: call-overload
    engine.chat(messages=HI, temperature="hot")  # E: call-overload
    engine.complete(promt="a")  # E: call-overload
    engine.respond(inputs="hi")  # E: call-overload
    engine.message(messages=HI, stop_sequence=["x"])  # E: call-overload
    engine.count_tokens(messages=HI, max_tokens=8)  # E: call-overload
    engine.chat({"messages": HI}, max_tokens=8)  # E: call-overload
    engine.chat(messages=HI, stream="yes")  # E: call-overload


def wrong_results(engine: Engine) -> None:
    print(engine.chat(messages=HI).choices[0].text)  # E: attr-defined
    print(engine.chat(messages=HI, stream=True).choices)  # E: attr-defined
    print(next(engine.complete(prompt="a")))  # E: call-overload
    print(engine.message(messages=HI, max_tokens=8).choices)  # E: attr-defined
    print(engine.respond(input="hi").content)  # E: attr-defined
    length: int = engine.complete(prompt="a").choices[0].text  # E: assignment
    print(length)


async def wrong_awaits(engine: Engine) -> None:
    print(engine.achat(messages=HI).choices)  # E: attr-defined
    for chunk in await engine.achat(messages=HI, stream=True):  # E: attr-defined
        print(chunk)
