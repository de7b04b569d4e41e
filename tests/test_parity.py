"""Parity oracle: batched greedy output equals plain transformers generate(),
token for token, on a tiny random model built here."""

import copy

import pytest
import torch
from tiny import tiny_config
from transformers import LlamaForCausalLM

from mashbox import Engine, EngineRequest, Finish, SamplingParams, TextDelta
from mashbox.engine.load.checkpoint import Checkpoint
from mashbox.engine.model.runner import ModelRunner
from mashbox.engine.model.weights import fbgemm_available
from mashbox.engine.sched.scheduler import Scheduler
from mashbox.engine.sched.sequence import Sequence

NEW = 24


def reference(model, prompt: list[int], new: int = NEW) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(7)
    return LlamaForCausalLM(tiny_config(1000)).eval()


def fp16_weights(model):
    """The same model with every weight rounded to fp16 (kept in fp32): what packed mode computes with."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.half().float())
    return rounded


@pytest.mark.parametrize("mode,rows_at_once", [("packed", False), ("tiled", False), ("plain", False), ("plain", True),
                                                ("plain", "graphs")])
def test_batched_greedy_equals_generate(model, mode, rows_at_once):
    if mode == "packed" and not fbgemm_available():
        pytest.skip("fbgemm is not in this torch build")
    g = torch.Generator().manual_seed(3)
    lengths = (1, 5, 40, 130, 300, 17, 64, 65)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]
    oracle = fp16_weights(model) if mode == "packed" else model
    expected = [reference(oracle, p) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(prompts)
    assert all(len(set(e)) > 3 for e in expected), "the oracle should not be a constant stream"

    runner = ModelRunner(Checkpoint.from_model(model), num_slots=4, ctx=512, form=mode, graphs=rows_at_once == "graphs")
    if rows_at_once:  # as on CUDA: the one-token rows of a step in one masked SDPA call a layer
        runner._rows_at_once = True  # and with "graphs", steps of one-token rows padded to fixed shapes
    for cache in (runner.kv.keys, runner.kv.values):
        cache.fill_(float("nan"))  # what a cache allocated empty may hold where nothing was written yet
    scheduler = Scheduler(num_slots=4, ctx=512, chunk_tokens=64)
    seqs = [Sequence(str(i), p, SamplingParams(), NEW) for i, p in enumerate(prompts)]
    for s in seqs:
        scheduler.add(s)
    mixed_steps = 0
    while scheduler.has_work:
        plan = scheduler.schedule()
        mixed_steps += any(len(w.token_ids) > 1 for w in plan.work) and any(len(w.token_ids) == 1 for w in plan.work)
        scheduler.update(plan, runner.run(plan))
    assert mixed_steps > 0, "prefill chunks and decode rows should share device calls"
    assert [s.output_ids for s in seqs] == expected
    if rows_at_once == "graphs":  # steps of padded rows of several counts, attending to 256-512 positions
        rows, lengths = zip(*runner._graphs.shapes)
        assert len(set(rows)) >= 2 and len(set(lengths)) >= 2, runner._graphs.shapes


def test_engine_text_equals_generate(tiny_model_dir, smol_tokenizer):
    """Exact fp32 weights: the Engine's text is generate()'s (int8 weights are checked in test_native)."""
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts = ["The quick brown fox", "Once upon a time, in a land far away,", "1 2 3"]
    with Engine(str(tiny_model_dir), ctx=512, slots=4, dtype="float32", quiet=True) as engine:
        assert engine.info.weights_mode == "tiled"
        streams = [list(engine.stream(EngineRequest(prompt=p, sampling=SamplingParams(max_tokens=16))))
                   for p in prompts]
    for prompt, events in zip(prompts, streams):
        events = list(events)
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        ids = smol_tokenizer.encode(prompt)
        expected = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):]
        assert isinstance(events[-1], Finish)
        assert events[-1].usage.completion_tokens == len(expected)
        assert text == smol_tokenizer.decode(expected, skip_special_tokens=True)
