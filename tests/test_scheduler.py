"""Scheduler and slot policy, driven with fake runner results: no model, no device."""

import itertools

import pytest

from mashbox.engine.request import SamplingParams
from mashbox.engine.sched.pace import Pace
from mashbox.engine.sched.scheduler import Plan, Scheduler
from mashbox.engine.sched.sequence import Sequence, Status
from mashbox.engine.sched.slots import SlotTable

EOS = 0


def seq(name: str, prompt_len: int, max_new: int = 8, first: int = 1) -> Sequence:
    """A request whose prompt counts up from ``first``: prompts with the same ``first`` share a prefix."""
    return Sequence(name, list(range(first, first + prompt_len)), SamplingParams(), max_new, frozenset({EOS}))


def step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    sampled = [token] * sum(w.sample for w in plan.work)
    s.update(plan, sampled)
    return plan


def test_slot_table_hands_out_and_takes_back():
    table = SlotTable(3)
    got = [table.allocate() for _ in range(3)]
    assert got == [0, 1, 2] and table.num_free == 0
    with pytest.raises(RuntimeError):
        table.allocate()
    table.free(1)
    assert table.allocate() == 1
    with pytest.raises(ValueError):
        table.free(5)


def test_new_request_joins_running_batch_at_next_step():
    s = Scheduler(num_slots=4, ctx=128, chunk_tokens=64)
    a = seq("a", 10)
    s.add(a)
    first = step(s)
    assert [(w.seq.id, len(w.token_ids), w.sample) for w in first.work] == [("a", 10, True)]
    s.add(seq("b", 5))
    second = s.schedule()
    assert [(w.seq.id, len(w.token_ids), w.position) for w in second.work] == [("a", 1, 10), ("b", 5, 0)]


def test_long_prompt_is_chunked_at_fixed_boundaries_while_others_decode():
    s = Scheduler(num_slots=2, ctx=512, chunk_tokens=64)
    s.add(seq("short", 4, max_new=50))
    step(s)
    s.add(seq("long", 150))
    shapes = [[(w.seq.id, w.position, len(w.token_ids), w.sample) for w in step(s).work] for _ in range(3)]
    assert shapes == [
        [("short", 4, 1, True), ("long", 0, 64, False)],
        [("short", 5, 1, True), ("long", 64, 64, False)],
        [("short", 6, 1, True), ("long", 128, 22, True)],
    ]


def test_a_short_prompt_goes_before_the_rest_of_a_long_one_being_computed():
    """A "Hi" waited for every chunk of a 7k-token prompt before it (35 s here); now it starts at the next
    step, and the long one goes on beside it, chunk by chunk, at its fixed boundaries."""
    s = Scheduler(num_slots=2, ctx=4096, chunk_tokens=64, step_tokens=64)
    s.add(seq("long", 2000))
    assert [(w.seq.id, w.position) for w in step(s).work] == [("long", 0)]
    s.add(seq("hi", 5, first=9000))
    work = [(w.seq.id, w.position, len(w.token_ids), w.sample) for w in step(s).work]
    assert work[0] == ("hi", 0, 5, True) and all(w[0] == "long" and w[1] % 64 == 0 for w in work[1:])
    for _ in range(5):
        plan = step(s)
        assert [w.seq.id for w in plan.work][0] == "hi" and any(w.seq.id == "long" for w in plan.work)
    assert s.running[0].in_prefill  # the long one: not done yet, but moving


def test_a_short_prompt_begun_goes_on_before_a_long_one_beside_decoding_streams():
    """Beside a decoding stream the step's prompt budget is small: the short prompt got its first piece,
    then waited behind the long one being computed for all of it (40 s behind two 7k-token prompts)."""
    def timed(s):
        plan = s.schedule()
        s.update(plan, [7] * sum(w.sample for w in plan.work), 0.05 + 0.002 * plan.prompt_tokens)
        return plan

    s = Scheduler(num_slots=4, ctx=4096, chunk_tokens=64, step_tokens=256)
    s.cut_anywhere = True
    s.add(seq("decoding", 64, max_new=500))
    s.add(seq("long", 3000, first=3000))
    for _ in range(6):
        timed(s)
    s.add(seq("hi", 40, first=9000))
    for _ in range(3):
        timed(s)
    assert not next(q for q in s.running if q.id == "hi").in_prefill


