"""Pipeline stages on step graphs, on the CPU: `StepGraphCache.run_stage` and the workers' micro-batch loop,
with the CUDA graph replaced by a stand-in that reruns the captured step over the same buffers (as the
multi-step chain test does). Each stage's graph takes the previous stage's values into buffers of the
graph's own bucket size (rows past them are padding); the stages together give the unsplit model's logits.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmc.ir.stages import split_stages
from llmc.runtime import step_graphs
from llmc.runtime.executor import StepBatch, StepInput, make_executor

PROMPTS = [[5, 17, 3, 200, 41, 9, 77], [250, 6, 1, 90]]
TABLES = [[0, 1], [2, 3]]


class _Plan:
    """The interpreter behind the kernel plan's interface."""

    def __init__(self, interp, graph):
        self.interp, self.graph = interp, graph

    def new_arena(self, inputs, hints):
        return None

    def run(self, inputs, hints, arena=None):
        return self.interp.run(inputs)


def _record(self, step):
    """A stand-in for a captured graph: each replay reruns the step and writes its outputs' buffers."""
    out = step()

    def replay():
        new = step()
        for o, n in zip(out if isinstance(out, (list, tuple)) else [out], new if isinstance(new, (list, tuple)) else [new]):
            o.copy_(n)
    return SimpleNamespace(replay=replay), out


@pytest.fixture
def stages(odd_heads_artifact, monkeypatch):
    """(unsplit executor, [(stage executor, its StepGraphCache)] for 2 stages), fp32 reference backend."""
    monkeypatch.setattr(step_graphs.StepGraphCache, "_record", _record)
    g = odd_heads_artifact.graph
    full = make_executor(g, "reference", num_blocks=8, block_size=8)
    out = []
    for sg in split_stages(g, 2).graphs:
        ex = make_executor(sg, "reference", num_blocks=8, block_size=8)
        names = set(sg.meta["pipeline"]["receives"])
        out.append((ex, step_graphs.StepGraphCache(_Plan(ex.plan, sg), ex.kv, 8, 16, ex.device, lambda x: x.argmax(-1),
                                                   [v for v in sg.inputs if v.name in names])))
    return full, out


def _through_stages(stages, batch):
    received = []
    for _, graphs in stages:
        received = graphs.run_stage(batch, received)
        assert received is not None
    return received[0]


def test_stage_graphs_give_the_unsplit_models_logits(stages):
    full, pipe = stages
    # each prompt's prefill on a prefill graph (bucket 16: padding rows), then decode steps of two and one rows
    steps = [[StepInput(PROMPTS[0], 0, TABLES[0], 1, True)], [StepInput(PROMPTS[1], 0, TABLES[1], 1, True)],
             [StepInput([11], 7, TABLES[0], 1), StepInput([12], 4, TABLES[1], 1)],
             [StepInput([13], 8, TABLES[0], 1), StepInput([14], 5, TABLES[1], 1)],
             [StepInput([15], 6, TABLES[1], 1)]]
    for batch in steps:
        want = full.execute(StepBatch(batch)).logits
        got = _through_stages(pipe, batch)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # one graph per kind and bucket and stage: prefill 16, decode 2, decode 1
    assert all(sorted(g.graphs) == [("decode", 1, "stage"), ("decode", 2, "stage"), ("prefill", 16, "stage")]
               for _, g in pipe)
    assert pipe[1][1].captured(steps[-1]) is True and pipe[1][1].captured([StepInput([1] * 2100, 0, [0], 1)]) is None


def test_pipeline_workers_replay_stage_graphs_between_eager_micro_batches(stages, monkeypatch):
    """PipelineStage.step of two stages, their sends and receives through an in-process stand-in for
    torch.distributed: micro-batches a graph fits replay it, the others run eagerly, and the last stage
    returns the unsplit model's greedy tokens."""
    import torch.distributed as dist

    from llmc.runtime.distributed.worker import PipelineStage, WorkerSpec
    full, pipe = stages
    sent = {}

    class Work:
        def __init__(self, fn=None):
            self.fn = fn

        def wait(self):  # once, as a finished NCCL request's wait is a no-op
            if self.fn:
                self.fn()
                self.fn = None

    monkeypatch.setattr(dist, "isend", lambda t, dst, tag: sent.__setitem__(tag, t.clone()) or Work())
    monkeypatch.setattr(dist, "irecv", lambda buf, src, tag: Work(lambda: buf.copy_(sent.pop(tag))))
    workers, eager = [], []
    for stage, (ex, graphs) in enumerate(pipe):
        ex.step_graphs = graphs
        ex.outputs = lambda x, mb, run=ex.outputs: eager.append(len(mb)) or run(x, mb)
        spec = WorkerSpec(artifact="-", rank=stage, tp=1, pp=2, expert_parallel=False, store_port=0,
                          backend="reference", block_size=8, num_blocks=8, kv_cache_dtype="auto", memory_fraction=0.5,
                          num_cpu_blocks=0, max_model_len=16, step_timeout_s=1.0, capacity=64, cuda_graphs=True)
        workers.append(PipelineStage(spec, ex, ex.graph.meta["pipeline"], control=None))
    # a two-prompt prefill cut into two micro-batches: prompt 0's first 5 tokens (a prefill graph), then its
    # last 2 with prompt 1 (two sequences: eager); then decode steps: two rows (two one-row micro-batches,
    # the decode graph), then one
    steps = [[StepInput(PROMPTS[0], 0, TABLES[0], 1, True), StepInput(PROMPTS[1], 0, TABLES[1], 1, True)],
             [StepInput([11], 7, TABLES[0], 1), StepInput([12], 4, TABLES[1], 1)],
             [StepInput([13], 8, TABLES[0], 1)]]
    for batch in steps:
        want = full.execute(StepBatch(batch, greedy=True)).tokens
        assert workers[0].step(StepBatch(batch, greedy=True)) is None and not sent.keys() - set(range(4))
        assert workers[1].step(StepBatch(batch, greedy=True)).tolist() == want.tolist() and not sent
    assert all(sorted(g.graphs) == [("decode", 1, "stage"), ("prefill", 16, "stage")] for _, g in pipe)
    assert eager == [2, 2]  # the two-sequence micro-batch, on each stage
