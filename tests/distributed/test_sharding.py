"""The shard rewrite and the pipeline cut, in one process: ranks as threads (ThreadGroup), stages in turn.

Every check compares with the unsharded paged graph on the same two-prompt prefill (fp32, 1e-4).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmc.errors import IRError, LLMCError
from llmc.ir.interpreter import Interpreter
from llmc.ir.sharding import ShardError, _kv_heads, shard_graph
from llmc.ir.stages import split_stages
from llmc.runtime.distributed import codec
from llmc.runtime.distributed.worker import microbatches
from llmc.runtime.executor import Feed, StepBatch, StepInput
from tests.conftest import make_model_dir
from tests.distributed.conftest import make_llama, run_ranks

A = torch.tensor([5, 17, 3, 200, 41, 9, 77, 12, 30])
B = torch.tensor([250, 6, 1, 90])


def step_inputs(g) -> dict[str, torch.Tensor]:
    """Two prompts (9 and 4 tokens) in one prefill over 4-slot blocks, with zeroed caches of g's own shape."""
    caches = {v.name: torch.zeros(v.type.shape[0], 8, 4, *v.type.shape[3:]) for v in g.inputs
              if v.name.startswith("kv_cache.")}
    return dict(input_ids=torch.cat([A, B]), positions=torch.cat([torch.arange(9), torch.arange(4)]),
                query_start_loc=torch.tensor([0, 9, 13], dtype=torch.int32),
                seq_lens=torch.tensor([9, 4], dtype=torch.int32),
                block_tables=torch.tensor([[0, 1, 2], [3, 0, 0]], dtype=torch.int32),
                slot_mapping=torch.tensor(list(range(9)) + list(range(12, 16))),
                logits_indices=torch.tensor([3, 8, 12]), **caches)


def sharded_logits(g, tp: int) -> list[torch.Tensor]:
    ranks = [shard_graph(g.clone(), tp, r) for r in range(tp)]
    return [out[0] for out in run_ranks(ranks, step_inputs)]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, odd_heads_artifact):
    import llmc
    root = tmp_path_factory.mktemp("shard")
    arts = {"h6-kv3-tied": odd_heads_artifact}
    # 6 query heads over 2 KV heads; a vocabulary (317) and an MLP (50) that 2 and 3 do not divide
    arts["h6-kv2"] = llmc.compile(make_llama(root, "h6-kv2", 6, 2, tied=False, vocab=317, intermediate=50),
                                  root / "h6-kv2.llmc")
    arts["qwen2"] = llmc.compile(make_model_dir(root, "qwen2"), root / "qwen2.llmc")  # biases, tied, sliding window
    return arts


@pytest.mark.parametrize("name,tp", [("h6-kv3-tied", 2), ("h6-kv3-tied", 3), ("h6-kv3-tied", 6), ("h6-kv2", 2),
                                     ("h6-kv2", 3), ("h6-kv2", 6), ("qwen2", 2), ("qwen2", 4)])
def test_every_rank_gives_the_unsharded_logits(artifacts, name, tp):
    g = artifacts[name].graph
    (want,) = Interpreter(g).run(step_inputs(g))
    for got in sharded_logits(g, tp):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_the_rewrite_splits_attention_mlp_and_head(artifacts):
    g = shard_graph(artifacts["h6-kv3-tied"].graph.clone(), 2, 1)
    tp = g.meta["tensor_parallel"]
    assert (tp["column"], tp["row"], tp["vocab_parallel"], tp["replicated"]) == (5, 4, True, [])
    assert g.op_counts()["all_reduce"] == 4 and g.op_counts()["all_gather"] == 1
    # rank 1 holds query heads 3-5, which read KV heads 1, 2, 2: one KV slot per query head
    assert [v.type.shape[3] for v in g.inputs if v.name.startswith("kv_cache.")] == [3, 3]
    emb = next(n for n in g.nodes if n.op == "embedding")
    assert emb.inputs[0].type.shape == (320, 48)  # the table stays whole; the tied head got its own rows
    head = next(n for n in g.nodes if n.op == "all_gather").inputs[0].producer
    assert head.inputs[1].type.shape == (160, 48)


@pytest.mark.parametrize("hq,hkv,tp,want", [(6, 2, 2, [[0], [1]]), (6, 3, 2, [[0, 0, 1], [1, 2, 2]]),
                                            (6, 1, 3, [[0], [0], [0]]), (8, 2, 4, [[0], [0], [1], [1]]),
                                            (8, 8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]])])
