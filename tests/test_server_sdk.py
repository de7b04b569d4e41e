"""The real openai and anthropic SDKs, strict, against the server running SmolLM2."""

from __future__ import annotations

import anthropic
import openai
import pytest
from server import OpenResponses

from mashbox.engine.request import Message

USER = [{"role": "user", "content": "Name three planets."}]


@pytest.fixture(scope="module")
def schemas():
    return OpenResponses()


def test_chat(oai, smol_server):
    completion = oai.chat.completions.create(model=smol_server.backend.model_id, messages=USER, max_tokens=12)
    assert completion.choices[0].message.content
    assert completion.usage.completion_tokens == 12
    assert completion.model == smol_server.backend.model_id


def test_logit_bias_bans_and_forces_tokens(oai, smol_server, smol_engine):
    """OpenAI's logit_bias (it was accepted and ignored): -100 never draws a token, 100 always does; an id
    past the vocabulary is a 400 naming the field."""
    ask = {"model": "smollm2-135m", "max_tokens": 6, "temperature": 0}
    plain = oai.completions.create(prompt="The largest planet is", **ask).choices[0].text
    first = smol_engine.tokenizer.encode(plain, add_special_tokens=False)[0]
    banned = oai.completions.create(prompt="The largest planet is", logit_bias={str(first): -100}, **ask)
    assert smol_engine.tokenizer.encode(banned.choices[0].text, add_special_tokens=False)[0] != first
    forced = smol_engine.tokenizer.encode(" moon", add_special_tokens=False)[0]
    chat = oai.chat.completions.create(messages=USER, logit_bias={str(forced): 100}, seed=3, **{**ask, "temperature": 1})
    assert chat.choices[0].message.content == smol_engine.tokenizer.decode([forced] * 6)
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(messages=USER, logit_bias={"49152": 5}, **ask)
    assert refused.value.body["param"] == "logit_bias" and "vocabulary" in refused.value.body["message"]
    for key in ("", "-1", "1.5", "x"):  # an empty key was a 500
        with pytest.raises(openai.BadRequestError) as refused:
            oai.completions.create(prompt="Hi", logit_bias={key: 5}, **ask)
        assert refused.value.body["param"] == "logit_bias" and repr(key) in refused.value.body["message"]


