"""The tokenizer and the chat template read without transformers, against transformers on the same files."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tokenizers
from transformers import AutoTokenizer

from mashbox.engine.request import Message, Tool, ToolCall
from mashbox.engine.text.template import ChatTemplate, _tool
from mashbox.engine.text.tokenizer import Tokenizer, _merges_as_text
from mashbox.errors import InvalidRequestError

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
TEXTS = ["The capital of France is", "  two  spaces\tand a tab\n\nnew lines", "naïve café 東京 🙂 ﬁ",
         "<|im_start|>user\nHi<|im_end|>", "def f(x):\n    return x ** 2  # squared", ""]
# A template that uses what transformers gives templates: loop controls, tojson's options,
# raise_exception, strftime_now, namespace, the special tokens by name.
FEATURES = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n{% if ns.n > 3 %}{% break %}{% endif %}{% endfor %}"
    "{% if tools %}{{ tools | tojson(indent=2, sort_keys=True) }}{% endif %}"
    "{% if strftime_now('%Y') | length != 4 %}{{ raise_exception('no year') }}{% endif %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
WEATHER = Tool("get_weather", "The weather in a city.", {"type": "object", "properties": {
    "city": {"type": "string", "description": "e.g. Zürich"}}, "required": ["city"]})
CONVERSATIONS = [
    (Message("user", "Hi"),),
    (Message("system", "Be brief."), Message("user", "Weather in Paris?"),
     Message("assistant", "", tool_calls=(ToolCall("c1", "get_weather", '{"city": "Paris"}'),)),
     Message("tool", '{"temp": 21}', tool_call_id="c1"), Message("assistant", "21 °C."), Message("user", "Thanks")),
    (Message("user", "Think first"), Message("assistant", "Done.", reasoning="I thought."), Message("user", "Again")),
]


@pytest.fixture(scope="module")
def pair(smol_tokenizer, tmp_path_factory) -> tuple[Tokenizer, object]:
    """The SmolLM2 tokenizer saved by mashbox and read back, and transformers' reading of the same files."""
    folder = tmp_path_factory.mktemp("tokenizer")
    Tokenizer.of(smol_tokenizer).save(folder)
    return Tokenizer.read(folder), AutoTokenizer.from_pretrained(folder)


def test_saved_merges_are_text_and_the_same_merges(smol_tokenizer, tmp_path: Path) -> None:
    """The saved BPE merges are "a b" strings (read a quarter faster at every start) and tokenize as the
    tokenizer they were saved from; where a piece holds a space they stay pairs."""
    Tokenizer.of(smol_tokenizer).save(tmp_path)
    merges = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"]
    assert merges and all(isinstance(m, str) and len(m.split(" ")) == 2 for m in merges)
    again = Tokenizer.read(tmp_path)
    for text in [*TEXTS, (Path(__file__).parent.parent / "README.md").read_text()]:
        assert again.encode(text) == smol_tokenizer(text)["input_ids"]
    spaced = json.loads((tmp_path / "tokenizer.json").read_text())
    spaced["model"]["merges"] = [m.split(" ") for m in merges] + [["a b", "c"]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spaced))
    _merges_as_text(tmp_path / "tokenizer.json")
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"][-1] == ["a b", "c"]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_are_transformers(pair, text: str) -> None:
    ours, theirs = pair
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == theirs.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_a_long_text_is_read_while_other_threads_run(pair) -> None:
    """``encode`` held the interpreter's lock throughout: a 2M-character prompt (a second or more) froze
    every other thread of the worker, the engine's too: every stream stalled while it was read."""
    ours, _ = pair
    text = "Some words, and some more: 12345 and more words.\n" * 20_000  # 1M characters
    spins, done = [0], threading.Event()

    def spin() -> None:
        while not done.is_set():
            spins[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        start, t0 = spins[0], time.perf_counter()
        time.sleep(0.2)
        alone = (spins[0] - start) / (time.perf_counter() - t0)
        start, t0 = spins[0], time.perf_counter()
        ids = ours.encode(text, add_special_tokens=False)
        beside = (spins[0] - start) / (time.perf_counter() - t0)
    finally:
        done.set()
        spinner.join()
    assert len(ids) > 100_000
    assert beside > alone / 10, (beside, alone)  # held, the lock let the other thread run 1% of its pace


def test_special_tokens_and_vocabulary_are_transformers(pair) -> None:
    ours, theirs = pair
    assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)
    assert ours.special_tokens_map == {k: v for k, v in theirs.special_tokens_map.items() if isinstance(v, str)}
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert ours.chat_template == theirs.chat_template


