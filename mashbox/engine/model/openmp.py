"""How the OpenMP threads of mashbox's kernels (and torch's) wait between parallel regions.

GNU OpenMP's default has a thread that reaches the end of a region spin for the others. On a
machine that is also doing something else (the server's own HTTP process, a load generator, an
editor, a build), the thread being waited for is often the one the kernel has just preempted, and
a decode step of ~120 small regions then spent 10-25x its time spinning (bench/step_profile.py
beside one busy process: 200-440 ms a step instead of 18). Passive waiting (sleep at once) keeps
a step at its own cost on a busy machine. The runtime reads the setting once, when it is loaded
with torch, so this must run before torch is first imported; a value the user set is kept.
"""

from __future__ import annotations

import os
import sys


def prefer_passive_wait() -> None:
    """Default ``OMP_WAIT_POLICY`` to ``PASSIVE`` unless torch (and its OpenMP) is already loaded."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
