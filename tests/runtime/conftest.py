"""A fake engine for scheduler tests: the real Scheduler and BlockManager over a simulated cache.

Each simulated KV slot stores the token prefix whose K/V it would hold. Every step applies the
plan in the runner's order (swap-out, swap-in, copies, forward), writes the new positions, then
checks that every position each scheduled sequence attends to holds exactly its own prefix.
Wrong sharing, a missing copy-on-write, a bad swap or a stale prefix-cache hit all show up there.
"""

import random
from collections import Counter

import pytest

from llmc.runtime.block_manager import BlockManager
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from llmc.runtime.sequence import SequenceGroup, SequenceStatus
from llmc.runtime.stop import StopChecker


class FakeEngine:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int = 4,
                 num_cpu_blocks: int = 0, prefix_caching: bool = True, seed: int = 0,
                 vocab: int = 3):
        self.config = config
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, num_cpu_blocks)
        self.sched = Scheduler(config, self.bm)
        self.stop = StopChecker(config.max_model_len)
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.kv: dict[int, tuple] = {}
        self.host: dict[int, tuple] = {}
        self.groups: list[SequenceGroup] = []
        self.num_preempted = 0

    def add(self, request_id: str, prompt: list[int], **params) -> SequenceGroup:
        group = SequenceGroup(request_id, prompt, SamplingParams(**params))
        self.sched.add(group)
        self.groups.append(group)
        return group

    def step(self) -> SchedulerOutput:
        # the scheduler's budget follows what runs when the step starts: a sequence admitted in it whose whole
        # context but its last token is a prefix-cache hit (a preempted sample of a forked request) is a decode
        # of that step, yet the step may have taken max_prefill_tokens before admitting it
        self.decoding = any(not s.is_prefill for s in self.sched.running) or bool(self.sched.swapped)
        out = self.sched.schedule()
        self.num_preempted += len(out.preempted)
        self.check_plan(out)
        bs = self.bm.block_size
        for dev, host in out.blocks_to_swap_out:
            for o in range(bs):
                self.host[host * bs + o] = self.kv.get(dev * bs + o)
        for host, dev in out.blocks_to_swap_in:
            for o in range(bs):
                self.kv[dev * bs + o] = self.host.get(host * bs + o)
        for src, dst in out.blocks_to_copy:
            for o in range(bs):
                self.kv[dst * bs + o] = self.kv.get(src * bs + o)
        for e in out.scheduled:
            start = e.seq.num_computed_tokens
            tokens = e.seq.token_ids
            for p, slot in zip(range(start, start + e.num_new_tokens),
                               self.bm.slot_mapping(e.seq, start, start + e.num_new_tokens)):
                self.kv[slot] = tuple(tokens[: p + 1])
        for e in out.scheduled:  # attention reads the whole context of each sequence
            end = e.seq.num_computed_tokens + e.num_new_tokens
            tokens = e.seq.token_ids
            for p, slot in enumerate(self.bm.slot_mapping(e.seq, 0, end)):
                assert self.kv.get(slot) == tuple(tokens[: p + 1]), (e.seq, p)
        sampled = out.sampled_seqs
        tokens = [self.rng.randrange(self.vocab) for _ in sampled]
        self.sched.update_after_step(out, tokens, [0.0] * len(tokens), self.stop)
        self.check_invariants()
        return out

    def run_until_done(self, max_steps: int = 5000) -> int:
        for step in range(max_steps):
            if not self.sched.has_unfinished():
                return step
            self.step()
        raise AssertionError(f"not done after {max_steps} steps: {self.sched.groups}")

    def check_plan(self, out: SchedulerOutput) -> None:
        cfg, bm = self.config, self.bm
        decodes = getattr(self, "decoding", True)  # else the step may take max_prefill_tokens
        top = max(cfg.max_num_batched_tokens, cfg.max_prefill_tokens or 0)
        if not (decodes and cfg.step_budget):  # a step budget's steps are checked by its own test
            # paced prompts: a step with decodes may grow up to max_prefill_tokens
            assert out.num_batched_tokens <= (cfg.max_num_batched_tokens if decodes and not cfg.pace_prompts else top)
        assert sum(1 + len(self.sched.groups[s.request_id].pending_forks(s))
                   for s in self.sched.running) <= cfg.max_num_seqs
        assert len({id(e.seq) for e in out.scheduled}) == len(out.scheduled)
        written: set[int] = set()
        for e in out.scheduled:
            s, n = e.seq, e.num_new_tokens
            assert s.status is SequenceStatus.RUNNING and n >= 1
            assert s.num_computed_tokens + n <= s.num_tokens
            assert e.sample == (s.num_computed_tokens + n == s.num_tokens)
            assert e.is_prefill == s.is_prefill
            if not e.is_prefill:
                assert n == 1
            elif not cfg.enable_chunked_prefill:
                assert n == s.num_uncomputed_tokens
            for slot in bm.slot_mapping(s, s.num_computed_tokens, s.num_computed_tokens + n):
                assert bm.ref_count(slot // bm.block_size) == 1, "write into a shared block"
                assert slot not in written
                written.add(slot)

    def check_invariants(self) -> None:
        bm, sched = self.bm, self.sched
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        live = [s for g in self.groups for s in g.seqs]
        refs = Counter(b for s in live for b in s.block_table)
        for b in range(bm.num_blocks):
            assert bm.ref_count(b) == refs.get(b, 0) >= 0
            assert bm.is_free(b) == (bm.ref_count(b) == 0)
        queues = {SequenceStatus.WAITING: sched.waiting, SequenceStatus.RUNNING: sched.running,
                  SequenceStatus.SWAPPED: sched.swapped}
        for status, queue in queues.items():
            assert all(s.status is status for s in queue)
        assert len({id(s) for q in queues.values() for s in q}) == sum(map(len, queues.values()))
        for s in live:
            if s.status is not SequenceStatus.RUNNING:
                assert s.block_table == []
            else:
                assert len(s.block_table) * bm.block_size >= s.num_tokens - 1
        host_held = sum(len(bm._swapped[s.seq_id]) for s in sched.swapped)
        assert bm.num_free_cpu_blocks + host_held == bm.num_cpu_blocks

    def assert_drained(self) -> None:
        bm = self.bm
        assert not self.sched.waiting and not self.sched.running and not self.sched.swapped
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
        assert bm.num_free_cpu_blocks == bm.num_cpu_blocks
        for g in self.groups:
            assert g.is_finished
            for s in g.seqs:
                assert s.finish_reason in ("stop", "length", "abort") and s.block_table == []


@pytest.fixture
def fake_engine():
    return FakeEngine


@pytest.fixture
def cpu_step_graphs(monkeypatch):
    """`StepGraphCache`, the GPU's path, on the CPU: each captured graph replaced by a stand-in that reruns the
    step on its own input buffers. Returns `make(executor)`: a cache over that executor's plan and KV cache."""
    from llmc.runtime import step_graphs

    class Plan:  # the interpreter behind the kernel plan's interface
        def __init__(self, interp):
            self.interp = interp

        def new_arena(self, inputs, hints):
            return None

        def run(self, inputs, hints, arena=None):
            return self.interp.run(inputs)

    class Replay:
        def __init__(self, fn):
            self.replay = fn

    def capture(self, kind, size, stage, context=None):
        dg = step_graphs._StepGraph(kind, size, (self.max_model_len + self.block_size - 1) // self.block_size,
                                    self.device)
        dg.context = context  # what the GPU's capture launches attention for (the stand-in reruns the plan)
        inputs = {**dg.inputs, **self.kv}

        def step():
            logits = self.plan.run(inputs, {})[0]
            return self.argmax(logits), logits

        def replay():
            for buf, new in zip(dg.out, step()):
                buf.copy_(new)
        dg.out = step()
        dg.graph = Replay(replay)
        return dg
    monkeypatch.setattr(step_graphs.StepGraphCache, "_capture", capture)

    def make(ex, max_model_len: int = 512):
        return step_graphs.StepGraphCache(Plan(ex.plan), ex.kv, ex.block_size, max_model_len, ex.device,
                                          lambda x: x.argmax(dim=-1))
    return make
