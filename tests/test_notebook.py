"""The quickstart notebook's code cells run, in order, against the real embedded model."""

import contextlib
import io
import json
from pathlib import Path

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"


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
