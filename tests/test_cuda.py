"""The CUDA path (bf16 weights, one matmul per layer). Runs where a GPU is; skipped on CPU."""

import pytest
import torch
from tiny import tiny_config
from transformers import LlamaForCausalLM

from mashbox import Engine, SamplingParams
from mashbox.engine.load.checkpoint import Checkpoint
from mashbox.engine.model.runner import ModelRunner
from mashbox.engine.sched.scheduler import Plan, Work
from mashbox.engine.sched.sequence import Sequence

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
        graphs = engine._core.runner._graphs
        assert graphs is not None and any(shape.graph is not None for shape in graphs.shapes.values())


@torch.inference_mode()
def test_cuda_graph_replays_equal_the_eager_step():
    torch.manual_seed(3)
    device = f"cuda:{torch.cuda.device_count() - 1}"  # a device named by index (the last one), as EngineConfig allows
    model = LlamaForCausalLM(tiny_config(500)).eval().to(device, torch.bfloat16)
    runner = ModelRunner(Checkpoint.from_model(model), num_slots=4, ctx=256, form="plain", graphs=True)
    seqs = []
    for slot, n in zip((0, 2, 3), (5, 9, 140)):
        seq = Sequence(str(slot), list(range(3, 3 + n)), SamplingParams(), 16)
        seq.slot = slot
        seqs.append(seq)
    runner.run(Plan([Work(s, tuple(s.prompt_ids), 0, True) for s in seqs]))
    for step in range(3):  # one capture, then replays with new inputs
        plan = Plan([Work(s, (7 + step + i,), len(s.prompt_ids) + step, True) for i, s in enumerate(seqs)])
        replayed = runner._graphs.hidden(plan).float().clone()
        eager = runner.forward(runner._batch(plan)).float()
        torch.testing.assert_close(replayed, eager, rtol=0.02, atol=0.02 * eager.abs().max().item())
    assert set(runner._graphs.shapes) == {(4, 256)} and runner._graphs.shapes[4, 256].graph is not None
