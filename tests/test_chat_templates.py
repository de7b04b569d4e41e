"""What a chat template takes, found by rendering probes through it, and the conversation fitted to it:
templates laid out as real families' are (Gemma 2: no system role, turns that alternate; Phi-3.5: only
system, user and assistant turns; Llama 3: one call a turn; Mistral: call ids of nine letters and
digits; Hermes' tool_use: no conversation without tools; DeepSeek-R1-Distill: names tool_calls but shows
no tools). Each used to refuse the request, or to lose the tools or a tool's result."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from mashbox import Engine, EngineRequest, InvalidRequestError
from mashbox.engine.request import Message, Tool, ToolCall
from mashbox.engine.text.template import ChatTemplate
from mashbox.engine.text.tokenizer import Tokenizer

WEATHER = Tool("get_weather", "Weather in a city", {"type": "object", "properties": {"city": {"type": "string"}}})
PARIS, ROME = (ToolCall(f"call_{c * 24}", "get_weather", f'{{"city": "{city}"}}') for c, city in (("a", "Paris"),
                                                                                                   ("b", "Rome")))
TWO_CALLS = (Message("system", "Be brief."), Message("user", "Paris and Rome?"),
             Message("assistant", "Checking.", tool_calls=(PARIS, ROME)),
             Message("tool", "RESULT_ROME", tool_call_id=ROME.id),
             Message("tool", "RESULT_PARIS", tool_call_id=PARIS.id))

GEMMA2 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
          "{% endif %}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + m['content'] | trim"
          " + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
PHI35 = ("{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
         "{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
LLAMA3 = ("{% for m in messages %}{% if m.tool_calls %}{% if m.tool_calls | length != 1 %}"
          "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
          "{% set f = m.tool_calls[0].function %}"
          "{{ '<|assistant|>' + {'name': f.name, 'parameters': f.arguments} | tojson + '<|eot|>' }}{% elif m.role == 'tool' %}{{ '<|ipython|>' + m.content + '<|eot|>' }}"
          "{% else %}{{ '<|' + m.role + '|>' + m.content + '<|eot|>' }}{% endif %}"
          "{% if loop.first and tools %}{{ '<|tools|>' + tools | tojson + '<|eot|>' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
MISTRAL = ("{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{% for c in m.tool_calls %}"
           "{% if c.id is not string or c.id | length != 9 %}"
           "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
           "{{ c.function.name }}[CALL_ID]{{ c.id }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}</s>"
           "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.tool_call_id }}[TOOL_CONTENT]{{ m.content }}[/TOOL_RESULTS]"
           "{% else %}[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}"
           "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}")
ALTERNATING = (  # Mistral's rule: past calls and results aside, the user's and the assistant's turns alternate
    "{% if messages[0].role == 'system' %}{% set turns = messages[1:] %}[SYSTEM]{{ messages[0].content }}"
    "{% else %}{% set turns = messages %}{% endif %}"
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% set ns = namespace(i=0) %}{% for m in turns | rejectattr('role', 'equalto', 'tool') "
    "| selectattr('tool_calls', 'undefined') %}{% if (m.role == 'user') != (ns.i % 2 == 0) %}"
    "{{ raise_exception('After the optional system message, conversation roles must alternate') }}{% endif %}"
    "{% set ns.i = ns.i + 1 %}{% endfor %}{% for m in turns %}{% if m.tool_calls %}[TOOL_CALLS]"
    "{{ m.tool_calls | map(attribute='function') | list | tojson }}{% elif m.role == 'tool' %}"
    "[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% else %}[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}")
HERMES_TOOL_USE = ("<|im_start|>system\nYou may call functions: <tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
                   "</tools><|im_end|>\n{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
R1_DISTILL = ("{% for m in messages %}{% if m.role == 'user' %}<|User|>{{ m.content }}{% elif m.tool_calls %}"
              "<|Assistant|>{% for c in m.tool_calls %}<|call|>{{ c.function.name }}{% endfor %}"
              "{% else %}<|{{ m.role }}|>{{ m.content }}{% endif %}{% endfor %}<|Assistant|>")


def template(source: str) -> ChatTemplate:
    class Tokenizer:
        chat_template = source
        special_tokens_map = {"bos_token": "<bos>", "eos_token": "<eos>"}

    return ChatTemplate(Tokenizer())


QWEN_DEFAULT = ("{% if messages[0].role == 'system' %}{% set turns = messages[1:] %}<|im_start|>system\n"
                "{{ messages[0].content }}<|im_end|>\n{% else %}{% set turns = messages %}<|im_start|>system\n"
                "You are Qwen.<|im_end|>\n{% endif %}{% for m in turns %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_an_empty_system_text_keeps_the_templates_default_out():
    """A client sends an empty system message to have none: it was dropped, and Qwen's default system text
    ("You are Qwen, created by Alibaba Cloud...") was the prompt's, as transformers does not."""
    hi = Message("user", "Hi")
    assert template(QWEN_DEFAULT).render((Message("system", ""), hi)).startswith("<|im_start|>system\n<|im_end|>\n")
    assert "You are Qwen." in template(QWEN_DEFAULT).render((hi,))