def test_kv_heads_follow_the_query_heads(hq, hkv, tp, want):
    assert [_kv_heads(r, tp, hq, hkv) for r in range(tp)] == want


def test_sizes_that_cannot_split_are_one_line_errors(artifacts):
    g = artifacts["h6-kv3-tied"].graph
    with pytest.raises(ShardError, match="tensor parallel size 4 does not divide the 6 attention heads"):
        shard_graph(g.clone(), 4, 0)
    with pytest.raises(LLMCError, match="pipeline parallel size 3 is larger than the model's 2 layers"):
        split_stages(g, 3)
    once = shard_graph(g.clone(), 2, 0)
    with pytest.raises(ShardError, match="already one rank's shard"):
        shard_graph(once, 2, 0)
    with pytest.raises(IRError, match="only the distributed executor binds"):
        Interpreter(once).run(step_inputs(once))


def test_shard_pass_by_name(artifacts):
    from llmc.passes import PassManager, parse_pass_spec
    g = PassManager([parse_pass_spec("shard{tp_size=3,rank=2}")], verify=True).run(artifacts["h6-kv2"].graph.clone())
    assert g.meta["tensor_parallel"]["rank"] == 2 and "all_gather" in str(g)
    assert g.op_counts()["linear_silu_mul"] == 2 and "silu_mul" not in g.op_counts()  # fused again, as a worker does


@pytest.mark.parametrize("name,tp", [("h6-kv2", 2), ("qwen2", 4)])
def test_a_shards_swiglu_products_return_to_their_epilogues(artifacts, name, tp):
    """The sharding unfolds each gate/up projection's SwiGLU epilogue to split the MLP; fused again on each rank
    (its rows of both halves), the ranks still give the unsharded logits."""
    from llmc.passes.fuse_linear_epilogue import fuse_swiglu_epilogues
    g = artifacts[name].graph
    layers = g.op_counts()["linear_silu_mul"]
    assert layers >= 2
    ranks = [shard_graph(g.clone(), tp, r) for r in range(tp)]
    assert all(r.op_counts().get("linear_silu_mul", 0) == 0 for r in ranks)
    assert [fuse_swiglu_epilogues(r) for r in ranks] == [layers] * tp
    (want,) = Interpreter(g).run(step_inputs(g))
    for (got,) in run_ranks(ranks, step_inputs):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("name", ["h6-kv3-tied", "qwen2"])
def test_pipeline_stages_chain_to_the_whole_graph(artifacts, name):
    g = artifacts[name].graph
    (want,) = Interpreter(g).run(step_inputs(g))
    cut = split_stages(g, 2)
    assert len(cut.boundaries) == 1 and len(cut.boundaries[0]) == 2  # the residual and the normed hidden state
    carried = {}
    for s, stage in enumerate(cut.graphs):
        assert [v.name for v in stage.inputs if v.name.startswith("kv_cache.")] == [f"kv_cache.{s}"]
        outs = Interpreter(stage).run({**step_inputs(stage), **carried})
        carried = {v.name: t for v, t in zip(stage.outputs, outs)}
    assert torch.equal(outs[0], want)


def test_tensor_and_pipeline_parallel_together(artifacts):
    g = artifacts["h6-kv2"].graph
    (want,) = Interpreter(g).run(step_inputs(g))
    cuts = [split_stages(shard_graph(g.clone(), 2, r), 2) for r in range(2)]
    first = run_ranks([c.graphs[0] for c in cuts], step_inputs)
    stages = [c.graphs[1] for c in cuts]
    last = run_ranks(stages, lambda stage: {**step_inputs(stage),
                                            **dict(zip(cuts[0].boundaries[0], first[stages.index(stage)]))})
    assert (last[1][0] - want).abs().max() <= 1e-4 * want.abs().max()


def test_microbatches_cut_tokens_and_keep_logits_rows():
    seqs = [StepInput(list(range(10)), 3, [0, 1, 2, 3], 2, True), StepInput([7], 5, [4], 1),
            StepInput([8, 9, 10], 0, [5], 0, True)]
    runs = microbatches(seqs, 2)
    assert [sum(len(p.token_ids) for p in run) for run, _ in runs] == [7, 7]
    # the first run samples nothing: its last row is computed (the graph wants one) and not kept
    assert [(p.start_pos, len(p.token_ids), p.num_logits) for p in runs[0][0]] == [(3, 7, 1)]
    assert [(p.start_pos, len(p.token_ids), p.num_logits) for p in runs[1][0]] == [(10, 3, 2), (5, 1, 1), (0, 3, 0)]
    assert [keep for _, keep in runs] == [False, True]
    assert len(microbatches([StepInput([1], 0, [0])], 4)) == 1


