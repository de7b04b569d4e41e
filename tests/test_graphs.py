"""Decode steps at fixed shapes (``DecodeGraphs``), run eagerly on the CPU: the shapes, and padding
rows that write only to the spare slot. Token parity with generate() is in test_parity; the CUDA
graphs themselves in test_cuda."""

import pytest
import torch
from tiny import tiny_config
from transformers import LlamaForCausalLM

from mashbox import SamplingParams
from mashbox.engine.load.checkpoint import Checkpoint
from mashbox.engine.model.graphs import LONGEST, DecodeGraphs, attended, row_sizes
from mashbox.engine.model.runner import ModelRunner
from mashbox.engine.sched.scheduler import Plan, Work
from mashbox.engine.sched.sequence import Sequence


def test_row_sizes_double_up_to_the_slots():
    assert row_sizes(1) == [1]
    assert row_sizes(16) == [1, 2, 4, 8, 16]
    assert row_sizes(24) == [1, 2, 4, 8, 16, 24]


@pytest.mark.parametrize("longest,ctx,expected", [(1, 512, 128), (128, 512, 128), (129, 512, 256),
                                                   (300, 512, 512), (512, 512, 512), (100, 64, 64)])
def test_attended_length_is_the_next_power_of_two_within_the_context(longest, ctx, expected):
    assert attended(longest, ctx) == expected


def test_steps_of_one_token_rows_within_the_longest_shape_are_taken():
    graphs = DecodeGraphs(lambda inputs, length: inputs, torch.device("cpu"), ctx=8192, spare=4, capture=False)
    seqs = [Sequence(str(i), [5], SamplingParams(), 8) for i in range(5)]

    def plan(*items):
        return Plan([Work(seq, tokens, position, True) for seq, (tokens, position) in zip(seqs, items)])

    assert graphs.takes(plan(((7,), 10), ((8,), LONGEST - 1)))
    assert not graphs.takes(plan(((7,), 10), ((8,), LONGEST)))  # attends past the longest shape: eager
    assert not graphs.takes(plan(((7,), 10), ((8, 9), 20)))  # a prompt chunk
    assert not graphs.takes(plan(*[((7,), 10)] * 5))  # more rows than slots
    assert not graphs.takes(Plan([]))


@pytest.fixture(scope="module")
def runner():
    torch.manual_seed(5)
    model = LlamaForCausalLM(tiny_config(500)).eval()
    return ModelRunner(Checkpoint.from_model(model), num_slots=4, ctx=256, form="plain", graphs=True)


def test_padding_rows_write_only_the_spare_slot(runner):
    assert runner.kv.keys.shape[1] == 5 and runner._graphs.spare == 4  # four slots and the spare
    seqs = []
    for slot, n in zip((0, 2, 3), (5, 9, 140)):  # slot 1 is free
        seq = Sequence(str(slot), list(range(3, 3 + n)), SamplingParams(), 16)
        seq.slot = slot
        seqs.append(seq)
    runner.run(Plan([Work(s, tuple(s.prompt_ids), 0, True) for s in seqs]))  # the prompts, unpadded
    keys, values = runner.kv.keys.clone(), runner.kv.values.clone()
    decode = Plan([Work(s, (7,), len(s.prompt_ids), True) for s in seqs])
    tokens = runner.run(decode)  # three rows padded to four, attending to 256 positions
    assert set(runner._graphs.shapes) == {(4, 256)}
    for cache, before in ((runner.kv.keys, keys), (runner.kv.values, values)):
        differs = (cache != before) & ~(cache.isnan() & before.isnan())  # the cache starts as empty memory
        changed = differs.any(-1).any(2).any(0)  # [slots, positions]
        written = {(s.slot, len(s.prompt_ids)) for s in seqs} | {(4, 0)}
        assert {tuple(i) for i in changed.nonzero().tolist()} == written
    with torch.inference_mode():
        alone = [runner._logits(runner.forward(runner._batch(Plan([w])))) for w in decode.work]
    expected = [logits[0].argmax().item() for logits in alone]
    assert tokens == expected  # each row alone, unpadded, picks the same token


def test_a_step_that_cannot_be_captured_runs_eagerly_from_then_on(caplog):
    torch.manual_seed(5)
    model = LlamaForCausalLM(tiny_config(500)).eval()
    runner = ModelRunner(Checkpoint.from_model(model), num_slots=2, ctx=128, form="plain", graphs=True)
    seq = Sequence("a", [3, 4, 5], SamplingParams(), 8)
    seq.slot = 0
    runner.run(Plan([Work(seq, (3, 4, 5), 0, True)]))

    def fails(inputs, longest):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner._graphs.step = fails
    step = Plan([Work(seq, (6,), 3, True)])
    with torch.inference_mode():
        expected = runner._logits(runner.forward(runner._batch(step)))[0].argmax().item()
    assert runner.run(step) == [expected]
    assert runner._graphs is None and "CUDA graphs off" in caplog.text