def test_a_system_message_after_the_first_answer_stays_where_it_is_where_the_template_takes_it():
    """Claude Code adds a system reminder every ~20 messages: joined into the system text at the top, it
    changed the prompt before the whole conversation, which was prefilled again (10 s and more a time)."""
    asked = (Message("system", "Be brief."), Message("user", "Hi"), Message("system", "Agents: none."),
             Message("assistant", "Hello."), Message("user", "And?"))
    reminded = (*asked, Message("assistant", "Nothing."), Message("system", "Remember the tasks."),
                Message("user", "Go on."))
    qwen = template(QWEN_DEFAULT)
    before = qwen.render(asked).removesuffix("<|im_start|>assistant\n")
    after = qwen.render(reminded)
    assert after.startswith(before) and after.startswith("<|im_start|>system\nBe brief.\n\nAgents: none.<|im_end|>")
    assert "Nothing.<|im_end|>\n<|im_start|>system\nRemember the tasks.<|im_end|>\n<|im_start|>user\nGo on." in after
    gemma = template(GEMMA2).render(reminded)  # no system turn there: the system text, as before
    assert gemma.startswith("<bos><start_of_turn>user\nBe brief.\n\nAgents: none.\n\nRemember the tasks.")


@pytest.mark.parametrize(("source", "end"), [(QWEN_DEFAULT, "\ndef f():\n    "), (GEMMA2, "model\ndef f():")])
def test_a_continued_message_keeps_its_trailing_spaces_where_the_template_does(source, end):
    """``continue_final_message`` on ``def f():\n    ``: the new line and the indent were cut, and the model
    had to write them again. transformers keeps them where the template does (Gemma's trims each message)."""
    messages = (Message("user", "Write f"), Message("assistant", "def f():\n    "))
    assert template(source).render(messages, continue_final=True).endswith(end)


