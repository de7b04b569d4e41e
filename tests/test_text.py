"""Stop strings, incremental detokenization and sampling, with no model."""

import sys

import pytest
import torch

from mashbox.engine.model import sampler
from mashbox.engine.request import SamplingParams
from mashbox.engine.text.stop import StopMatcher


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


def test_the_held_back_tail_is_the_longest_suffix_that_begins_a_stop():
    import random

    from mashbox.engine.text.stop import overlap

    rng = random.Random(7)
    for _ in range(3000):
        text, stop = ("".join(rng.choices("ab", k=rng.randint(1, 12))) for _ in range(2))
        naive = max((n for n in range(1, min(len(text), len(stop) - 1) + 1) if text.endswith(stop[:n])), default=0)
        assert overlap(text, stop) == naive, (text, stop)


def test_at_most_64_stop_strings():
    assert len(SamplingParams(stop=tuple(map(str, range(64)))).stop) == 64
    with pytest.raises(ValueError, match="stop: must be at most 64 strings"):
        SamplingParams(stop=tuple(map(str, range(65))))


def test_stop_strings_of_at_most_10000_characters():
    assert SamplingParams(stop=("x" * 10_000,)).stop == ("x" * 10_000,)
    with pytest.raises(ValueError, match=r"stop: must be strings of at most 10000 characters \(one has 10001\)"):
        SamplingParams(stop=("a", "x" * 10_001))


def test_long_stop_strings_cost_a_token_its_characters_not_the_held_text_squared():
    """Two 100,000-character stops that the answer kept half-matching were searched again at every token
    over all the text held back: ~8 ms a token at 24,000 characters held, in the step every stream shares.
    Counted, not timed: the calls into C (a search, a comparison) a token makes, whatever is held."""
    m = StopMatcher(("#" * 10_000, "#" + "x" * 9_999))
    calls = []
    for _ in range(100):
        calls.append(0)
        sys.setprofile(lambda frame, event, arg: event == "c_call" and calls.__setitem__(-1, calls[-1] + 1))
        try:
            held = m.push("#" * 80)
        finally:
            sys.setprofile(None)
        assert held == ""  # all held: it may yet be the first stop
    assert max(calls[1:]) <= 1.5 * calls[1] and max(calls) < 500, calls  # the same at every token, not one search
    # per '#' held (thousands by the last token)


def test_release_gives_up_the_held_tail_and_follows_the_stops_afresh():
    """A call began after a partial match: the held text is the call's, and no match spans the call."""
    matcher = StopMatcher(("ab",))
    assert matcher.push("xa") == "x" and matcher.release() == "a" and matcher.held == ""
    assert matcher.push("b") == "b" and matcher.matched is None
    assert matcher.push("ab") == "" and matcher.matched == "ab"


def test_no_stops_passes_text_through():
    assert run_stop([], ["a", "b"]) == ("ab", None)


def row(values):
    return torch.tensor([values], dtype=torch.float32)


def test_greedy_takes_argmax_without_drawing():
    assert sampler.sample(row([0.1, 3.0, 2.0]), [SamplingParams()], [([], [])], [None]) == [1]


def test_logit_bias_is_added_to_its_tokens_logits_greedy_or_sampled():
    ban = SamplingParams(logit_bias={1: -100})
    assert sampler.sample(row([0.1, 3.0, 2.0]), [ban], [([], [])], [None]) == [2]
    force = SamplingParams(temperature=1.0, logit_bias={0: 100})
    assert {sampler.sample(row([0.1, 3.0, 2.0]), [force], [([], [])], [sampler.uniform(1, i)])[0]
            for i in range(50)} == {0}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})


def test_seeded_sampling_is_reproducible():
    params = SamplingParams(temperature=1.0, seed=5)
    logits = torch.randn(1, 1000)
    draws = [[sampler.sample(logits, [params], [([], [])], [sampler.uniform(5, i)])[0] for i in range(20)]
             for _ in range(2)]
    assert draws[0] == draws[1] and len(set(draws[0])) > 1


def test_the_number_drawn_depends_on_seed_and_position_alone_and_is_uniform():
    numbers = [sampler.uniform(seed, position) for seed in (0, 1, -7, 2**63) for position in range(2500)]
    assert numbers[:2500] == [sampler.uniform(0, p) for p in range(2500)]  # no state between draws
    assert len(set(numbers)) == len(numbers) and all(0 <= u < 1 for u in numbers)
    tenths = [sum(int(10 * u) == k for u in numbers) for k in range(10)]
    assert max(abs(n - 1000) for n in tenths) < 130  # ~4 standard deviations of a uniform's count


