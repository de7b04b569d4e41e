"""The Makefile's set-up, read with ``make -n``: which torch build it installs, and from where."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def torch_lines(*assignments):
    out = subprocess.run(["make", "-n", "-B", "venv", *assignments], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    commands = out.replace("\\\n", " ").splitlines()
    return [line for line in commands if "torch" in line and "-e '.[test]'" not in line]


def test_without_a_gpu_torch_is_the_cpu_build_from_a_local_wheel_or_the_cpu_index():
    [line] = torch_lines("GPU=")
    local, index = line.split("||")
    assert 'pip install -q --no-index --no-deps "torch==2.13.0+cpu"' in local
    assert 'pip install -q --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu"' in index


def test_with_a_gpu_torch_is_the_plain_build_and_both_are_overridable():
    [line] = torch_lines("GPU=yes")
    assert "||" not in line and "index-url" not in line and line.endswith('pip install -q  "torch==2.13.0"')
    [line] = torch_lines("GPU=", "TORCH=torch==2.13.0", "TORCH_INDEX=https://download.pytorch.org/whl/cu128")
    assert line.endswith('pip install -q --extra-index-url https://download.pytorch.org/whl/cu128 "torch==2.13.0"')
