"""The quickstart notebook's code cells run, in order, against the real embedded model."""

import contextlib
import io
import json
import re
from pathlib import Path

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"
# a path of this machine: /root/..., /home/..., /tmp/... (also escaped in JSON), or a Windows drive
ABSOLUTE = re.compile(r"(?<![\w.~])(?:\\?/(?:root|home|tmp|work|usr|opt|var|srv|mnt|Users)\\?/|[A-Za-z]:\\\\)")


def test_quickstart_notebook_runs():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for source in code:
            exec(compile(source, str(NOTEBOOK), "exec"), namespace)
    printed = out.getvalue()
    assert "refused: temperature" in printed
    assert any(p in printed.lower() for p in ("mars", "venus", "earth", "jupiter", "saturn"))
    assert namespace["message"].stop_reason in ("end_turn", "max_tokens")


def test_answers_show_their_text_finish_and_usage_at_a_glance_in_jupyter(tiny_engine):
    hi = [{"role": "user", "content": "hi"}]
    answers = [tiny_engine.chat(messages=hi, max_tokens=3), tiny_engine.complete(prompt="a", max_tokens=3),
               tiny_engine.respond(input="hi", max_output_tokens=16), tiny_engine.message(messages=hi, max_tokens=3)]
    texts = [answers[0].choices[0].message.content, answers[1].choices[0].text,
             answers[2].output[-1].content[0].text, answers[3].content[0].text]
    for answer, text in zip(answers, texts):
        shown = answer._repr_markdown_()
        assert shown.startswith(text.strip()) and "*finish: " in shown and " new tokens*" in shown
    assert "*finish: length · " in answers[0]._repr_markdown_()


def test_saved_outputs_carry_no_absolute_path_of_the_machine():
    text = NOTEBOOK.read_text()
    assert json.loads(text)["cells"][1]["outputs"], "the notebook is saved with its outputs"
    assert ABSOLUTE.findall(text) == []


def test_engine_info_names_the_weights_not_their_path(tiny_engine, tiny_model_dir):
    assert tiny_engine.info.weights == tiny_model_dir.name
    assert ABSOLUTE.findall(repr(tiny_engine.info)) == []
