"""Property tests: random add / step / abort traces on tiny caches (so preemption is common).

Every step the fake engine (conftest.py) checks the plan (budgets, exclusive writes), replays it
on a simulated KV cache (every context position must hold its own prefix) and checks the block
accounting (free + used == total, ref count == number of tables holding the block). At the end
the trace is drained: everything must finish (no starvation, no livelock) and nothing may leak.
"""

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmc.errors import RequestError
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.scheduler import SchedulerConfig

MAX_MODEL_LEN = 24

add_op = st.tuples(
    st.just("add"),
    st.lists(st.integers(0, 1), min_size=1, max_size=14),  # 2 symbols: shared prefixes
    st.integers(1, 3),  # n
    st.integers(0, 2),  # priority
    st.integers(1, 12),  # max_tokens
)
ops = st.lists(
    st.one_of(add_op, add_op, st.tuples(st.just("step")), st.tuples(st.just("step")),
              st.tuples(st.just("abort"), st.integers(0, 15))),
    min_size=6,
    max_size=40,
)


@st.composite
def setups(draw):
    chunked = draw(st.booleans())
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(
            st.integers(1, 12) if chunked else st.integers(MAX_MODEL_LEN, 30)
        ),
        enable_chunked_prefill=chunked,
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        max_model_len=MAX_MODEL_LEN,
        aging_steps=draw(st.sampled_from([None, 1, 8])),
        max_prefill_tokens=draw(st.sampled_from([None, 24])),
        pace_prompts=draw(st.sampled_from([None, 0.5, 2.0])),
    )
    return dict(
        config=config,
        num_blocks=draw(st.integers(4, 10)),
        block_size=draw(st.sampled_from([2, 4])),
        num_cpu_blocks=draw(st.sampled_from([0, 4, 16])),
        prefix_caching=draw(st.booleans()),
        seed=draw(st.integers(0, 1000)),
    )


def expect_rejected(bm: BlockManager, config: SchedulerConfig, prompt, n, max_tokens) -> bool:
    longest = min(len(prompt) + max_tokens, config.max_model_len) - 1
    return (len(prompt) >= config.max_model_len or bm.blocks_for(longest) > bm.num_blocks
            or n > config.max_num_seqs)


@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(setup=setups(), trace=ops)
def test_random_traces_keep_invariants_and_drain(fake_engine, setup, trace):
    eng = fake_engine(**setup)
    config, added = setup["config"], 0
    for op in trace:
        if op[0] == "add":
            _, prompt, n, priority, max_tokens = op
            rid = f"r{added}"
            added += 1
            rejected = expect_rejected(eng.bm, config, prompt, n, max_tokens)
            try:
                eng.add(rid, prompt, n=n, priority=priority, max_tokens=max_tokens)
                assert not rejected
            except RequestError:
                assert rejected
        elif op[0] == "step":
            eng.step()
        else:
            rid = f"r{op[1]}"
            live = rid in eng.sched.groups
            assert eng.sched.abort(rid) == live
            eng.check_invariants()
    eng.run_until_done(max_steps=3000)
    eng.assert_drained()
    stats = eng.bm.stats  # coverage report for --hypothesis-show-statistics
    for name in ("prefix_cache_hit_tokens", "evictions", "cow_copies", "swapped_out_blocks"):
        event(f"{name} > 0: {getattr(stats, name) > 0}")
    event(f"preempted > 0: {eng.num_preempted > 0}")
    for g in eng.groups:
        for s in g.seqs:
            if s.finish_reason == "length":
                assert s.num_output_tokens == g.params.max_tokens or s.num_tokens == MAX_MODEL_LEN
            if s.finish_reason != "abort":
                assert 1 <= s.num_output_tokens <= g.params.max_tokens
    finished = eng.sched.pop_finished()
    assert sorted(g.request_id for g in finished) == sorted(g.request_id for g in eng.groups)