def test_chat_stream(oai, smol_server):
    chunks = list(oai.chat.completions.create(model=smol_server.backend.model_id, messages=USER, max_tokens=8,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_stream_helper(oai, smol_server):
    # room for the whole answer: the helper refuses a completion cut by the length limit
    with oai.chat.completions.stream(model=smol_server.backend.model_id, messages=USER, max_tokens=400) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content and final.choices[0].finish_reason == "stop"


def test_completions(oai, smol_server):
    completion = oai.completions.create(model="smollm2-135m", prompt="The largest planet is", max_tokens=6)
    assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
    # Stream objects carry finish_reason null until the last, as OpenAI sends them; the SDK's strict
    # Completion type admits no null there, so the stream is read without strict validation.
    lenient = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)
    streamed = list(lenient.completions.create(model="smollm2-135m", prompt="The largest planet is", max_tokens=6,
                                               stream=True))
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text
    assert all(c.usage is None for c in streamed)


def test_completions_stream_with_usage(smol_server):
    """``stream_options.include_usage`` on Completions (it was ignored): a last object of no choices with the
    usage, which the text's objects do not carry, and the same usage as the whole answer's."""
    lenient = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)
    ask = {"model": "smollm2-135m", "prompt": "The largest planet is", "max_tokens": 7}
    whole = lenient.completions.create(**ask)
    streamed = list(lenient.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    *text, last = streamed
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    assert last.usage.completion_tokens == 7 and last.id == text[0].id
    assert text[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in text)
    assert "".join(c.choices[0].text for c in text) == whole.choices[0].text


def test_responses(oai, schemas):
    response = oai.responses.create(input="Name three planets.", max_output_tokens=12, model="smollm2-135m")
    assert response.output_text and response.status in ("completed", "incomplete")
    schemas.response(response.model_dump(mode="json", exclude_unset=True))


def test_responses_stream(oai, schemas):
    with oai.responses.stream(input="Name three planets.", max_output_tokens=8, model="smollm2-135m") as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    for event in events:
        schemas.event(event.model_dump(mode="json", exclude_unset=True, warnings=False))


def test_messages(claude):
    message = claude.messages.create(model="local-model", max_tokens=12, messages=USER)
    assert message.content[0].text and message.stop_reason in ("end_turn", "max_tokens")
    assert message.model == "local-model"


def test_messages_stream(claude, smol_engine):
    with claude.messages.stream(model="local-model", max_tokens=8, messages=USER) as stream:
        events = list(stream)
        final = stream.get_final_message()
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text and final.content[0].text == text
    assert final.usage.output_tokens == 8
    start = events[0].message.usage  # message_start tells the prompt's tokens, as Anthropic's does
    prompt = claude.messages.count_tokens(model="x", messages=USER).input_tokens
    assert start.input_tokens + (start.cache_read_input_tokens or 0) == prompt > 0
    (start,) = [e for e in smol_engine.message(messages=USER, max_tokens=2, stream=True) if e.type == "message_start"]
    assert start.message.usage.input_tokens + start.message.usage.cache_read_input_tokens == prompt



def test_messages_continue_a_prefilled_answer(claude, oai, smol_engine):
    """A conversation that ends with an assistant message of text is continued from that text
    (Anthropic's prefill): the answer is what a plain completion of the prompt up to the prefill
    writes next, not a new turn that says the prefill again."""
    prefill = "The capital of France is"
    ask = [{"role": "user", "content": "Tell me the capital of France."}, {"role": "assistant", "content": prefill}]
    message = claude.messages.create(model="x", max_tokens=8, messages=ask)
    prompt = smol_engine.template.render((Message("user", ask[0]["content"]), Message("assistant", prefill)),
                                         continue_final=True)
    assert prompt.endswith("assistant\n" + prefill)
    plain = oai.completions.create(model=smol_engine.model_id, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    assert message.content[0].text == plain and not plain.lstrip().startswith(prefill)
    counted = claude.messages.count_tokens(model="x", messages=ask).input_tokens
    assert counted == len(smol_engine.tokenizer.encode(prompt, add_special_tokens=False))
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        claude.messages.create(model="x", max_tokens=8, messages=[ask[0], {"role": "assistant", "content": prefill + " "}])

@pytest.mark.parametrize("prefill", ["<", ">", "|", "im_end", "x>"])
def test_a_prefill_that_the_turns_end_marker_also_holds_is_continued_right_after_it(smol_engine, prefill):
    """Found by its text, the prefill's end was taken inside ``<|im_end|>``: ``<`` was written twice, ``>``
    closed the turn before the answer began."""
    messages = (Message("user", "hi"), Message("assistant", prefill))
    assert smol_engine.template.render(messages, continue_final=True).endswith("<|im_start|>assistant\n" + prefill)


def test_count_tokens_and_models(claude, smol_server):
    assert claude.messages.count_tokens(model="x", messages=USER).input_tokens > 5
    (model,) = claude.models.list().data
    assert model.id == smol_server.backend.model_id


def test_openai_models(oai, smol_server):
    assert [m.id for m in oai.models.list()] == [smol_server.backend.model_id]
    assert oai.models.retrieve(smol_server.backend.model_id).id == smol_server.backend.model_id


def test_sdk_errors(oai, claude):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="smollm2-135m", messages=USER, max_tokens=2, temperature=9)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="x", max_tokens=2, messages=[])
    assert refused.value.request_id.startswith("req_")  # Anthropic's SDK reads request-id (x-request-id: OpenAI's)
    assert claude.messages.create(model="x", max_tokens=2, messages=USER)._request_id.startswith("req_")
