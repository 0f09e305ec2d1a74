"""Whole-step CUDA graphs of mixed steps (runtime/step_graphs.py, kind "mixed", on by default) on the
CPU: the generated kernels under Triton's interpreter, the cache's own capture code with each recorded graph
replaced by a stand-in that reruns the recorded step on the graph's fixed buffers. A graph is captured for a
token bucket once; every step of that bucket, whatever its sequences, then replays it: its attention is
launched for any rows (`paged_attention`'s `rows`), so each step gives the eager plan's logits."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmc.errors import LLMCError
from llmc.runtime import step_graphs
from llmc.runtime.executor import StepInput, make_executor, warm_up_batches
from llmc.runtime.step_graphs import StepGraphCache, graph_kind


@pytest.fixture
def replayed(monkeypatch):
    """StepGraphCache._record without CUDA: the step runs once (the capture's outputs), and each replay runs it
    again into those outputs. Returns the list of recorded steps."""
    recorded = []

    def record(self, step):
        out = step()
        recorded.append(step)

        def replay():
            for buf, new in zip(out, step()):
                buf.copy_(new)
        return SimpleNamespace(replay=replay), out
    monkeypatch.setattr(StepGraphCache, "_record", record)
    return recorded


def graphs_of(ex, max_model_len=64):
    from llmc.codegen.sampling import argmax
    g = StepGraphCache(ex.plan, ex.kv, ex.block_size, max_model_len, ex.device, argmax)
    g.mixed, g.max_seqs = tuple(b for b in step_graphs.MIXED_BUCKETS if b <= step_graphs.MIXED_LARGEST), 8
    return g


@pytest.mark.parametrize("split", ["1", "0"], ids=["decodes-split", "one-launch"])
def test_mixed_steps_replay_one_graph_per_bucket_with_the_eager_logits(llama_artifact, replayed, monkeypatch, split):
    """One graph of a token bucket replays every step of that bucket with the eager plan's logits and K/V: the
    decodes on the decode kernel, or (LLMC_SPLIT_DECODES=0) every row on the prefill kernel, as eager."""
    monkeypatch.setenv("LLMC_SPLIT_DECODES", split)
    g = llama_artifact.graph
    plain, cached = (make_executor(g, "triton-interpret", num_blocks=32, block_size=4) for _ in range(2))
    graphs = graphs_of(cached)
    graphs.split_decodes = cached.split_decodes
    p0, p1, p2 = list(range(3, 12)), [40, 41, 42, 43, 44], [7, 8, 9, 10, 11, 12, 13]
    steps = [  # two prompts; their decodes beside a third prompt's first chunk (no logits row); then its rest; ...
        [StepInput(p0, 0, [0, 1, 2], 1, True), StepInput(p1, 0, [3, 4], 1, True)],
        [StepInput([50], 9, [0, 1, 2], 1), StepInput([51], 5, [3, 4], 1), StepInput(p2[:4], 0, [5, 6], 0, True)],
        [StepInput([52], 10, [0, 1, 2], 1), StepInput(p2[4:], 4, [5, 6], 1, True)],
        [StepInput([53], 11, [0, 1, 2], 1), StepInput([54], 6, [3, 4], 1), StepInput([55, 56], 7, [5, 6, 7], 1, True),
         StepInput([60, 61, 62], 0, [8], 1, True)],
    ]
    for seqs in steps:
        assert graph_kind(seqs, graphs.prefill, graphs.mixed, graphs.max_seqs) == ("mixed", 16)
        want = plain.outputs(plain.build_inputs(seqs), seqs)[0]
        got = graphs.run(seqs, greedy=False)
        assert got is not None and got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        tokens = graphs.run(seqs, greedy=True)  # the same graph's argmax rows (a replay writes the same K/V)
        assert torch.equal(tokens, got.argmax(-1))
    assert [k[:2] for k in graphs.graphs] == [("mixed", 16)] and len(replayed) == 1
    for a, b in zip(plain.kv.values(), cached.kv.values()):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_which_steps_a_mixed_graph_takes(llama_artifact):
    ex = make_executor(llama_artifact.graph, "triton-interpret", num_blocks=32, block_size=4)
    graphs = graphs_of(ex)
    kind = lambda seqs: graph_kind(seqs, graphs.prefill, graphs.mixed, graphs.max_seqs)  # noqa: E731
    decode = StepInput([5], 3, [0], 1)
    assert kind([decode] * 3) == ("decode", 4)  # decodes alone, one prompt alone: their own graphs
    assert kind([StepInput([1] * 20, 0, [0] * 5, 1, True)]) == ("prefill", 32)
    assert kind([decode, StepInput([1] * 20, 0, [0] * 5, 1, True)]) == ("mixed", 32)
    assert kind([decode] * 9 + [StepInput([1] * 20, 0, [0] * 5, 1, True)]) is None  # more sequences than it holds
    assert kind([decode, StepInput([1] * 2100, 0, [0] * 525, 1, True)]) is None  # past the largest bucket
    assert kind([decode, StepInput([1, 2, 3], 3, [0], 3)]) is None  # a verify row: all its logits
    graphs.mixed = None
    assert kind([decode, StepInput([1] * 20, 0, [0] * 5, 1, True)]) is None  # off


def test_the_decode_rows_context_picks_the_graph(llama_artifact, replayed):
    """A mixed step's decode rows size its decode launch: their longest context picks the context bucket, as for a
    decode step; the prompt rows' contexts do not."""
    ex = make_executor(llama_artifact.graph, "triton-interpret", num_blocks=64, block_size=4)
    graphs = graphs_of(ex, max_model_len=4096)
    assert graphs.contexts == (1024, 2048, 4096)
    prompt = StepInput([1] * 6, 1500, [0] * 377, 1, True)
    key = lambda seqs: (*graph_kind(seqs, graphs.prefill, graphs.mixed, graphs.max_seqs),  # noqa: E731
                        graphs._context(("mixed", 16), seqs))
    assert key([StepInput([5], 1000, [0] * 251, 1), prompt]) == ("mixed", 16, 1024)
    assert key([StepInput([5], 1023, [0] * 256, 1), prompt])[2] == 1024
    assert key([StepInput([5], 1024, [0] * 257, 1), prompt])[2] == 2048
    assert key([StepInput([5], 3000, [0] * 751, 1), prompt])[2] is None  # the model's limit


UP_TO_2048 = (16, 32, 64, 128, 256, 512, 1024, 2048)


@pytest.mark.parametrize("value, buckets", [(None, UP_TO_2048), ("1", UP_TO_2048), ("0", None),
                                            ("1024", UP_TO_2048[:-1]), ("4096", UP_TO_2048 + (4096,)),
                                            (" 64 ", (16, 32, 64))])
def test_the_switch_names_the_largest_mixed_graph(monkeypatch, value, buckets):
    if value is None:
        monkeypatch.delenv("LLMC_MIXED_STEP_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("LLMC_MIXED_STEP_GRAPHS", value)
    assert step_graphs.mixed_buckets() == buckets


@pytest.mark.parametrize("value", ["3000", "yes", "-1"])
def test_a_switch_value_that_is_no_bucket_is_named(monkeypatch, value):
    monkeypatch.setenv("LLMC_MIXED_STEP_GRAPHS", value)
    with pytest.raises(LLMCError, match=f"LLMC_MIXED_STEP_GRAPHS='{value}'.*2048, 4096, 8192"):
        step_graphs.mixed_buckets()


def test_the_warm_up_meets_each_mixed_graph_at_each_context():
    batches = warm_up_batches(8, 64, 4, contexts=(1024, 2048, 4096), mixed=(16, 32, 64))
    mixed = [b for b in batches if any(len(s.token_ids) > 1 for s in b.seqs)]
    seen = {(sum(len(s.token_ids) for s in b.seqs), max(s.start_pos for s in b.seqs if len(s.token_ids) == 1))
            for b in mixed}
    # the first context bucket with decodes at position 0, as every other step; the others at their last position
    assert {(T, p) for T in (16, 32, 64) for p in (0, 2047, 4095)} <= seen
    assert not [b for b in warm_up_batches(8, 64, 4, contexts=(1024, 4096)) if any(s.start_pos for s in b.seqs
                                                                                  if len(s.token_ids) > 1)]


def test_an_engine_run_on_the_graphs_gives_the_eager_runs_tokens(llama_artifact, replayed):
    """Whole engine runs (prompts chunked beside decodes, overlapped steps; greedy, then sampled on the host) with
    every step the executor can put on a graph on one (decode, prefill and mixed graphs, recorded and rerun as
    above): the eager runs' tokens."""
    from llmc import LLM, SamplingParams
    prompts = [list(range(3, 3 + n)) for n in (11, 5, 17, 9)]
    runs = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=8, ignore_eos=True)]
    opts = dict(backend="triton-interpret", num_blocks=32, block_size=4, max_num_batched_tokens=12, max_num_seqs=4)
    want = [LLM(llama_artifact, **opts).generate(prompts, p) for p in runs]
    llm = LLM(llama_artifact, **opts)
    ex = llm.engine.executor
    ex.step_graphs, ex.use_cuda_graphs = graphs_of(ex, llm.engine.max_model_len), True
    got = [llm.generate(prompts, p) for p in runs]
    kinds = [k[0] for k in ex.step_graphs.graphs]
    assert "mixed" in kinds and "decode" in kinds, kinds
    for w, g in zip(want, got):
        assert [o.outputs[0].token_ids for o in g] == [o.outputs[0].token_ids for o in w]


def test_a_table_too_short_for_its_tokens_is_named():
    from llmc.errors import LLMCError
    dg = step_graphs._StepGraph("mixed", 32, 8, torch.device("cpu"), 4)
    with pytest.raises(LLMCError, match="sequence 1: 13 tokens need more blocks"):
        dg.load([StepInput([5], 3, [0], 1), StepInput([1] * 10, 3, [1, 2, 3], 1, True)], 4)
