"""Scheduler policies on hand-built scenarios, driven through the fake engine (conftest.py)."""

from collections import Counter

import pytest

from llmc.errors import RequestError
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Scheduler, SchedulerConfig
from llmc.runtime.sequence import Sequence, SequenceGroup, SequenceStatus
from llmc.runtime.stop import StopChecker


def cfg(**kw):
    kw.setdefault("max_model_len", 64)
    return SchedulerConfig(**kw)


def test_chunked_prefill_respects_token_budget(fake_engine):
    eng = fake_engine(cfg(max_num_batched_tokens=8), num_blocks=32)
    long = eng.add("long", list(range(20)), max_tokens=3).leader
    plans = [eng.step() for _ in range(3)]
    assert [[(e.num_new_tokens, e.sample) for e in p.scheduled] for p in plans] == [
        [(8, False)], [(8, False)], [(4, True)]]
    assert long.num_output_tokens == 1 and long.num_computed_tokens == 20
    short = eng.add("short", [1, 2, 3], max_tokens=2).leader
    eng.add("big", list(range(30)), max_tokens=1)
    p = eng.step()  # decode first, then admit: short prompt whole, big gets the rest (8-1-3)
    assert [(e.seq, e.num_new_tokens, e.is_prefill) for e in p.scheduled] == [
        (long, 1, False), (short, 3, True), (eng.groups[2].leader, 4, True)]
    while eng.sched.has_unfinished():
        assert eng.step().num_batched_tokens <= 8
    eng.assert_drained()


def test_a_step_with_no_decode_takes_the_prefill_budget(fake_engine):
    """With nothing decoding, prompts run in chunks of max_prefill_tokens; once a sequence decodes, every
    step that carries it keeps to max_num_batched_tokens (its wait stays bounded)."""
    eng = fake_engine(cfg(max_num_batched_tokens=8, max_prefill_tokens=16), num_blocks=32)
    long = eng.add("long", list(range(20)), max_tokens=3).leader
    plans = [eng.step() for _ in range(2)]
    assert [[(e.num_new_tokens, e.sample) for e in p.scheduled] for p in plans] == [[(16, False)], [(4, True)]]
    assert long.num_output_tokens == 1
    eng.add("big", list(range(30)), max_tokens=1)
    p = eng.step()  # long decodes: the step keeps to 8 tokens
    assert [e.num_new_tokens for e in p.scheduled] == [1, 7]
    while eng.sched.has_unfinished():
        p = eng.step()
        decoding = any(not e.is_prefill for e in p.scheduled)
        assert p.num_batched_tokens <= (8 if decoding else 16)
    eng.assert_drained()
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        cfg(max_prefill_tokens=0)


def test_a_step_with_decodes_and_prompt_work_takes_the_step_budget(fake_engine):
    """With a step_budget, a step that carries decodes takes what it gives for their tokens and K/V
    context (where more than max_num_batched_tokens) while prompt work remains; decode-only steps never
    ask it."""
    asked = []

    def step_budget(decodes, context):
        asked.append((decodes, context))
        return decodes + 10 * decodes  # a chunk of 10 prompt tokens per decode

    eng = fake_engine(cfg(max_num_batched_tokens=12, step_budget=step_budget), num_blocks=64)
    a = eng.add("a", list(range(6)), max_tokens=30).leader
    b = eng.add("b", list(range(10, 16)), max_tokens=30).leader
    eng.step()  # both prompts: no decode yet
    assert a.num_output_tokens == b.num_output_tokens == 1 and not asked
    eng.add("big", list(range(20, 60)), max_tokens=2)
    p = eng.step()
    assert asked == [(2, 14)]  # two decodes, each 7 tokens long
    assert [e.num_new_tokens for e in p.scheduled] == [1, 1, 20]  # 22 tokens, over the fixed 12
    p = eng.step()
    assert asked[1:] == [(2, 16)] and [e.num_new_tokens for e in p.scheduled] == [1, 1, 20]
    eng.add("c", list(range(60, 66)), max_tokens=30)
    while eng.sched.has_unfinished():
        n = len(asked)
        p = eng.step()
        if not any(e.is_prefill for e in p.scheduled) and not eng.sched.waiting:
            assert len(asked) == n  # nothing but decodes: the fixed budget, not asked
    eng.assert_drained()


