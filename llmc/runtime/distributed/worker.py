"""A worker process: one rank's shard of one pipeline stage, driven by the driver's step broadcasts.

Worker w (0 .. TP x PP - 1) is tensor-parallel rank w % TP of stage w // TP. It loads the artifact
itself, shards the graph (llmc/ir/sharding.py), cuts its stage (llmc/ir/stages.py) and runs it
with the executor of its backend over its own KV cache. Each step it receives the batch (one
broadcast from the driver), applies the block moves, and runs the step's micro-batches: a stage
after the first receives each micro-batch's hidden states from its partner in the previous stage,
every stage but the last sends them on, so stage s runs micro-batch i while stage s + 1 runs i - 1.
The last stage's rank 0 returns the sampled rows' logits (or their argmax) to the driver.

Process groups: `compute` (the workers: NCCL on GPUs, gloo on the CPU; all_reduce, all_gather and the
stages' sends) and `control` (gloo, the workers and the driver, rank 0: step broadcasts and results).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

from llmc.ir.types import dim_eval, torch_dtype
from llmc.runtime import heap
from llmc.runtime.distributed import codec
from llmc.runtime.executor import Feed, Launched, StepBatch, StepInput, _verifies, as_decode_rows, make_executor
from llmc.runtime.kv_cache import KVCache
from llmc.runtime.step_graphs import row_dims

CONTROL_TIMEOUT = datetime.timedelta(days=365)  # a worker waits for the next step as long as the engine idles


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to start: plain values only (it loads the weights itself, from `artifact`)."""

    artifact: str
    rank: int
    tp: int
    pp: int
    expert_parallel: bool
    store_port: int
    backend: str  # resolved: cuda, triton-interpret or reference
    block_size: int
    num_blocks: int | None
    kv_cache_dtype: str
    memory_fraction: float
    num_cpu_blocks: int
    max_model_len: int
    step_timeout_s: float
    capacity: int  # the step broadcast's initial length
    cuda_graphs: bool = False  # replay steps (a stage's micro-batches) as graphs: see PipelineStage.step
    plugins: list = field(default_factory=list)  # [module, file] behind a user's ops (llmc/plugins.py)

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp


def main(argv: list[str]) -> None:
    """`python -m llmc.runtime.distributed SPEC_JSON`: what the driver starts. A failure is written
    to the store (`error/<rank>`, one line, for the driver's message) and to stderr, and ends the process.
    With LLMC_STACKS_EVERY_S=S set, every worker prints its Python stack to stderr every S seconds."""
    from torch.distributed import TCPStore
    spec = WorkerSpec(**json.loads(argv[0]))
    if os.environ.get("LLMC_STACKS_EVERY_S"):  # a hung run: every worker prints where it waits
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["LLMC_STACKS_EVERY_S"]), repeat=True)
    store = TCPStore("127.0.0.1", spec.store_port, spec.world + 1, is_master=False,
                     timeout=datetime.timedelta(seconds=spec.step_timeout_s))
    try:
        _serve(spec, store)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which raises it as its own error
        traceback.print_exc()
        detail = str(e).splitlines()[0] if str(e) else ""
        try:
            store.set(f"error/{spec.rank}", f"{type(e).__name__}: {detail}")
        except Exception:  # noqa: BLE001 - the driver is gone too
            pass
        sys.stderr.flush()
        os._exit(1)  # not sys.exit: process-group destructors could block on peers that are gone
    os._exit(0)


