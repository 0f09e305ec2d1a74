"""Mixed steps on piecewise graphs (llmc/runtime/piecewise.py) on the CPU: the generated kernels under
Triton's interpreter, each captured piece replaced by a stand-in that reruns its steps over the same
tensors. Padded to a token bucket, with attention run on each step's real metadata between the
pieces, every step gives the plain plan's outputs, and the KV cache the same contents."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from llmc.runtime.executor import StepInput, make_executor
from llmc.runtime.piecewise import PiecewiseGraphs


class _Graphs:
    """Stand-ins for StepGraphCache._warm (runs the piece twice, where the GPU's runs it once: however many
    warm-up runs there are, the step's result must not change) and _capture_only: a capture
    runs nothing, so the stand-in runs the piece (to make its values) and then puts back every tensor it
    may have written (KV caches, the arenas, attention outputs); its replay reruns the piece."""

    def __init__(self, executor):
        self.ex, self.pw = executor, None

    def warm(self, fn):
        fn()
        fn()

    def capture(self, fn):
        held = [*self.ex.kv.values()] + [t for b in self.pw.buckets.values()
                                          for t in [b.arena, *b.break_out.values()] if t is not None]
        saved = [t.clone() for t in held]
        fn()
        for t, s in zip(held, saved):
            t.copy_(s)
        return SimpleNamespace(replay=fn), None


def test_mixed_steps_on_pieces_give_the_plans_outputs(llama_artifact):
    g = llama_artifact.graph
    plain, pieces = (make_executor(g, "triton-interpret", num_blocks=32, block_size=4) for _ in range(2))
    graphs = _Graphs(pieces)
    pw = graphs.pw = PiecewiseGraphs(pieces.plan, graphs.warm, graphs.capture)
    p0, p1, p2 = list(range(3, 12)), [40, 41, 42, 43, 44], [7, 8, 9, 10, 11, 12, 13]
    steps = [  # two prompts; then their decodes with a third prompt's first chunk; then its rest, ...
        [StepInput(p0, 0, [0, 1, 2], 1, True), StepInput(p1, 0, [3, 4], 1, True)],
        [StepInput([50], 9, [0, 1, 2], 1), StepInput([51], 5, [3, 4], 1), StepInput(p2[:4], 0, [5, 6], 0, True)],
        [StepInput([52], 10, [0, 1, 2], 1), StepInput(p2[4:], 4, [5, 6], 2, True)],
        [StepInput([53], 11, [0, 1, 2], 1), StepInput([54], 6, [3, 4], 1), StepInput([55], 7, [5, 6], 1)],
    ]
    for seqs in steps:
        hints = {"max_seqlen_q": max(len(s.token_ids) for s in seqs),
                 "max_seqlen_k": max(s.start_pos + len(s.token_ids) for s in seqs)}
        if sum(s.num_logits for s in seqs) == 0:
            continue
        want = plain.outputs(plain.build_inputs(seqs), seqs)[0]
        got = pw.run(pieces.build_inputs(seqs), hints)[0]
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert list(pw.buckets) == [16]  # one bucket: the first step captured it, the others replayed it
    assert len(pw.buckets[16].pieces) == len(pw.breaks) == sum(n.op in ("attend_paged", "paged_attention")
                                                                for n in g.nodes)
    # the same K/V (up to the rounding of GEMMs over more rows): the padding rows and the warm-ups left none
    for a, b in zip(plain.kv.values(), pieces.kv.values()):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_a_bucket_whose_capture_runs_out_of_memory_runs_eagerly(llama_artifact):
    """Its run returns None (the executor then runs the plan), the bucket is dropped and never tried again."""
    ex = make_executor(llama_artifact.graph, "triton-interpret", num_blocks=32, block_size=4)
    calls = []

    def capture(fn):
        calls.append(fn)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    pw = PiecewiseGraphs(ex.plan, lambda fn: fn(), capture)
    seqs = [StepInput([3, 4, 5, 6], 0, [0], 1, True), StepInput([7, 8], 0, [1], 1, True)]
    hints = {"max_seqlen_q": 4, "max_seqlen_k": 4}
    assert pw.run(ex.build_inputs(seqs), hints) is None
    assert pw.refused == {16} and not pw.buckets and len(calls) == 1
    assert pw.run(ex.build_inputs(seqs), hints) is None and len(calls) == 1


def test_on_by_default_except_on_a_tensor_parallel_shard(llama_artifact, monkeypatch):
    """One GPU's plan takes piecewise graphs unless LLMC_MIXED_GRAPHS=0; a shard's (its pieces would hold
    its collectives) only with LLMC_MIXED_GRAPHS=1."""
    from llmc.ir.sharding import shard_graph
    g = llama_artifact.graph
    shard = shard_graph(g.clone(), 2, 0)  # in place: a copy
    monkeypatch.delenv("LLMC_MIXED_GRAPHS", raising=False)
    made = lambda graph: make_executor(graph, "triton-interpret", num_blocks=8, block_size=4)  # noqa: E731
    assert made(g).mixed_graphs and not made(shard).mixed_graphs
    monkeypatch.setenv("LLMC_MIXED_GRAPHS", "1")
    assert made(shard).mixed_graphs
    monkeypatch.setenv("LLMC_MIXED_GRAPHS", "0")
    assert not made(g).mixed_graphs


def test_a_mixed_steps_leading_decodes_take_the_decode_kernel(llama_artifact, monkeypatch):
    """The executor hands attention the step's leading one-token rows (decode_rows) and the decode graphs' context
    limit; with LLMC_SPLIT_DECODES=0 none. Either way the logits agree (fp32: the two kernels' sums differ only
    in rounding)."""
    import llmc.codegen.attention as attention
    seen, real = [], attention.paged_attention

    def spy(*args, **kw):
        seen.append((kw.get("decode_rows"), kw.get("context_limit")))
        return real(*args, **kw)
    monkeypatch.setattr(attention, "paged_attention", spy)
    step = [StepInput([50], 9, [0, 1, 2], 1), StepInput([51], 5, [3, 4], 1),
            StepInput([7, 8, 9, 10], 0, [5, 6], 1, True), StepInput([52], 3, [7], 1)]
    outs = {}
    for split in ("1", "0"):
        monkeypatch.setenv("LLMC_SPLIT_DECODES", split)
        ex = make_executor(llama_artifact.graph, "triton-interpret", num_blocks=32, block_size=4, max_model_len=64)
        for warm in ([StepInput(list(range(3, 12)), 0, [0, 1, 2], 1, True), StepInput([40, 41, 42, 43, 44], 0, [3, 4],
                                                                                          1, True)],
                     [StepInput([5, 6, 7], 0, [7], 1, True)]):
            ex.outputs(ex.build_inputs(warm), warm)  # the decodes' context in the cache
        seen.clear()
        outs[split] = ex.outputs(ex.build_inputs(step), step)[0]
        layers = sum(n.op in ("attend_paged", "paged_attention") for n in llama_artifact.graph.nodes)
        # the two leading decodes only: the one after the prompt chunk stays in the prefill kernel's launch
        assert seen == [(2 if split == "1" else 0, 64)] * layers
    assert (outs["1"] - outs["0"]).abs().max() <= 1e-5 * outs["0"].abs().max()