def test_paced_prompts_grow_the_step_to_finish_within_the_decodes(fake_engine):
    """With pace_prompts a step that carries decodes takes d + f * P / L tokens (a power of two, at most
    max_prefill_tokens) where more than the budget: P prompt tokens left, L the steps its decodes run anyway,
    each pending prompt with its own output's deadline; decode-only steps keep the budget."""
    eng = fake_engine(cfg(max_model_len=512, max_num_batched_tokens=8, max_prefill_tokens=128, pace_prompts=2.0),
                      num_blocks=256)
    a = eng.add("a", list(range(6)), max_tokens=41).leader
    eng.step()  # a's prompt: no decode yet
    assert a.num_output_tokens == 1
    assert eng.sched.waiting.total == 0
    eng.add("b", list(range(10, 210)), max_tokens=5)  # 200 prompt tokens; 40 steps of a's left
    assert eng.sched.waiting.total == 200
    p = eng.step()  # P 200 over 40 steps, or b's own deadline: 200 over 40 - 5 = 35 -> 1 + ceil(2 * 5.71) = 13 -> 16
    assert [e.num_new_tokens for e in p.scheduled] == [1, 15] and eng.sched.waiting.total == 0
    eng.add("c", list(range(300, 320)), max_tokens=38)  # 20 tokens, but its output outlasts a's 38 steps left
    p = eng.step()  # c's deadline: 185 + 20 tokens in max(1, 38 - 38) step -> 128 (max_prefill_tokens)
    assert sum(e.num_new_tokens for e in p.scheduled) == 128
    while eng.sched.has_unfinished():
        p = eng.step()
        if not any(e.is_prefill for e in p.scheduled) and not eng.sched.waiting:
            assert p.num_batched_tokens <= 8  # nothing but decodes: the budget
    eng.assert_drained()
    assert eng.sched.waiting.total == 0 and eng.sched.waiting.top() == 0


def test_paced_prompts_see_a_long_output_behind_the_queue_head(fake_engine):
    """Requests not queued longest first: a long output waiting behind a short one makes the step grow for the
    whole queue (the queue keeps its longest output as requests join and leave), where the head alone would not."""
    eng = fake_engine(cfg(max_model_len=512, max_num_batched_tokens=8, max_prefill_tokens=64, pace_prompts=1.0,
                          max_num_seqs=2), num_blocks=256)
    eng.add("a", list(range(6)), max_tokens=41)
    eng.step()
    eng.add("b", list(range(10, 50)), max_tokens=3)  # 40 tokens: head, short output
    eng.add("c", list(range(60, 100)), max_tokens=40)  # behind it (no slot yet), an output as long as a's
    assert eng.sched.waiting.top() == 40 and eng.sched.waiting.total == 80
    p = eng.step()  # the head alone: 1 + ceil(40 / (40 - 3)) = 3 -> 8; the queue: 80 / max(1, 40 - 40) -> 64
    assert sum(e.num_new_tokens for e in p.scheduled) == 41  # a's decode and all of b's prompt (c has no slot)


def test_without_chunking_prompts_run_whole():
    config = SchedulerConfig(
        max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False
    )
    sched = Scheduler(config, BlockManager(32, 4))
    sched.add(SequenceGroup("a", list(range(10)), SamplingParams()))
    sched.add(SequenceGroup("b", list(range(10)), SamplingParams()))
    out = sched.schedule()
    assert [e.num_new_tokens for e in out.scheduled] == [10]  # b must wait for a fresh budget
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_model_len"):
        SchedulerConfig(max_num_batched_tokens=8, max_model_len=16, enable_chunked_prefill=False)


