"""Regression tests: valid input never breaks the engine, failures abort only what they touch, a
request of higher priority preempts whichever resource is short, requests admitted together share
their common prefix, and multi-token (verify) steps with rollback give the tokens of plain decoding."""
import pytest
import torch

from llmc.errors import RequestError
from llmc.runtime.llm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def alone(art, prompt, params=GREEDY):
    return LLM(art, backend="reference", num_blocks=64, block_size=4).generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("backend", ["reference", "triton-interpret"])
def test_step_that_samples_nothing(llama_artifact, backend):
    """Bug 1: a prompt longer than the token budget, alone, makes steps with no logits row."""
    prompt = list(range(1, 40))
    llm = LLM(llama_artifact, backend=backend, max_num_batched_tokens=16, num_blocks=32, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([prompt], params)[0].token_ids
    assert first == alone(llama_artifact, prompt, params)
    assert llm.generate([prompt[:20]], params)[0].token_ids == alone(llama_artifact, prompt[:20], params)
    assert llm.stats()["blocks_used"] == 0


def test_token_ids_outside_the_vocabulary_are_a_request_error(llama_artifact):
    """Bug 2."""
    llm = LLM(llama_artifact, backend="reference", num_blocks=32, block_size=4)
    for bad in ([1, 2, 9000], [1, -1], [1, 2.5]):
        with pytest.raises(RequestError, match="vocabulary|token ids"):
            llm.generate([bad], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids == alone(llama_artifact, [1, 2, 3])


def test_prompts_and_params_of_the_wrong_kind_are_type_errors(llama_artifact):
    """bytes, None and numbers are no prompts; a dict is no SamplingParams: each a TypeError saying what to give,
    nothing queued. Token ids as a numpy array, and prompts from a generator, are taken."""
    import numpy as np
    llm = LLM(llama_artifact, backend="reference", num_blocks=32, block_size=4)
    for bad, match in ((b"def f():", "bytes: decode"), (None, "NoneType"), (5, "got int")):
        with pytest.raises(TypeError, match=match):
            llm.generate(bad, GREEDY)
    with pytest.raises(TypeError, match=r"SamplingParams\(\*\*params\)"):
        llm.generate([[1, 2, 3]], {"max_tokens": 3})
    assert not llm.engine.has_unfinished()
    want = alone(llama_artifact, [1, 2, 3])
    assert llm.generate(np.array([1, 2, 3]), GREEDY)[0].token_ids == want
    assert [o.token_ids for o in llm.generate((p for p in ([1, 2, 3], [1, 2, 3])), GREEDY)] == [want, want]


def test_cpu_with_an_index_is_the_cpu(llama_artifact):
    """torch.device("cpu:0") is the CPU but compares unequal to "cpu": the KV cache must not be copied away from
    the writes of a step by a `.to(device)` (the tokens then parted from the plain CPU's after the prompt)."""
    want = alone(llama_artifact, [1, 2, 3])
    llm = LLM(llama_artifact, backend="reference", device="cpu:0", num_blocks=64, block_size=4)
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids == want


def test_failure_inside_generate_aborts_its_requests_and_engine_stays_usable(llama_artifact):
    """Bug 3: an exception mid-generate (here: the executor, on the 3rd step) returns every block and
    leaves nothing queued; the next generate works."""
    llm = LLM(llama_artifact, backend="reference", num_blocks=32, block_size=4)
    ex, calls = llm.engine.executor, []

    def flaky(real):  # steps run now (execute) and overlapped ones (launch) count alike
        def call(*args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("device fell over")
            return real(*args)
        return call
    ex.execute, ex.launch = flaky(ex.execute), flaky(ex.launch)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17]]
    with pytest.raises(RuntimeError, match="fell over"):
        llm.generate(prompts, GREEDY)
    eng = llm.engine
    assert not eng.has_unfinished() and eng.block_manager.num_used_blocks == 0 and not eng.requests
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [alone(llama_artifact, p) for p in prompts]


def test_interrupted_stream_aborts_what_it_queued(llama_artifact):
    llm = LLM(llama_artifact, backend="reference", num_blocks=32, block_size=4)
    it = llm.stream([[1, 2, 3], [4, 5, 6]], GREEDY)
    next(it)
    it.close()
    assert not llm.engine.has_unfinished() and llm.stats()["blocks_used"] == 0


def test_failed_step_aborts_only_its_requests(llama_artifact):
    """step() raising ends the requests of that step as aborted; a request still waiting is untouched."""
    llm = LLM(llama_artifact, backend="reference", num_blocks=32, block_size=4, max_num_seqs=1)
    eng = llm.engine
    a = eng.add_request([1, 2, 3], GREEDY)
    b = eng.add_request([4, 5, 6], GREEDY)
    ex = eng.executor
    ex.execute = ex.launch = lambda *args: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError):
        eng.step()
    del ex.execute, ex.launch  # the class's methods again
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    assert final[a].finish_reason == "abort"
    assert final[b].token_ids == alone(llama_artifact, [4, 5, 6])
    assert eng.block_manager.num_used_blocks == 0


