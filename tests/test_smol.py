"""End-to-end checks on the real embedded SmolLM2: answers, batch invariance,
every protocol's response and stream order, validated by the official SDK types."""

import threading

import anthropic.types as at
import openai.types as ot
import openai.types.chat as oc
import openai.types.responses as orr
from pydantic import TypeAdapter

PLANETS = ("mercury", "venus", "earth", "mars", "jupiter", "saturn", "uranus", "neptune")
ASK = [{"role": "user", "content": "Name three planets."}]


def test_names_a_planet(smol_engine):
    answer = smol_engine.chat(messages=ASK, max_tokens=48)
    text = answer.choices[0].message.content.lower()
    assert any(p in text for p in PLANETS), text
    assert answer.usage.prompt_tokens > 5 and answer.usage.completion_tokens > 0
    oc.ChatCompletion.model_validate(answer.model_dump(mode="json"), strict=False)


def test_sixteen_concurrent_greedy_equal_sequential(smol_engine):
    questions = [f"Write one sentence about the number {i}." for i in range(16)]
    ask = lambda q: smol_engine.chat(messages=[{"role": "user", "content": q}], max_tokens=32)  # noqa: E731
    sequential = [ask(q).choices[0].message.content for q in questions]
    together = [None] * 16

    def worker(i):
        together[i] = ask(questions[i]).choices[0].message.content

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert together == sequential


def types(events):
    return [e.type for e in events]


def test_chat_stream(smol_engine):
    chunks = list(smol_engine.chat(messages=ASK, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    for c in chunks:
        oc.ChatCompletionChunk.model_validate(c.model_dump(mode="json"))
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].timings is not None
    assert chunks[-1].choices == [] and 0 < chunks[-1].usage.completion_tokens <= 16
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == smol_engine.chat(messages=ASK, max_tokens=16).choices[0].message.content


def test_completion_and_its_stream(smol_engine):
    whole = smol_engine.complete(prompt="The three largest planets are", max_tokens=12)
    ot.Completion.model_validate(whole.model_dump(mode="json"))
    chunks = list(smol_engine.complete(prompt="The three largest planets are", max_tokens=12, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length"


def test_responses_stream_order(smol_engine):
    events = list(smol_engine.respond(input="Name three planets.", max_output_tokens=16, stream=True))
    adapter = TypeAdapter(orr.ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e.model_dump(mode="json"))
    names = types(events)
    deltas = names.count("response.output_text.delta")
    assert deltas > 0
    assert names == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ] or names[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    whole = smol_engine.respond(input="Name three planets.", max_output_tokens=4)
    orr.Response.model_validate(whole.model_dump(mode="json"))
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"


def test_messages_stream_order(smol_engine):
    events = list(smol_engine.message(messages=ASK, max_tokens=6, stream=True))
    adapter = TypeAdapter(at.RawMessageStreamEvent)
    for e in events:
        if e.type != "ping":
            adapter.validate_python(e.model_dump(mode="json"))
    names = types(events)
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    assert events[-2].delta.stop_reason == "max_tokens"
    whole = smol_engine.message(messages=ASK, max_tokens=6)
    at.Message.model_validate(whole.model_dump(mode="json"))
    assert whole.content[0].text == "".join(e.delta.text for e in events if e.type == "content_block_delta")


def test_stop_sequence_reported_by_messages(smol_engine):
    whole = smol_engine.message(messages=ASK, max_tokens=48)
    text = whole.content[0].text
    stop = text.split()[1]
    cut = smol_engine.message(messages=ASK, max_tokens=48, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_count_tokens_matches_the_prompt_that_runs(smol_engine):
    counted = smol_engine.count_tokens(messages=ASK, system="Be brief.")
    answer = smol_engine.message(messages=ASK, system="Be brief.", max_tokens=1)
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert counted.input_tokens > len(smol_engine.tokenizer.encode("Name three planets. Be brief."))


def test_system_messages_anywhere_join_one_system_prompt(smol_engine):
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Rule two."},
                {"role": "developer", "content": "Rule three."}]
    answer = smol_engine.chat(messages=[{"role": "system", "content": "Rule one."}, *messages], max_tokens=1)
    text = smol_engine.template.render(
        tuple(__import__("mashbox").Message(m["role"] if m["role"] != "developer" else "system", m["content"])
              for m in [{"role": "system", "content": "Rule one."}, *messages]))
    assert text.count("<|im_start|>system") == 1
    assert text.index("Rule one.") < text.index("Rule two.") < text.index("Rule three.") < text.index("Hi")
    assert answer.usage.prompt_tokens == len(smol_engine.tokenizer.encode(text))
