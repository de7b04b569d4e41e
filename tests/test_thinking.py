"""Thinking models, each a scripted tiny model (``tiny.scripted``) that thinks, then answers: where the
answer begins inside thinking, a thinking budget met as the model closes it, ``<think>`` as a special
token, a prefill that opened thinking, and ``mashbox chat`` showing it."""

from __future__ import annotations

import pytest
from tiny import scripted

from mashbox import Engine, chat

# Qwen3's way: the model opens thinking itself, unless the request turns it off
OWN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# DeepSeek-R1's, QwQ's, Qwen3-Thinking-2507's: the prompt opens it, whatever the request asks
OPENED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
THOUGHT = ["Let", " me", " think", " hard"]
ANSWER = ["The", " answer", "."]
HI = [{"role": "user", "content": "hi"}]


def engine(tmp_path, tiny_model_dir, template: str, chain: list[str], **options) -> Engine:
    return Engine(str(scripted(tmp_path / "model", tiny_model_dir, template, chain, **options)), ctx=256, slots=2,
                  quiet=True)


@pytest.mark.parametrize("enable", [None, False])
def test_a_prompt_that_opens_thinking_starts_the_answer_in_it_even_with_thinking_off(tmp_path, tiny_model_dir,
                                                                                     enable):
    """The template opens ``<think>`` whatever ``enable_thinking`` says: the model's thinking is still its
    thinking (it was the answer's text, with a literal ``</think>``), and the new lines after it no answer's."""
    with engine(tmp_path, tiny_model_dir, OPENED, ["\n", *THOUGHT, "</think>", "\n\n", *ANSWER]) as e:
        message = e.chat(messages=HI, enable_thinking=enable, max_tokens=30).choices[0].message
        assert (message.reasoning_content, message.content) == ("Let me think hard", "The answer.")
        blocks = e.message(messages=HI, max_tokens=30, thinking={"type": "disabled"}).content
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in blocks] == [
            ("thinking", "Let me think hard"), ("text", "The answer.")]


def test_a_think_tag_the_model_writes_again_after_the_prompts_is_no_thought(tmp_path, tiny_model_dir):
    with engine(tmp_path, tiny_model_dir, OPENED, ["\n", "<think>", *THOUGHT, "</think>", "\n\n", *ANSWER]) as e:
        message = e.chat(messages=HI, max_tokens=30).choices[0].message
        assert (message.reasoning_content, message.content) == ("Let me think hard", "The answer.")


def test_a_forced_call_after_a_prompt_that_opens_thinking_is_a_call(tmp_path, tiny_model_dir):
    """The grammar writes the call from the answer's first token: it was taken for thinking, and lost."""
    tool = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
    with engine(tmp_path, tiny_model_dir, OPENED, ["\n", *THOUGHT, "</think>", "\n\n", *ANSWER]) as e:
        choice = e.chat(messages=HI, tools=[tool], tool_choice="required", max_tokens=40).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content is None
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("ping", "{}")]


def test_a_budget_spent_as_the_model_closes_thinking_closes_it_once(tmp_path, tiny_model_dir):
    """Each budget, up to one past the model's own close (the token that closes it counts): thinking ends
    once, and no ``</think>`` is text (a budget met by the closing token closed it a second time)."""
    with engine(tmp_path, tiny_model_dir, OWN, ["\n", "<think>", *THOUGHT, "</think>", "\n\n", *ANSWER]) as e:
        for budget in range(1, len(THOUGHT) + 3):
            blocks = e.message(messages=HI, max_tokens=30, thinking={"type": "enabled", "budget_tokens": budget})
            found = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in blocks.content]
            assert [kind for kind, _ in found] == ["thinking", "text"], (budget, found)
            assert "Let me think hard".startswith(found[0][1]) and found[1][1] == "The answer.", (budget, found)