def test_short_prompts_keep_their_order_and_a_long_waiting_one_its_turn():
    s = Scheduler(num_slots=3, ctx=4096, chunk_tokens=64, step_tokens=64)
    for name, length, first in (("a", 30, 1), ("b", 30, 500), ("long", 2000, 900)):
        s.add(seq(name, length, first=first))
    assert [w.seq.id for w in step(s).work] == ["a", "b"]  # nothing long being computed: first come, first served
    assert [w.seq.id for w in step(s).work] == ["a", "b", "long"]


def test_waiting_requests_wait_for_a_free_slot():
    s = Scheduler(num_slots=1, ctx=64, chunk_tokens=32)
    a, b = seq("a", 3, max_new=2), seq("b", 3, max_new=2)
    s.add(a)
    s.add(b)
    assert [w.seq.id for w in step(s).work] == ["a"]
    assert [w.seq.id for w in step(s).work] == ["a"]
    assert a.status == Status.FINISHED_LENGTH and s.slots.num_free == 1
    assert [w.seq.id for w in step(s).work] == ["b"]


def test_eos_finishes_with_stop_and_frees_slot():
    s = Scheduler(num_slots=1, ctx=64, chunk_tokens=32)
    a = seq("a", 3)
    s.add(a)
    step(s, token=EOS)
    assert a.status == Status.FINISHED_STOP and a.finish_reason == "stop"
    assert s.slots.num_free == 1 and not s.has_work


def test_end_of_context_finishes_with_length():
    s = Scheduler(num_slots=1, ctx=8, chunk_tokens=32)
    a = seq("a", 6, max_new=100)
    s.add(a)
    while s.has_work:
        step(s)
    assert a.status == Status.FINISHED_LENGTH and a.num_tokens == 8


def test_prompt_longer_than_context_is_refused():
    s = Scheduler(num_slots=1, ctx=8, chunk_tokens=32)
    with pytest.raises(ValueError):
        s.add(seq("a", 8))


def test_abort_frees_slot_for_the_next_request():
    s = Scheduler(num_slots=1, ctx=64, chunk_tokens=32)
    a, b = seq("a", 3, max_new=50), seq("b", 3)
    s.add(a)
    s.add(b)
    step(s)
    s.finish(a, Status.FINISHED_ABORT)
    assert a.finish_reason == "abort"
    assert [w.seq.id for w in s.schedule().work] == ["b"]


def test_finished_state_is_not_overwritten():
    a = seq("a", 3)
    a.finish(Status.FINISHED_STOP)
    a.finish(Status.FINISHED_ABORT)
    assert a.status == Status.FINISHED_STOP and a.status.is_finished
    with pytest.raises(ValueError):
        a.finish(Status.RUNNING)


def test_prefix_cache_reuses_whole_chunks_of_a_finished_prompt():
    s = Scheduler(num_slots=2, ctx=1024, chunk_tokens=64)
    first = seq("first", 300, max_new=1)
    s.add(first)
    while s.has_work:
        step(s)
    second = Sequence("second", first.prompt_ids[:290] + [999] * 20, SamplingParams(), 1, frozenset({EOS}))
    s.add(second)
    plan = s.schedule()
    assert second.slot == first.slot and second.num_cached == 256
    assert [(w.position, len(w.token_ids)) for w in plan.work] == [(256, 54)]
    assert (s.lookup_tokens, s.hit_tokens) == (610, 256)
    s.cache.check_integrity()


