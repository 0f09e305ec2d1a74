"""Overlapped steps (`overlap=True`, the default): a greedy step is launched and the host schedules the next
one before reading its tokens, which the next step takes from the device. Outputs must be exactly those
of steps run one at a time, whatever happens while a step is in flight: stops, preemption (recompute and
swap), prefix sharing, aborts, a failed launch, and steps that sample on the host in between."""
import torch

from llmc.runtime.executor import Feed, StepBatch, StepInput
from llmc.runtime.llm import LLM, SamplingParams
from tests.conftest import CODE_PROMPTS

# greedy requests of several lengths and stops, with sampled ones (run on the host, between launched steps)
PARAMS = [SamplingParams(temperature=0, max_tokens=6 + i % 13) if i % 4 == 0 else
          SamplingParams(temperature=0.8, top_k=40, seed=100 + i, max_tokens=12) if i % 4 == 1 else
          SamplingParams(temperature=0, max_tokens=24, stop=["\n\n", "(self"]) if i % 4 == 2 else
          SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) for i in range(24)]
PROMPTS = [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(24)]


def run(art, overlap: bool, prompts=PROMPTS, params=PARAMS, **options):
    with LLM(art, backend="reference", overlap=overlap, **options) as llm:
        outs = llm.generate(prompts, params)
        return [(c.token_ids, c.text, c.finish_reason) for o in outs for c in o.outputs], llm.stats()


def test_overlapped_steps_give_the_outputs_of_steps_one_at_a_time(tiny_py_artifact):
    # 24 blocks of 4 for up to 8 sequences of ~30 tokens: sequences are preempted while steps are in flight
    for opts in (dict(max_num_seqs=8, num_blocks=24, block_size=4),
                 dict(max_num_seqs=8, num_blocks=24, block_size=4, preemption_mode="swap", num_cpu_blocks=64),
                 dict(max_num_seqs=4, num_blocks=64, block_size=8, enable_prefix_caching=False)):
        want, plain = run(tiny_py_artifact, False, **opts)
        got, stats = run(tiny_py_artifact, True, **opts)
        assert got == want, opts
        # a step with a sampled row runs at once (the sampler reads the logits on the host); the others fly
        assert plain["overlapped_steps"] == 0 and stats["overlapped_steps"] > 0, (opts, stats)
        assert stats["blocks_used"] == 0
        if opts["num_blocks"] == 24:
            assert stats["num_preemptions"] > 0


def test_a_shared_prefix_and_the_end_of_the_context(tiny_py_artifact):
    # one long prefix, prompts that differ at its end: blocks are shared while the steps writing them fly;
    # a 40-token context ends every sequence with the token in flight
    prefix = "import os\nimport sys\n\n\ndef main(argv):\n    "
    prompts = [prefix + tail for tail in ("return 0", "print(argv)", "x = 1", "if argv:")]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    opts = dict(max_model_len=40, block_size=4, num_blocks=64)
    want, _ = run(tiny_py_artifact, False, prompts, params, **opts)
    got, stats = run(tiny_py_artifact, True, prompts, params, **opts)
    assert got == want and all(r == "length" for _, _, r in got)
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["overlapped_steps"] == stats["steps"] - 1  # all but the last, which had nothing to run


