"""The KV cache's forms: fp16 (the default on CPU) and q8_0 (``kv_dtype="q8_0"``, int8 with an fp16
scale for each 32 values, as llama.cpp's ``-ctk/-ctv q8_0``), through the engine and its caches."""

from pathlib import Path

import pytest
import torch
from tiny import tiny_config
from transformers import LlamaForCausalLM

from mashbox import Engine, SamplingParams
from mashbox.engine.config import EngineConfig
from mashbox.engine.events import Started, TextDelta
from mashbox.engine.load.checkpoint import Checkpoint
from mashbox.engine.model.form import Form, decide
from mashbox.engine.model.runner import ModelRunner
from mashbox.engine.request import EngineRequest

PROMPT = " ".join(f"fact{i} is true." for i in range(60)) + " Question?"


@pytest.fixture(scope="module")
def wide_heads_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A random 2-layer Llama whose heads hold 32 values (q8_0 blocks), with SmolLM2's tokenizer."""
    torch.manual_seed(99)
    model = LlamaForCausalLM(tiny_config(len(smol_tokenizer), head_dim=32)).eval()
    path = tmp_path_factory.mktemp("wide-heads")
    model.save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


def _run(engine: Engine, prompt: str = PROMPT) -> tuple[int, str]:
    events = list(engine.stream(EngineRequest(prompt=prompt, sampling=SamplingParams(max_tokens=8))))
    return next(e.cached for e in events if isinstance(e, Started)), "".join(
        e.text for e in events if isinstance(e, TextDelta))


def test_q8_0_cache_takes_about_half_the_memory_and_the_prefix_cache_keeps_its_answers(wide_heads_dir, tmp_path):
    options = {"ctx": 512, "slots": 1, "quiet": True, "cache_ram_mib": 64, "cache_disk_gib": 1,
               "cache_dir": str(tmp_path)}
    with Engine(str(wide_heads_dir), **options) as f16, Engine(str(wide_heads_dir), kv_dtype="q8_0", **options) as q8:
        kv, wide = q8._core.runner.kv, f16._core.runner.kv
        assert kv.keys.dtype == torch.uint8 and kv.nbytes * 64 == wide.nbytes * 34  # 34 bytes per 32 values, not 64
        assert q8.stats().kv_cache_bytes == kv.nbytes
        cold = _run(q8)
        assert cold[0] == 0 and cold[1]
        warm = _run(q8)  # from the slot's own prefix: its whole chunks
        assert warm[0] >= 256 and warm[1] == cold[1]
        _run(q8, PROMPT.replace("fact", "other"))  # the one slot now holds another prompt
        assert _run(q8) == warm  # restored from host memory
        assert _run(f16)[0] == 0  # the fp16 cache never takes q8_0 pages from the shared folder
    with Engine(str(wide_heads_dir), kv_dtype="q8_0", **options) as again:
        assert _run(again) == (256, cold[1])  # q8_0 pages read back from disk, the same answer


def test_q8_0_cache_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="kv_dtype: must be one of f16, q8_0"):
        EngineConfig(kv_dtype="q4_0")
    with pytest.raises(ValueError, match="kv_dtype: q8_0 needs mashbox's CPU kernels"):
        decide(torch.device("cpu"), "float32", True, "q8_0")
    with pytest.raises(ValueError, match="kv_dtype: q8_0 needs"):
        decide(torch.device("cuda"), None, True, "q8_0")
    narrow = Checkpoint.from_model(LlamaForCausalLM(tiny_config(100)).eval())  # heads of 16
    with pytest.raises(ValueError, match="multiple of 32 values; this model.s have 16"):
        ModelRunner(narrow, num_slots=1, ctx=64, form=Form(torch.device("cpu"), torch.float32, "q8", "q8_0"))
    assert decide(torch.device("cpu"), None, True, "f16").kv_dtype == torch.float16


def test_smollm2_answers_with_a_q8_0_cache():
    with Engine("smollm2-135m", ctx=1024, slots=2, kv_dtype="q8_0", quiet=True) as engine:
        answer = engine.chat(messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=24, temperature=0)
        assert "4" in answer.choices[0].message.content
        assert engine._core.runner.kv.keys.dtype == torch.uint8
