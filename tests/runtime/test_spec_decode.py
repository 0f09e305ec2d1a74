"""Speculative decoding end to end: greedy output identical to decoding without speculation for every
proposer and k, batched with preemption and n > 1; sampled output distributed as without speculation;
no block leaked and no prefix-cache entry of a rejected token."""
import pytest

from llmc.runtime.llm import LLM, SamplingParams
from tests.conftest import CODE_PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_outputs(tiny_py_artifact):
    llm = LLM(tiny_py_artifact, backend="reference", num_blocks=256)
    return [o.token_ids for o in llm.generate(CODE_PROMPTS, GREEDY)]


def cached_blocks_are_real(llm, outs):
    """Every prefix-cache entry holds tokens some request really has at that block."""
    bm = llm.engine.block_manager
    streams = [list(o.prompt_token_ids) + c.token_ids for o in outs for c in o.outputs]
    real = {tuple(s[i:i + bm.block_size]) for s in streams for i in range(0, len(s) - bm.block_size + 1, bm.block_size)}
    return all(key[1] in real for key in bm._cached)


@pytest.mark.parametrize("k", [1, 3, 5, "auto"])
def test_ngram_greedy_equals_plain(tiny_py_artifact, plain_outputs, k):
    llm = LLM(tiny_py_artifact, backend="reference", num_blocks=256,
              speculative={"method": "ngram", "num_speculative_tokens": k})
    outs = llm.generate(CODE_PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    st = llm.stats()
    assert st["spec_proposed_tokens"] > 0 and st["blocks_used"] == 0
    assert cached_blocks_are_real(llm, outs)


@pytest.fixture(scope="module")
def tiny_py_draft(tmp_path_factory):
    import llmc
    return llmc.compile("builtin:tiny-py-draft", tmp_path_factory.mktemp("draft") / "tiny-py-draft.llmc")


@pytest.mark.parametrize("method,k", [("draft", 1), ("draft", 3), ("draft", 5), ("draft", "auto"),
                                      ("multi", 3), ("multi", "auto")])
def test_draft_greedy_equals_plain(tiny_py_artifact, tiny_py_draft, plain_outputs, method, k):
    llm = LLM(tiny_py_artifact, backend="reference", num_blocks=256,
              speculative={"method": method, "draft": tiny_py_draft, "num_speculative_tokens": k})
    outs = llm.generate(CODE_PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    st = llm.stats()
    assert st["spec_accepted_tokens"] > 0 and st["blocks_used"] == 0 and st["steps"] < 24 * len(CODE_PROMPTS)
    assert cached_blocks_are_real(llm, outs)
    proposer = llm.engine.spec.proposer
    assert getattr(proposer, "draft", proposer).block_manager.num_used_blocks == 0  # the draft cache is returned too


def test_draft_batched_with_preemption_and_n2(tiny_py_artifact, tiny_py_draft):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    kw = dict(backend="reference", num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=64)
    plain = LLM(tiny_py_artifact, **kw).generate(CODE_PROMPTS, params)
    llm = LLM(tiny_py_artifact, speculative={"method": "draft", "draft": tiny_py_draft,
                                             "num_speculative_tokens": 3}, **kw)
    outs = llm.generate(CODE_PROMPTS, params)
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["spec_accepted_tokens"] > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in plain]
    assert llm.stats()["blocks_used"] == 0 and cached_blocks_are_real(llm, outs)


def test_draft_with_another_vocabulary_is_refused(llama_artifact, tiny_py_draft):
    from llmc.errors import LLMCError
    with pytest.raises(LLMCError, match="vocab"):
        LLM(llama_artifact, backend="reference", speculative={"method": "draft", "draft": tiny_py_draft})


def test_ngram_batched_with_preemption_and_n2(tiny_py_artifact):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    kw = dict(backend="reference", num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=64)
    plain = LLM(tiny_py_artifact, **kw).generate(CODE_PROMPTS, params)
    llm = LLM(tiny_py_artifact, speculative={"method": "ngram", "num_speculative_tokens": 3}, **kw)
    outs = llm.generate(CODE_PROMPTS, params)
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["spec_accepted_tokens"] > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in plain]
    assert llm.stats()["blocks_used"] == 0 and cached_blocks_are_real(llm, outs)