def test_an_abort_while_its_step_is_in_flight(tiny_py_artifact):
    with LLM(tiny_py_artifact, backend="reference", block_size=4, num_blocks=64) as llm:
        eng = llm.engine
        keep = eng.add_request(CODE_PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        gone = eng.add_request(CODE_PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        for _ in range(4):
            eng.step()
        assert eng._inflight is not None and {e.seq.request_id for e in eng._inflight.out.scheduled} == {keep, gone}
        assert eng.abort(gone)
        finals = {}
        while eng.has_unfinished():
            finals.update({o.request_id: o for o in eng.step() if o.finished})
        assert finals[gone].outputs[0].finish_reason == "abort" and len(finals[gone].outputs[0].token_ids) < 12
        assert eng.block_manager.num_used_blocks == 0
    alone, _ = run(tiny_py_artifact, False, [CODE_PROMPTS[0]], [SamplingParams(temperature=0, max_tokens=12,
                                                                                ignore_eos=True)])
    assert (finals[keep].outputs[0].token_ids, finals[keep].outputs[0].finish_reason) == alone[0][::2]


def test_a_failed_launch_ends_its_requests_and_the_step_in_flight_still_lands(tiny_py_artifact):
    with LLM(tiny_py_artifact, backend="reference", block_size=4, num_blocks=64) as llm:
        eng = llm.engine
        a = eng.add_request(CODE_PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        for _ in range(3):
            eng.step()
        b = eng.add_request(CODE_PROMPTS[2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        real = eng.executor.launch

        def failing(*args):
            eng.executor.launch = real
            raise RuntimeError("device lost")
        eng.executor.launch = failing
        before = len(eng.requests[a].group.seqs[0].output_token_ids)
        try:
            eng.step()
        except RuntimeError:
            pass
        else:
            raise AssertionError("the failed launch did not reach the caller")
        seq = eng.requests[a].group.seqs[0]
        # the step in flight landed: its token is in place, not a stand-in; the failed step's requests ended
        assert seq.finish_reason == "abort" and len(seq.output_token_ids) == before + 1
        assert eng.requests[b].group.seqs[0].finish_reason == "abort"
        while eng.has_unfinished():
            eng.step()
        assert eng.block_manager.num_used_blocks == 0
    alone, _ = run(tiny_py_artifact, False, [CODE_PROMPTS[0]], [SamplingParams(temperature=0, max_tokens=10,
                                                                                ignore_eos=True)])
    assert seq.output_token_ids == alone[0][0][:len(seq.output_token_ids)]


def test_launch_takes_fed_tokens_from_the_device(tiny_py_artifact):
    """The executor's side: a step whose input tokens are stand-ins, fed from the previous step's argmax rows,
    computes what the step with the real tokens does."""
    with LLM(tiny_py_artifact, backend="reference", block_size=4, num_blocks=32) as llm:
        ex = llm.engine.executor
        prompts = [[5, 9, 14, 20, 7], [3, 8, 8, 30]]
        tables = [[0, 1, 2], [3, 4, 5]]
        first = ex.launch(StepBatch([StepInput(p, 0, t, 1, True) for p, t in zip(prompts, tables)], greedy=True))
        real = first.tokens()
        # the next step, the second sequence first, its tokens stand-ins: row 1 feeds batch row 0, row 0 row 1
        fed = ex.launch(StepBatch([StepInput([0], 4, tables[1]), StepInput([0], 5, tables[0])], greedy=True),
                        Feed(first.device_tokens, [0, 1], [1, 0]))
        got = fed.tokens()
        want = ex.execute(StepBatch([StepInput([real[1]], 4, tables[1]), StepInput([real[0]], 5, tables[0])],
                                    greedy=True)).tokens
        assert got == want.tolist()
        assert torch.equal(first.device_tokens, torch.tensor(real))


def test_rollback_with_a_step_in_flight(tiny_py_artifact):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    (want, _, _), = run(tiny_py_artifact, False, [CODE_PROMPTS[3]], [params])[0]
    with LLM(tiny_py_artifact, backend="reference", block_size=4, num_blocks=64) as llm:
        eng = llm.engine
        rid = eng.add_request(CODE_PROMPTS[3], params)
        for _ in range(10):
            eng.step()
        seq = eng.requests[rid].group.seqs[0]
        assert eng._inflight is not None and len(seq.output_token_ids) == 9  # step 1's token came with step 2
        eng.rollback(rid, 5)  # the token in flight lands first: 10 tokens, then 5 dropped
        assert seq.output_token_ids == want[:5] and eng._inflight is None
        while eng.has_unfinished():
            outs = eng.step(finished_only=True)
        assert outs[0].outputs[0].token_ids == want


def test_sampled_rows_are_drawn_on_the_device_while_steps_overlap(tiny_py_artifact):
    """Rows sampled without a seed, penalty or logprobs are drawn on the device in launched steps, and the
    next step is fed the drawn token: top_k=1 gives greedy's tokens, and with top_k=2 every token is one of
    the two most likely after the tokens actually drawn before it (the model's own ranking, checked with
    prompt log-probabilities)."""
    prompts = CODE_PROMPTS[:4]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = run(tiny_py_artifact, False, prompts, greedy)
    one, stats = run(tiny_py_artifact, True, prompts, SamplingParams(temperature=0.7, top_k=1, max_tokens=24,
                                                                     ignore_eos=True))
    assert [t for t, _, _ in one] == [t for t, _, _ in want] and stats["overlapped_steps"] >= 20
    two, stats = run(tiny_py_artifact, True, prompts, SamplingParams(temperature=1.0, top_k=2, max_tokens=24,
                                                                     ignore_eos=True))
    assert stats["overlapped_steps"] >= 20
    with LLM(tiny_py_artifact, backend="reference") as llm:
        for prompt, (tokens, _, _) in zip(prompts, two):
            ids = llm.engine.encode(prompt)
            scored = llm.generate([ids + tokens], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
            for j, t in enumerate(tokens):
                top = scored.prompt_top_logprobs[len(ids) + j]
                assert t in sorted(top, key=top.get)[-2:], (j, t, top)
    # a seeded row is drawn on the host: its steps are waited for
    _, stats = run(tiny_py_artifact, True, prompts[:1], SamplingParams(temperature=1.0, seed=7, max_tokens=8))
    assert stats["overlapped_steps"] == 0


def test_speculation_under_load_overlaps_its_plain_steps(tiny_py_artifact):
    """With speculation on, steps above its batch limit (where it proposes nothing) are launched as without
    it, and steps at or below the limit wait, since the next step's proposals need their tokens: the
    outputs are those of steps one at a time, and of no speculation at all (greedy)."""
    # 8 requests of 4 to 32 tokens: the batch shrinks below the limit as they end
    params = [SamplingParams(temperature=0, max_tokens=4 + 4 * i, ignore_eos=True) for i in range(8)]
    prompts = CODE_PROMPTS[:8]

    def spec_run(overlap, spec):
        with LLM(tiny_py_artifact, backend="reference", num_blocks=256, overlap=overlap, speculative=spec) as llm:
            outs = llm.generate(prompts, params)
            return [o.outputs[0].token_ids for o in outs], llm.stats()
    want, _ = spec_run(False, None)
    # at most 3 sequences speculate: 8 decode together first, then, as requests end, few enough to propose
    spec = {"method": "ngram", "num_speculative_tokens": "auto", "max_batch": 3}
    got, stats = spec_run(True, spec)
    off, plain = spec_run(False, spec)
    assert got == want == off
    assert stats["overlapped_steps"] > 0 and plain["overlapped_steps"] == 0 and stats["spec_steps"] > 0, stats


def test_a_proposal_after_a_step_in_flight_continues_the_real_tokens(tiny_py_artifact):
    """A sequence that stops (a stop string) while the next step is in flight leaves few enough sequences
    to speculate: that step's tokens are read before anything is proposed, so every proposal starts from
    each sequence's real tokens, never from the stand-in of a launched step; outputs are those of steps
    one at a time."""
    from collections import deque

    from llmc.runtime.spec_decode import SpecDecoder
    prompts = CODE_PROMPTS[:4]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["\n"]) if i == 0 else
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for i in range(4)]
    seen = []  # (request, tokens the proposal continued)

    def spec_run(overlap):
        spec = {"method": "ngram", "num_speculative_tokens": "auto", "max_batch": 3}
        with LLM(tiny_py_artifact, backend="reference", num_blocks=256, overlap=overlap, speculative=spec) as llm:
            dec = llm.engine.spec
            for b in (1, 2, 4):  # as if plain steps of every size had been timed: they may speculate at once
                dec.plain_s[b] = deque([1.0] * SpecDecoder.WARM)
            inner = dec.proposer.propose

            def propose(seqs, ks):
                seen.extend((s.request_id, list(s.token_ids)) for s in seqs)
                return inner(seqs, ks)
            dec.proposer.propose = propose
            outs = llm.generate(prompts, params)
            return {o.request_id: list(o.prompt_token_ids) + o.outputs[0].token_ids for o in outs}, llm.stats()
    want, _ = spec_run(False)
    seen.clear()
    got, stats = spec_run(True)
    assert got == want and stats["overlapped_steps"] > 0 and seen
    assert all(want[rid][:len(ctx)] == ctx for rid, ctx in seen)