def test_priority_orders_admission(fake_engine):
    eng = fake_engine(cfg(max_num_seqs=1), num_blocks=32)
    for rid, prio in (("low", 2), ("high", 0), ("mid", 1), ("high2", 0)):
        eng.add(rid, [1, 2, 3], priority=prio, max_tokens=2)
    order = []
    while eng.sched.has_unfinished():
        for e in eng.step().scheduled:
            if e.is_prefill:
                order.append(e.seq.request_id)
    assert order == ["high", "high2", "mid", "low"]
    eng.assert_drained()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_picks_lowest_priority(fake_engine, mode):
    # 4 blocks of 4: the three requests fill 3 blocks, the first decode block then preempts.
    eng = fake_engine(cfg(preemption_mode=mode), num_blocks=4, num_cpu_blocks=8)
    a = eng.add("a", [1, 2, 3, 4], priority=0, max_tokens=6).leader
    b = eng.add("b", [5, 6, 7, 8], priority=2, max_tokens=6).leader
    c = eng.add("c", [9, 9, 9, 9], priority=1, max_tokens=6).leader
    eng.step()  # prefill all three
    out = eng.step()  # a takes the last free block; c then needs one -> the worst key, b, goes
    assert out.preempted == [b]
    assert [e.seq for e in out.scheduled] == [a, c]
    if mode == "swap":
        assert b.status is SequenceStatus.SWAPPED and len(out.blocks_to_swap_out) == 1
        assert b.num_computed_tokens == 4
    else:
        assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
        assert not out.blocks_to_swap_out
    assert b.num_output_tokens == 1  # generated tokens are kept
    eng.run_until_done()
    eng.assert_drained()
    assert all(s.num_output_tokens == 6 for s in (a, b, c))


def test_recompute_prefills_prompt_plus_output(fake_engine):
    eng = fake_engine(cfg(), num_blocks=3, prefix_caching=False)
    a = eng.add("a", [1, 2, 3, 4], priority=0, max_tokens=5).leader
    b = eng.add("b", [5, 6, 7], priority=1, max_tokens=5).leader
    eng.step()
    eng.step()  # a decodes into a second block: all 3 blocks used; b's next decode preempts b
    out = eng.step()
    assert out.preempted == [b] and b.status is SequenceStatus.WAITING
    b_tokens = b.num_tokens
    for _ in range(20):
        mine = [e for e in eng.step().scheduled if e.seq is b]
        if mine:
            break
    assert mine[0].is_prefill and mine[0].num_new_tokens == b_tokens and mine[0].sample
    eng.run_until_done()
    eng.assert_drained()


def test_aging_prevents_starvation(fake_engine):
    """One sequence at a time, a new urgent request every step: with aging the patient request
    runs within a bounded number of steps; with strict priority it never does."""
    def run(aging):
        eng = fake_engine(cfg(max_num_seqs=1, aging_steps=aging), num_blocks=64)
        patient = eng.add("patient", [1, 2], priority=5, max_tokens=1).leader
        for i in range(60):
            eng.add(f"urgent{i}", [3, 4], priority=0, max_tokens=2)
            eng.step()
            if patient.is_finished:
                return sum(g.is_finished for g in eng.groups[1:])
        return None
    # Priority 5 with aging_steps=2 is a 10-step handicap: only the urgent requests that arrived
    # within 10 steps of the patient one (keys 0..9) may overtake it.
    assert run(aging=2) == 10
    assert run(aging=None) is None