def test_prefix_cache_leaves_one_token_to_compute_and_prefers_lru_without_hit():
    s = Scheduler(num_slots=3, ctx=1024, chunk_tokens=64)
    for name in ("a", "b"):
        s.add(Sequence(name, [7] * 128 if name == "a" else [8] * 64, SamplingParams(), 1))
        while s.has_work:
            step(s)
    again = Sequence("again", [7] * 128, SamplingParams(), 1)
    s.add(again)
    while s.has_work:
        step(s)
    assert again.num_cached == 64, "the last block is recomputed so the prompt has a token to sample from"
    fresh = Sequence("fresh", [5] * 10, SamplingParams(), 1)
    s.add(fresh)
    s.schedule()
    assert fresh.slot == 2 and fresh.num_cached == 0, "an empty slot is taken before one holding a prefix"


def run_to_end(s: Scheduler, seq_: Sequence) -> Plan:
    s.add(seq_)
    first = s.schedule()
    s.update(first, [7] * sum(w.sample for w in first.work))
    while s.has_work:
        step(s)
    return first


def prompt(base: int, n: int = 200) -> list[int]:
    return [base + i for i in range(n)]


def test_evicted_prefix_goes_to_host_memory_and_comes_back():
    from mashbox.engine.sched.prefix_cache import Restore, Save

    s = Scheduler(num_slots=1, ctx=1024, chunk_tokens=64, host_cache_bytes=10_000, kv_bytes_per_token=10)
    run_to_end(s, Sequence("a", prompt(1000), SamplingParams(), 1))
    plan_b = run_to_end(s, Sequence("b", prompt(5000), SamplingParams(), 1))
    assert [type(op) for op in plan_b.cache_ops] == [Save] and plan_b.cache_ops[0].tokens == 192
    again = Sequence("a2", prompt(1000) + [3, 3], SamplingParams(), 1)
    plan = run_to_end(s, again)
    assert [type(op) for op in plan.cache_ops] == [Save, Restore]
    restore = plan.cache_ops[1]
    assert restore.entry == plan_b.cache_ops[0].entry and restore.tokens == 192 and again.num_cached == 192
    assert plan.work[0].position == 192
    assert s.cache.host.bytes == 2 * 192 * 10 and s.cache.host.evictions == 0
    s.cache.check_integrity()


def test_host_memory_counts_its_bytes_through_supersedes_evictions_and_forgets():
    """The tier keeps a running count (summing its entries at each eviction made a store quadratic)."""
    import random

    from mashbox.engine.sched.prefix_cache import HostTier

    rng, host = random.Random(0), HostTier(cap=4000, bytes_per_token=10)
    for n in range(300):
        tokens = tuple(rng.randrange(4) for _ in range(rng.randrange(1, 120)))
        host.store(0, tokens, None, rng.choice("ab"))
        if n % 7 == 0:
            host.forget({e for e, _, _ in host.entries() if rng.random() < 0.3} | {10**6})
        assert host.bytes == 10 * sum(len(t) for _, _, t in host.entries()) <= 4000
    assert host.evictions > 0


def test_host_memory_cap_evicts_least_recently_used_but_never_the_prefix_being_restored():
    from mashbox.engine.sched.prefix_cache import Drop, Restore, Save

    s = Scheduler(num_slots=1, ctx=1024, chunk_tokens=64, host_cache_bytes=2500, kv_bytes_per_token=10)
    for base in (1000, 5000):
        run_to_end(s, Sequence(str(base), prompt(base), SamplingParams(), 1))
    assert s.cache.host.bytes == 1920
    plan = run_to_end(s, Sequence("a-again", prompt(1000) + [3], SamplingParams(), 1))
    assert [type(op) for op in plan.cache_ops] == [Restore], "no room for the slot's prefix beside the kept one"
    plan = run_to_end(s, Sequence("c", prompt(9000), SamplingParams(), 1))
    assert plan.cache_ops == [], "the slot's prefix is in host memory already"
    plan = run_to_end(s, Sequence("d", prompt(13000), SamplingParams(), 1))
    assert [type(op) for op in plan.cache_ops] == [Save, Drop] and s.cache.host.evictions == 1
    assert s.cache.host.bytes <= 2500
    s.cache.check_integrity()


