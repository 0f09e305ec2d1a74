"""The paged-KV engine end to end on a tiny Llama: batching, preemption, prefix caching, chunked
prefill, n > 1 sampling, int8 KV cache and bad requests, each checked against generating alone and
against Hugging Face."""
import pytest
import torch

from llmc.errors import RequestError
from llmc.runtime.llm import LLM, SamplingParams
from tests.conftest import CODE_PROMPTS, hf_greedy, hf_model, prefill_graph_matches_eager

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts12(tok):
    words = ["def", " add", "(a", ", b", "):", "\n    return", " a", " +", " b", "\n", "class", " Point"]
    return [tok.encode("".join(words[: 2 + i]) * (1 + i % 3), add_special_tokens=False) for i in range(12)]


@pytest.fixture(scope="module")
def tok(llama_artifact):
    return llama_artifact.tokenizer()


@pytest.fixture(scope="module")
def alone(llama_artifact, tok):
    llm = LLM(llama_artifact, num_blocks=64, block_size=4)
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts12(tok)]


def test_batched_with_preemption_equals_alone_and_hf(llama_artifact, llama_dir, tok, alone):
    ps = prompts12(tok)
    # 4 sequences at a time and 24 blocks of 4 slots: the 4 longest reach ~110 slots, so decodes preempt
    llm = LLM(llama_artifact, max_num_seqs=4, num_blocks=24, block_size=4, max_num_batched_tokens=64)
    outs = llm.generate(ps, GREEDY)
    assert llm.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == alone
    m = hf_model(llama_dir)
    for p, o in zip(ps[:4], outs[:4]):
        assert o.token_ids == hf_greedy(m, p, 12)
    assert llm.stats()["blocks_used"] == 0


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}], ids=["plain", "ngram"])
def test_logit_bias_forces_and_bans_tokens_on_every_path(llama_artifact, tok, alone, spec):
    """A greedy request with a logit bias leaves the argmax-only path (overlapped and speculative steps included):
    +100 forces its token, -100 bans one; requests without a bias in the same steps keep their tokens."""
    ps = prompts12(tok)[:3]
    llm = LLM(llama_artifact, num_blocks=64, block_size=4, speculative=spec)
    banned = alone[1][0]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={7: 100.0}),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={banned: -100.0}), GREEDY]
    outs = llm.generate(ps, params)
    assert outs[0].token_ids == [7] * 12
    assert banned not in outs[1].token_ids and outs[1].token_ids != alone[1]
    assert outs[2].token_ids == alone[2]
    with pytest.raises(RequestError, match="logit_bias keys must be token ids"):
        llm.generate(ps[:1], SamplingParams(logit_bias={llama_artifact.info.vocab_size: 1.0}))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}], ids=["plain", "ngram"])
def test_min_tokens_holds_off_a_forced_end_of_sequence(llama_artifact, tok, spec):
    """The end of sequence made the certain choice (logit_bias) still waits for min_tokens, then ends the
    request; on speculative steps too, where the threshold may fall inside a verified draft."""
    eos = llama_artifact.info.eos_token_ids[0]
    llm = LLM(llama_artifact, num_blocks=64, block_size=4, speculative=spec)
    ps = prompts12(tok)[:2]
    params = [SamplingParams(temperature=0, max_tokens=12, min_tokens=m, logit_bias={eos: 100.0}) for m in (5, 0)]
    outs = llm.generate(ps, params)
    assert len(outs[0].token_ids) == 6 and outs[0].token_ids[-1] == eos and eos not in outs[0].token_ids[:-1]
    assert outs[0].finish_reason == "stop" and outs[1].token_ids == [eos]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}], ids=["plain", "ngram"])
def test_logits_processors_see_every_token_before_theirs(llama_artifact, tok, alone, spec):
    """A processor that reads the history (next = last + 1) gets each request's real tokens, never a stand-in for
    one still on the device: its request waits for them, beside plain greedy ones that overlap."""
    vocab = llama_artifact.info.vocab_size

    def successor(ids, row):
        out = torch.full_like(row, float("-inf"))
        out[(ids[-1] + 1) % vocab if ids else 5] = 0.0
        return out
    llm = LLM(llama_artifact, num_blocks=64, block_size=4, speculative=spec)
    ps = prompts12(tok)[:2]
    chained = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logits_processors=[successor])
    outs = llm.generate(ps, [chained, GREEDY])
    assert outs[0].token_ids == list(range(5, 17)) and outs[1].token_ids == alone[1]


def test_generate_queues_longest_first(llama_artifact, tok):
    """The call ends with its last request: queued first, the long one runs beside the short ones instead of
    alone after them, so the call takes fewer steps; outputs, ids and their order are those of the prompts."""
    ps = prompts12(tok)[:5]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 4, 4, 4, 20)]
    runs = {}
    for longest_first in (False, True):
        llm = LLM(llama_artifact, max_num_seqs=2, num_blocks=64, block_size=4, overlap=False)
        outs = llm.generate(ps, params, longest_first=longest_first)
        assert [o.request_id for o in outs] == [f"req-{i}" for i in range(5)]
        runs[longest_first] = ([o.token_ids for o in outs], llm.stats()["steps"])
    assert [len(t) for t in runs[True][0]] == [4, 4, 4, 4, 20]
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] <= 21 < 28 <= runs[False][1]