@pytest.fixture(scope="module")
def other_draft(llama_dir, tmp_path_factory):
    """The tiny Llama with its logits sharpened and perturbed: a draft with the same top tokens whose q
    differs from p, so proposals are accepted, rejected and resampled."""
    import shutil
    import torch
    import llmc
    from transformers import AutoModelForCausalLM
    out = tmp_path_factory.mktemp("draft") / "hf"
    m = AutoModelForCausalLM.from_pretrained(llama_dir)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        head = m.get_output_embeddings().weight
        head.mul_(1.6).add_(0.3 * head.std() * torch.randn(head.shape, generator=g))
    m.save_pretrained(out)
    for f in llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return llmc.compile(out, out.parent / "d.llmc")


@pytest.mark.parametrize("method,temperature,top_k,top_p,min_p", [
    ("draft", 1.0, 3, 1.0, 0.0), ("draft", 0.5, 4, 0.9, 0.0), ("draft", 1.0, 5, 1.0, 0.8), ("multi", 1.0, 3, 1.0, 0.0)])
def test_sampled_output_distribution_matches_plain(llama_artifact, other_draft, method, temperature, top_k, top_p,
                                                   min_p):
    """Two-sample chi-square over the (2nd, 3rd) generated tokens, with and without speculation:
    1,000 seeded requests each; the draft is another random model (q != p), k = 2, so tokens are
    accepted, rejected and resampled."""
    from scipy.stats import chi2_contingency
    prompt = [5, 6, 7, 8, 9] if method == "draft" else [5, 6, 7] * 4  # repeats give n-gram hints
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=4,
                             ignore_eos=True, seed=s) for s in range(1000)]
    kw = dict(backend="reference", num_blocks=2048, block_size=4, max_num_seqs=256, max_num_batched_tokens=4096)

    def counts(llm):
        c = {}
        for o in llm.generate([prompt] * len(params), params):
            key = tuple(o.token_ids[1:3])
            c[key] = c.get(key, 0) + 1
        return c
    spec = LLM(llama_artifact, speculative={"method": method, "draft": other_draft, "num_speculative_tokens": 2,
                                            "max_batch": None, "max_verify_rows": None}, **kw)  # 256 x 3 rows a step
    a, b = counts(LLM(llama_artifact, **kw)), counts(spec)
    st = spec.stats()
    assert st["spec_proposed_tokens"] > 1000 and 0 < st["spec_accepted_tokens"] < st["spec_proposed_tokens"]
    # pool the rare sequences so that every cell has a fair expected count
    common = [k for k in set(a) | set(b) if a.get(k, 0) + b.get(k, 0) >= 20]
    table = [[c.get(k, 0) for k in common] + [sum(c.values()) - sum(c.get(k, 0) for k in common)] for c in (a, b)]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    assert len(table[0]) >= 2
    assert chi2_contingency(table).pvalue > 1e-4


def test_cli_spec_options(tiny_py_artifact, tiny_py_draft):
    import json
    from click.testing import CliRunner
    from llmc.cli import main

    def run(*args):
        res = CliRunner().invoke(main, ["run", str(tiny_py_artifact.path), "--prompt", "def fibonacci(n):",
                                        "--max-tokens", "16", "--json", "--backend", "reference", *map(str, args)])
        return res.exit_code, res.output
    code, plain = run()
    assert code == 0, plain
    for args in (["--spec", "ngram"], ["--draft", tiny_py_draft.path, "--spec-tokens", "3"]):
        code, out = run(*args)
        assert code == 0 and json.loads(out)["token_ids"] == json.loads(plain)["token_ids"], out
    for args, needle in ((["--spec", "draft"], "--draft"), (["--spec-tokens", "0", "--spec", "ngram"], "1-16"),
                         (["--spec", "ngram", "--draft", tiny_py_draft.path], "--draft")):
        code, out = run(*args)
        assert code == 1 and out.startswith("error: ") and needle in out, out


