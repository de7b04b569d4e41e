"""Stop strings, incremental detokenization and sampling, with no model."""

import pytest
import torch

from mashbox.engine import sampler
from mashbox.engine.request import SamplingParams
from mashbox.engine.stop import StopMatcher


def run_stop(stops, pieces):
    m = StopMatcher(tuple(stops))
    out = "".join(m.push(p) for p in pieces)
    return out + m.flush(), m.matched


@pytest.mark.parametrize("text", ["Hello END world", "abcSTOPdef", "one\n\ntwo", "xx<|x|>yy"])
@pytest.mark.parametrize("stops", [["END", "STOP", "\n\n", "<|x|>"]])
def test_stop_split_at_every_position_gives_same_result(text, stops):
    whole = run_stop(stops, [text])
    for cut in range(len(text) + 1):
        assert run_stop(stops, [text[:cut], text[cut:]]) == whole
    chars = run_stop(stops, list(text))
    assert chars == whole
    stop = whole[1]
    assert stop is not None and whole[0] == text[: text.index(stop)]


def test_stop_partial_match_is_held_back_then_released():
    m = StopMatcher(("STOP",))
    assert m.push("abc ST") == "abc "
    assert m.push("x") == "STx"
    assert m.push("ST") == ""
    assert m.flush() == "ST" and m.matched is None


def test_earliest_stop_wins():
    assert run_stop(["bb", "a"], ["xxbbya"]) == ("xx", "bb")


def test_no_stops_passes_text_through():
    assert run_stop([], ["a", "b"]) == ("ab", None)


def row(values):
    return torch.tensor([values], dtype=torch.float32)


def test_greedy_takes_argmax_without_generator():
    assert sampler.sample(row([0.1, 3.0, 2.0]), [SamplingParams()], [([], [])], [None]) == [1]


def test_seeded_sampling_is_reproducible():
    params = SamplingParams(temperature=1.0, seed=5)
    logits = torch.randn(1, 1000)
    draws = []
    for _ in range(2):
        g = torch.Generator().manual_seed(5)
        draws.append([sampler.sample(logits, [params], [([], [])], [g])[0] for _ in range(20)])
    assert draws[0] == draws[1] and len(set(draws[0])) > 1


def test_top_k_one_is_greedy():
    logits = torch.randn(1000)
    kept = sampler.filter_logits(logits, SamplingParams(temperature=1.0, top_k=1))
    assert torch.isfinite(kept).sum() == 1 and int(kept.argmax()) == int(logits.argmax())


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = sampler.filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.isfinite(kept).tolist() == [True, True, False, False]


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    kept = sampler.filter_logits(logits, SamplingParams(temperature=1.0, min_p=0.25))
    assert torch.isfinite(kept).tolist() == [True, True, False]


def test_repetition_penalty_lowers_seen_tokens():
    logits = torch.tensor([2.0, 1.5, -1.0])
    out = sampler.apply_penalties(logits.clone(), SamplingParams(repetition_penalty=2.0), [0], [2])
    assert out.tolist() == [1.0, 1.5, -2.0]
    assert sampler.sample(logits[None], [SamplingParams(repetition_penalty=2.0)], [([0], [])], [None]) == [1]


def test_frequency_and_presence_penalties_count_output_tokens():
    logits = torch.zeros(3)
    out = sampler.apply_penalties(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), [1], [0, 0])
    assert out.tolist() == [-2.0, 0.0, 0.0]