def test_reasoning_tokens_are_the_thought_with_both_its_tags(tmp_path, tiny_model_dir):
    """The model's own ``<think>`` was counted as the answer's and ``</think>`` as reasoning: cut inside
    its thinking, an answer of no text had a token of it."""
    with engine(tmp_path, tiny_model_dir, OWN, ["\n", "<think>", *THOUGHT, "</think>", "\n\n", *ANSWER]) as e:
        cut = e.chat(messages=HI, max_tokens=4)
        assert (cut.choices[0].message.content or "") == "" and cut.choices[0].finish_reason == "length"
        assert cut.usage.completion_tokens_details.reasoning_tokens == 4  # <think>, Let, me, think
        whole = e.respond(input="hi", max_output_tokens=30)
        assert whole.usage.output_tokens_details.reasoning_tokens == len(THOUGHT) + 2


def test_a_budget_spent_inside_a_close_written_in_pieces_forces_only_the_rest_of_it(tmp_path, tiny_model_dir):
    """``</think>`` of three tokens: spent after ``</``, the whole tag was forced after it, and the thinking
    ended with ``</`` (``</think`` after ``think``)."""
    chain = ["\n", *THOUGHT, "</", "think", ">", "\n\n", *ANSWER]
    with engine(tmp_path, tiny_model_dir, OPENED, chain, think_tokens=False) as e:
        for budget in range(1, len(THOUGHT) + 4):
            blocks = e.message(messages=HI, max_tokens=30, thinking={"type": "enabled", "budget_tokens": budget})
            found = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in blocks.content]
            assert found[0][0] == "thinking" and "Let me think hard".startswith(found[0][1]), (budget, found)
            assert found[1:] == [("text", "The answer.")], (budget, found)


@pytest.mark.parametrize("template", [OWN, OPENED])
def test_thinking_tags_that_are_special_tokens_still_mark_the_thinking(tmp_path, tiny_model_dir, template):
    """Special tokens leave the text; ``<think>`` and ``</think>`` are kept for the markup (the thinking was
    the answer's text, its tags gone)."""
    opens = ["<think>"] if template == OWN else []
    with engine(tmp_path, tiny_model_dir, template, ["\n", *opens, *THOUGHT, "</think>", "\n\n", *ANSWER],
                special=True) as e:
        message = e.chat(messages=HI, max_tokens=30).choices[0].message
        assert (message.reasoning_content, message.content) == ("Let me think hard", "The answer.")


def test_a_prefill_that_opened_thinking_goes_on_thinking(tmp_path, tiny_model_dir):
    prefill = [*HI, {"role": "assistant", "content": "<think>\nLet"}]
    with engine(tmp_path, tiny_model_dir, OWN, ["\n", "<think>", *THOUGHT, "</think>", "\n\n", *ANSWER]) as e:
        message = e.chat(messages=prefill, continue_final_message=True, max_tokens=30).choices[0].message
        assert (message.reasoning_content, message.content) == (" me think hard", "The answer.")
        closed = [*HI, {"role": "assistant", "content": "<think>\nI know.\n</think>\n\nThe"}]
        message = e.chat(messages=closed, continue_final_message=True, max_tokens=30).choices[0].message
        assert (message.reasoning_content, message.content) == (None, " answer.")
        named = [*HI, {"role": "assistant", "content": "<think>\nok\n</think>\n\nWrite the <think> tag.\n\nThe"}]
        message = e.chat(messages=named, continue_final_message=True, max_tokens=30).choices[0].message
        assert (message.reasoning_content, message.content) == (None, " answer.")  # a mention of the tag is text


def test_mashbox_chat_shows_the_thinking_dimmed_in_a_terminal_not_piped(tmp_path, tiny_model_dir, capsys):
    with engine(tmp_path, tiny_model_dir, OPENED, ["\n", *THOUGHT, "</think>", "\n\n", *ANSWER]) as e:
        for shown in (True, False):
            conversation = chat.Conversation(None)
            conversation.turns.append(HI[0])
            answer = chat._answer(e, conversation, {"max_tokens": 30}, shown)
            out = capsys.readouterr().out
            assert answer == "The answer."
            expected = f"{chat.DIM}Let{chat.PLAIN}" if shown else "The answer.\n"
            assert (out.startswith(expected), "think" in out) == (True, shown), out