def test_config_forms_of_special_tokens_and_templates(tmp_path: Path, pair) -> None:
    """AddedToken dicts for special tokens; the template in chat_template.jinja or as a named list."""
    ours, _ = pair
    ours.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|im_end|>", "special": True, "__type": "AddedToken"}
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    read = Tokenizer.read(tmp_path)
    assert read.eos_token_id == ours.eos_token_id and read.chat_template == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert Tokenizer.read(tmp_path).chat_template == "J"


@pytest.mark.parametrize("source", ["qwen2.5-coder.jinja", "smol", "features"])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("tools", [(), (WEATHER,)])
def test_templates_render_as_transformers_renders_them(pair, source, conversation, tools) -> None:
    ours, theirs = pair
    template = {"smol": ours.chat_template, "features": FEATURES}.get(source) or (TEMPLATES / source).read_text()
    ours.chat_template = theirs.chat_template = template
    chat = ChatTemplate(ours, verbatim=True)
    kept = () if chat.knows_tools else tools
    expected = theirs.apply_chat_template(chat.conversation(conversation, kept), tokenize=False, add_generation_prompt=True,
                                          tools=[_tool(t) for t in tools] if tools and chat.knows_tools else None)
    assert chat.render(conversation, tools) == expected


def test_tools_come_before_the_system_text_where_the_template_puts_them_after_it(pair) -> None:
    """Qwen's template: the system turn is the tools' schemas, the system text, then the template's
    call rules; the rest is the template's own; two system texts share every token of the schemas."""
    ours, theirs = pair
    ours.chat_template = theirs.chat_template = (TEMPLATES / "qwen2.5-coder.jinja").read_text()
    conversation = CONVERSATIONS[1]
    verbatim = ChatTemplate(ours, verbatim=True).render(conversation, (WEATHER,))
    first = ChatTemplate(ours).render(conversation, (WEATHER,))
    end = verbatim.rindex("</tools>") + len("</tools>")
    schemas, rules = verbatim[verbatim.index("# Tools"):end], verbatim[end:verbatim.index("</tool_call><|im_end|>") + 12]
    assert verbatim.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and rules.startswith("\n\nFor each")
    assert first == verbatim.replace("Be brief.\n\n" + schemas + rules, schemas + "\n\nBe brief." + rules)
    assert first.startswith("<|im_start|>system\n# Tools") and "</tools>\n\nBe brief.\n\nFor each" in first
    other = (Message("system", "Working folder: /elsewhere"), *conversation[1:])
    a, b = (ours.encode(ChatTemplate(ours).render(c, (WEATHER,)), add_special_tokens=False)
            for c in (conversation, other))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert len(ours.encode(first[:first.index("Be brief.")], add_special_tokens=False)) - 2 <= shared
    a, b = (ours.encode(ChatTemplate(ours, verbatim=True).render(c, (WEATHER,)), add_special_tokens=False)
            for c in (conversation, other))
    assert next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) < 5, "verbatim: the system text comes first"


