"""Shared fixtures: a tiny random Llama built here (fast, exact), the real embedded SmolLM2 (slow
to load, so loaded once per test session), and mashbox's compiled CPU kernels."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from server import (  # noqa: F401
    claude,
    fuzz_server,
    idle_server,
    loading_server,
    long_engine,
    oai,
    smol_server,
    tiny_server,
)
from tiny import tiny_config
from transformers import AutoTokenizer, LlamaForCausalLM

from mashbox import Engine
from mashbox.engine.load.catalog import resolve

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory) -> Path:
    """What the tests' engines, servers and chats keep (kernels, packed weights, prompt pages, the tasks
    file, chat history) goes to a folder of this run, never to the user's own ``~/.cache/mashbox``."""
    path = tmp_path_factory.mktemp("mashbox-cache")
    os.environ["MASHBOX_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def smol_tokenizer():
    if saved := os.environ.get("MASHBOX_TEST_TOKENIZER"):  # a saved copy where the model is not installed (gpu_check.sh)
        return AutoTokenizer.from_pretrained(saved)
    source = resolve("smollm2-135m")
    return AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A randomly initialised 2-layer Llama with the SmolLM2 tokenizer, saved as an HF directory."""
    torch.manual_seed(1234)
    model = LlamaForCausalLM(tiny_config(len(smol_tokenizer))).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    with Engine(str(tiny_model_dir), ctx=512, slots=16, quiet=True) as engine:
        yield engine


@pytest.fixture(scope="session")
def smol_engine():
    with Engine("smollm2-135m", ctx=2048, slots=16, quiet=True) as engine:
        yield engine


@pytest.fixture(scope="session")
def lib():
    """mashbox's CPU kernels, built with the machine's C compiler (the set-up installs one)."""
    from mashbox.engine.model import native

    assert shutil.which("cc") or shutil.which("gcc"), "these tests need a C compiler, as the set-up installs"
    kernels = native.load()
    assert kernels is not None, "the kernels should build wherever a C compiler is"
    return kernels