def test_abort_in_every_state_frees_blocks(fake_engine):
    eng = fake_engine(cfg(max_num_batched_tokens=4, preemption_mode="swap"), num_blocks=6,
                      num_cpu_blocks=6)
    waiting = eng.add("waiting", [7] * 8, priority=3, max_tokens=4)
    prefilling = eng.add("prefilling", list(range(10)), priority=0, n=2, max_tokens=4)
    eng.step()
    assert prefilling.leader.status is SequenceStatus.RUNNING and prefilling.leader.is_prefill
    assert eng.sched.abort("prefilling") and eng.sched.abort("waiting")
    assert all(s.finish_reason == "abort" for s in prefilling.seqs + waiting.seqs)
    assert eng.bm.num_used_blocks == 0
    assert not eng.sched.abort("prefilling")  # already gone
    # forked and swapped
    forked = eng.add("forked", [1, 2, 3], priority=0, n=3, max_tokens=12)
    other = eng.add("other", [4, 5, 6], priority=1, max_tokens=12)
    for _ in range(50):
        if any(s.status is SequenceStatus.SWAPPED for s in forked.seqs + other.seqs):
            break
        eng.step()
    assert any(s.status is SequenceStatus.SWAPPED for s in forked.seqs + other.seqs)
    assert eng.sched.abort("other") and eng.sched.abort("forked")
    eng.check_invariants()
    eng.assert_drained()
    assert [g.request_id for g in eng.sched.pop_finished()] == [
        "prefilling", "waiting", "other", "forked"]


def test_abort_between_schedule_and_update(fake_engine):
    eng = fake_engine(cfg(), num_blocks=8)
    eng.add("a", [1, 2, 3], max_tokens=4)
    out = eng.sched.schedule()
    eng.sched.abort("a")
    assert eng.sched.update_after_step(out, [0]) == []
    eng.assert_drained()


def test_requests_that_can_never_run_are_rejected():
    sched = Scheduler(cfg(max_num_seqs=2), BlockManager(num_blocks=4, block_size=4))
    with pytest.raises(RequestError, match="cache has only 4"):
        sched.add(SequenceGroup("big", list(range(17)), SamplingParams(max_tokens=1)))
    with pytest.raises(RequestError, match="cache has only 4"):  # fits now, not when grown
        sched.add(SequenceGroup("grows", list(range(10)), SamplingParams(max_tokens=8)))
    with pytest.raises(RequestError, match="shorten the prompt"):
        sched.add(SequenceGroup("ctx", list(range(64)), SamplingParams()))
    with pytest.raises(RequestError, match="prompt is empty"):
        sched.add(SequenceGroup("empty", [], SamplingParams()))
    with pytest.raises(RequestError, match="exceeds max_num_seqs"):
        sched.add(SequenceGroup("n", [1], SamplingParams(n=3)))
    with pytest.raises(RequestError, match="top_p"):
        sched.add(SequenceGroup("p", [1], SamplingParams(top_p=0)))
    sched.add(SequenceGroup("ok", list(range(10)), SamplingParams(max_tokens=7)))  # 16 K/V
    with pytest.raises(RequestError, match="already in use"):
        sched.add(SequenceGroup("ok", [1], SamplingParams()))
    assert not sched.waiting[1:]


def test_n_samples_fork_share_prompt_blocks_then_copy_on_write(fake_engine):
    eng = fake_engine(cfg(), num_blocks=16, vocab=50)
    group = eng.add("g", list(range(10)), n=4, max_tokens=3)
    out = eng.step()
    (entry,) = out.scheduled
    assert entry.seq is group.leader and entry.forks == group.seqs[1:] and out.logits_repeats == [4]
    assert len(out.sampled_seqs) == 4
    table = list(group.leader.block_table)
    assert all(s.block_table == table for s in group.seqs)
    assert all(eng.bm.ref_count(b) == 4 for b in table)
    out = eng.step()  # each writes position 10 into the shared partial last block
    assert len(out.blocks_to_copy) == 3 and all(src == table[-1] for src, _ in out.blocks_to_copy)
    assert all(eng.bm.ref_count(b) == 4 for b in table[:2])
    assert len({s.block_table[-1] for s in group.seqs}) == 4
    eng.run_until_done()
    eng.assert_drained()


def test_prefix_cache_shared_across_requests(fake_engine):
    eng = fake_engine(cfg(), num_blocks=16)
    eng.add("a", [1] * 12 + [2], max_tokens=2)
    eng.run_until_done()
    eng.add("b", [1] * 12 + [3, 3], max_tokens=2)
    out = eng.step()
    assert out.scheduled[0].num_new_tokens == 2 and eng.bm.stats.prefix_cache_hit_tokens == 12
    eng.run_until_done()
    eng.assert_drained()


