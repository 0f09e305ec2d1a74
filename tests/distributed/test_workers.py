"""The real multi-process path on the CPU: workers over gloo behind the Executor protocol.

One artifact for the module (6 query heads over 3 KV heads, tied embeddings: at TP=2 a query group
straddles the two ranks). Each gang of workers takes a few seconds to start, so each test starts
one and checks everything it can on it.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from llmc import LLM, SamplingParams
from llmc.errors import LLMCError
from llmc.runtime.distributed import DistributedExecutor
from llmc.runtime.executor import StepBatch, StepInput, make_executor
from tests.test_cli import assert_clean_error, cli

pytestmark = pytest.mark.slow

# three prompts of different lengths: a pipeline step's micro-batches cut through the longest
PROMPTS = [[5, 17, 3, 200, 41, 9, 77], [250, 6, 1], list(range(20, 44))]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
OPTIONS = dict(num_blocks=64, block_size=4, backend="reference")


@pytest.fixture(scope="module")
def single(odd_heads_artifact):
    return [o.token_ids for o in LLM(odd_heads_artifact, **OPTIONS).generate(PROMPTS, GREEDY)]


def assert_logits_match(executor, art):
    """A prefill of two prompts, then a decode step and a speculative verify step, against one process (fp32)."""
    ref = make_executor(art.graph, "reference", block_size=4, num_blocks=64)
    steps = [StepBatch([StepInput(list(range(3, 14)), 0, [50, 51, 52], 2, True), StepInput([40, 41, 42], 0, [53])]),
             StepBatch([StepInput([7], 11, [50, 51, 52]), StepInput([8, 9, 10], 3, [53, 54], 3)])]
    for batch in steps:
        want, got = ref.execute(batch).logits, executor.execute(batch).logits
        assert got.shape == want.shape and (got - want).abs().max() < 1e-4


def test_tensor_parallel_matches_one_process_and_fails_cleanly_when_a_worker_dies(odd_heads_artifact, single):
    llm = LLM(odd_heads_artifact, tensor_parallel_size=2, **OPTIONS)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == single
    assert llm.stats()["overlapped_steps"] >= 6  # each step sent while the workers ran the one before
    # a request that stops on a token while its next step is in flight: that step's result is read and dropped,
    # and the steps after read their own
    stop = single[0][2]
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop]))[0]
    assert out.token_ids == single[0][:single[0].index(stop) + 1] and out.finish_reason == "stop"
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == single
    # a request whose rows the driver samples (it asks for logprobs) makes steps that wait for their logits, between
    # launched ones: the workers return each result in order either way
    steps = llm.stats()["overlapped_steps"]
    mixed = [GREEDY, SamplingParams(max_tokens=6, temperature=0.0, logprobs=1), GREEDY]
    outs = llm.generate(PROMPTS, mixed)
    assert [o.token_ids for o in outs] == single and outs[1].outputs[0].logprobs is not None
    assert llm.stats()["overlapped_steps"] == steps  # every decode step had the logprobs row
    outs = llm.generate(PROMPTS[:2], [GREEDY, SamplingParams(max_tokens=2, temperature=0.0, logprobs=1)])
    assert [o.token_ids for o in outs] == [single[0], single[1][:2]] and llm.stats()["overlapped_steps"] > steps
    assert_logits_match(llm.engine.executor, odd_heads_artifact)
    gang = llm.engine.executor._gang
    os.kill(gang.procs[1].pid, signal.SIGKILL)
    assert gang._died.wait(5)  # the watchdog saw it (so the blame cannot go to a peer that fails after it)
    t0 = time.monotonic()
    for _ in range(2):  # the step that meets the dead worker, and every later one
        with pytest.raises(LLMCError, match=r"worker 1 \(tensor-parallel rank 1, pipeline stage 0\) failed: killed by "
                                            r"signal SIGKILL.*create a new engine"):
            llm.generate(PROMPTS[:1], GREEDY)
    assert time.monotonic() - t0 < 10
    llm.engine.executor.close()
    assert all(p.poll() is not None for p in gang.procs)


def test_tensor_parallel_multi_step_matches_one_process(odd_heads_artifact, single):
    # every rank runs a chain's steps alike (each step's all_reduce and all_gather on every rank)
    with LLM(odd_heads_artifact, tensor_parallel_size=2, multi_step=4, **OPTIONS) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == single
        assert llm.engine.num_steps <= 4  # the prefill, then the 5 decodes in chains of 4


def test_pipeline_parallel_matches_one_process(odd_heads_artifact, single):
    with LLM(odd_heads_artifact, pipeline_parallel_size=2, max_num_batched_tokens=16, **OPTIONS) as llm:  # chunked
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == single
        assert llm.stats()["overlapped_steps"] == 0  # stages hand their rows on: every step is waited for
        assert_logits_match(llm.engine.executor, odd_heads_artifact)
        gang = llm.engine.executor._gang
        assert all(p.poll() is None for p in gang.procs)
    assert [p.returncode for p in gang.procs] == [0, 0]  # stopped by the driver's message on leaving, not killed
    # where the steps' time went, the workers' own once they have stopped: both ran every step
    t = llm.engine.executor.timings
    assert t["send_s"] > 0 and t["receive_s"] > 0 and len(t["workers"]) == 2
    assert len({w["steps"] for w in t["workers"]}) == 1 and t["workers"][0]["steps"] >= 6
    assert all(w["step_s"] > 0 and w["wait_s"] > 0 for w in t["workers"])


def test_a_worker_error_and_a_hung_worker_are_llmc_errors(odd_heads_artifact):
    ex = DistributedExecutor(odd_heads_artifact, 2, 1, "reference", block_size=4, num_blocks=64, step_timeout_s=3)
    try:
        assert ex.execute(StepBatch([StepInput([1, 2, 3], 0, [0])], greedy=True)).tokens.shape == (1,)
        os.kill(ex._gang.procs[0].pid, signal.SIGSTOP)  # alive, but never answers
        t0 = time.monotonic()
        with pytest.raises(LLMCError, match="no answer from the workers within 3 s"):
            ex.execute(StepBatch([StepInput([4], 3, [0])], greedy=True))
        assert time.monotonic() - t0 < 10
    finally:
        ex.close()
    ex = DistributedExecutor(odd_heads_artifact, 1, 2, "reference", block_size=4, num_blocks=64)
    try:
        with pytest.raises(LLMCError, match=r"worker 0 \(tensor-parallel rank 0, pipeline stage 0\) failed: IRError: "
                                            r"rope_kv_write failed in the interpreter: index 1000 is out of bounds"):
            ex.execute(StepBatch([StepInput([1, 2, 3], 0, [1000])]))  # a block past the cache
    finally:
        ex.close()


def test_cli_options(odd_heads_artifact):
    art = odd_heads_artifact.path
    code, one = cli("run", art, "--prompt", "def f(x):", "--max-tokens", "5", "--backend", "reference")
    assert code == 0, one
    code, two = cli("run", art, "--prompt", "def f(x):", "--max-tokens", "5", "--backend", "reference",
                    "--tensor-parallel-size", "2")
    assert (code, two) == (0, one)
    assert_clean_error(*cli("run", art, "--prompt", "x", "-tp", "4"), "tensor parallel size 4 does not divide the 6 "
                       "attention heads")
    assert_clean_error(*cli("run", art, "--prompt", "x", "-pp", "3"), "pipeline parallel size 3 is larger than the "
                       "model's 2 layers")


def test_workers_run_the_generated_kernels(odd_heads_artifact, single):
    """Workers on the kernel plan (the path GPUs take, here under Triton's interpreter over gloo), at
    TP=2 and PP=2: the collectives run as plan steps between generated kernels, a stage's plan takes
    and gives the values that cross the cut, and the greedy tokens are one process's."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the triton-interpret backend needs TRITON_INTERPRET=1 (this run compiles for a GPU)")
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2, "max_num_batched_tokens": 16}):
        with LLM(odd_heads_artifact, **layout, **{**OPTIONS, "backend": "triton-interpret"}) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == single, layout