def test_a_request_that_ends_in_a_failed_step_is_not_aborted_and_keeps_its_output(llama_artifact):
    """A step() that reads the overlapped step's tokens (which end a one-token request) and then fails to launch
    the next: the ended request is finished, so abort() says False, and its final output ("length", its token)
    comes from the next step. Found by the engine property test on random seeds; its driver now checks this."""
    from tests.runtime.test_engine_properties import Alone, Driver
    llm = LLM(llama_artifact, backend="reference", block_size=2, num_blocks=8, max_num_seqs=2,
              max_num_batched_tokens=8, enable_chunked_prefill=False, enable_prefix_caching=False)
    d = Driver(llm, Alone(llama_artifact))
    for n, priority in ((8, 0), (16, 1), (8, 0), (8, 0)):
        d.add([1] * n, 1, priority, 1, None)
    d.step(False)
    d.add([1] * 8, 1, 0, 1, None)
    d.add([1] * 8, 1, 0, 1, None)
    d.abort(23)  # r2, waiting
    for _ in range(3):
        d.add([1] * 8, 1, 0, 1, None)
    d.flaky.arm(0, False)
    d.step(False)
    assert d.num_failed == 1 and llm.engine.requests["r0"].group.seqs[0].finish_reason == "length"
    assert llm.engine.abort("r0") is False
    d.drain()  # r0's final output checked against generating it alone, the aborted and failed ones as aborts
    assert not d.pending and llm.engine.block_manager.num_used_blocks == 0


def test_aborted_request_yields_a_final_abort_output(llama_artifact):
    """Bug 4, for a running and for a waiting request."""
    llm = LLM(llama_artifact, backend="reference", num_blocks=32, block_size=4, max_num_seqs=1)
    eng = llm.engine
    running = eng.add_request([1, 2, 3], GREEDY)
    waiting = eng.add_request([4, 5, 6], GREEDY)
    eng.step()
    assert eng.abort(running) and eng.abort(waiting)
    assert not eng.abort("nope")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert sorted(o.request_id for o in outs) == sorted([running, waiting])
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    assert eng.block_manager.num_used_blocks == 0


def test_higher_priority_preempts_when_max_num_seqs_is_the_limit(llama_artifact):
    """Bug 5: two low-priority requests hold both sequence slots; a higher-priority arrival runs at once."""
    llm = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4, max_num_seqs=2)
    eng = llm.engine
    low = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, priority=2)
    lows = [eng.add_request([1, 2, 3], low), eng.add_request([5, 6, 7], low)]
    eng.step()
    eng.step()
    high = eng.add_request([9, 10, 11], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, priority=0))
    eng.step()
    assert {s.request_id for s in eng.scheduler.running} >= {high}
    assert eng.stats()["num_preemptions"] == 1
    final = {}
    while eng.has_unfinished():
        for o in eng.step(finished_only=True):
            final[o.request_id] = o.token_ids
    assert final[high] == alone(llama_artifact, [9, 10, 11])
    assert [final[r] for r in lows] == [alone(llama_artifact, p, low) for p in ([1, 2, 3], [5, 6, 7])]


def test_common_prefix_admitted_together_is_computed_once(llama_artifact):
    """Bug 6: six prompts with a 3-block common prefix in one generate: the first computes the prefix,
    the others wait a step and hit it; outputs unchanged."""
    prefix = list(range(1, 13))
    prompts = [prefix + [20 + i, 40 + i] for i in range(6)]
    llm = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4)
    outs = llm.generate(prompts, GREEDY)
    assert llm.stats()["prefix_cache_hit_tokens"] == 5 * len(prefix)
    assert [o.token_ids for o in outs] == [alone(llama_artifact, p) for p in prompts]