def test_step_codec_round_trip():
    batch = StepBatch([StepInput([1, 2, 3], 4, [7, 8], 2, True), StepInput([9], 0, [], 0)],
                      swap_out=[(1, 2)], swap_in=[(3, 4), (5, 6)], copies=[(7, 8)], greedy=True)
    assert codec.decode(codec.encode(batch)) == (batch, [], False)
    feed = Feed(torch.zeros(3, dtype=torch.int64), [0, 5], [2, 1])
    assert codec.decode(codec.encode(batch, feed, launched=True)) == (batch, [(0, 2), (5, 1)], True)
    chain = StepBatch([StepInput([5, 0, 0], 9, [1], 3)], greedy=True, chain=True)  # multi-step's chains
    assert codec.decode(codec.encode(chain)) == (chain, [], False)
    buf = codec.message(codec.STEP, codec.encode(batch), 64)
    assert buf.shape == (64,) and buf[:2].tolist() == [codec.STEP, len(codec.encode(batch))]


def test_w8a8_codes_made_before_the_linears_shard_through_the_unfused_form(tmp_path):
    """A SmoothQuant artifact's fused activation quantization (rms_norm_quant, silu_mul_quant ▸
    qlinear_codes) is unfolded exactly before sharding; at TP=2 the row-parallel linears quantize
    their slice of the row with its own per-token scale, so the logits move by quantization noise."""
    import llmc
    from llmc.ir.act_quant import unfuse_act_quant
    art = llmc.compile(make_model_dir(tmp_path, "llama"), tmp_path / "sq.llmc",
                       quant={"method": "smoothquant", "calib_samples": 4, "calib_len": 32})
    g = art.graph
    assert g.op_counts().get("qlinear_codes")
    (want,) = Interpreter(g).run(step_inputs(g))
    plain = g.clone()
    assert unfuse_act_quant(plain) > 0 and "qlinear_codes" not in plain.op_counts()
    assert torch.equal(Interpreter(plain).run(step_inputs(plain))[0], want)
    for got in sharded_logits(g, 2):
        err = (got - want).abs().max() / want.abs().max()
        assert 0 < err <= 0.05, err  # 0 would mean the row-parallel linears did not requantize their slices


class _FakeGraphs:
    """Step graphs that fit only decode steps (as graph_kind's decode buckets do) and record the calls."""

    def __init__(self):
        self.calls, self.feeds = [], []

    def run(self, seqs, greedy, feed=None):
        self.calls.append((len(seqs), greedy))
        self.feeds.append(None if feed is None else (feed.dst, feed.src, feed.tokens.tolist()))
        if any(len(s.token_ids) > 1 for s in seqs):
            return None
        return torch.arange(len(seqs)) + 100 if greedy else torch.ones(len(seqs), 8)

    def captured(self, seqs):
        return None if any(len(s.token_ids) > 1 for s in seqs) else True


class _FakeExecutor:
    def __init__(self):
        self.step_graphs, self.eager = _FakeGraphs(), 0
        self.graph = SimpleNamespace(inputs=[])

    def _begin(self, batch):  # no block moves here
        return batch.seqs

    def build_inputs(self, seqs):
        return {}

    def outputs(self, inputs, seqs):
        self.eager += 1
        return [torch.zeros(sum(s.num_logits for s in seqs), 8)]


def _stage(rank: int, pp: int = 1):
    from llmc.runtime.distributed.worker import PipelineStage, WorkerSpec
    spec = WorkerSpec(artifact="-", rank=rank, tp=2, pp=pp, expert_parallel=False, store_port=0, backend="cuda",
                      block_size=16, num_blocks=8, kv_cache_dtype="auto", memory_fraction=0.5, num_cpu_blocks=0,
                      max_model_len=64, step_timeout_s=1.0, capacity=64, cuda_graphs=True)
    return PipelineStage(spec, _FakeExecutor(), {}, control=None)