def test_tools_stay_where_a_template_puts_them_elsewhere(pair, smol_tokenizer) -> None:
    """A template whose tools do not follow the system text renders as written; mashbox's own tool
    prompt (a template without tools) comes before the system text unless verbatim."""
    ours, _ = pair
    ours.chat_template = (  # the tools after the first user turn (as Llama 3's templates put them)
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}"
        "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}\n"
        "{% if loop.index == 2 and tools %}{{ tools | tojson }}\n{% endif %}{% endfor %}")
    conversation = CONVERSATIONS[1]
    assert ChatTemplate(ours).knows_tools
    assert ChatTemplate(ours).render(conversation, (WEATHER,)) == ChatTemplate(ours, verbatim=True).render(
        conversation, (WEATHER,))
    ours.chat_template = smol_tokenizer.chat_template
    first, verbatim = (ChatTemplate(ours, verbatim=v).render(conversation, (WEATHER,)) for v in (False, True))
    assert first.index("# Tools") < first.index("</tools>") < first.index("Be brief.") < first.index("To call one")
    assert verbatim.index("Be brief.") < verbatim.index("# Tools")


def test_a_template_error_is_the_request_s(pair) -> None:
    ours, _ = pair
    ours.chat_template = "{{ raise_exception('only user turns, please') }}"
    with pytest.raises(InvalidRequestError, match="only user turns, please"):
        ChatTemplate(ours).render((Message("user", "Hi"),))
    ours.chat_template = "{% for m in messages %}"
    with pytest.raises(InvalidRequestError, match="does not read"):
        ChatTemplate(ours)


def test_a_second_load_imports_no_transformers(tiny_model_dir: Path) -> None:
    """The worker is ready sooner without transformers: a GGUF whose tokenizer copy is made, and an HF
    directory with its tokenizer.json, load and answer without importing it."""
    code = ("import sys; from mashbox import Engine\n"
            "for model in sys.argv[1:]:\n"
            "    with Engine(model, quiet=True) as e:\n"
            "        e.chat(messages=[{'role': 'user', 'content': 'Hi'}], max_tokens=2)\n"
            "print('transformers' in sys.modules)")
    models = ["smollm2-135m", str(tiny_model_dir)]
    subprocess.run([sys.executable, "-c", code, "smollm2-135m"], check=True, capture_output=True)  # the copy made
    done = subprocess.run([sys.executable, "-c", code, *models], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_llama3_turn_also_ends_at_end_of_message(smol_tokenizer, tmp_path: Path) -> None:
    """Llama 3 ends a turn that calls a tool with <|eom_id|> (its template's ``Environment: ipython``),
    the others with <|eot_id|>: an answer ends at either, as llama.cpp's end-of-generation tokens."""
    from mashbox.engine.text.template import turn_ends

    Tokenizer.of(smol_tokenizer).save(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    hf.add_special_tokens({"additional_special_tokens": ["<|eot_id|>", "<|eom_id|>"]})
    hf.chat_template = "{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}"
    eot, eom = hf.convert_tokens_to_ids(["<|eot_id|>", "<|eom_id|>"])
    assert turn_ends(Tokenizer.of(hf)) == {eot, eom}
    hf.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    assert eom not in turn_ends(Tokenizer.of(hf))


def test_a_prompt_read_piece_by_piece_between_special_tokens_is_read_as_a_whole(smol_tokenizer):
    """Quoting special texts (runtime's ``_quoted``) reads the text between the template's special tokens
    piece by piece: the same tokens as one encode, checked once per vocabulary (``quotes``)."""
    tokenizer = Tokenizer(smol_tokenizer.backend_tokenizer, smol_tokenizer.special_tokens_map, None)
    assert tokenizer.quotes and "<|im_end|>" in tokenizer.special_texts
    text = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode_quoting(text, tokenizer.new_quotes()) == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("scheme, pieces_read_alike", [("first", False), ("always", True)])
def test_quoting_is_only_where_pieces_read_as_the_whole(scheme: str, pieces_read_alike: bool) -> None:
    """A sentencepiece vocabulary that marks only the text's first word (Metaspace ``first``, as Llama's and
    Mistral's) reads a piece after a special token otherwise alone than in the whole prompt: no quoting there."""
    words = ["<unk>", "user\na", "▁user\na", "▁b", "b", "▁c\n\n", "c\n\n", "▁", "▁d", "d"]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme=scheme)
    backend.add_special_tokens(["<s>", "</s>"])
    assert Tokenizer(backend, {"eos_token": "</s>"}, None).quotes is pieces_read_alike
