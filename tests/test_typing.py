"""The Engine's methods are typed: their keyword parameters agree with the protocols' request
models, and mypy passes correct use (tests/typed/clean.py) and catches mistakes (tests/typed/wrong.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mashbox.api import anthropic_messages, params
from mashbox.api.protocols import PROTOCOLS

TYPED = Path(__file__).parent / "typed"
ROOT = TYPED.parent.parent
PARAMS = {"chat": params.ChatParams, "complete": params.CompletionParams, "respond": params.ResponsesParams,
          "message": params.MessagesParams}
MODELS = {**{method: p.request for method, p in PROTOCOLS.items()}, "count_tokens": anthropic_messages.CountTokensRequest}
ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")
MARK = re.compile(r"  # E: (?P<code>[a-z-]+)$")  # the error a line of wrong.py must get


@pytest.mark.parametrize("method", [*PROTOCOLS, "count_tokens"])
def test_keyword_parameters_agree_with_the_request_model(method: str) -> None:
    typed = {**PARAMS, "count_tokens": params.CountTokensParams}[method]
    model = MODELS[method]
    fields = {info.alias or name for name, info in model.model_fields.items()}
    required = {info.alias or name for name, info in model.model_fields.items() if info.is_required()}
    stream = {"stream"} if "stream" in fields else set()  # each method's own keyword: it picks the return type
    assert set(typed.__annotations__) | stream == fields
    assert typed.__required_keys__ == required


@pytest.fixture(scope="module")
def mypy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[tuple[int, str]]]:
    """mypy's errors on both files, by file name: {(line, code)}."""
    cache = tmp_path_factory.mktemp("mypy-cache")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(TYPED / "mypy.ini"), "--cache-dir", str(cache),
         "--no-error-summary", "--hide-error-context", str(TYPED / "clean.py"), str(TYPED / "wrong.py")],
        check=False, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "MYPYPATH": str(ROOT)}, timeout=300)
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 1: errors found; anything else: mypy failed
    errors: dict[str, set[tuple[int, str]]] = {"clean.py": set(), "wrong.py": set()}
    for line in done.stdout.splitlines():
        if found := ERROR.match(line):
            errors[Path(found["file"]).name].add((int(found["line"]), found["code"]))
    return errors


def test_correct_use_type_checks(mypy: dict[str, set[tuple[int, str]]]) -> None:
    assert mypy["clean.py"] == set()


def test_a_wrong_field_or_a_wrong_use_of_the_result_is_an_error(mypy: dict[str, set[tuple[int, str]]]) -> None:
    lines = (TYPED / "wrong.py").read_text().splitlines()
    expected = {(n, mark["code"]) for n, line in enumerate(lines, 1) if (mark := MARK.search(line))}
    assert len(expected) >= 15 and mypy["wrong.py"] == expected


def test_the_package_says_it_is_typed() -> None:
    """Without PEP 561's py.typed an installed mashbox is untyped to mypy (every type Any)."""
    assert (ROOT / "mashbox" / "py.typed").is_file()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()  # shipped in the wheel