def test_a_template_without_a_system_role_gets_the_system_text_in_the_first_turn():
    """Gemma 2's template refuses a system turn, and any turn out of alternation: the system text (and
    mashbox's tool prompt, with the tools) opens the first user turn, and the results of the calls are a
    user turn of their own, one after the call, as Gemma 3's template does it."""
    rendered = template(GEMMA2).render(TWO_CALLS, (WEATHER,))
    assert rendered.startswith("<bos><start_of_turn>user\n# Tools") and "get_weather" in rendered
    assert "Be brief." in rendered and rendered.index("Be brief.") < rendered.index("Paris and Rome?")
    model, user = rendered.split("<start_of_turn>model\n")[1], rendered.split("<start_of_turn>user\n")[2]
    assert model.startswith("Checking.\n<tool_call>") and model.count("<tool_call>") == 2
    assert user == ("<tool_response>\nRESULT_PARIS\n</tool_response>\n<tool_response>\nRESULT_ROME\n</tool_response>"
                    "<end_of_turn>\n<start_of_turn>model\n")  # in the calls' order: no id says which is which
    assert template(GEMMA2).render((Message("system", "Be brief."), Message("user", "Hi"))).startswith(
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>")


def test_a_template_that_skips_the_tool_role_gets_the_results_as_the_users():
    """Phi-3.5's template renders only system, user and assistant turns: the results came to nothing. Sent out
    of their calls' order, they are put in it (matched by id): no id shows which call the nth result answers."""
    rendered = template(PHI35).render(TWO_CALLS, (WEATHER,))
    assert "RESULT_ROME" in rendered and "RESULT_PARIS" in rendered
    assert rendered.endswith("<|user|>\n<tool_response>\nRESULT_PARIS\n</tool_response>\n<tool_response>\n"
                             "RESULT_ROME\n</tool_response><|end|>\n<|assistant|>\n")


def test_a_template_of_one_call_a_turn_gets_each_call_in_its_own_turn_with_its_result():
    """Llama 3's templates refuse a turn of two calls (which mashbox parses, and a client sends back): each
    call becomes a turn of its own, followed by its result, matched by id."""
    rendered = template(LLAMA3).render(TWO_CALLS, (WEATHER,))
    turns = re.findall(r"<\|(\w+)\|>(.*?)<\|eot\|>", rendered)
    assert [role for role, _ in turns] == ["system", "tools", "user", "assistant", "ipython", "assistant", "ipython"]
    assert '"Paris"' in turns[3][1] and turns[4][1] == "RESULT_PARIS"
    assert '"Rome"' in turns[5][1] and turns[6][1] == "RESULT_ROME"


def test_call_ids_are_made_nine_letters_and_digits_where_the_template_takes_no_other():
    """Mistral's templates refuse any other id (mashbox's and OpenAI's are ``call_`` and 24 more): each id
    is made nine, the same for a call and its result, the same at every render (a cached prefix holds)."""
    rendered = template(MISTRAL).render(TWO_CALLS, (WEATHER,))
    ids = re.findall(r"\[CALL_ID\](\w+)\[ARGS\]", rendered)
    assert len(ids) == 2 and len(set(ids)) == 2 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert re.findall(r"\[TOOL_RESULTS\](\w+)\[TOOL_CONTENT\]RESULT_(\w+)", rendered) == [(ids[0], "PARIS"),
                                                                                           (ids[1], "ROME")]
    assert template(MISTRAL).render(TWO_CALLS, (WEATHER,)) == rendered
    nine = (Message("user", "Hi"), Message("assistant", tool_calls=(ToolCall("abc123XYZ", "get_weather", "{}"),)))
    assert "[CALL_ID]abc123XYZ[ARGS]" in template(MISTRAL).render(nine, (WEATHER,)), "an id of nine stays"


def test_a_template_of_alternating_turns_gets_the_users_words_joined():
    """Mistral's templates refuse two turns of the user's in a row, and the user's words right after results
    (what an Anthropic client sends with every result: Claude Code): they join the turn before them."""
    chat = template(ALTERNATING)
    assert chat.render((Message("user", "Hi"), Message("user", "Weather?"))) == "[user]Hi\nWeather?"
    rendered = chat.render((*TWO_CALLS[1:], Message("user", "And tomorrow?")), (WEATHER,))
    assert rendered.endswith("[TOOL_RESULTS]RESULT_PARIS[/TOOL_RESULTS][TOOL_RESULTS]RESULT_ROME\nAnd tomorrow?"
                             "[/TOOL_RESULTS]")


@pytest.mark.parametrize("conversation", [TWO_CALLS[:2], TWO_CALLS[1:2]])
def test_a_template_that_needs_tools_renders_with_them(conversation):
    """Hermes' tool_use template loops over the tools unchecked: putting the tools first rendered it once
    without them, and the request was refused."""
    rendered = template(HERMES_TOOL_USE).render(conversation, (WEATHER,))
    assert '"name": "get_weather"' in rendered and rendered.endswith("<|im_start|>assistant\n")


def test_a_template_that_names_calls_but_shows_no_tools_gets_mashboxs_tool_prompt():
    """DeepSeek-R1-Distill's template renders calls made but never the tools: the model was never told of
    them."""
    chat = template(R1_DISTILL)
    assert not chat.knows_tools
    rendered = chat.render(TWO_CALLS[1:2], (WEATHER,))
    assert '"name": "get_weather"' in rendered and "<tool_call>" in rendered


def test_a_models_tool_use_template_renders_its_requests_with_tools(tiny_model_dir, tmp_path):
    """Hermes 2 Pro and 3 name two templates: ``default`` knows no tools, ``tool_use`` does (as transformers
    picks it when tools are passed). mashbox took the default alone, and its own tool prompt instead of the
    one the model was trained on; the copy it saves keeps both."""
    folder = tmp_path / "hermes"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # the config's list of named templates, as Hermes' has
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                                                              "{% endfor %}"},
                               {"name": "tool_use", "template": HERMES_TOOL_USE}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.read(folder)
    assert tokenizer.tool_template == HERMES_TOOL_USE and tokenizer.chat_template.startswith("{% for m")
    (tmp_path / "copy").mkdir()
    tokenizer.save(tmp_path / "copy")
    assert Tokenizer.read(tmp_path / "copy").tool_template == HERMES_TOOL_USE
    with Engine(str(folder), ctx=512, slots=1, quiet=True) as engine:
        ask = (Message("user", "Weather?"),)
        with_tools = engine.tokenizer.decode(engine.encode(EngineRequest(messages=ask, tools=(WEATHER,))))
        plain = engine.tokenizer.decode(engine.encode(EngineRequest(messages=ask)))
    assert with_tools.startswith("<|im_start|>system\nYou may call functions: <tools>") and "# Tools" not in with_tools
    assert plain == "[user]Weather?"