def test_a_step_runs_several_chunks_when_idle_and_fewer_while_others_decode():
    s = Scheduler(num_slots=2, ctx=1024, chunk_tokens=32, step_tokens=128, busy_tokens=64)
    s.add(seq("long", 300, max_new=50))
    alone = step(s)
    assert [(w.position, len(w.token_ids), w.sample) for w in alone.work] == [
        (0, 32, False), (32, 32, False), (64, 32, False), (96, 32, False)]
    while s.running[0].in_prefill:
        step(s)
    s.add(seq("other", 200, first=1000))
    shapes = [[(w.seq.id, w.position, len(w.token_ids)) for w in step(s).work] for _ in range(2)]
    assert shapes == [[("long", 300, 1), ("other", 0, 32)], [("long", 301, 1), ("other", 32, 32)]]  # no times yet


def test_prompt_tokens_beside_decoding_requests_follow_the_measured_step_times():
    s = Scheduler(num_slots=2, ctx=4096, chunk_tokens=32, step_tokens=256, busy_tokens=256)
    s.add(seq("decoding", 40, max_new=500))
    s.update(s.schedule(), [1], seconds=0.040)  # its prompt alone
    for _ in range(5):
        s.update(s.schedule(), [1], seconds=0.010)  # a decode step: 10 ms
    s.add(seq("long", 3000, first=1000))
    budgets = []
    for _ in range(6):  # each prompt token adds 1 ms: 2.5 decode steps hold 15 tokens, so one chunk
        plan = s.schedule()
        budgets.append(plan.prompt_tokens)
        s.update(plan, [1], seconds=0.010 + 0.001 * plan.prompt_tokens)
    assert budgets == [32] * 6
    s.pace.record(decode_rows=1, prompt_tokens=255, seconds=0.0101)  # 256 rows as fast as one (a GPU)
    assert s.schedule().prompt_tokens == 256  # up to busy_tokens


def paced(num_slots: int) -> Scheduler:
    """A scheduler whose prompts may be cut anywhere, one request decoding (its prompt far from the
    tests' others) and two step sizes known: 40 prompt rows in 40 ms, one decode row in 10 ms."""
    s = Scheduler(num_slots=num_slots, ctx=4096, chunk_tokens=32, step_tokens=256, busy_tokens=256, cut_anywhere=True)
    s.add(seq("decoding", 40, max_new=500, first=5000))
    s.update(s.schedule(), [1], seconds=0.040)
    s.update(s.schedule(), [1], seconds=0.010)
    return s


def test_where_prompts_may_be_cut_anywhere_a_busy_step_ends_mid_chunk_at_its_pace():
    s = paced(num_slots=3)
    long = seq("long", 300, first=1000)
    s.add(long)
    pieces, steps = [], []
    while long.num_computed < 300:  # 1 ms a prompt token: 1.5 decode steps (15 ms) hold 5 tokens, so 4
        plan = s.schedule()
        pieces += [(w.position, len(w.token_ids)) for w in plan.work if w.in_prompt]
        steps.append((300 - long.num_computed, plan.prompt_tokens))
        s.update(plan, [1] * sum(w.sample for w in plan.work), seconds=0.010 + 0.001 * plan.prompt_tokens)
    # to its end: a long prompt's last chunks are spread too
    assert [n for _, n in steps] == [4] * 75 and long.output_ids
    assert (28, 4) in pieces and (32, 4) in pieces and len(pieces) == 75  # none runs across a chunk boundary
    assert [p for p, _ in pieces] == list(itertools.accumulate([0] + [n for _, n in pieces[:-1]]))
    s.add(seq("new", 50, first=3000))  # a short prompt beside two decode rows: a whole chunk
    assert [(w.seq.id, w.position, len(w.token_ids)) for w in s.schedule().work if w.in_prompt] == [("new", 0, 32)]


def test_a_short_prompt_beside_decoding_streams_runs_in_whole_chunks():
    def first_busy_step(prompt: int) -> int:
        s = paced(num_slots=8)
        s.add(seq("new", prompt, first=1000))
        return s.schedule().prompt_tokens

    assert first_busy_step(300) == 4  # 1.5 decode steps (15 ms) hold 7 rows (read as between 1 and 40)
    assert first_busy_step(128) == 32  # 4 chunks or fewer: whole chunks, at least one (30 ms hold 27 rows)
    assert first_busy_step(600) == 4 and first_busy_step(64) == 32


