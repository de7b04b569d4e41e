"""The CUDA path (bf16 weights, one matmul per layer). Runs where a GPU is; skipped on CPU."""

import pytest
import torch

from mashbox import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_engine_answers_batched_and_constrained(tiny_model_dir):
    with Engine(str(tiny_model_dir), ctx=512, slots=4, quiet=True) as engine:
        assert engine.info.device.startswith("cuda") and engine.info.dtype == "bfloat16"
        answers = [engine.chat(messages=[{"role": "user", "content": f"Hi {i}"}], max_tokens=8) for i in range(3)]
        assert all(a.usage.completion_tokens == 8 for a in answers)
        seeded = [engine.chat(messages=[{"role": "user", "content": "x"}], temperature=1.0, seed=3, max_tokens=8)
                  for _ in range(2)]
        assert seeded[0].choices[0].message.content == seeded[1].choices[0].message.content
        tool = {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"], "additionalProperties": False}}}
        call = engine.chat(messages=[{"role": "user", "content": "call f"}], tools=[tool], tool_choice="required",
                           max_tokens=60)
        assert call.choices[0].finish_reason == "tool_calls"