def _serve(spec: WorkerSpec, store) -> None:
    import torch.distributed as dist
    from torch.distributed import PrefixStore
    from llmc.artifact import load_artifact
    from llmc.ir.collectives import TorchCollectives
    from llmc.ir.sharding import shard_graph
    from llmc.ir.stages import split_stages
    from llmc.passes.fuse_linear_epilogue import fuse_swiglu_epilogues
    from llmc.plugins import import_sources
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world))
    cuda = spec.backend == "cuda"
    device = torch.device("cuda", spec.rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    import_sources(spec.plugins)  # the ops of a user's that the artifact holds, registered as in the driver
    art = load_artifact(spec.artifact, verify=False)  # the driver checks the hashes before it sends a step
    graph = shard_graph(art.graph, spec.tp, spec.tp_rank, spec.expert_parallel)
    if spec.tp > 1:  # the sharding unfolded each SwiGLU epilogue to split the MLP: the rank's own, fused again
        fuse_swiglu_epilogues(graph)
    mine, tuning = split_stages(graph, spec.pp).graphs[spec.stage], art.tuning
    if cuda and spec.tp > 1:  # the shard's linears have shapes of their own: tuned here, once per machine
        tuning = shard_tuning(spec, store, mine, tuning)
    del art, graph  # the weights of other shards and stages go once this stage holds its own
    ex = make_executor(mine, spec.backend, str(device), spec.block_size, spec.num_blocks,
                       spec.kv_cache_dtype, spec.memory_fraction, spec.num_cpu_blocks, tuning,
                       cuda_graphs=spec.cuda_graphs, max_model_len=spec.max_model_len)
    store.set(f"ready/{spec.rank}", json.dumps({"num_blocks": ex.num_blocks,
                                                "block_bytes": ex.kv_bytes // ex.num_blocks}))
    # longer than the driver's wait for a step, so that a hung peer is the driver's to report
    timeout = datetime.timedelta(seconds=2 * spec.step_timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", store=PrefixStore("compute", store), rank=spec.rank,
                            world_size=spec.world, timeout=timeout)
    tp_groups = [dist.new_group(list(range(s * spec.tp, (s + 1) * spec.tp))) for s in range(spec.pp)] \
        if spec.pp > 1 else [None]
    control = dist.ProcessGroupGloo(PrefixStore("control", store), spec.rank + 1, spec.world + 1, CONTROL_TIMEOUT)
    num_blocks = int(store.get("num_blocks"))
    if num_blocks != ex.num_blocks:  # every rank's cache holds the block manager's count: the smallest
        resize_cache(ex, num_blocks, spec.memory_fraction, spec.num_cpu_blocks)
    # symmetric-memory all_reduces rely on each step ending in the LM head's all_gather (collectives.py): one
    # stage only; a pipeline stage's all_reduces go through NCCL
    ex.plan.state["process_groups"] = {"tp": TorchCollectives(tp_groups[spec.stage], device if spec.pp == 1 else None)}
    if spec.cuda_graphs:  # NCCL sets up a communicator on its first collective, which a capture may not hold
        dist.all_reduce(torch.zeros(1, device=device), group=tp_groups[spec.stage])
        torch.cuda.synchronize(device)
    stage = PipelineStage(spec, ex, mine.meta.get("pipeline", {}), control)
    if cuda:  # this process's heap out of the collector's way for its step loop (llmc/runtime/heap.py)
        heap.freeze()
    stage.serve()
    store.set(f"timings/{spec.rank}", json.dumps(stage.timings))
    dist.destroy_process_group()


def shard_tuning(spec: WorkerSpec, store, graph, tuning: dict) -> dict:
    """The tuning choices of this rank's shard (`compiler.tune_shard`), alike on every tensor-parallel rank of a
    stage: its rank 0 times the shapes the artifact lacks and hands its choices on through the store; the
    others time only shapes of their own (an uneven split). Ranks that timed on their own could choose
    differently (timing noise), and then run different kernels, in different sums, at different speeds,
    each step waiting in its all_reduces for the slowest."""
    from llmc.compiler import tune_shard
    key = f"tuning/{spec.stage}"
    if spec.tp_rank == 0:
        tuning = tune_shard(graph, tuning)
        store.set(key, json.dumps(tuning))
        return tuning
    return tune_shard(graph, json.loads(store.get(key)))


def resize_cache(ex, num_blocks: int, memory_fraction: float, num_cpu_blocks: int) -> None:
    """Re-make the executor's KV cache with `num_blocks` blocks. The first cache goes before the second is
    made (both may not fit at once): the executor and its step graphs (captured later, over the second)
    drop every reference to it first."""
    graphs = getattr(ex, "step_graphs", None)
    ex.cache = None
    if graphs is not None:
        graphs.kv = {}
    if ex.device.type == "cuda":
        torch.cuda.empty_cache()
    ex.cache = KVCache(ex.graph, ex.device, ex.block_size, num_blocks, memory_fraction, num_cpu_blocks)
    ex.num_blocks, ex.kv_bytes = num_blocks, ex.cache.bytes
    if graphs is not None:
        graphs.kv = ex.kv


class PipelineStage:
    """One worker's step loop (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, executor, pipeline: dict, control):
        self.spec, self.ex, self.control = spec, executor, control
        self.first, self.last = spec.stage == 0, spec.stage == spec.pp - 1
        self.receives = [v for v in executor.graph.inputs if v.name in set(pipeline.get("receives", []))]
        self.prev, self.next = spec.rank - spec.tp, spec.rank + spec.tp  # same tensor-parallel rank, next stage
        self.capacity = spec.capacity
        # where this worker's time goes, summed over steps (left in the store at the end: `worker_timings`):
        # waiting for the step's broadcast, decoding it, running it (the GPU's time too where the step
        # reads its result back), returning the result
        self.timings = {"steps": 0, "wait_s": 0.0, "decode_s": 0.0, "step_s": 0.0, "send_s": 0.0}

    def serve(self) -> None:
        """The step loop. A launched step (the engine's overlapped steps) is not waited for: its argmax rows
        stay on the device for the next step's Feed, and its result goes to the driver after the next step
        is enqueued, or on the driver's FLUSH when it has no next step to send first. Only then: a result
        sent while the driver broadcasts would leave each waiting for the other."""
        import torch.distributed as dist
        from llmc.runtime.profiling import StepProfiler
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        clock = time.perf_counter
        profiler = StepProfiler.from_env(f"rank{self.spec.rank}") if self.spec.backend == "cuda" else None
        returns = self.last and self.spec.tp_rank == 0  # this rank sends the driver each step's result
        self.in_flight: Launched | None = None  # a launched step's result not sent yet
        self.tokens = None  # the last greedy step's argmax rows, on the device
        while True:
            if profiler is not None:
                profiler.tick()
            t0 = clock()
            buf = torch.empty(self.capacity, dtype=torch.int64)
            self.control.broadcast([buf], opts).wait()
            op, length = int(buf[0]), int(buf[1])
            t1 = clock()
            if op == codec.STOP:
                if profiler is not None:
                    profiler.finish()  # a run shorter than the window: the steps it had
                return
            if op == codec.RESIZE:
                self.capacity = int(buf[2])
                continue
            if op == codec.FLUSH:
                self._return_in_flight()
                continue
            batch, fed, launched = codec.decode(buf[codec.HEADER:codec.HEADER + length].tolist())
            t2 = clock()
            assert launched or self.in_flight is None, "a step that waits comes after its predecessor's FLUSH"
            feed = Feed(self.tokens, *map(list, zip(*fed))) if fed else None
            result = self.step(batch, feed)
            if batch.greedy and result is not None:
                self.tokens = result
            t3 = clock()
            if launched:
                self._return_in_flight()  # the previous step's, while this one runs
                if returns:
                    self.in_flight = Launched(result)
            elif returns:
                self.control.send([result.cpu()], 0, 0).wait()
            t = self.timings
            t["steps"] += 1
            t["wait_s"] += t1 - t0
            t["decode_s"] += t2 - t1
            t["step_s"] += t3 - t2
            t["send_s"] += clock() - t3

    def _return_in_flight(self) -> None:
        """Send the launched step's result, once its copy to the host is done."""
        if self.in_flight is None:
            return
        host, self.in_flight = self.in_flight.wait(), None
        self.control.send([host], 0, 0).wait()

    @torch.inference_mode()
    def step(self, batch: StepBatch, feed: Feed | None = None) -> torch.Tensor | None:
        """Run this stage's share of a step. Returns on every rank of the last stage the result, on the device:
        the argmax rows (greedy), fp32 logits rows, or a one-element acknowledgement when the step samples
        nothing; None on other stages. `feed` (one stage only) overwrites input tokens with rows of the
        previous step's argmax."""
        import torch.distributed as dist
        ex = self.ex
        seqs = ex._begin(batch)  # the block moves
        if batch.chain and seqs:  # multi-step: every rank runs the k steps alike (one stage: see the config)
            return ex.chain(seqs)
        if seqs and any(_verifies(s) for s in seqs):
            seqs = as_decode_rows(seqs)
        graphs = getattr(ex, "step_graphs", None)
        if graphs is not None and seqs and self.first and self.last:
            # one stage: every rank replays the same step graph (all ranks see the same batch, so they
            # capture the same shapes in the same order), its all_reduce and all_gather inside
            out = graphs.run(seqs, batch.greedy, feed)
            if out is not None:
                return out
        mbs = microbatches(seqs, self.spec.pp) if seqs else []
        # a micro-batch a step graph fits replays it (pipeline stages: sends and receives stay outside the
        # graphs); the others run eagerly over inputs built here
        staged = [graphs is not None and graphs.captured(mb) is not None for mb, _ in mbs]
        inputs = [None if g else ex.build_inputs(mb) for (mb, _), g in zip(mbs, staged)]
        if feed is not None:  # one stage, no graph fits (see above): one micro-batch built here, in step order
            assert len(mbs) == 1 and inputs[0] is not None, "a fed step runs on one stage"
            feed.apply(inputs[0]["input_ids"])
        received: list[list[torch.Tensor]] = [[] for _ in mbs]
        pending = []
        if not self.first:  # post every receive now: the previous stage sends as it finishes each micro-batch
            for i, ((mb, _), x) in enumerate(zip(mbs, inputs)):
                dims = row_dims(mb)  # what crosses between stages has the micro-batch's token rows
                for j, v in enumerate(self.receives):
                    buf = torch.empty([dim_eval(d, dims) for d in v.type.shape], dtype=torch_dtype(v.type.dtype),
                                      device=ex.device)
                    received[i].append(buf)
                    if x is not None:
                        x[v.name] = buf
                    pending.append((i, dist.irecv(buf, src=self.prev, tag=i * len(self.receives) + j)))
        sends, rows = [], []
        for i, ((mb, keep), x) in enumerate(zip(mbs, inputs)):
            for k, w in pending:
                if k == i:
                    w.wait()
            if x is None:
                if not graphs.captured(mb):  # a capture overlaps no NCCL work of this worker's
                    for _, w in sends + pending:
                        w.wait()
                    if ex.device.type == "cuda":
                        torch.cuda.synchronize(ex.device)
                outs = graphs.run_stage(mb, received[i])
            else:
                outs = ex.outputs(x, mb)
            # copies: the plan may keep its outputs in its arena (a graph: its buffers), which the next
            # micro-batch reuses while a send is still reading (the copies are [T, hidden] and [rows, V]
            # against the step's GEMMs)
            if not self.last:
                for j, t in enumerate(outs):
                    t = t.clone(memory_format=torch.contiguous_format)
                    sends.append((t, dist.isend(t, dst=self.next, tag=i * len(outs) + j)))
            elif keep:
                rows.append(outs[0].to(torch.float32, copy=True))
        for _, w in sends:
            w.wait()
        if not self.last:
            return None
        if not rows:
            return torch.zeros(1, dtype=torch.int64, device=ex.device)  # an acknowledgement: the step is done
        logits = torch.cat(rows) if len(rows) > 1 else rows[0]
        return logits.argmax(dim=-1) if batch.greedy else logits


def microbatches(seqs: list[StepInput], m: int) -> list[tuple[list[StepInput], bool]]:
    """The step's tokens cut into at most m contiguous runs of near-equal length, cutting through sequences
    where needed (a later piece attends over the K/V its earlier piece wrote on this stage). Each run
    is (pieces, keep): a run that wants no logits computes its last row anyway (the graph wants one)
    and is not kept."""
    total = sum(len(s.token_ids) for s in seqs)
    m = max(1, min(m, total))
    bounds = [total * i // m for i in range(m + 1)]
    runs: list[list[StepInput]] = [[] for _ in range(m)]
    at = 0
    for s in seqs:
        n, first_row = len(s.token_ids), len(s.token_ids) - s.num_logits
        for r in range(m):
            a, b = max(bounds[r], at) - at, min(bounds[r + 1], at + n) - at
            if a < b:
                runs[r].append(StepInput(s.token_ids[a:b], s.start_pos + a, s.block_table,
                                         max(0, b - max(a, first_row)), s.prefill))
        at += n
    out = []
    for run in runs:
        keep = sum(p.num_logits for p in run) > 0
        if not keep:
            last = run[-1]
            run[-1] = StepInput(last.token_ids, last.start_pos, last.block_table, 1, last.prefill)
        out.append((run, keep))
    return out
