"""Multi-step decoding (`multi_step=k`): k greedy decode steps per engine step, each step's tokens fed to the
next by the executor. The tokens must be exactly those of single steps, whatever cuts a chain short
(max_tokens, a stop string, the end of the context, the step's token budget, preemption)."""
import pytest

from llmc.errors import LLMCError
from llmc.runtime.llm import LLM, SamplingParams
from tests.conftest import CODE_PROMPTS


def generate(art, k: int, prompts, params, **options):
    with LLM(art, backend="reference", multi_step=k, **options) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.stats()
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs], \
            llm.engine.num_steps, stats


def test_chains_give_the_tokens_of_single_steps(tiny_py_artifact):
    prompts = CODE_PROMPTS[:4]
    # lengths that are no multiple of k, a stop string, and eos left on
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (37, 64, 5)] + \
        [SamplingParams(temperature=0, max_tokens=64, stop=["\n\n"])]
    one, steps1, _ = generate(tiny_py_artifact, 1, prompts, params, num_blocks=64, block_size=8)
    four, steps4, stats = generate(tiny_py_artifact, 4, prompts, params, num_blocks=64, block_size=8)
    assert four == one
    assert steps4 < steps1 / 2  # the decode steps ran 4 to an engine step
    assert stats["blocks_used"] == 0  # the placeholders' slots past a stop went back


def test_chains_stop_at_the_context_and_under_preemption(tiny_py_artifact):
    prompts = CODE_PROMPTS[:6]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # a 48-token context ends every sequence mid-chain; 14 blocks of 8 cannot hold six sequences at once
    opts = dict(num_blocks=14, block_size=8, max_model_len=48, max_num_seqs=6)
    one, _, _ = generate(tiny_py_artifact, 1, prompts, params, **opts)
    five, _, stats = generate(tiny_py_artifact, 5, prompts, params, **opts)
    assert stats["num_preemptions"] > 0
    assert five == one and all(r == "length" for _, r, _ in five)


def test_sampling_requests_step_one_at_a_time_and_full_slots_still_chain(tiny_py_artifact):
    prompts = CODE_PROMPTS[:3]
    mixed = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 2 + \
        [SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True)]
    one, steps1, _ = generate(tiny_py_artifact, 1, prompts, mixed, num_blocks=64)
    four, steps4, _ = generate(tiny_py_artifact, 4, prompts, mixed, num_blocks=64)
    assert four == one and steps4 == steps1  # a sampled token is not an argmax: no chains
    # two sequence slots for three requests: while one waits with a slot free (after the first finishes)
    # nothing chains; while both slots run, the waiting one cannot be admitted anyway, and chains go on
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one, steps1, _ = generate(tiny_py_artifact, 1, prompts, greedy, num_blocks=64, max_num_seqs=2)
    four, steps4, _ = generate(tiny_py_artifact, 4, prompts, greedy, num_blocks=64, max_num_seqs=2)
    assert four == one and steps4 < steps1 / 2


@pytest.mark.parametrize("options, needle", [
    ({"multi_step": 0}, "multi_step must be an integer >= 1"),
    ({"multi_step": 2, "speculative": {"method": "ngram"}}, "multi_step and speculative decoding"),
    ({"multi_step": 2, "pipeline_parallel_size": 2}, "multi_step runs on one pipeline stage"),
])
def test_bad_options_are_one_clear_error(tiny_py_artifact, options, needle):
    with pytest.raises(LLMCError, match=needle):
        LLM(tiny_py_artifact, backend="reference", num_blocks=16, **options)


def test_the_cli_flag(tiny_py_artifact):
    from tests.test_cli import cli
    args = ("run", str(tiny_py_artifact.path), "--prompt", "def fib(n):", "--max-tokens", "24", "--temperature", "0",
            "--backend", "reference", "--num-blocks", "32")
    code1, one = cli(*args)
    code4, four = cli(*args, "--multi-step", "4")
    assert code1 == code4 == 0 and four == one
    code, out = cli(*args, "--multi-step", "0")
    assert code != 0 and "--multi-step must be >= 1" in out


def test_bench_counts_time_per_token_where_outputs_carry_several(tiny_py_artifact):
    from llmc.bench import bench
    r1 = bench(tiny_py_artifact, "decode", num_requests=1, backend="reference", num_blocks=40)
    r8 = bench(tiny_py_artifact, "decode", num_requests=1, backend="reference", num_blocks=40, multi_step=8)
    # outputs of 8 tokens: the gap between them is ~8 steps, the time per token is still one step's
    assert r8["itl_ms_p50"] > 4 * r1["itl_ms_p50"]
    assert r8["tpot_ms_p50"] < 2 * r1["tpot_ms_p50"]


def test_a_graph_chain_feeds_each_step_its_previous_tokens(tiny_py_artifact, cpu_step_graphs):
    """`StepGraphCache.run_chain`, the GPU's path, on the CPU: its graph replaced by a stand-in that reruns
    the captured step on the same buffers. Its k steps (positions moved on, each step's input ids copied
    from the last step's output buffer) give the tokens of the executor's step-by-step chain."""
    from llmc.runtime.executor import StepBatch, StepInput, make_executor

    prompts = [[5, 17, 3, 200, 41, 9, 77], [250, 6, 1, 90]]
    tables = [[0, 1, 2], [3, 4, 5]]
    executors = [make_executor(tiny_py_artifact.graph, "reference", num_blocks=8, block_size=8) for _ in range(2)]
    for ex in executors:
        first = ex.execute(StepBatch([StepInput(p, 0, t, 1, True) for p, t in zip(prompts, tables)], greedy=True))
    t0 = first.tokens.tolist()
    k = 4
    want = executors[0].chain([StepInput([t, 0, 0, 0], len(p), tb, k) for t, p, tb in zip(t0, prompts, tables)])
    graphs = cpu_step_graphs(executors[1], 24)
    got = graphs.run_chain([StepInput([t], len(p), tb, 1) for t, p, tb in zip(t0, prompts, tables)], k)
    assert got.shape == (2, k) and got.flatten().tolist() == want.tolist()
    assert len(set(got.flatten().tolist())) > 1  # the chain moved on (not one token over and over)