def test_max_prefill_tokens_sizes_the_steps_without_decodes(llama_artifact, tok, alone):
    """A lone prompt takes max_prefill_tokens a step; once a sequence decodes, steps keep to the smaller budget."""
    ps = prompts12(tok)
    steps = []
    for extra in ({}, {"max_prefill_tokens": 128}):
        llm = LLM(llama_artifact, max_num_batched_tokens=8, num_blocks=64, block_size=4, overlap=False,
                  enable_prefix_caching=False, **extra)
        assert llm.engine.scheduler.config.max_prefill_tokens == extra.get("max_prefill_tokens")
        assert [o.token_ids for o in llm.generate([ps[11]], GREEDY)] == [alone[11]]
        steps.append(llm.stats()["steps"])
    assert 8 < len(ps[11]) <= 128 and steps == [-(-len(ps[11]) // 8) + 11, 1 + 11]
    eng = llm.engine
    eng.add_request(ps[11], GREEDY, "a")
    eng.step()  # the whole prompt, and a's first token
    eng.add_request(ps[10], GREEDY, "b")
    eng.step()
    assert eng.scheduler.groups["b"].leader.num_computed_tokens == 7  # 8 tokens: a's decode and 7 of b's


def test_paced_prompts_opt_in(llama_artifact, tok, alone, monkeypatch):
    """LLMC_PACE_PROMPTS=1: steps with decodes at the smallest timed GEMM size (256 where the compile timed
    none), grown with the prompts' pace; a step without takes the default budget; the tokens are the same."""
    monkeypatch.setenv("LLMC_PACE_PROMPTS", "1")
    llm = LLM(llama_artifact, num_blocks=64, block_size=4)
    c = llm.engine.scheduler.config
    assert (c.max_num_batched_tokens, c.max_prefill_tokens, c.pace_prompts) == (256, 2048, 2.0)
    assert [o.token_ids for o in llm.generate(prompts12(tok), GREEDY)] == alone
    from llmc.runtime.config import paced_floor
    assert paced_floor({"token_budget": {"gemm_ms": {"512": 2.0, "128": 1.0}}}) == 128
    assert paced_floor({"token_budget": {"tokens": 512}}) == paced_floor(None) == 256


def test_swap_preemption_gives_same_outputs(llama_artifact, tok, alone):
    llm = LLM(llama_artifact, max_num_seqs=4, num_blocks=24, block_size=4, max_num_batched_tokens=64,
              preemption_mode="swap", num_cpu_blocks=64)
    outs = llm.generate(prompts12(tok), GREEDY)
    assert llm.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == alone


def test_chunked_prefill_gives_same_outputs(llama_artifact, tok, alone):
    llm = LLM(llama_artifact, max_num_batched_tokens=5, num_blocks=64, block_size=4)
    assert [o.token_ids for o in llm.generate(prompts12(tok), GREEDY)] == alone


def test_prefix_cache_computes_shared_prefix_once(llama_artifact, tok):
    prefix = list(range(1, 13))  # 3 full blocks of 4
    a, b = prefix + [20, 21], prefix + [30, 31, 32]
    ref = LLM(llama_artifact, num_blocks=64, block_size=4, enable_prefix_caching=False)
    want = [ref.generate([p], GREEDY)[0].token_ids for p in (a, b)]
    llm = LLM(llama_artifact, num_blocks=64, block_size=4)
    first = llm.generate([a], GREEDY)[0].token_ids
    second = llm.generate([b], GREEDY)[0].token_ids
    assert [first, second] == want
    assert llm.stats()["prefix_cache_hit_tokens"] == 12


def test_n4_sampling_shares_prompt_blocks_and_repeats_with_seed(llama_artifact, tok):
    prompt = tok.encode("def add(a, b):\n    return", add_special_tokens=False)
    params = SamplingParams(n=4, temperature=1.0, top_k=50, seed=1234, max_tokens=8, ignore_eos=True)
    llm = LLM(llama_artifact, num_blocks=64, block_size=4)
    eng = llm.engine
    eng.add_request(prompt, params, "r")
    eng.step()  # prefill: the leader samples for all four and the siblings fork its blocks
    group = eng.requests["r"].group
    full = len(prompt) // 4
    for blk in group.seqs[0].block_table[:full]:
        assert eng.block_manager.ref_count(blk) == 4
    while eng.has_unfinished():
        eng.step()
    first = [s.output_token_ids for s in group.seqs]
    again = LLM(llama_artifact, num_blocks=64, block_size=4).generate([prompt], params)[0]
    assert [o.token_ids for o in again.outputs] == first
    assert len({tuple(t) for t in first}) > 1  # four real samples, not four copies


def test_int8_kv_cache_agrees_with_unquantized(tiny_py_artifact, capsys):
    """On the shipped trained model, 8 prompts x 64 greedy tokens.

    The issue's criterion: free-running greedy tokens equal to the unquantized cache's on >= 95% of
    positions. Free-running agreement compounds (one flipped near-tie changes every later token of
    that prompt), so teacher-forced agreement (each step's argmax on the unquantized run's own
    sequence), which measures the int8 cache itself, is checked as well (>= 99%)."""
    from llmc.runtime.executor import StepBatch, StepInput, make_executor
    tok = tiny_py_artifact.tokenizer()
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    full = LLM(tiny_py_artifact, num_blocks=256).generate(CODE_PROMPTS, params)
    q8 = LLM(tiny_py_artifact, num_blocks=256, kv_cache_dtype="int8").generate(CODE_PROMPTS, params)
    free = sum(x == y for a, b in zip(full, q8) for x, y in zip(a.token_ids, b.token_ids)) / 512
    r8 = make_executor(tiny_py_artifact.graph, num_blocks=256, kv_cache_dtype="int8")
    same, errs = 0, []
    for i, (prompt, out) in enumerate(zip(CODE_PROMPTS, full)):
        ids = tok.encode(prompt, add_special_tokens=False)
        seq, bt = ids + out.token_ids, list(range(16 * i, 16 * i + 16))
        logits = r8.execute(StepBatch([StepInput(ids, 0, bt)])).logits[0]
        preds = [int(logits.argmax())]
        for j in range(len(ids), len(seq) - 1):
            preds.append(int(r8.execute(StepBatch([StepInput([seq[j]], j, bt)])).logits[0].argmax()))
        same += sum(x == y for x, y in zip(preds, out.token_ids))
    forced = same / 512
    # the floor of the free-running measure: the same run with K/V merely stored in bf16
    from llmc.ir.kv_layout import kv_cache_inputs
    from llmc.artifact import Artifact
    g = tiny_py_artifact.graph.clone()
    for c in kv_cache_inputs(g):
        c.type = c.type.with_dtype("bf16")
    bf = LLM(Artifact(tiny_py_artifact.path, tiny_py_artifact.manifest, g), num_blocks=256).generate(CODE_PROMPTS, params)
    free_bf16 = sum(x == y for a, b in zip(full, bf) for x, y in zip(a.token_ids, b.token_ids)) / 512
    with capsys.disabled():
        print(f"\n[int8 KV, tiny-py] teacher-forced agreement {forced:.4f}, free-running agreement {free:.4f} "
              f"over 8 prompts x 64 tokens (a bf16 cache, free-running: {free_bf16:.4f})")
    assert forced >= 0.99
    assert free >= 0.95


def test_int8_paged_attention_logit_error(llama_artifact):
    from llmc.ir.interpreter import Interpreter
    from llmc.ir.paged_attention import scale_width
    from llmc.ir.types import torch_dtype
    from llmc.ir.kv_layout import kv_cache_inputs, set_kv_cache_dtype
    torch.manual_seed(0)
    ids = torch.randint(1, 300, (20,))
    errs = []
    for dt in ("auto", "int8"):
        g = set_kv_cache_dtype(llama_artifact.graph.clone(), dt)
        kv = {}
        for v in g.inputs:
            if v.name.startswith("kv_cache."):
                kv[v.name] = torch.zeros(2, 8, 4, v.type.shape[3], v.type.shape[4],
                                         dtype=torch.int8 if dt == "int8" else torch.float32)
            if v.name.startswith("kv_scale."):
                kv[v.name] = torch.zeros(8, v.type.shape[1], scale_width(kv_cache_inputs(g)[0].type.shape[4], 4),
                                         dtype=torch_dtype(v.type.dtype))
        (out,) = Interpreter(g).run(input_ids=ids, positions=torch.arange(20), query_start_loc=torch.tensor([0, 20], dtype=torch.int32),
                                    seq_lens=torch.tensor([20], dtype=torch.int32), block_tables=torch.arange(5, dtype=torch.int32)[None],
                                    slot_mapping=torch.arange(20), logits_indices=torch.arange(20), **kv)
        errs.append(out)
    rel = ((errs[0] - errs[1]).abs().max() / errs[0].abs().max()).item()
    print(f"[int8 KV, tiny llama] max relative logit error over a 20-token prefill: {rel:.2e}")
    assert 0 < rel < 0.05  # quantization changes logits a little, never a lot


def test_int8_graph_with_an_older_scale_layout_runs(llama_artifact):
    """A graph compiled with an int8 cache declares its kv_scale inputs; one written with an older
    layout ([2, NB, Hkv] f32) is retyped at load to the current one instead of failing mid-step."""
    from llmc.ir.paged_attention import scale_width
    from llmc.ir.types import TensorType
    from llmc.ir.kv_layout import kv_cache_inputs, set_kv_cache_dtype
    from llmc.runtime.executor import StepBatch, StepInput, make_executor
    g = set_kv_cache_dtype(llama_artifact.graph.clone(), "int8")
    for v in g.inputs:
        if v.name.startswith("kv_scale."):
            v.type = TensorType((2, "NB", v.type.shape[1]), "f32")
    r = make_executor(g, num_blocks=8, block_size=4, kv_cache_dtype="int8")
    D = kv_cache_inputs(g)[0].type.shape[4]
    assert r.kv["kv_scale.0"].shape == (8, r.kv["kv_cache.0"].shape[3], scale_width(D, 4))
    assert r.execute(StepBatch([StepInput([1, 2, 3, 4, 5], 0, [0, 1])])).logits.shape[0] == 1


def test_bad_requests_rejected_without_disturbing_others(llama_artifact, tok, alone):
    ps = prompts12(tok)[:3]
    llm = LLM(llama_artifact, num_blocks=64, block_size=4)
    eng = llm.engine
    ids = [eng.add_request(p, GREEDY) for p in ps]
    eng.step()
    eng.step()
    bad = [
        (list(range(1, 200)), GREEDY, "context"),
        (ps[0], SamplingParams(max_tokens=0), "max_tokens"),
        (ps[0], SamplingParams(top_p=1.5), "top_p"),
        (ps[0], SamplingParams(stop=[""]), "stop"),
        ("", GREEDY, "empty"),
    ]
    for prompt, params, needle in bad:
        with pytest.raises(RequestError, match=needle):
            eng.add_request(prompt, params)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert [done[i] for i in ids] == alone[:3]


def test_prefill_graph_inputs_pad_without_changing_logits(llama_artifact):
    prefill_graph_matches_eager(llama_artifact, "reference")


def test_decode_graph_inputs_match_build_inputs(llama_artifact):
    """The decode graphs' packed inputs (one pinned buffer, one copy) hold what build_inputs makes for
    the same batch, and rows left by a shrinking batch become padding (no KV write, one-token context)."""
    from llmc.runtime.executor import StepInput, make_executor
    from llmc.runtime.step_graphs import _StepGraph
    runner = make_executor(llama_artifact.graph, "reference", "cpu", block_size=4, num_blocks=64)
    dg = _StepGraph("decode", 4, 16, torch.device("cpu"))
    batch = [StepInput([7], 9, [3, 5, 8, 60, 61]), StepInput([2], 0, [11]), StepInput([5], 4, [1, 2])]
    dg.load(batch, 4)
    ref = runner.build_inputs(batch)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices"):
        assert dg.inputs[name][:3].tolist() == ref[name].tolist(), name
    assert dg.inputs["query_start_loc"][:4].tolist() == ref["query_start_loc"].tolist()
    for i, s in enumerate(batch):  # the blocks each context covers
        used = s.start_pos // 4 + 1
        assert dg.inputs["block_tables"][i, :used].tolist() == s.block_table[:used]
    dg.load(batch[:1], 4)
    assert dg.inputs["slot_mapping"][1:].tolist() == [-1, -1, -1]
    assert dg.inputs["seq_lens"][1:].tolist() == [1, 1, 1] and dg.inputs["input_ids"][1:].tolist() == [0, 0, 0]


def test_decode_graph_tables_follow_grown_new_and_moved_lists(llama_artifact):
    """A decode graph's buffer rewrites a row's table only where it changed since the row last held it (the
    same list grown in place: its new blocks; another list: the whole row); after every step it holds what
    build_inputs makes for the batch, whatever the rows held before."""
    from llmc.runtime.executor import StepInput, make_executor
    from llmc.runtime.step_graphs import _StepGraph
    runner = make_executor(llama_artifact.graph, "reference", "cpu", block_size=4, num_blocks=64)
    dg = _StepGraph("decode", 4, 16, torch.device("cpu"))

    def step(*seqs):
        batch = [StepInput([7], pos, table) for pos, table in seqs]
        dg.load(batch, 4)
        ref = runner.build_inputs(batch)
        assert dg.inputs["slot_mapping"][:len(batch)].tolist() == ref["slot_mapping"].tolist()
        for i, s in enumerate(batch):
            used = s.start_pos // 4 + 1
            assert dg.inputs["block_tables"][i, :used].tolist() == s.block_table[:used], (i, s)

    a, b, c = [3, 5], [11], [1, 2, 9]
    step((5, a), (0, b))
    a.append(8)  # grown in place: the row gains a block
    step((8, a), (1, b))
    step((9, [3, 40, 8]), (2, b))  # a copy on write: a new list whose second block changed
    step((2, b), (9, a), (10, c))  # every row holds another list
    step((10, c))
    c.append(12)
    step((11, c), (12, c[:3] + [30]))  # the same blocks' prefix in another list, then a trimmed table
    step((5, a), (3, b), (12, c))  # lists back in rows that held others in between


def test_an_engine_run_on_decode_graphs_gives_the_eager_runs_tokens(tiny_py_artifact, cpu_step_graphs):
    """Decode steps on the decode graphs' buffers (kept block-table rows, step_graphs.TableRows) through whole
    engine runs, with samples of one prompt sharing blocks (copies on write) and a cache small enough to preempt:
    the tokens of the same runs with every step's inputs built afresh."""
    from llmc.runtime.executor import StepResult
    prompts = [p for p in CODE_PROMPTS[:6]]
    runs = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
            SamplingParams(temperature=0.8, n=3, seed=11, max_tokens=40, ignore_eos=True)]
    want = [LLM(tiny_py_artifact, backend="reference", num_blocks=40).generate(prompts, p) for p in runs]
    llm = LLM(tiny_py_artifact, backend="reference", num_blocks=40)
    ex = llm.engine.executor
    graphs, replayed = cpu_step_graphs(ex), []
    eager_rows, eager_forward = ex._token_rows, ex._forward

    def rows(seqs, feed=None, sample=None):  # KernelExecutor._token_rows's and _forward's use of its graphs
        out = graphs.run(seqs, sample is None, feed)
        if out is None:
            return eager_rows(seqs, feed, sample)
        replayed.append(len(seqs))
        return out if sample is None else sample(out)

    def forward(seqs, greedy):
        out = graphs.run(seqs, greedy) if not greedy else None
        if out is None:
            return eager_forward(seqs, greedy)
        replayed.append(len(seqs))
        return StepResult(logits=out)
    ex._token_rows, ex._forward = rows, forward
    got = [llm.generate(prompts, p) for p in runs]
    stats = llm.stats()
    assert len(replayed) > 60 and stats["num_preemptions"] > 0 and stats["cow_copies"] > 0, (len(replayed), stats)
    for w, g in zip(want, got):
        assert [[c.token_ids for c in o.outputs] for o in g] == [[c.token_ids for c in o.outputs] for o in w]


def test_the_token_budget_is_the_one_the_compile_measured_and_2048_at_least(llama_artifact, monkeypatch):
    """max_num_batched_tokens left unset: the artifact's measured budget (tuning.json "token_budget"), at least
    max_num_seqs and the default 2048, for every step; 2048 where none was measured (a CPU compile); an explicit
    value always wins. LLMC_STEP_BUDGET=1: the measured budget itself for steps with decodes, 2048 at least for
    a step with none."""
    import copy

    from llmc.compiler import choose_token_budget
    from llmc.runtime.config import DEFAULT_TOKEN_BUDGET, token_budget
    # per token: 7.8, 5.9, 5.1, 4.9, 4.9, 4.9 us: 1024 is the first within 1.1x of the best
    assert choose_token_budget({256: 2.0, 512: 3.0, 1024: 5.2, 2048: 10.0, 4096: 20.0, 8192: 40.5}) == 1024
    assert choose_token_budget({256: 1.0, 512: 2.5}) == 256
    assert token_budget(None) == token_budget({}) == token_budget({"token_budget": {"tokens": "x"}}) == \
        DEFAULT_TOKEN_BUDGET == 2048
    art, big = copy.copy(llama_artifact), copy.copy(llama_artifact)
    art.tuning = {**llama_artifact.tuning, "token_budget": {"tokens": 512, "slack": 1.1, "gemm_ms": {}}}
    big.tuning = {**llama_artifact.tuning, "token_budget": {"tokens": 4096, "slack": 1.1, "gemm_ms": {}}}

    def budget(a, **kw):
        config = LLM(a, backend="reference", num_blocks=16, block_size=4, **kw).engine.scheduler.config
        return config.max_num_batched_tokens, config.max_prefill_tokens
    assert budget(art) == (2048, None) and budget(art, max_num_seqs=3000) == (3000, None)
    assert budget(big) == (4096, None) and budget(llama_artifact) == (2048, None)
    assert budget(art, max_num_batched_tokens=64) == (64, None)
    assert art.summary()["token_budget"]["tokens"] == 512
    monkeypatch.setenv("LLMC_STEP_BUDGET", "1")
    assert budget(art) == (512, 2048) and budget(art, max_num_seqs=600) == (600, 2048)
    assert budget(art, max_num_batched_tokens=64) == (64, None)


def test_steps_with_decodes_take_the_budget_the_measured_costs_give(llama_artifact, monkeypatch):
    """With LLMC_STEP_BUDGET=1, an artifact whose compile measured its GEMMs at several sizes and the HBM rate
    gets a per-step budget (StepBudget): its floor is the measured budget, its K/V cost the cache's bytes per
    token at that rate. By default, with an explicit max_num_batched_tokens or for an older artifact: the
    fixed budget."""
    import copy

    from llmc.runtime.config import StepBudget
    gemm = {"256": 2.0, "512": 3.0, "1024": 5.2, "2048": 10.0, "4096": 20.0, "8192": 40.5}
    art = copy.copy(llama_artifact)
    art.tuning = {**llama_artifact.tuning, "token_budget": {"tokens": 1024, "gemm_ms": gemm, "hbm_gb_s": 4000.0}}

    def step_budget(a, **kw):
        eng = LLM(a, backend="reference", num_blocks=16, block_size=4, **kw).engine
        return eng, eng.scheduler.config.step_budget
    assert step_budget(art)[1] is None
    monkeypatch.setenv("LLMC_STEP_BUDGET", "1")
    eng, b = step_budget(art)
    assert isinstance(b, StepBudget) and b.floor == 1024
    assert b.gemm_ms == tuple((int(m), t) for m, t in gemm.items())
    per_token = eng.executor.kv_bytes / (eng.executor.num_blocks * 4)
    assert b.kv_ms_per_token == pytest.approx(per_token / 4000e9 * 1e3)  # bytes at 4,000 GB/s, in ms
    assert step_budget(art, max_num_batched_tokens=64)[1] is None
    old = copy.copy(art)
    old.tuning = {**art.tuning, "token_budget": {"tokens": 1024, "gemm_ms": gemm}}
    assert step_budget(old)[1] is None and step_budget(llama_artifact)[1] is None


def test_the_step_budget_spreads_the_decodes_cost_over_the_prompt_chunk():
    """StepBudget: with no decode it is the compile's rule (its floor); more decodes and longer contexts
    take larger chunks, on top of the decodes' own rows; the chunk is the smallest measured size whose cost
    per prompt token is within the slack of the best; never below the floor; bad records give None."""
    from llmc.compiler import choose_token_budget
    from llmc.runtime.config import StepBudget
    ms = {256: 5.6, 512: 9.7, 1024: 18.9, 2048: 37.3, 4096: 74.5, 8192: 149.0}  # an 8B-shaped step's GEMMs
    floor = choose_token_budget(ms)
    b = StepBudget(tuple(ms.items()), kv_ms_per_token=131072 / 4.15e9, floor=floor)
    assert floor == 512 and b(0, 0) == 512
    assert b.gemm(1) == b.gemm(256) == 5.6 and b.gemm(768) == pytest.approx(14.3)
    assert b.gemm(16384) == pytest.approx(149.0 + 74.5 * 2)
    sizes = [b(d, d * 600) for d in (8, 32, 64, 128)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    for d, c in ((8, 8 * 600), (32, 32 * 600), (128, 128 * 600)):
        chunk = b(d, c) - d
        cost = {m: (b.gemm(d + m) + b.kv_ms_per_token * c) / m for m in ms}
        assert chunk in ms and cost[chunk] <= 1.1 * min(cost.values())
        assert all(cost[m] > 1.1 * min(cost.values()) for m in ms if m < chunk)
    assert b(128, 128 * 600) == 128 + 2048  # 128 decodes of 600 tokens: 2.4 ms of K/V a step
    assert StepBudget(tuple(ms.items()), 0.0, floor=4096)(8, 100) == 4096
    bad = [None, {}, {"token_budget": {"gemm_ms": {"256": 1.0}, "hbm_gb_s": 4000}},
           {"token_budget": {"gemm_ms": {"256": 1.0, "512": 2.0}}},
           {"token_budget": {"gemm_ms": {"256": 1.0, "512": 2.0}, "hbm_gb_s": "x"}},
           {"token_budget": {"gemm_ms": {"256": 1.0, "512": 0.0}, "hbm_gb_s": 4000}}]
    assert all(StepBudget.of(t, 1000.0, 512) is None for t in bad)


def test_the_compile_measures_the_budget_over_every_linear_but_the_lm_head(llama_dir, tmp_path, monkeypatch):
    """compiler._measure_token_budget on the CPU, a stand-in tuner timing each GEMM as M x N x K: each
    distinct shape is timed once per token count and counted as often as the graph runs it; the LM head
    (vocabulary rows, run on the sampled rows only) is left out. The HBM rate is a device copy's bytes
    read and written per second."""
    import collections

    import llmc
    import llmc.compiler
    from llmc.codegen.autotune import TuneRecord
    from llmc.compiler import TOKEN_BUDGET_CANDIDATES, _measure_token_budget
    from llmc.ir.ops import FLOAT_LINEARS, linear_weight_inputs
    g = llmc.compile(llama_dir, tmp_path / "bf16.llmc", dtype="bfloat16").graph
    vocab = int(g.outputs[0].type.shape[-1])
    monkeypatch.setattr(llmc.compiler, "COPY_BYTES", 1 << 20)

    class Tuner:
        def __init__(self):
            self.times, self.calls = {}, []

        def choose(self, key, bucket, candidates, bench):
            if key.startswith("hbm_copy_ms:"):
                assert key == f"hbm_copy_ms:{1 << 20}" and bucket == "1"
                self.times[(key, bucket)] = 0.5  # 2 MiB in 0.5 ms
                return candidates[0]
            n, k = map(int, key.split(":")[1].split("x"))
            self.calls.append(key)
            self.times[(key, bucket)] = int(bucket) * n * k * 1e-9 + 1e-3  # a fixed cost, then linear in M
            return candidates[0]

        def lookup(self, key, bucket):
            return TuneRecord({}, self.times[(key, bucket)], None, False)

    t = Tuner()
    out = _measure_token_budget(g, t, SimpleBar(), device="cpu")
    weights = [g.weights[linear_weight_inputs(n)[0].name] for n in g.nodes
               if n.op in FLOAT_LINEARS]
    runs = collections.Counter((int(w.shape[0]), int(w.shape[1])) for w in weights)
    shapes = {s for s in runs if s[0] != vocab}
    assert any(n == vocab for n, _ in runs)  # the graph's LM head is a linear: what is left out
    assert len(t.calls) == len(shapes) * len(TOKEN_BUDGET_CANDIDATES) and all(f"{vocab}x" not in c for c in t.calls)
    want = {m: sum(c * (m * n * k * 1e-9 + 1e-3) for (n, k), c in runs.items() if n != vocab)
            for m in TOKEN_BUDGET_CANDIDATES}
    assert out["gemm_ms"] == {str(m): round(v, 4) for m, v in want.items()}
    assert out["tokens"] == min(m for m in want if want[m] / m <= 1.1 * min(v / k for k, v in want.items()))
    assert out["hbm_gb_s"] == round(2 * (1 << 20) / 0.5e-3 / 1e9, 1) == 4.2


def test_a_quantized_artifact_measures_its_budget_over_its_quantized_linears(llama_dir, tmp_path, monkeypatch):
    """Where the linears are quantized (qlinear, and qlinear_codes fed by a norm or SwiGLU), the budget is
    measured over their kernels, each run through the compile's tuner with float x of its output dtype;
    the LM head is left out; before, such an artifact took the constant default."""
    import collections
    import re

    import llmc
    import llmc.compiler
    from llmc.codegen import qmatmul as qmm
    from llmc.codegen.autotune import TuneRecord
    from llmc.compiler import TOKEN_BUDGET_CANDIDATES, _measure_token_budget
    from llmc.ir.ops import qlinear_weight_inputs
    g = llmc.compile(llama_dir, tmp_path / "w8a8.llmc", quant={"method": "smoothquant"}).graph
    monkeypatch.setattr(llmc.compiler, "COPY_BYTES", 1 << 20)
    vocab = int(g.outputs[0].type.shape[-1])
    ran = []

    class Tuner:
        def __init__(self):
            self.times = {}

        def choose(self, key, bucket, candidates, bench):
            bench(candidates[0])
            if key.startswith("hbm_copy_ms:"):
                self.times[(key, bucket)] = 1.0
                return candidates[0]
            n, k = map(int, re.search(r"(\d+)x(\d+)", key).groups())
            self.times[(key, bucket)] = int(bucket) * n * k * 1e-9 + 1e-3
            return candidates[0]

        def lookup(self, key, bucket):
            return TuneRecord({}, self.times[(key, bucket)], None, False)

    t = Tuner()
    monkeypatch.setattr(qmm, "qlinear", lambda x, p, b, act, tuner: ran.append(
        ((p.out_features, p.in_features), x.shape[0], x.dtype, tuner is t)))
    out = _measure_token_budget(g, t, SimpleBar(), device="cpu")
    runs = collections.Counter(tuple(int(d) for d in g.weights[qlinear_weight_inputs(n)[0].name].shape)
                               for n in g.nodes if n.op in ("qlinear", "qlinear_codes"))
    assert {n.op for n in g.nodes} >= {"qlinear_codes"} and all(n != vocab for n, _ in runs)
    assert sorted({(s, m) for s, m, *_ in ran}) == sorted((s, m) for s in runs for m in TOKEN_BUDGET_CANDIDATES)
    assert {(d, mine) for *_, d, mine in ran} == {(torch.float32, True)}
    want = {m: sum(c * (m * n * k * 1e-9 + 1e-3) for (n, k), c in runs.items()) for m in TOKEN_BUDGET_CANDIDATES}
    assert out["gemm_ms"] == {str(m): round(v, 4) for m, v in want.items()}


class SimpleBar:
    def step(self, msg):
        pass


def test_optional_tuning_that_fails_leaves_the_defaults_and_the_compile_goes_on(llama_artifact, monkeypatch, caplog):
    """The decode attention choice and the token budget are optional: if timing them fails on a GPU, the
    compile warns and keeps the defaults rather than failing."""
    import logging

    import llmc.compiler as compiler

    def fail(*a, **kw):
        raise RuntimeError("no such launch")
    monkeypatch.setattr(compiler, "_tune_linears", lambda *a: None)
    monkeypatch.setattr(compiler, "_tune_attention", fail)
    with caplog.at_level(logging.WARNING, logger="llmc.compiler"):
        compiler._tune_kernels(llama_artifact.graph, None, SimpleBar())
    assert "attention tuning failed (RuntimeError: no such launch)" in caplog.text


def test_the_compile_tunes_decode_over_a_quantized_cache(llama_dir, tmp_path, monkeypatch):
    """A bf16 model compiled for an int8 / fp8 cache times its decode launches over a cache of that type (codes
    and a scale row: the launch the runtime makes), among DECODE_TILE_CANDIDATES; its prefill keeps
    the default launch. Run here on the CPU, interpreted, with a recording tuner and short contexts."""
    import llmc
    import llmc.compiler as compiler
    from llmc.codegen.attention import DECODE_TILE_CANDIDATES

    class Recording:
        def __init__(self):
            self.calls = []

        def choose(self, key, bucket, candidates, bench, lighter=None, within=0.0):
            bench(dict(candidates[0]))
            self.calls.append((key, bucket, candidates))
            self.lighter, self.within = lighter, within
            return dict(candidates[0])
    monkeypatch.setattr(compiler, "DECODE_TUNING_CONTEXTS", ([20], [37, 5]))
    for kv, name in (("int8", "int8"), ("fp8", "float8_e4m3fn")):
        art = llmc.compile(llama_dir, tmp_path / f"{kv}.llmc", dtype="bfloat16", kv_cache_dtype=kv, tune=False)
        tuner = Recording()
        compiler._tune_attention(art.graph, tuner, SimpleBar(), device="cpu")
        assert [(key.split(":")[0], key.split(":")[-1], bucket) for key, bucket, _ in tuner.calls] == \
            [("paged_attention_decode", name, "decode")]
        assert tuner.calls[0][2] == DECODE_TILE_CANDIDATES
        # of launches timed alike, the one of fewest warps (compiler.DECODE_LIGHTER_WITHIN)
        assert tuner.lighter(DECODE_TILE_CANDIDATES[-1]) == 8 and tuner.within == compiler.DECODE_LIGHTER_WITHIN > 0


def test_decode_graphs_per_context_bucket_give_the_eager_runs_tokens(tiny_py_artifact, cpu_step_graphs,
                                                                     monkeypatch):
    """A decode step whose contexts all fit a bucket replays that bucket's graph
    (its attention launched for the bucket, not the model's limit), a longer one the limit's. Whole engine runs
    over contexts that cross the buckets give the eager runs' tokens, each graph captured for its bucket and
    the warm-up's decode steps meeting every bucket."""
    from llmc.runtime import step_graphs
    from llmc.runtime.executor import warm_up_batches
    from llmc.runtime.step_graphs import decode_contexts
    assert decode_contexts(4096) == (1024, 2048, 4096) and decode_contexts(1500) == (1024, 1500)
    monkeypatch.setenv("LLMC_DECODE_CONTEXT_GRAPHS", "0")
    assert decode_contexts(4096) == (4096,)  # one graph per batch bucket when switched off
    monkeypatch.delenv("LLMC_DECODE_CONTEXT_GRAPHS")
    monkeypatch.setattr(step_graphs, "DECODE_CONTEXT_BUCKETS", (32, 64))
    prompts = [p[:40] for p in CODE_PROMPTS[:4]] + [CODE_PROMPTS[4][:8]]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = LLM(tiny_py_artifact, backend="reference", num_blocks=64).generate(prompts, params)
    llm = LLM(tiny_py_artifact, backend="reference", num_blocks=64)
    ex = llm.engine.executor
    graphs = cpu_step_graphs(ex, 256)
    assert graphs.contexts == (32, 64, 256)
    eager_rows, chosen = ex._token_rows, []

    def rows(seqs, feed=None, sample=None):
        kind = step_graphs.graph_kind(seqs)
        if kind is not None and kind[0] == "decode":  # the bucket holds every context of the step
            chosen.append((max(s.start_pos + 1 for s in seqs), graphs._context(kind, seqs) or 256))
        out = graphs.run(seqs, sample is None, feed)
        return eager_rows(seqs, feed, sample) if out is None else (out if sample is None else sample(out))
    ex._token_rows = rows
    got = llm.generate(prompts, params)
    assert chosen and all(n <= c and (c == 32 or n > c // 2 or c == 256) for n, c in chosen), chosen
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    decode = {k: g.context for k, g in graphs.graphs.items() if k[0] == "decode"}
    assert {c for c in decode.values()} == {32, 64, None}, decode  # every bucket met, the limit's past 64
    assert all(len(k) == 4 and k[3] == g or len(k) == 3 and g is None for k, g in decode.items())
    warm = warm_up_batches(4, 64, 16, contexts=graphs.contexts)
    met = {graphs._context(("decode", len(b.seqs)), b.seqs) for b in warm if all(len(s.token_ids) == 1
                                                                                 for s in b.seqs)}
    assert met == {32, 64, None}