def test_a_short_prompts_last_few_tokens_go_with_the_chunk_before_them():
    def busy_steps(prompt: int) -> list[int]:
        s = paced(num_slots=8)
        new = seq("new", prompt, first=1000)
        s.add(new)
        steps = []
        while new.num_computed < prompt:
            plan = s.schedule()
            steps.append(plan.prompt_tokens)
            s.update(plan, [1] * sum(w.sample for w in plan.work), seconds=0.010)  # the pace as measured
        return steps

    # 4 decode steps (40 ms) hold one chunk; one more decode step's time (to 20 ms) holds 13 tokens: a last
    # chunk of up to 13 tokens more than the budget goes with the one before it, not in a step of its own
    assert busy_steps(40) == [40] and busy_steps(45) == [45]
    assert busy_steps(46) == [32, 14] and busy_steps(64) == [32, 32] and busy_steps(104) == [32, 32, 40]


def test_a_long_prompt_mostly_in_the_prefix_cache_counts_as_short():
    s = paced(num_slots=3)
    first = seq("first", 300, max_new=1)
    s.add(first)
    while not first.status.is_finished:
        plan = s.schedule()
        s.update(plan, [1] * sum(w.sample for w in plan.work), seconds=0.010 + 0.001 * plan.prompt_tokens)
    again = seq("again", 320)  # the same 300 tokens and 20 more: 288 of them (9 chunks) cached
    s.add(again)
    pieces = []
    for _ in range(2):  # waiting, its hit is not known yet: a piece; admitted, the rest in a whole chunk
        plan = s.schedule()
        pieces += [(w.position, len(w.token_ids)) for w in plan.work if w.in_prompt]
        s.update(plan, [1] * sum(w.sample for w in plan.work), seconds=0.010 + 0.001 * plan.prompt_tokens)
    assert again.num_cached == 288 and pieces == [(288, 4), (292, 28)]


def test_pace_needs_two_step_sizes_and_keeps_within_its_bounds():
    pace = Pace()
    assert pace.step(4) is None and pace.budget(4, 4, 256, 2.0) == 4 and pace.budget(4, 4, 256, 2.0, 32) == 32  # nothing yet
    pace.record(decode_rows=4, prompt_tokens=0, seconds=0.009)
    assert pace.budget(4, 4, 256, 2.0, 32) == 32  # one size: what a prompt token adds is not known
    pace.record(decode_rows=0, prompt_tokens=196, seconds=0.200)  # ~1 ms a row
    assert pace.budget(4, 4, 256, 2.0) == 8  # 2 steps of 4 rows (18 ms) hold 9 rows more
    assert pace.budget(4, 16, 256, 2.0) == 16  # a unit, never none
    for _ in range(30):  # steps with 64 prompt tokens as fast as decode steps: those cost nothing
        pace.record(decode_rows=4, prompt_tokens=64, seconds=0.007)
    # up to the cap, or as far as the sizes measured say (the steps of 4 rows now read 7 ms too)
    assert pace.budget(4, 4, 64, 2.0) == 64 and pace.budget(4, 4, 256, 2.0) == 68


def test_pace_keeps_step_times_rising_with_the_size():
    pace = Pace()
    pace.record(decode_rows=0, prompt_tokens=104, seconds=0.216)  # a first, cold step
    pace.record(decode_rows=1, prompt_tokens=0, seconds=0.006)
    pace.record(decode_rows=0, prompt_tokens=256, seconds=0.100)  # a bigger one, faster: the cold one was slow
    assert [pace.seconds[n] for n in pace.sizes] == [0.006, 0.100, 0.100]
    pace.record(decode_rows=0, prompt_tokens=50, seconds=0.500)  # a stray slow step raises those after it
    assert [pace.seconds[n] for n in pace.sizes] == [0.006, 0.500, 0.500, 0.500]


