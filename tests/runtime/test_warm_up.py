"""The load-time warm-up's steps (executor.warm_up_batches): which shapes they cover, that each runs on
a fresh cache, and that an engine which warmed up generates what one that did not does."""
from __future__ import annotations

import pytest

from llmc.runtime.executor import make_executor, warm_up_batches
from llmc.runtime.step_graphs import DECODE_BUCKETS


def _shape(batch):
    return len(batch.seqs), sum(len(s.token_ids) for s in batch.seqs), batch.num_logits


@pytest.mark.parametrize("max_num_seqs,max_tokens,max_chunk", [(128, 2176, None), (64, 512, None), (3, 40, None),
                                                             (1, 16, None), (128, 8320, 4095), (4, 100, 30)])
def test_batches_cover_the_decode_buckets_and_the_token_sizes(max_num_seqs, max_tokens, max_chunk):
    batches = warm_up_batches(max_num_seqs, max_tokens, 16, max_chunk)
    decodes = [len(b.seqs) for b in batches if all(len(s.token_ids) == 1 for s in b.seqs)]
    top = next(b for b in DECODE_BUCKETS if b >= max_num_seqs)
    assert decodes[:len([b for b in DECODE_BUCKETS if b <= top])] == [b for b in DECODE_BUCKETS if b <= top]
    mixed = [_shape(b) for b in batches if any(s.prefill for s in b.seqs)]
    tokens = [t for _, t, _ in mixed]
    assert tokens == sorted(set(tokens)) and tokens[-1] == max_tokens
    for b in (16, 32, 64, 128, 256, 512, 1024, 2048):
        if b <= max_tokens:
            assert b in tokens and b - 1 in tokens  # both sides of Triton's divisible-by-16 specialization
    for n, t, rows in mixed:
        assert n <= max_num_seqs and rows == n  # one logits row per decode and one per chunk
    for batch in batches:  # no chunk longer than a sequence's context
        assert all(len(s.token_ids) <= (max_chunk or max_tokens) for s in batch.seqs)
    for batch in batches:  # every sequence's table covers its tokens
        for s in batch.seqs:
            assert len(s.block_table) * 16 >= s.start_pos + len(s.token_ids)


def test_every_step_runs_on_a_fresh_cache(llama_artifact):
    ex = make_executor(llama_artifact.graph, "reference", num_blocks=8, block_size=4)
    for batch in warm_up_batches(4, 24, block_size=4):
        for greedy in (True, False):
            batch.greedy = greedy
            r = ex.execute(batch)
            rows = batch.num_logits
            assert (r.tokens if greedy else r.logits).shape[0] == rows


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_an_engine_after_the_warm_up_generates_the_same(llama_artifact, kv_cache_dtype):
    """The warm-up's steps write junk K/V into block 0 (and, quantized, its scales); the first request's
    blocks include block 0 (the free list hands it out first), and its tokens are those of an engine that never ran them."""
    from llmc.runtime.llm import LLM, SamplingParams
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7]]
    outs = []
    for warm in (False, True):
        with LLM(llama_artifact, backend="reference", num_blocks=32, block_size=4,
                 kv_cache_dtype=kv_cache_dtype) as llm:
            assert llm.stats()["warm_up_s"] == 0  # the engine warms up on a GPU only
            if warm:
                assert llm.engine.executor.warm_up(4, 24) == 2 * len(warm_up_batches(4, 24, 4))
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, p)])
    assert outs[0] == outs[1]


def test_kernels_compiled_ahead_run_every_step_eagerly(llama_artifact, monkeypatch):
    """LLMC_WARM_UP_AHEAD's collection runs each warm-up step once, greedy and not, with graphs off (so the
    eager kernels are the ones collected), and puts the executor's graph setting back after."""
    from llmc.codegen import precompile, triton_setup
    ex = make_executor(llama_artifact.graph, "triton-interpret", num_blocks=32, block_size=4)
    ex.use_cuda_graphs = True  # as on a GPU
    seen = []

    def compile_ahead(calls, threads):
        for call in calls:
            call()
            seen.append(ex.use_cuda_graphs)
        return len(calls)
    monkeypatch.setattr(precompile, "compile_ahead", compile_ahead)
    monkeypatch.setattr(triton_setup, "ready", lambda: None)
    monkeypatch.setattr(triton_setup, "enabled", lambda: True)
    monkeypatch.setenv("LLMC_TUNE_THREADS", "2")
    monkeypatch.delenv("LLMC_TUNE_PROCESSES", raising=False)
    batches = warm_up_batches(2, 20, 4)
    assert ex.compile_ahead(batches) == 2 * len(batches) == len(seen)
    assert not any(seen) and ex.use_cuda_graphs is True


def test_kernels_compiled_ahead_in_worker_processes_when_asked(llama_artifact, monkeypatch):
    """With LLMC_TUNE_PROCESSES set, the warm-up's kernels go to a CompilePool of that many workers (the
    same eager calls), not to threads; the pool is closed after."""
    from llmc.codegen import precompile, triton_setup
    ex = make_executor(llama_artifact.graph, "triton-interpret", num_blocks=32, block_size=4)
    ex.use_cuda_graphs = True
    pools = []

    class Pool:
        def __init__(self, workers):
            self.workers, self.closed, self.calls = workers, False, 0
            pools.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.closed = True

        def compile(self, calls):
            for call in calls:
                call()
                assert ex.use_cuda_graphs is False
            self.calls = len(calls)
            return 7

    monkeypatch.setattr(precompile, "CompilePool", Pool)
    monkeypatch.setattr(precompile, "compile_ahead", lambda *a: pytest.fail("threads used"))
    monkeypatch.setattr(triton_setup, "ready", lambda: None)
    monkeypatch.setattr(triton_setup, "enabled", lambda: True)
    monkeypatch.setenv("LLMC_TUNE_PROCESSES", "3")
    batches = warm_up_batches(2, 20, 4)
    assert ex.compile_ahead(batches) == 7
    assert [(p.workers, p.closed, p.calls) for p in pools] == [(3, True, 2 * len(batches))]
    assert ex.use_cuda_graphs is True
