"""Mixture of experts under tensor and expert parallelism: tiny Mixtral, Qwen2-MoE and Qwen3-MoE.

Ranks as threads (ThreadGroup) check the rewrite against the unsharded graph on the same two-prompt
prefill (fp32, 1e-4): experts split by expert (EP) and each expert split by its intermediate size
(TP), an expert count that 2 does not divide, and EP with pipeline stages. Then one gang of two gloo
workers per architecture runs EP=2 end to end against Hugging Face's greedy tokens.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import llmc
from llmc import LLM, SamplingParams
from llmc.ir.interpreter import Interpreter
from llmc.ir.kv_layout import kv_cache_inputs
from llmc.ir.sharding import ShardError, shard_graph
from llmc.ir.stages import split_stages
from tests.conftest import hf_greedy, hf_model, save_random_model
from tests.distributed.conftest import run_ranks
from tests.distributed.test_sharding import step_inputs
from tests.distributed.test_workers import assert_logits_match
from tests.frontend.test_moe import MOE_ARCHS, make_moe_config, make_moe_dir
from tests.test_cli import assert_clean_error, cli

PROMPTS = [[5, 17, 99, 3, 250, 41], [7, 7, 120], list(range(20, 41))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
OPTIONS = dict(num_blocks=64, block_size=4, backend="reference")


def make_five_experts_dir(root: Path) -> Path:
    """Mixtral with 5 experts (2 + 3 at EP=2) and 8 heads (so that 8 ranks split the attention and meet
    fewer experts than ranks)."""
    from transformers import MixtralConfig
    cfg = MixtralConfig(**{**make_moe_config("mixtral").to_dict(), "num_local_experts": 5, "num_attention_heads": 8,
                           "head_dim": 8})
    return save_random_model(root / "mixtral_e5", cfg)


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """arch -> (HF directory, artifact on disk), compiled on first use."""
    root, done = tmp_path_factory.mktemp("moe_parallel"), {}

    def get(arch: str):
        if arch not in done:
            path = make_five_experts_dir(root) if arch == "mixtral_e5" else make_moe_dir(root, arch)
            done[arch] = path, llmc.compile(path, root / f"{arch}.llmc")
        return done[arch]
    return get


def assert_ranks_match(g, tp: int, expert_parallel: bool) -> list:
    (want,) = Interpreter(g).run(step_inputs(g))
    ranks = [shard_graph(g.clone(), tp, r, expert_parallel) for r in range(tp)]
    for (got,) in run_ranks(ranks, step_inputs):
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-4 * want.abs().max()
    return ranks


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep", "tp"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_every_rank_gives_the_unsharded_logits(arts, arch, expert_parallel):
    ranks = assert_ranks_match(arts(arch)[1].graph, 2, expert_parallel)
    g = ranks[1]
    moe = next(n for n in g.nodes if n.op == "moe")
    users = g.users()
    if arch == "qwen2_moe":  # experts plus the gated shared expert, summed over the ranks by one all_reduce
        (mix,) = users[moe.out]
        assert mix.op == "fused" and [u.op for u in users[mix.out]] == ["all_reduce"]
        shared_down = next(v.producer for v in mix.inputs if v is not moe.out and v.producer.op == "linear")
        assert [u.op for u in users[shared_down.out]] == ["fused"]
        assert g.meta["tensor_parallel"]["merged_reductions"] == 1
    else:
        assert [u.op for u in users[moe.out]] == ["all_reduce"]
    # one all_reduce after each attention, one after each MLP or MoE block
    assert g.op_counts()["all_reduce"] == 2 * len(kv_cache_inputs(g))
    assert moe.inputs[1].type.shape == (4, 64)  # the router stays whole: every rank routes every token
    if expert_parallel:  # rank 1 holds experts 2 and 3, whole
        assert moe.attrs["expert_start"] == 2 and moe.inputs[2].type.shape == (2, 96, 64)
    else:  # every expert, half of its intermediate columns
        assert moe.attrs["expert_start"] == 0 and moe.inputs[2].type.shape == (4, 48, 64)
        assert moe.inputs[3].type.shape == (4, 64, 24)
    tp = g.meta["tensor_parallel"]
    assert (tp["expert_parallel"], tp["moe"]) == (expert_parallel, g.op_counts()["moe"])
    # Qwen2-MoE's shared-expert gate is one column of the fused gate/up linear: every rank keeps it whole
    shared = ["model.layers.0.mlp.fused_weight[0:1]"] if arch == "qwen2_moe" else []
    assert tp["replicated"] == shared


def test_an_expert_count_that_does_not_divide(arts):
    g = arts("mixtral_e5")[1].graph
    for tp in (2, 4):
        ranks = assert_ranks_match(g, tp, expert_parallel=True)
        held = [[(n.attrs["expert_start"], n.inputs[2].type.shape[0]) for n in r.nodes if n.op == "moe"][0]
                for r in ranks]
        assert held == ([(0, 2), (2, 3)] if tp == 2 else [(0, 1), (1, 1), (2, 1), (3, 2)])
    assert_ranks_match(g, 2, expert_parallel=False)
    with pytest.raises(ShardError, match=r"^expert parallel size 8 is larger than the 5 experts of MoE layer 0; "
                                         r"use at most 5 ranks"):
        shard_graph(g.clone(), 8, 0, expert_parallel=True)


def test_expert_and_pipeline_parallel_together(arts):
    g = arts("qwen2_moe")[1].graph  # stage 0: the MoE layer (with its shared expert), stage 1: the dense one
    (want,) = Interpreter(g).run(step_inputs(g))
    cuts = [split_stages(shard_graph(g.clone(), 2, r, expert_parallel=True), 2) for r in range(2)]
    first = run_ranks([c.graphs[0] for c in cuts], step_inputs)
    stages = [c.graphs[1] for c in cuts]
    last = run_ranks(stages, lambda stage: {**step_inputs(stage),
                                            **dict(zip(cuts[0].boundaries[0], first[stages.index(stage)]))})
    assert (last[0][0] - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_parallel_workers_give_hf_greedy_tokens(arts, arch):
    path, art = arts(arch)
    m = hf_model(path)
    want = [hf_greedy(m, p, GREEDY.max_tokens) for p in PROMPTS]
    assert [o.token_ids for o in LLM(art, **OPTIONS).generate(PROMPTS, GREEDY)] == want
    with LLM(art, tensor_parallel_size=2, expert_parallel=True, **OPTIONS) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        assert_logits_match(llm.engine.executor, art)


@pytest.mark.slow
def test_expert_parallel_workers_on_the_generated_kernels(arts):
    """EP=2 workers on the kernel plan (the GPU path: the grouped-GEMM expert kernels over each rank's
    experts, under Triton's interpreter here) give Hugging Face's greedy tokens."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the triton-interpret backend needs TRITON_INTERPRET=1 (this run compiles for a GPU)")
    path, art = arts("qwen2_moe")
    want = [hf_greedy(hf_model(path), p, GREEDY.max_tokens) for p in PROMPTS]
    with LLM(art, tensor_parallel_size=2, expert_parallel=True, **{**OPTIONS, "backend": "triton-interpret"}) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_cli_expert_parallel_errors(arts, odd_heads_artifact):
    moe = arts("mixtral")[1].path
    assert_clean_error(*cli("run", moe, "--prompt", "x", "--expert-parallel"), "tensor_parallel_size >= 2")
    assert_clean_error(*cli("run", odd_heads_artifact.path, "--prompt", "x", "-tp", "2", "--expert-parallel"),
                       "no mixture-of-experts layers")
    code, out = cli("serve", "--help")
    assert code == 0 and "--expert-parallel" in out