def test_a_conversation_the_template_refuses_names_the_protocols_field(tiny_model_dir, tmp_path):
    """The engine names its conversation ``messages``; the Responses API calls it ``input`` (a prompt too
    long already said so, a template's refusal did not)."""
    folder = tmp_path / "picky"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.content == 'refuse' %}{{ raise_exception('not this one') }}{% endif %}"
        "[{{ m.role }}]{{ m.content }}{% endfor %}")
    with Engine(str(folder), ctx=512, slots=1, quiet=True) as engine:
        with pytest.raises(InvalidRequestError) as responses:
            engine.respond(input="refuse", max_output_tokens=2)
        with pytest.raises(InvalidRequestError) as chat:
            engine.chat(messages=[{"role": "user", "content": "refuse"}], max_tokens=2)
    assert responses.value.param == "input" and "not this one" in responses.value.message
    assert chat.value.param == "messages"


def test_a_template_that_raises_any_python_error_refuses_only_what_it_raises_on():
    """A template whose arithmetic failed on three turns (ZeroDivisionError, not among the errors caught)
    broke the probes that read it: every chat request was a 500, however many turns."""
    picky = template("{% if messages | length > 2 %}{{ 1 // 0 }}{% endif %}"
                     "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert picky.render((Message("user", "Hi"),)) == "[user]Hi"
    with pytest.raises(InvalidRequestError, match="refuses this conversation: ZeroDivisionError"):
        picky.render((Message("user", "a"), Message("assistant", "b"), Message("user", "c")))


def test_transformers_generation_tag_renders_its_body():
    """TRL's assistant-only-loss templates mark the answer with {% generation %}: "unknown tag" before."""
    tagged = template("{% for m in messages %}[{{ m.role }}]{% if m.role == 'assistant' %}{% generation %}"
                      "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    assert tagged.render((Message("user", "Hi"), Message("assistant", "Yo"), Message("user", "Ok"))) == \
        "[user]Hi[assistant]Yo[user]Ok"


def test_a_template_that_does_not_compile_is_said_at_load(tiny_model_dir, tmp_path, caplog):
    """It loaded silently, /health 200, and every chat request was then a 400 blaming its messages."""
    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")  # no endfor
    with caplog.at_level("WARNING", logger="mashbox"), Engine(str(folder), ctx=512, slots=1, quiet=True) as engine:
        assert "the model's chat template does not read" in caplog.text and "complete" in caplog.text
        assert engine.complete(prompt="Hi", max_tokens=1).choices[0].finish_reason == "length"