def test_tensor_parallel_worker_replays_step_graphs_on_every_rank():
    decode = StepBatch([StepInput([5], 3, [0], 1), StepInput([6], 7, [1], 1)], greedy=True)
    r0, r1 = _stage(0), _stage(1)
    # every rank replays (its collectives are inside the graph) and holds the tokens (a next step's Feed);
    # TP rank 0 sends them to the driver (serve)
    assert r0.step(decode).tolist() == r1.step(decode).tolist() == [100, 101]
    assert r0.ex.step_graphs.calls == r1.ex.step_graphs.calls == [(2, True)] and r0.ex.eager == r1.ex.eager == 0
    # or logits rows, as float32
    assert r0.step(StepBatch(decode.seqs)).shape == (2, 8)
    # a step no graph fits runs eagerly, on every rank alike
    prefill = StepBatch([StepInput([1, 2, 3], 0, [2], 1, True), StepInput([7], 4, [3], 1)], greedy=True)
    assert r0.step(prefill).tolist() == [0, 0] and r0.ex.eager == 1
    assert r1.step(prefill).tolist() == [0, 0] and r1.ex.eager == 1


class _ScriptedControl:
    """The driver's side of the control group, scripted: each broadcast the worker waits on receives the next
    message; every receive and send is logged in order."""

    def __init__(self, messages):
        self.messages, self.log = list(messages), []

    def broadcast(self, bufs, opts):
        op, payload = self.messages.pop(0)
        bufs[0][:codec.HEADER + len(payload)] = torch.tensor([op, len(payload), *payload])
        self.log.append(("recv", op))
        return SimpleNamespace(wait=lambda *a: None)

    def send(self, tensors, dst, tag):
        self.log.append(("send", tensors[0].tolist()))
        return SimpleNamespace(wait=lambda *a: None)


def test_worker_returns_a_launched_steps_result_only_after_the_next_step_or_a_flush():
    """A result sent while the driver broadcasts leaves both waiting (gloo's send waits for its receive), so
    worker 0 sends a launched step's result only once the next step is enqueued, or on FLUSH; the next step
    is fed the launched step's argmax rows from the worker's device."""
    decode = [StepInput([5], 3, [0], 1), StepInput([6], 7, [1], 1)]
    launched = StepBatch(decode, greedy=True)
    fed = StepBatch([StepInput([0], 4, [0], 1), StepInput([0], 8, [1], 1)], greedy=True)
    control = _ScriptedControl([
        (codec.STEP, codec.encode(launched, launched=True)),
        (codec.STEP, codec.encode(fed, Feed(None, [0, 1], [1, 0]), launched=True)),
        (codec.FLUSH, []),
        (codec.STEP, codec.encode(launched)),  # waited for: its result at once
        (codec.STOP, []),
    ])
    r0 = _stage(0)
    r0.control = control
    r0.serve()
    assert control.log == [("recv", codec.STEP), ("recv", codec.STEP), ("send", [100, 101]),
                           ("recv", codec.FLUSH), ("send", [100, 101]),
                           ("recv", codec.STEP), ("send", [100, 101]), ("recv", codec.STOP)]
    assert r0.ex.step_graphs.feeds == [None, ([0, 1], [1, 0], [100, 101]), None]


def test_tune_shard_times_only_the_shapes_the_artifact_lacks(artifacts, monkeypatch, tmp_path):
    """A rank's linears (N/TP rows, K/TP columns) are tuned at load; the artifact's own choices stand, the new
    ones join them (and the per-GPU tuning cache), and an artifact tuned on another GPU is left alone."""
    import llmc.codegen.autotune as autotune
    import llmc.compiler as compiler
    from llmc.codegen.matmul import MatmulSpec
    g = artifacts["h6-kv2"].graph
    shard = shard_graph(g.clone(), 2, 0)

    def key(n):
        w = n.inputs[1].type
        return MatmulSpec(w.dtype, len(n.inputs) > 2, ()).key(int(w.shape[0]), int(w.shape[1]))

    full = {key(n) for n in g.nodes if n.op == "linear"}
    mine = {key(n) for n in shard.nodes if n.op == "linear"}
    assert mine - full  # the shard's shapes are new
    rec = {"config": {"BLOCK_N": 64}, "triton_ms": 1.0, "cublas_ms": 2.0, "prefer_cublas": False}
    tuning = {"format": autotune.FORMAT, "device": "GPU-A", "triton": "3", "joint_buckets": ["1"],
              "kernels": {k: {"1": dict(rec)} for k in full}}
    timed = []

    def fake_tune(graph, tuner, bar):  # what _tune_kernels does on a GPU (linears): time each key with no record
        for n in graph.nodes:
            if n.op == "linear":
                k = key(n)
                tuner.used.add(k)
                if tuner.lookup(k, "1") is None:
                    timed.append(k)
                    tuner.records.setdefault(k, {})["1"] = {**rec, "config": {"BLOCK_N": 32}}

    monkeypatch.setattr(compiler, "_tune_kernels", fake_tune)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(autotune, "_device_name", lambda: "GPU-A")
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "cache_file", lambda device, joint: tmp_path / "tuning-cache.json")
    out = compiler.tune_shard(shard, tuning)
    assert set(timed) == mine - full and out["device"] == "GPU-A"
    assert all(out["kernels"][k]["1"]["config"] == {"BLOCK_N": 64} for k in full & mine)
    assert all(out["kernels"][k]["1"]["config"] == {"BLOCK_N": 32} for k in mine - full)
    assert set(autotune.Tuner.load(tmp_path / "tuning-cache.json").records) >= mine - full
    timed.clear()  # the second load on this machine finds them in the cache
    compiler.tune_shard(shard, tuning)
    assert timed == []
    monkeypatch.setattr(autotune, "_device_name", lambda: "GPU-B")
    assert compiler.tune_shard(shard, tuning) is tuning