@pytest.mark.parametrize("temperature", [1e-30, 1e-46, 5e-324])
def test_a_temperature_too_small_for_the_dtype_draws_the_likeliest_token(temperature):
    logits = row([0.1, 3.0, 2.0])[0]
    assert [sampler.draw(logits, SamplingParams(temperature=temperature), sampler.uniform(1, i)) for i in range(5)] == [1] * 5


def test_top_k_one_is_greedy():
    logits = torch.randn(1000)
    ids, probs = sampler.support(logits, SamplingParams(temperature=1.0, top_k=1))
    assert ids.tolist() == [int(logits.argmax())] and probs.tolist() == [1.0]


def test_top_k_renormalises_over_the_k_kept():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    ids, probs = sampler.support(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    assert ids.tolist() == [1] and abs(float(probs[0]) - 4 / 7) < 1e-6


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    ids, probs = sampler.support(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert ids.tolist() == [0, 1] and torch.allclose(probs, torch.tensor([0.5, 0.3]))


def test_top_p_beyond_the_candidates_reads_the_whole_vocabulary():
    logits = torch.zeros(sampler.CANDIDATES * 4)  # flat: the candidates hold a quarter of the mass
    ids, _ = sampler.support(logits, SamplingParams(temperature=1.0, top_p=0.9))
    assert len(ids) == int(0.9 * len(logits)) + 1 or len(ids) == int(0.9 * len(logits))
    assert len(set(ids.tolist())) == len(ids)


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    ids, _ = sampler.support(logits, SamplingParams(temperature=1.0, min_p=0.25))
    assert ids.tolist() == [0, 1]


def test_filtered_draws_follow_the_filtered_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.8, seed=1)
    draws = [sampler.draw(logits, params, sampler.uniform(1, i)) for i in range(4000)]
    assert set(draws) == {0, 1} and abs(draws.count(0) / 4000 - 0.5 / 0.8) < 0.03


def test_repetition_penalty_lowers_seen_tokens():
    logits = torch.tensor([2.0, 1.5, -1.0])
    out = sampler.apply_penalties(logits.clone(), SamplingParams(repetition_penalty=2.0), [0], [2])
    assert out.tolist() == [1.0, 1.5, -2.0]
    assert sampler.sample(logits[None], [SamplingParams(repetition_penalty=2.0)], [([0], [])], [None]) == [1]


def test_frequency_and_presence_penalties_count_output_tokens():
    logits = torch.zeros(3)
    out = sampler.apply_penalties(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), [1], [0, 0])
    assert out.tolist() == [-2.0, 0.0, 0.0]


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}])
@pytest.mark.parametrize("strength", [{"temperature": 1e-38}, {"temperature": 1e-45}, {"repetition_penalty": 1e-300},
                                      {"repetition_penalty": 1e-40, "temperature": 1e-30}])
def test_a_tiny_temperature_or_penalty_draws_a_likely_token_and_never_fails(filters, strength):
    """logits / 1e-38 overflowed to inf, the softmax was NaN: the last token of the vocabulary came out,
    and with min_p the step raised (every other request of that step failed with it)."""
    logits = torch.tensor([[0.5, 3.0, 2.9, -1.0, 0.0]])
    params = SamplingParams(**{"temperature": 1.0, **strength, **filters}, seed=3)
    seen = [1] if "repetition_penalty" in strength else []  # the penalty makes the seen token the likeliest
    tokens = {sampler.sample(logits, [params], [(seen, [])], [sampler.uniform(3, i)])[0] for i in range(50)}
    assert tokens == {1}


def test_min_p_keeps_every_token_above_it_beyond_the_candidates():
    logits = torch.zeros(sampler.CANDIDATES * 4)  # flat: every token is as likely as the likeliest
    ids, _ = sampler.support(logits, SamplingParams(temperature=1.0, min_p=0.5))
    assert len(ids) == len(logits) and len(set(ids.tolist())) == len(ids)
    ids, _ = sampler.support(torch.arange(4096.0) / 1000, SamplingParams(temperature=4.0, min_p=1e-4))
    assert len(ids) == 4096  # e^(-4.095 / 4) is far above 1e-4 of the top


def test_a_request_s_logit_bias_is_made_into_tensors_once(tiny_engine, monkeypatch):
    """The whole vocabulary's bias was rebuilt from its pairs at every token (60 ms a step, in the step
    every stream shares); a request makes it once, at its first sampled token."""
    made, real = [], sampler.bias
    monkeypatch.setattr(sampler, "bias", lambda *args: made.append(args) or real(*args))
    vocab = len(tiny_engine.tokenizer)
    out = tiny_engine.complete(prompt="Hello", max_tokens=12, temperature=0.8, seed=1,
                               logit_bias={str(i): 0.5 for i in range(vocab)})
    assert out.usage.completion_tokens == 12 and len(made) == 1