class OracleProposer:
    """Proposes the known greedy continuation with its last `wrong` tokens corrupted."""

    def __init__(self, truth: dict[tuple, list[int]], wrong: int):
        self.truth, self.wrong = truth, wrong

    def propose(self, seqs, ks):
        from llmc.runtime.spec_decode import Proposal
        out = []
        for s, k in zip(seqs, ks):
            full = self.truth[tuple(s.prompt_token_ids)]
            nxt = full[s.num_output_tokens:s.num_output_tokens + k]
            out.append(Proposal(nxt[:len(nxt) - self.wrong] + [(t + 1) % 320 for t in nxt[len(nxt) - self.wrong:]]))
        return out

    def accepted(self, seq, n):
        pass

    def release(self, seq):
        pass


@pytest.mark.parametrize("wrong", [0, 2])
def test_verify_steps_give_plain_greedy_tokens(llama_artifact, wrong):
    """Multi-token steps: k speculated tokens verified in one step (k + 1 logits rows per sequence); the
    rejected ones are rolled back (their blocks freed) and output equals plain greedy decoding."""
    from llmc.runtime.engine import EngineConfig, LLMEngine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17]]
    truth = {tuple(p): alone(llama_artifact, p, params) for p in prompts}
    from llmc.runtime.sampler import Sampler
    from llmc.runtime.spec_decode import SpecDecoder
    from llmc.runtime.spec_decode.adaptive import AdaptiveK
    spec = SpecDecoder(OracleProposer(truth, wrong=wrong), AdaptiveK.fixed(4, max_batch=None), 128, Sampler())
    eng = LLMEngine(llama_artifact, EngineConfig(backend="reference", num_blocks=64, block_size=4), spec)
    rids = [eng.add_request(p, params) for p in prompts]
    final = {}
    while eng.has_unfinished():
        for o in eng.step(finished_only=True):
            final[o.request_id] = o.token_ids
    assert [final[r] for r in rids] == [truth[tuple(p)] for p in prompts]
    st = eng.stats()
    assert st["spec_accepted_tokens"] > 0 and st["blocks_used"] == 0
    if wrong:
        assert st["spec_accepted_tokens"] < st["spec_proposed_tokens"]
    assert st["steps"] < 12  # fewer steps than one token per step


def test_rollback_drops_tokens_frees_blocks_and_regenerates(llama_artifact):
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    want = alone(llama_artifact, [1, 2, 3], params)
    # one token per step (overlapped steps: tests/runtime/test_overlap.py rolls back with a step in flight)
    llm = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4, overlap=False)
    eng = llm.engine
    rid = eng.add_request([1, 2, 3], params)
    for _ in range(12):
        eng.step()
    seq = eng.requests[rid].group.seqs[0]
    assert seq.output_token_ids == want[:12]
    used = eng.block_manager.num_used_blocks
    eng.rollback(rid, 8)
    assert seq.output_token_ids == want[:4] and seq.num_computed_tokens == seq.num_tokens - 1
    assert eng.block_manager.num_used_blocks == -(-seq.num_computed_tokens // 4) < used
    cached_tokens = {key[1] for key in eng.block_manager._cached}
    assert all(len(t) == 4 for t in cached_tokens)
    while eng.has_unfinished():
        outs = eng.step(finished_only=True)
    assert outs[0].token_ids == want


def test_verify_step_runs_as_decode_rows(llama_artifact):
    """A verify batch (every fed token's logits) runs as one-token rows, each attending up to its own
    position as a decode step would: the same logits as the multi-token step, and a decode graph shape."""
    from llmc.runtime.executor import StepBatch, StepInput, as_decode_rows, make_executor
    from llmc.runtime.step_graphs import graph_kind
    ex = make_executor(llama_artifact.graph, "reference", "cpu", block_size=4, num_blocks=64)
    torch.manual_seed(0)
    prefix = torch.randint(1, 300, (16,)).tolist()
    ex.execute(StepBatch([StepInput(prefix[:9], 0, [3, 5, 8, 60], 0), StepInput(prefix[:4], 0, [1, 2], 0)]))
    batch = [StepInput(prefix[9:12], 9, [3, 5, 8, 60], 3), StepInput([2], 0, [11]), StepInput(prefix[4:6], 4, [1, 2], 2)]
    rows = as_decode_rows(batch)
    assert [(r.token_ids, r.start_pos) for r in rows[:3]] == [([prefix[9 + j]], 9 + j) for j in range(3)]
    assert len(rows) == 6 and graph_kind(rows)[0] == "decode"
    got = ex.execute(StepBatch(batch)).logits
    want = ex._forward(batch, False).logits  # the multi-token step, as one prefill-kernel step
    assert got.shape == want.shape == (6, got.shape[1])
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_generate_beside_a_request_added_to_the_engine(llama_artifact):
    """generate returns its own requests' outputs when another request shares the engine."""
    llm = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4)
    llm.engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=1), "other")
    out = llm.generate([[8, 9, 10]], GREEDY)
    assert out[0].token_ids == alone(llama_artifact, [8, 9, 10])
    assert llm.stats()["blocks_used"] == 0