def test_resizing_a_workers_cache_frees_the_first_before_making_the_second(artifacts, monkeypatch):
    """Ranks agree on the smallest cache; a rank that made a larger one drops every reference to it (the
    step graphs' too) before the second is allocated, or the GPU would have to hold both at once."""
    import gc
    import weakref

    import llmc.runtime.distributed.worker as worker
    from llmc.runtime.executor import make_executor
    ex = make_executor(artifacts["h6-kv2"].graph, "reference", "cpu", 4, 16)

    class Graphs:  # the step-graph cache's hold on the cache tensors
        def __init__(self):
            self.kv = ex.kv

    ex.step_graphs = Graphs()
    first = [weakref.ref(t) for t in ex.kv.values()]
    made = worker.KVCache

    def check(*args):
        gc.collect()
        assert all(r() is None for r in first), "the first cache is still alive"
        return made(*args)

    monkeypatch.setattr(worker, "KVCache", check)
    worker.resize_cache(ex, 9, 0.5, 0)
    assert ex.num_blocks == 9 and ex.cache.num_blocks == 9
    assert ex.step_graphs.kv.keys() == ex.kv.keys() and all(a is b for a, b in zip(ex.step_graphs.kv.values(),
                                                                                ex.kv.values()))


def test_every_tensor_parallel_rank_runs_rank_zeros_tuning_choices(monkeypatch):
    """Rank 0 of a stage tunes its shard and hands the choices on; the others start from them (timing only
    what rank 0 did not have), so that every rank runs the same kernels."""
    import json

    import llmc.compiler as compiler
    from llmc.runtime.distributed.worker import WorkerSpec, shard_tuning

    class Store(dict):
        def set(self, k, v):
            self[k] = v.encode()

        def get(self, k):
            return self[k]

    seen = []

    def fake(graph, tuning):  # rank 0 chooses "a"; a later rank keeps what it is given and adds its own shapes
        seen.append((graph, tuning))
        return {**tuning, "kernels": {**tuning["kernels"], f"k-{graph}": {"1": {"config": {"choice": graph}}}}}

    monkeypatch.setattr(compiler, "tune_shard", fake)
    store, art = Store(), {"kernels": {}}
    def spec(rank):
        return WorkerSpec(artifact="-", rank=rank, tp=2, pp=2, expert_parallel=False, store_port=0, backend="cuda",
                          block_size=16, num_blocks=None, kv_cache_dtype="auto", memory_fraction=0.5,
                          num_cpu_blocks=0, max_model_len=64, step_timeout_s=1.0, capacity=64)
    t0 = shard_tuning(spec(2), store, "r0", art)  # stage 1's rank 0
    t1 = shard_tuning(spec(3), store, "r1", art)  # stage 1's rank 1
    assert set(store) == {"tuning/1"} and json.loads(store["tuning/1"]) == t0
    assert seen[1] == ("r1", t0) and t1["kernels"]["k-r0"] == t0["kernels"]["k-r0"]