def _work_per_step(monkeypatch, queued: int, steps: int = 20) -> list[dict]:
    """Per step: admission keys computed and sequences compared (a list scan, sort or `in` compares them)
    with `queued` requests waiting; the first 200 requests, and every other step's urgent one, are the same
    whatever `queued` is, so every step plans the same batch."""
    counts: Counter = Counter()
    real_key = Scheduler._key

    def key(self, seq):
        counts["keys"] += 1
        return real_key(self, seq)

    def eq(self, other):
        counts["compares"] += 1
        return self is other
    monkeypatch.setattr(Scheduler, "_key", key)
    monkeypatch.setattr(Sequence, "__eq__", eq)
    sched = Scheduler(cfg(max_num_seqs=4, max_num_batched_tokens=32), BlockManager(num_blocks=10, block_size=4))
    stop = StopChecker(64)
    for i in range(queued):  # distinct prompts: no request waits for another's prefix
        sched.add(SequenceGroup(f"q{i}", [i % 97 + 1, i % 89 + 1, 5, 6, 7], SamplingParams(
            max_tokens=6 + i % 5, priority=i % 3)))
    per_step = []
    for step in range(steps):
        counts.clear()
        if step % 2:  # better than every running one, into a full batch: admission preempts the worst one
            sched.add(SequenceGroup(f"new{step}", [9, step + 1], SamplingParams(max_tokens=1, priority=-2)))
        out = sched.schedule()
        sched.update_after_step(out, [7] * len(out.sampled_seqs), None, stop)
        per_step.append({**counts, "admitted": sum(e.is_prefill for e in out.scheduled),
                         "preempted": len(out.preempted), "finished": len(sched.pop_finished())})
    return per_step


def test_step_work_does_not_grow_with_the_waiting_queue(monkeypatch):
    """Counted, not timed: a step with 5,000 requests waiting computes as many admission keys and compares
    as many sequences as the same step with 200 waiting (no per-step sort or scan of the queue)."""
    small = _work_per_step(monkeypatch, 200)
    large = _work_per_step(monkeypatch, 5000)
    assert large == small
    assert sum(s["admitted"] for s in small) > 20 and sum(s["preempted"] for s in small) >= 5
    assert sum(s["finished"] for s in small) > 10
    assert max(s.get("keys", 0) for s in small) <= 16  # one per sequence joining a queue


@pytest.mark.parametrize("aging", [None, 3])
def test_admission_order_is_the_documented_key(aging):
    """One sequence at a time, one token each: every step admits the waiting request with the smallest
    (arrival_step + priority * aging_steps, arrival), or (priority, arrival) under strict priority."""
    sched = Scheduler(cfg(max_num_seqs=1, aging_steps=aging), BlockManager(num_blocks=8, block_size=4))
    stop = StopChecker(64)
    expected, got, keys, arrivals = [], [], {}, 0
    for step in range(40):
        for j in range(step * 7 % 4):  # 0-3 arrivals a step, priorities 0-3: a backlog builds, so aging shows
            prio = (step * 5 + j * 3) % 4
            rid = f"r{arrivals}"
            sched.add(SequenceGroup(rid, [1, 2], SamplingParams(max_tokens=1, priority=prio)))
            keys[rid] = (prio, arrivals) if aging is None else (step + prio * aging, arrivals)
            arrivals += 1
        if keys:
            expected.append(min(keys, key=keys.get))
            del keys[expected[-1]]
        out = sched.schedule()
        got += [e.seq.request_id for e in out.scheduled if e.is_prefill]
        sched.update_after_step(out, [3] * len(out.sampled_seqs), None, stop)
    assert got == expected and len(got) == 39 and len(keys) == 21
    assert [s.request_id for s in sched.waiting] == sorted(keys, key=keys.get)