def test_close_releases_the_device_memory_it_holds_and_a_closed_llm_says_so(llama_artifact):
    """LLM.close drops the KV cache, the plan's weights and a draft model's (the next model can then load on
    the same GPU in the same process); a request after that is a clear error, not a crash."""
    import gc
    import weakref

    from llmc.errors import LLMCError
    llm = LLM(llama_artifact, backend="reference", num_blocks=32, block_size=4,
              speculative={"method": "draft", "draft": str(llama_artifact.path), "num_speculative_tokens": 2})
    assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 6
    held = [weakref.ref(t) for ex in (llm.engine.executor, llm.engine.spec.proposer.executor)
            for t in ex.kv.values()]
    llm.close()
    gc.collect()
    assert all(r() is None for r in held)
    with pytest.raises(LLMCError, match="closed"):
        llm.generate([[1, 2, 3]], GREEDY)


def test_a_graph_that_does_not_fit_leaves_its_steps_eager(monkeypatch, caplog):
    """A step graph whose capture runs out of device memory (a long prefill bucket's arena on a full GPU) is
    not an error: that shape's steps run eagerly from then on (run returns None, as for a shape without a
    graph), the capture is not tried again, a warning says so, and other shapes keep their graphs."""
    from llmc.runtime import step_graphs
    from llmc.runtime.executor import StepInput
    tried = []

    class Graph:
        def __init__(self):
            self.graph = type("Replay", (), {"replay": lambda self: None})()
            self.out = (torch.zeros(4, dtype=torch.int64), torch.zeros(4, 8))

        def load(self, batch, block_size, offset=0):
            pass

    def capture(self, kind, size, stage, context=None):
        tried.append((kind, size))
        if size == 2048:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")
        return Graph()
    monkeypatch.setattr(step_graphs.StepGraphCache, "_capture", capture)
    cache = step_graphs.StepGraphCache(None, {}, 16, 4096, torch.device("cpu"), None)
    long, short = [StepInput(list(range(2000)), 0, list(range(126)))], [StepInput(list(range(20)), 0, [0, 1])]
    with caplog.at_level("WARNING", logger="llmc.runtime.step_graphs"):
        assert cache.run(long, True) is None and cache.run(long, True) is None
    assert "out of device memory" in caplog.text and "they run eagerly" in caplog.text
    assert cache.run(short, True) is not None
    assert cache.captured(long) is False  # a pipeline stage's graph of that shape: not tried yet
    assert cache.run_stage(long, []) is None and cache.captured(long) is None  # refused too: eager
    assert tried == [("prefill", 2048), ("prefill", 32), ("prefill", 2048)]


def test_long_prefill_graphs_unless_turned_off(monkeypatch):
    """One sequence's prefill replays a graph of the next bucket up: to 2,048 tokens in steps of 256 above 512
    (padding under 256 rows); with LLMC_LONG_PREFILL_GRAPHS=0 to 512 only; past the last bucket, or with
    several sequences, it runs eagerly."""
    from llmc.runtime.executor import StepInput
    from llmc.runtime.step_graphs import graph_kind, prefill_buckets
    prompt = lambda n: [StepInput(list(range(n)), 0, list(range(n // 16 + 1)))]  # noqa: E731
    monkeypatch.delenv("LLMC_LONG_PREFILL_GRAPHS", raising=False)
    long = prefill_buckets()
    assert [graph_kind(prompt(n), long) for n in (300, 513, 769, 2000, 2048)] == [
        ("prefill", 512), ("prefill", 768), ("prefill", 1024), ("prefill", 2048), ("prefill", 2048)]
    assert graph_kind(prompt(2049), long) is None and graph_kind(prompt(700) + prompt(8), long) is None
    monkeypatch.setenv("LLMC_LONG_PREFILL_GRAPHS", "0")
    assert graph_kind(prompt(300), prefill_buckets()) == ("prefill", 512)
    assert graph_kind(prompt(513), prefill_buckets()) is None