def _two_sums(body_or_op, out: str = "v2"):
    """A graph of two partial sums p, q (each all_reduced) and a replicated r [T, 4] read by `body_or_op`: an
    elementwise op name (over the two sums) or a fused region's body over (in0 = r, in1 = sum p, in2 = sum q)
    that returns its value `out`."""
    from llmc.ir.graph import Graph
    from llmc.ir.types import TensorType
    g = Graph("sums")
    g.add_dim("T", 1, None)
    p, q, r = (g.add_input(n, TensorType(("T", 4), "f32")) for n in "pqr")
    sp, sq = (g.call("all_reduce", v, group="tp") for v in (p, q))
    if isinstance(body_or_op, str):
        g.outputs = [g.call(body_or_op, sp, sq)]
    else:
        g.outputs = [g.call("fused", r, sp, sq, kind="elementwise", body=body_or_op, outputs=[out])]
    return g


GATED = [["v0", "sigmoid", ["in0"], {}], ["v1", "mul", ["v0", "in1"], {}], ["v2", "add", ["in2", "v1"], {}]]


@pytest.mark.parametrize("case, merged", [
    ("add", 1), ("sub", 1), ("mul", 0), ("maximum", 0),
    (GATED, 1),  # Qwen2-MoE: experts + sigmoid(gate) * shared expert
    ([["v0", "cast", ["in1"], {"dtype": "bf16"}], ["v1", "neg", ["in2"], {}], ["v2", "sub", ["v0", "v1"], {}]], 1),
    ([["v0", "add", ["in1", "in2"], {}], ["v1", "mul", ["v0", "v0"], {}], ["v2", "neg", ["v1"], {}]], 0),
    ([["v0", "add", ["in1", "in2"], {}], ["v1", "neg", ["v0"], {}], ["v2", "add", ["v1", "in0"], {}]], 0),  # + r
    ([["v0", "div", ["in0", "in1"], {}], ["v1", "neg", ["v0"], {}], ["v2", "add", ["v1", "in2"], {}]], 0),  # r / sum
])
def test_one_all_reduce_after_an_op_linear_in_the_sums(case, merged):
    """merge_reductions moves the all_reduce after an op only where that op is linear in the ranks' partial
    sums (a replicated term or a product of two sums would change the result), and the ranks' results are the
    unmerged graph's."""
    from llmc.ir.sharding import merge_reductions
    g = _two_sums(case)
    want = g.clone()
    assert merge_reductions(g) == merged
    assert g.op_counts()["all_reduce"] == 2 - merged
    if merged:
        (ar,) = [n for n in g.nodes if n.op == "all_reduce"]
        assert g.outputs == [ar.out] and ar.inputs[0].producer.inputs[-2:] == [v for v in g.inputs[:2]]
    _ranks_agree(g, want, 0, 2 ** -7 if "bf16" in str(case) else 1e-6)  # bf16: each rank's part is rounded


def _ranks_agree(g, want, seed: int, tol: float) -> None:
    """g and want (the unmerged graph) give the same result on two thread ranks, with r replicated."""
    torch.manual_seed(seed)
    ins = [{n: torch.rand(3, 4) + 1 for n in "pqr"} for _ in range(2)]  # in [1, 2): no division near zero
    ins[1]["r"] = ins[0]["r"]
    got = run_ranks([g, g.clone()], lambda graph, it=iter(ins): next(it))
    ref = run_ranks([want, want.clone()], lambda graph, it=iter(ins): next(it))
    for (x,), (y,) in zip(got, ref):  # a random region may divide by its own zero: NaN and inf where the reference is
        scale = float(y.float().nan_to_num(0.0, 0.0, 0.0).abs().max())
        torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol * scale, equal_nan=True)


def test_merging_reductions_never_changes_what_a_random_region_computes():
    """200 random elementwise regions over a replicated r and two sums: wherever merge_reductions moves the
    all_reduce after the region, the ranks' results are the unmerged graph's (and it does for some, not all)."""
    import random

    from llmc.ir.sharding import merge_reductions
    rng, outcomes = random.Random(0), set()
    for seed in range(200):
        names, body = ["in0", "in1", "in2"], []
        for i in range(rng.randint(1, 5)):
            op = rng.choice(["add", "sub", "mul", "div", "neg", "sigmoid", "cast"])
            args = [rng.choice(names) for _ in range(1 if op in ("neg", "sigmoid", "cast") else 2)]
            body.append([f"v{i}", op, args, {"dtype": "f32"} if op == "cast" else {}])
            names.append(f"v{i}")
        g = _two_sums(body, out=body[-1][0])
        want = g.clone()
        merged = merge_reductions(g)
        outcomes.add(merged)
        _ranks_agree(g, want, seed, 1e-5)
    assert outcomes == {0, 1}
