"""Loading progress where a person looks: a Jupyter cell (a real IPython kernel), a terminal (a
pty), and nothing when quiet or when stderr is a file."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from typing import Any

import pytest
from jupyter_client.manager import start_new_kernel

STEPS = ("reading the tokenizer", "reading the weights", "preparing the weights and the KV cache (1 x 256 tokens, float16)")


@pytest.fixture(scope="module")
def kernel():
    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=120)
    try:
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def run_cell(client: Any, code: str) -> list[dict[str, Any]]:
    """Execute ``code`` in the kernel; its output messages (display, update, stream, error), in order."""
    msg_id = client.execute(code)
    outputs = []
    while True:
        msg = client.get_iopub_msg(timeout=180)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return outputs
        if msg["msg_type"] in ("display_data", "update_display_data", "stream", "error", "execute_result"):
            outputs.append(msg)


def test_a_jupyter_cell_shows_each_step_as_it_begins_then_ready_with_times(kernel, tiny_model_dir):
    code = f"from mashbox import Engine\nengine = Engine({str(tiny_model_dir)!r}, ctx=256, slots=1)"
    outputs = run_cell(kernel, code)
    assert [m for m in outputs if m["msg_type"] in ("stream", "error")] == []  # no TqdmWarning, no error
    kinds = [m["msg_type"] for m in outputs]
    assert kinds[0] == "display_data" and set(kinds[1:]) == {"update_display_data"}
    ids = {m["content"]["transient"]["display_id"] for m in outputs}
    assert len(ids) == 1  # one output, updated in place
    shown = [m["content"]["data"]["text/plain"] for m in outputs]
    name = tiny_model_dir.name
    assert shown[0] == f"{name}: loading"
    for step, text in zip(STEPS, shown[1:]):  # each step appears as it begins, the ones before with times
        assert text.splitlines()[-1].split() == [*step.split(), "..."]
        assert all(line.rstrip().endswith(" s") for line in text.splitlines()[1:-1])
    assert shown[-1].startswith(f"{name} ready in ")
    assert all(f"{step} " in shown[-1] for step in STEPS)


def test_a_load_that_fails_in_a_cell_ends_its_output_saying_so(kernel, tiny_model_dir):
    """The output does not stay on a step that never ends: its last line says the load failed, where."""
    code = f"from mashbox import Engine\nEngine({str(tiny_model_dir)!r}, ctx=100000, slots=1)"
    outputs = run_cell(kernel, code)
    shown = [m["content"]["data"]["text/plain"] for m in outputs if "data" in m["content"]]
    assert shown[-1].startswith(f"{tiny_model_dir.name}: not loaded while ") and "ctx: 100000" in shown[-1]
    assert outputs[-1]["msg_type"] == "error" and outputs[-1]["content"]["ename"] == "ConfigError"


def test_quiet_silences_the_cell(kernel, tiny_model_dir):
    code = f"from mashbox import Engine\nquiet = Engine({str(tiny_model_dir)!r}, ctx=256, slots=1, quiet=True)"
    assert run_cell(kernel, code) == []


def load_in_a_terminal(model: str, *options: str) -> str:
    """What loading ``model`` writes on a pseudo-terminal."""
    code = f"import sys; from mashbox import Engine; Engine(sys.argv[1], ctx=256, slots=1{''.join(options)}).close()"
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code, model], stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    seen = b""
    while select.select([master], [], [], 120)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the program ended
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0
    return seen.decode(errors="replace")


def test_a_terminal_shows_the_current_step_then_ready_with_times(tiny_model_dir):
    seen = load_in_a_terminal(str(tiny_model_dir))
    name = tiny_model_dir.name
    for step in STEPS:
        assert f"{name}: {step}" in seen  # the transient line, step by step
    assert f"{name} ready in " in seen


def test_quiet_silences_the_terminal_and_a_file_gets_nothing(tiny_model_dir):
    assert load_in_a_terminal(str(tiny_model_dir), ", quiet=True") == ""
    code = "import sys; from mashbox import Engine; Engine(sys.argv[1], ctx=256, slots=1).close()"
    done = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], capture_output=True, text=True,
                          timeout=180, check=True)
    assert done.stderr == ""