class Ones:
    """A proposer of k ones, whatever the sequence."""

    def propose(self, seqs, ks):
        from llmc.runtime.spec_decode import Proposal
        return [Proposal([1] * k) for k in ks]

    def accepted(self, seq, n):
        pass

    def release(self, seq):
        pass


def decoding_seq(name: str, max_tokens: int = 10_000):
    """A sequence of a 3-token prompt and one generated token, decoding (its prompt computed)."""
    from llmc.runtime.sequence import Sequence
    seq = Sequence(name, [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    seq.append_token(4)
    seq.num_computed_tokens = 3
    return seq


def spec_call(dec, seqs, row_tokens):
    """One engine call's worth of `dec`'s work on the decoding `seqs`: propose, then verify each proposal of k
    tokens against `row_tokens(k)` (the target's greedy tokens at its k + 1 rows). Returns the step the
    engine would have run and whether anything was proposed."""
    from llmc.runtime.scheduler import ScheduledSeq, SchedulerOutput
    dec.propose(seqs)
    out = SchedulerOutput([ScheduledSeq(s, 1 + len(s.spec_token_ids), False, True, spec=list(s.spec_token_ids))
                           for s in seqs])
    for s in seqs:
        if s.spec_token_ids:
            dec.verify(s, s.spec_token_ids, None, row_tokens(len(s.spec_token_ids)))
    return out, any(e.spec for e in out.scheduled)


def test_adaptive_k_learns_what_a_proposed_token_costs():
    """The cost of a proposed token is measured against plain decode steps of the same batch size: a
    proposer as slow as a target step drives auto k to 0, a cheap one keeps it; a plain step is taken to
    calibrate first, and again after CALIBRATE speculative steps."""
    from llmc.runtime.sampler import Sampler
    from llmc.runtime.scheduler import ScheduledSeq, SchedulerOutput
    from llmc.runtime.spec_decode import SpecDecoder
    from llmc.runtime.spec_decode.adaptive import AdaptiveK


    def run(propose_s):
        seq = decoding_seq("r")
        dec = SpecDecoder(Ones(), AdaptiveK(k_max=4, cost=0.25, max_batch=None), 100_000, Sampler())
        ks, clock = [], 0.0
        for _ in range(200):
            dec.propose([seq])
            ks.append(len(seq.spec_token_ids))
            out = SchedulerOutput([ScheduledSeq(seq, 1 + len(seq.spec_token_ids), False, True,
                                                spec=list(seq.spec_token_ids))])
            if seq.spec_token_ids:
                k = len(seq.spec_token_ids)
                dec.verify(seq, seq.spec_token_ids, None, [1] * max(1, k - 1) + [2] * (k + 1 - max(1, k - 1)))
            clock += (propose_s if seq.spec_token_ids else 0.0) + 1.0 + 0.02 * len(seq.spec_token_ids)
            dec.observe_step(out, clock)
        return ks, dec.chooser.overhead + dec.chooser.cost
    ks, cost = run(propose_s=0.05)
    assert ks[0] == 0 and cost < 0.1 and sum(k > 0 for k in ks) > 150
    assert ks.count(0) >= 2  # calibration steps recur
    ks, cost = run(propose_s=3.0)
    assert cost > 0.5 and sum(k > 0 for k in ks[100:]) < 20


def test_steps_that_capture_graphs_do_not_switch_auto_k_off():
    """The first speculative steps of a batch size capture CUDA graphs (each verify row count, the draft's
    own steps) and take many times their usual time: they decide nothing (the engine passes `one_time`),
    so auto k speculates from the start. Had they counted, the measured cost of a proposed token would
    have stopped every proposal."""
    from llmc.runtime.sampler import Sampler
    from llmc.runtime.scheduler import ScheduledSeq, SchedulerOutput
    from llmc.runtime.spec_decode import SpecDecoder
    from llmc.runtime.spec_decode.adaptive import AdaptiveK
    seq = decoding_seq("r")
    dec = SpecDecoder(Ones(), AdaptiveK(k_max=4, cost=0.25, max_batch=32), 100_000, Sampler())
    ks, spec_steps, clock = [], 0, 0.0
    for _ in range(400):
        dec.propose([seq])
        k = len(seq.spec_token_ids)
        ks.append(k)
        out = SchedulerOutput([ScheduledSeq(seq, 1 + k, False, True, spec=list(seq.spec_token_ids))])
        if k:
            dec.verify(seq, seq.spec_token_ids, None, [1] * (k + 1))  # every proposed token holds
            spec_steps += 1
        # a speculative step costs 1.1 plain steps, but the first six capture graphs: 50x
        capture = bool(k) and spec_steps <= 6
        clock += (50.0 if capture else 1.1) if k else 1.0
        dec.observe_step(out, clock, one_time=capture)
    # plain calls only calibrate: WARM + 1 at the start, then two after every CALIBRATE speculative ones
    calibrating = SpecDecoder.WARM + 1 + 2 * (400 // SpecDecoder.CALIBRATE)
    assert sum(k > 0 for k in ks) >= 400 - calibrating and dec.chooser.overhead + dec.chooser.cost < 0.2, \
        (ks, dec.chooser.cost)


def test_a_step_with_proposals_verifies_at_most_the_batch_invariant_rows():
    """Proposals are cut so that a step verifies at most VERIFY_ROWS rows (those whose GEMMs share one choice,
    so greedy speculation keeps plain decoding's tokens in bf16 too): the longest lose tokens first."""
    from llmc.runtime.sampler import Sampler
    from llmc.runtime.spec_decode import VERIFY_ROWS, SpecDecoder, within_rows
    from llmc.runtime.spec_decode.adaptive import AdaptiveK
    assert VERIFY_ROWS == 64
    assert within_rows([8, 1, 3], 64) == [8, 1, 3] and within_rows([8, 8], 10) == [4, 4]
    assert within_rows([5, 1, 1], 6) == [1, 1, 1]
    assert within_rows([2] * 64, 64) == [0] * 64
    for batch in (1, 8, 16, 32, 100):
        seqs = [decoding_seq(f"r{i}", 100) for i in range(batch)]
        dec = SpecDecoder(Ones(), AdaptiveK.fixed(8, max_batch=None), 100_000, Sampler())
        dec.propose(seqs)
        ks = [len(s.spec_token_ids) for s in seqs]
        assert batch + sum(ks) <= max(VERIFY_ROWS, batch) and max(ks) - min(ks) <= 1, (batch, ks)
        assert sum(ks) == min(8 * batch, max(0, VERIFY_ROWS - batch))


def simulate(chooser, accept: float, overhead: float, per_token: float, steps: int = 3000, seed: int = 0):
    """Tokens per unit of time of one sequence under `chooser`: each proposed token holds with probability
    `accept` (independently), a plain step takes 1, a speculative one 1 + overhead + per_token * k."""
    import random

    from llmc.runtime.sampler import Sampler
    from llmc.runtime.scheduler import ScheduledSeq, SchedulerOutput
    from llmc.runtime.spec_decode import SpecDecoder
    rng = random.Random(seed)
    seq = decoding_seq("r", 10 ** 9)
    dec = SpecDecoder(Ones(), chooser, 10 ** 9, Sampler())
    tokens = elapsed = 0.0
    for _ in range(steps):
        dec.propose([seq])
        k = len(seq.spec_token_ids)
        out = SchedulerOutput([ScheduledSeq(seq, 1 + k, False, True, spec=list(seq.spec_token_ids))])
        t = 1.0 + (overhead + per_token * k if k else 0.0)
        tokens += len(dec.verify(seq, seq.spec_token_ids, None, [1 if rng.random() < accept else 2 for _ in range(k)]
                                 + [2])[0]) if k else 1
        elapsed += t
        dec.observe_step(out, elapsed)
    return tokens / elapsed, dec.chooser


@pytest.mark.parametrize("accept", [0.6, 0.75, 0.9])
def test_auto_k_keeps_up_with_the_best_fixed_k_when_a_step_with_a_draft_costs_a_fixed_extra(accept):
    """On an H200 a step with the shipped draft costs about 1.27 plain steps whatever k is, and each drafted
    token 0.015 more (fixed k = 3 and 5 end to end). Auto k measures both terms of that cost (a fixed
    overhead and a per-token one) and keeps up with the best fixed k; with the cost as one per-token term
    it would take f for a per-token cost and propose few tokens, or none."""
    from llmc.runtime.spec_decode.adaptive import AdaptiveK
    fixed = max(simulate(AdaptiveK.fixed(k, max_batch=None), accept, 0.27, 0.0145)[0] for k in range(1, 9))
    auto, chooser = simulate(AdaptiveK(k_max=8, cost=0.25, max_batch=32), accept, 0.27, 0.0145)
    assert auto >= 0.95 * fixed, (auto, fixed)
    assert abs(chooser.overhead - 0.27) < 0.03 and abs(chooser.cost - 0.0145) < 0.01, (chooser.overhead, chooser.cost)


def test_speculation_stops_where_it_gives_fewer_tokens_per_second():
    """Whatever the per-token cost model says, a batch size whose speculative calls give fewer tokens
    per second than its plain calls (measured) goes plain, and probes again after CALIBRATE plain calls,
    then after twice as many each time the gate stays closed; a batch size where speculation pays keeps it."""
    from llmc.runtime.sampler import Sampler
    from llmc.runtime.spec_decode import SpecDecoder
    from llmc.runtime.spec_decode.adaptive import AdaptiveK


    def run(batch, spec_step_s, steps=1000):
        seqs = [decoding_seq(f"r{i}") for i in range(batch)]
        dec = SpecDecoder(Ones(), AdaptiveK(k_max=2, cost=0.01, max_batch=None), 100_000, Sampler())
        regime, clock = [], 0.0
        for _ in range(steps):
            regime.append(dec.may_propose(len(seqs)))
            # one of the two proposed tokens holds: 2 tokens per sequence
            out, spec = spec_call(dec, seqs, lambda k: [1, 2, 2])
            clock += spec_step_s if spec else 1.0
            dec.observe_step(out, clock)
        return regime

    slow = run(8, spec_step_s=3.0)  # 2 tokens per sequence for 3x the time: a loss
    probes = [i for i in range(1, len(slow)) if slow[i] and not slow[i - 1]]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 3 and all(b > 1.5 * a for a, b in zip(gaps, gaps[1:])), probes
    assert sum(slow[100:]) <= 2 * len(probes)
    fast = run(1, spec_step_s=1.2)  # 2 tokens for 1.2x: a gain
    assert sum(fast[100:]) >= 0.95 * 900


def test_speculation_pays_for_the_overlap_that_its_calls_give_up():
    """Plain calls overlap their step with the host's work, so an engine call takes what the GPU step takes;
    in the speculative regime each step is waited for, proposals or not. The gate compares the calls' wall
    times (each from the end of the call before it of the same kind): at batch 32 where n-gram lookup
    finds a match for two sequences only, the extra tokens do not pay for the overlap lost, and
    speculation goes off; where each call is timed alone (the old measure: the step's own time, equal in
    both regimes) it would have looked free."""
    from llmc.runtime.sampler import Sampler
    from llmc.runtime.spec_decode import Proposal, SpecDecoder
    from llmc.runtime.spec_decode.adaptive import AdaptiveK

    class TwoMatch(Ones):
        def propose(self, seqs, ks):
            return [Proposal([1] * k if s.request_id in ("r0", "r1") else []) for s, k in zip(seqs, ks)]

    seqs = [decoding_seq(f"r{i}") for i in range(32)]
    dec = SpecDecoder(TwoMatch(), AdaptiveK(k_max=4, cost=0.05, max_batch=32), 100_000, Sampler())
    regime, clock = [], 0.0
    for _ in range(400):
        out, spec = spec_call(dec, seqs, lambda k: [1] * (k + 1))  # every proposed token holds: up to 8 more a call
        regime.append(spec)
        # a plain call 1.0 (its step overlapped), a waited one 1.4 (the host's work no longer hidden)
        clock += 1.4 if regime[-1] else 1.0
        dec.observe_step(out, clock)
    assert sum(regime[100:]) <= 2 * (300 // SpecDecoder.CALIBRATE + 1), "".join(".S"[r] for r in regime)


def test_speculative_calls_that_are_never_measured_stop():
    """A speculative call is measured only after another one: where every second call is interrupted (a
    prefill chunk, a graph capture), the gate would never learn what speculation costs. After PROBE such
    calls the bucket goes plain for CALIBRATE calls, then probes again."""
    from llmc.runtime.sampler import Sampler
    from llmc.runtime.spec_decode import SpecDecoder
    from llmc.runtime.spec_decode.adaptive import AdaptiveK
    seqs = [decoding_seq(f"r{i}") for i in range(4)]
    dec = SpecDecoder(Ones(), AdaptiveK(k_max=2, cost=0.01, max_batch=None), 100_000, Sampler())
    spec, clock = [], 0.0
    for i in range(600):
        out, proposed = spec_call(dec, seqs, lambda k: [1] * (k + 1))  # all hold
        spec.append(proposed)
        clock += 3.0 if spec[-1] else 1.0
        dec.observe_step(out, clock, one_time=spec[-1] and i % 2 == 0)
    rounds = 600 // SpecDecoder.CALIBRATE + 1
    assert sum(spec) <= SpecDecoder.PROBE * (rounds + 1), "".join(".S"[s] for s in spec)
    assert 4 not in dec.window  # never measured



def gate_run(batches, per_k, matching, steps=600):
    """The gate's regime over `steps` calls: the i-th call decodes `batches(i)` sequences, of which the first
    `matching` get proposals (all accepted); a plain call takes 1.0 whatever its width (the weights are read
    once for all), a speculative one 1 + per_k * k (k: the most proposed for a sequence). Each sequence's
    own cost model sees a gain (its k + 1 tokens for the call's time), so what the whole call gives is for
    the gate to judge."""
    from llmc.runtime.sampler import Sampler
    from llmc.runtime.spec_decode import Proposal, SpecDecoder
    from llmc.runtime.spec_decode.adaptive import AdaptiveK
    pool = [decoding_seq(f"r{i}") for i in range(64)]
    some = {s.request_id for s in pool[:matching]}

    class Some(Ones):
        def propose(self, seqs, ks):
            return [Proposal([1] * k if s.request_id in some else []) for s, k in zip(seqs, ks)]

    dec = SpecDecoder(Some(), AdaptiveK(k_max=4, cost=0.01, max_batch=None), 100_000, Sampler())
    regime, clock = [], 0.0
    for i in range(steps):
        out, spec = spec_call(dec, pool[:batches(i)], lambda k: [1] * (k + 1))
        regime.append(spec)
        clock += 1.0 + per_k * max(len(e.spec) for e in out.scheduled)
        dec.observe_step(out, clock)
    return regime


def test_the_gate_compares_calls_not_tokens_within_a_batch_bucket():
    """Plain calls measured at the narrow end of a bucket (17 sequences, the tail of a batch) must not make
    speculation at its wide end (32) look better than it is: 8 sequences of 32 given 4 tokens more each is
    2x the tokens, for 2.2x the time, a loss, and the gate closes, while its time per token (2.2 / 64
    against 1 / 17) would have called it a gain."""
    from llmc.runtime.spec_decode import SpecDecoder
    # the first CALIBRATE calls at 17 sequences (plain calls calibrate there, and speculation pays: 2.9x
    # the tokens for 2.2x the time), then all at 32
    regime = gate_run(lambda i: 17 if i < SpecDecoder.CALIBRATE else 32, per_k=0.3, matching=8)
    assert any(regime[:SpecDecoder.CALIBRATE])
    late = regime[200:]
    assert sum(late) <= 0.05 * len(late), "".join(".S"[r] for r in regime)


def test_speculation_near_break_even_stays_off():
    """Speculation must win by MARGIN: 5 tokens a sequence for 4.7x the time (1.06x the tokens per second;
    2 for 1.925x at k = 1) is not worth what it costs outside the calls measured; 5 for 4x (1.25x) is."""
    marginal = gate_run(lambda i: 8, per_k=0.925, matching=8)
    assert sum(marginal[200:]) <= 0.05 * 400, "".join(".S"[r] for r in marginal)
    paying = gate_run(lambda i: 8, per_k=0.75, matching=8)
    assert sum(paying[200:]) >= 0.9 * 400, "".join(".S"[r] for r in paying)


def test_a_closed_verdict_over_many_requests_outlives_them():
    """Batch 32 with requests coming and going (each new prompt in a mixed step): the verdict of calls of 32
    sequences, none of whose proposals pay, stands for the workload, so speculation runs on little more than
    its probes even as the requests it measured finish (measuring again whenever they all had finished ran it
    on 4.3% of these calls; on the GPU, 66% of a batch-32 run's steps). At batch 1 it does measure again:
    `test_a_closed_verdict_ends_with_the_requests_it_measured`."""
    import random

    from llmc.runtime.sampler import Sampler
    from llmc.runtime.scheduler import ScheduledSeq, SchedulerOutput
    from llmc.runtime.spec_decode import SpecDecoder
    from llmc.runtime.spec_decode.adaptive import AdaptiveK
    rng = random.Random(0)
    dec = SpecDecoder(Ones(), AdaptiveK(k_max=4, cost=0.01, max_batch=None), 100_000, Sampler())
    left, made, regime, clock = {}, 0, [], 0.0
    while len(left) < 32:
        left[decoding_seq(f"r{len(left)}")] = rng.randint(32, 128)
    for _ in range(3000):
        seqs = list(left)  # half the proposals get their first token accepted, the rest none: a loss
        out, spec = spec_call(dec, seqs, lambda k: [2] + [1] * k if rng.random() < 0.5 else [2] * (k + 1))
        regime.append(spec)
        clock += 1.0 + 0.1 * max(len(e.spec) for e in out.scheduled)
        dec.observe_step(out, clock)
        done = [s for s in seqs if left.__setitem__(s, left[s] - 1) or left[s] <= 0]
        for s in done:
            del left[s]
            dec.release(s)
            made += 1
            left[decoding_seq(f"n{made}")] = rng.randint(32, 128)
        if done:
            clock += 1.5
            dec.observe_step(SchedulerOutput([ScheduledSeq(s, 1, False, True) for s in left]
                                             + [ScheduledSeq(decoding_seq("p"), 3, True, True)]), clock)
    assert sum(regime) <= 0.02 * len(regime), "".join(".S"[s] for s in regime[:600])


def test_a_closed_verdict_ends_with_the_requests_it_measured():
    """Batch 1, one request after another: two requests whose proposals all fail close the gate; the easy
    requests after them get speculation back from the first one on: the verdict was about requests that are
    gone (before, the first easy request ran without speculation, its probes outvoted by the hard stretch's
    calls in the window, and the gap between probes had grown to 512 calls)."""
    from llmc.runtime.sampler import Sampler
    from llmc.runtime.spec_decode import SpecDecoder
    from llmc.runtime.spec_decode.adaptive import AdaptiveK
    dec = SpecDecoder(Ones(), AdaptiveK(k_max=4, cost=0.01, max_batch=None), 100_000, Sampler())
    regime, clock = [], 0.0
    for r in range(10):  # requests of 256 tokens: two hard, then eight easy
        seq, hard = decoding_seq(f"r{r}"), r < 2
        for _ in range(256):
            out, spec = spec_call(dec, [seq], lambda k: [2] * (k + 1) if hard else [1] * (k + 1))
            regime.append(spec)
            clock += 1.0 + 0.1 * max(len(e.spec) for e in out.scheduled)  # a cheap draft
            dec.observe_step(out, clock)
        dec.release(seq)
    first, easy = regime[2 * 256:3 * 256], regime[2 * 256:]
    assert sum(first) >= 0.9 * len(first) and sum(easy) >= 0.9 * len(easy), "".join(".S"[s] for s in regime)