def test_pace_weighs_a_step_by_all_its_rows_decode_and_prompt():
    pace = Pace()
    pace.record(decode_rows=2, prompt_tokens=0, seconds=0.006)
    pace.record(decode_rows=16, prompt_tokens=0, seconds=0.030)
    pace.record(decode_rows=16, prompt_tokens=30, seconds=0.060)
    pace.record(decode_rows=0, prompt_tokens=256, seconds=0.200)
    assert pace.sizes == [2, 16, 46, 256]
    assert pace.step(9) == pytest.approx(0.018)  # between the sizes measured
    assert pace.step(1) == pytest.approx(0.003) and pace.step(512) == pytest.approx(0.400)  # beyond: in proportion
    assert pace.budget(16, 4, 256, 2.0) == 28  # 2 x 30 ms hold 46 rows: 28 beside the 16, in units of 4
    assert pace.budget(2, 4, 256, 2.0) == 4  # 2 x 6 ms hold 5 rows: one unit, never none
    assert pace.budget(2, 4, 256, 6.0) == 20  # 6 steps of 2 rows hold 22 rows


@pytest.mark.parametrize("fields,name", [({"chunk_tokens": 8}, "chunk_tokens"),
                                         ({"chunk_tokens": 64, "busy_tokens": 32}, "busy_tokens"),
                                         ({"step_tokens": 16}, "step_tokens")])
def test_engine_config_refuses_a_step_budget_smaller_than_a_chunk(fields, name):
    from mashbox import EngineConfig

    with pytest.raises(ValueError, match=name):
        EngineConfig(**fields)


def test_a_prefix_is_shared_only_under_its_salt_in_slots_and_in_host_memory():
    """Tenants' prompts never hit each other's cached prefixes, wherever those are kept."""
    s = Scheduler(num_slots=1, ctx=1024, chunk_tokens=64, host_cache_bytes=10_000, kv_bytes_per_token=10)
    run_to_end(s, Sequence("alice", prompt(1000), SamplingParams(), 1, cache_salt="alice"))
    bob = Sequence("bob", prompt(1000), SamplingParams(), 1, cache_salt="bob")
    run_to_end(s, bob)  # the same prompt, in the slot alice's prefix is in
    assert bob.num_cached == 0
    again = Sequence("alice2", prompt(1000), SamplingParams(), 1, cache_salt="alice")
    plan = run_to_end(s, again)  # alice's prefix went to host memory when bob took the slot
    assert again.num_cached == 192 and any(type(op).__name__ == "Restore" for op in plan.cache_ops)
    assert {salt for _, salt, _ in s.cache.host.entries()} == {"alice", "bob"}
    s.cache.check_integrity()


def test_a_prompt_being_prefilled_is_not_computed_again_by_a_twin_that_arrives_meanwhile():
    s = Scheduler(num_slots=2, ctx=512, chunk_tokens=64, step_tokens=64)
    s.add(seq("first", 200))
    step(s)  # first: chunk 0-64
    s.add(seq("twin", 200))
    positions = []
    while not s.running or any(q.in_prefill for q in s.running) or s.waiting:
        plan = step(s)
        positions += [(w.seq.id, w.position) for w in plan.work if w.seq.id == "twin"]
        if any(w.seq.id == "twin" for w in plan.work):
            break
    # the twin waited while the first computed 64-192, then started at 192 from a copy of its slot
    assert positions[0] == ("twin", 192)
    assert [op.tokens for op in plan.cache_ops] == [192] and type(plan.cache_ops[0]).__name__ == "Copy"
    assert s.hit_tokens == 192


def test_a_twin_of_another_tenant_neither_waits_nor_copies():
    s = Scheduler(num_slots=2, ctx=1024, chunk_tokens=64, step_tokens=256)
    first = seq("first", 400)
    first.cache_salt = "alice"
    s.add(first)
    step(s)  # first: 0-256
    twin = seq("twin", 400)
    twin.cache_salt = "bob"
    s.add(twin)
    plan = s.schedule()
    assert ("twin", 0) in [(w.seq.id, w.position) for w in plan.work] and not plan.cache_ops
