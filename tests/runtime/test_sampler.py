"""Sampler: greedy, seeding, filters and penalties against direct formulas."""

import math

import pytest
import torch

from llmc.runtime.sampler import Sampler
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence, SequenceGroup

V = 50


def seq(prompt=(1, 2, 3), output=(), **params):
    s = Sequence("r", list(prompt), SamplingParams(**params), seed=params.get("seed"))
    for t in output:
        s.append_token(t)
    return s


def rand_logits(n, v=V, seed=0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_ties_to_lowest_id():
    logits = rand_logits(4)
    logits[3] = 0.0
    logits[3, [7, 3, 11]] = 5.0  # a three-way tie
    out = Sampler()(logits, [seq(temperature=0.0) for _ in range(4)])
    expected = logits.argmax(-1).tolist()
    expected[3] = 3
    assert out.token_ids == expected


def test_logprobs_are_log_softmax_of_processed_logits():
    logits = rand_logits(3)
    seqs = [seq(temperature=0.7, seed=1), seq(temperature=0.0), seq(temperature=1.3, seed=2)]
    out = Sampler()(logits, seqs)
    for i, (s, t) in enumerate(zip(seqs, out.token_ids)):
        temp = s.params.temperature or 1.0
        expected = torch.log_softmax(logits[i] / temp, -1)[t].item()
        assert out.logprobs[i] == pytest.approx(expected, abs=1e-5)


def test_seeded_sampling_repeats_and_depends_on_seed():
    logits = torch.zeros(1, 1000)  # uniform: any two seeds disagree almost surely
    def draws(seed):
        s = seq(seed=seed)
        return [Sampler()(logits, [s]).token_ids[0] for _ in range(6)]
    assert draws(123) == draws(123)
    assert draws(123) != draws(124)


def test_seed_is_independent_of_batch_composition():
    logits = rand_logits(3, v=200)
    alone = Sampler()(logits[1:2], [seq(seed=5)]).token_ids
    batched = Sampler()(logits, [seq(seed=9), seq(seed=5), seq()]).token_ids
    assert batched[1] == alone[0]


def test_n_samples_with_seed_use_seed_plus_index():
    group = SequenceGroup("g", [1, 2], SamplingParams(n=3, seed=40))
    logits = torch.zeros(3, 1000)
    got = Sampler()(logits, group.seqs).token_ids
    for i in range(3):
        g = torch.Generator().manual_seed(40 + i)
        assert got[i] == torch.multinomial(torch.softmax(logits[i], -1), 1, generator=g).item()


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = rand_logits(6)
    logits[5] = 0.0
    logits[5, [9, 4]] = 2.0  # tie at the top: filters must keep the lowest id like argmax
    greedy = Sampler()(logits, [seq(temperature=0.0) for _ in range(6)]).token_ids
    for trial in range(3):
        top_k = Sampler()(logits, [seq(top_k=1, seed=trial) for _ in range(6)]).token_ids
        top_p = Sampler()(logits, [seq(top_p=1e-6, seed=trial) for _ in range(6)]).token_ids
        assert top_k == greedy and top_p == greedy


def test_top_k_keeps_exactly_k_best():
    logits = rand_logits(2)
    processed = Sampler().process(logits, [seq(top_k=5), seq(top_k=-1)])
    kept = torch.isfinite(processed[0])
    assert kept.sum() == 5
    assert set(kept.nonzero().flatten().tolist()) == set(logits[0].topk(5).indices.tolist())
    assert torch.equal(processed[1], logits[1])


def test_top_p_matches_direct_definition():
    logits = rand_logits(3)
    for p in (0.3, 0.6, 0.9):
        processed = Sampler().process(logits, [seq(top_p=p) for _ in range(3)])
        for i in range(3):
            probs = torch.softmax(logits[i], -1)
            order = probs.argsort(descending=True).tolist()
            keep, mass = set(), 0.0
            for t in order:  # smallest prefix of the ranking whose mass reaches p
                keep.add(t)
                mass += probs[t].item()
                if mass >= p:
                    break
            assert set(torch.isfinite(processed[i]).nonzero().flatten().tolist()) == keep


def test_min_p_filters_relative_to_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    processed = Sampler().process(logits, [seq(min_p=0.15)])  # floor = 0.075
    assert torch.isfinite(processed[0]).tolist() == [True, True, True, False, False]
    for _ in range(20):
        assert Sampler()(logits, [seq(min_p=0.15)]).token_ids[0] in (0, 1, 2)


def test_penalties_match_direct_formula():
    logits = rand_logits(1)[0]
    prompt, output = [1, 2, 3, 3], [3, 7, 7, 7, 40]
    s = seq(prompt, output, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    processed = Sampler().process(logits[None], [s])[0]
    expected = logits.clone()
    for t in set(prompt + output):  # HF repetition penalty over prompt+output
        x = expected[t].item()
        expected[t] = x / 1.3 if x > 0 else x * 1.3
    for t in set(output):  # OpenAI penalties over output only
        expected[t] -= 0.25 * output.count(t) + 0.5
    torch.testing.assert_close(processed, expected)
    untouched = [t for t in range(V) if t not in prompt + output]
    assert torch.equal(processed[untouched], logits[untouched])


def test_repetition_penalty_makes_seen_tokens_less_likely_either_sign():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    processed = Sampler().process(logits, [seq(prompt=[0, 1], repetition_penalty=2.0)])
    assert processed[0].tolist() == [1.0, -4.0, 1.0, 0.5]


def test_temperature_scales_logits_and_rows_are_independent():
    logits = rand_logits(2)
    seqs = [seq(temperature=0.5), seq(temperature=0.0, frequency_penalty=1.0, output=[4])]
    processed = Sampler().process(logits, seqs)
    torch.testing.assert_close(processed[0], logits[0] / 0.5)
    expected = logits[1].clone()
    expected[4] -= 1.0
    torch.testing.assert_close(processed[1], expected)


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    s = seq(seed=0)
    counts = [0, 0, 0]
    for _ in range(2000):
        counts[Sampler()(logits, [s]).token_ids[0]] += 1
    for c, p in zip(counts, (0.7, 0.2, 0.1)):
        assert math.isclose(c / 2000, p, abs_tol=0.04), counts


def test_unseeded_rows_drawn_together_each_follow_their_own_distribution():
    # three sampled rows (one seeded) and a greedy one in one batch: the unseeded rows share one draw
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.2, 0.5, 0.3], [0.1, 0.6, 0.3]])
    seqs = [seq(temperature=1.0), seq(temperature=1.0, seed=3), seq(temperature=1.0), seq(temperature=0)]
    counts = torch.zeros(4, 3)
    torch.manual_seed(0)
    for _ in range(2000):
        for i, t in enumerate(Sampler()(torch.log(probs), seqs).token_ids):
            counts[i, t] += 1
    assert torch.allclose(counts[:3] / 2000, probs[:3], atol=0.04), counts
    assert counts[3].tolist() == [0, 2000, 0]  # the greedy row


def test_logit_bias_is_added_first_and_decides_greedy_and_draws():
    logits = rand_logits(3)
    bias = {5: 100.0, 9: -2.5}
    s_bias = seq(temperature=0.0, logit_bias=bias)
    assert not s_bias.params.plain_greedy and not s_bias.argmax_only
    # added before the repetition penalty, which then scales the biased logit (vLLM's order)
    s_pen = seq(prompt=[9], temperature=0.8, logit_bias={"9": 3.0}, repetition_penalty=1.5)
    processed = Sampler().process(logits, [s_bias, s_pen, seq(temperature=0.0)])
    want = logits.clone()
    want[0, 5] += 100.0
    want[0, 9] -= 2.5
    x = want[1, 9].item() + 3.0
    want[1, 9] = x / 1.5 if x > 0 else x * 1.5
    want[1] /= 0.8
    torch.testing.assert_close(processed, want)
    out = Sampler()(logits[:2], [s_bias, seq(temperature=0.0)])
    assert out.token_ids == [5, int(logits[1].argmax())]
    # -100 bans: a token never drawn, even at a high temperature, where it was the most likely
    top = int(logits[2].argmax())
    banned = [seq(temperature=2.0, seed=i, logit_bias={top: -100.0}) for i in range(200)]
    draws = Sampler()(logits[2:3].expand(200, V), banned).token_ids
    assert top not in draws and len(set(draws)) > 5


@pytest.mark.parametrize("bias, msg", [
    ([1, 2], "logit_bias must map token ids"), ({-1: 1.0}, "keys must be token ids"), ({"x": 1.0}, "keys must be"),
    ({3: 101.0}, r"logit_bias\[3\] must be from -100 to 100"), ({3: float("nan")}, r"logit_bias\[3\] must be a finite number"),
])
def test_logit_bias_errors(bias, msg):
    from llmc.errors import RequestError
    with pytest.raises(RequestError, match=msg):
        SamplingParams(logit_bias=bias).validate()


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    from llmc.errors import RequestError
    p = SamplingParams(logit_bias={"49": 1.0})
    assert p.logit_bias == {49: 1.0}
    p.check_vocab(50)
    with pytest.raises(RequestError, match=r"token ids \[0, 50\); got 50"):
        SamplingParams(logit_bias={50: 1.0}).check_vocab(50)


def test_min_tokens_holds_off_the_end_of_sequence_and_stop_ids():
    logits = rand_logits(2)
    sampler = Sampler(eos_token_ids=[3])
    short = seq(output=(10, 11), temperature=0.0, min_tokens=3, stop_token_ids=[8])
    long = seq(output=(10, 11, 12), temperature=0.0, min_tokens=3, stop_token_ids=[8])
    assert not short.params.plain_greedy
    processed = sampler.process(logits, [short, long])
    assert processed[0, [3, 8]].isneginf().all() and not processed[1].isneginf().any()
    keep = [t for t in range(V) if t not in (3, 8)]
    assert torch.equal(processed[0, keep], logits[0, keep])
    forced = [seq(output=(10,) * n, temperature=0.0, min_tokens=3, logit_bias={3: 100.0}) for n in (2, 3)]
    assert sampler(logits, forced).token_ids[1] == 3 and sampler(logits, forced).token_ids[0] != 3


def test_min_tokens_errors():
    from llmc.errors import RequestError
    with pytest.raises(RequestError, match=r"min_tokens must be from 0 to max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5).validate()
    with pytest.raises(RequestError, match="min_tokens must be an int"):
        SamplingParams(min_tokens=1.5).validate()


def test_logits_processors_run_per_row_after_the_bias_and_see_the_outputs():
    seen = []

    def even_only(ids, row):
        seen.append(list(ids))
        out = row.clone()
        out[1::2] = float("-inf")
        return out
    logits = rand_logits(2)
    s = seq(output=(4, 9), temperature=0.0, logits_processors=[even_only], logit_bias={7: 50.0})
    assert not s.params.plain_greedy and not Sampler.on_device(s)
    out = Sampler()(logits, [s, seq(temperature=0.0)])
    assert out.token_ids[0] == int(logits[0, ::2].argmax()) * 2 and seen == [[4, 9]]
    assert out.token_ids[1] == int(logits[1].argmax())
    from llmc.errors import RequestError
    with pytest.raises(RequestError, match="a logits processor returned NoneType"):
        Sampler()(logits[:1], [seq(temperature=0.0, logits_processors=[lambda ids, row: None])])
    with pytest.raises(RequestError, match="logits_processors must be a list of callables"):
        SamplingParams(logits_processors=["x"]).validate()


def _reference_row(logits: torch.Tensor, s, eos=(3,)) -> torch.Tensor:
    """Sampler.process for one row, step by step in plain Python over a list (the module docstring's order)."""
    p, v = s.params, logits.tolist()
    for t, b in (p.logit_bias or {}).items():
        v[t] += b
    if len(s.output_token_ids) < p.min_tokens:
        for t in {*eos, *p.stop_token_ids}:
            v[t] = float("-inf")
    if p.repetition_penalty != 1.0:
        for t in set(s.token_ids):
            v[t] = v[t] / p.repetition_penalty if v[t] > 0 else v[t] * p.repetition_penalty
    for t in set(s.output_token_ids):
        v[t] -= p.frequency_penalty * s.output_token_ids.count(t) + p.presence_penalty
    v = [x / (p.temperature or 1.0) for x in v]
    order = sorted(range(len(v)), key=lambda t: (-v[t], t))  # ties: the lowest id first
    keep = set(order[:p.top_k] if 0 < p.top_k < len(v) else order)
    if p.top_p < 1.0:
        z = [math.exp(v[t] - v[order[0]]) if t in keep else 0.0 for t in order]
        total, before, kept = sum(z), 0.0, set()
        for rank, (t, w) in enumerate(zip(order, z)):
            if t in keep and (rank == 0 or before / total < p.top_p):
                kept.add(t)
            before += w
        keep = kept
    v = [x if t in keep else float("-inf") for t, x in enumerate(v)]
    if p.min_p > 0:
        top = max(v)
        v = [x if math.exp(x - top) >= p.min_p else float("-inf") for x in v]
    return torch.tensor(v)


def test_process_matches_a_plain_reference_under_random_combinations():
    """Every option at once, 300 random rows in batches: bias, min_tokens, penalties, temperature, top-k,
    top-p and min-p composed in the documented order, against a one-row plain Python version."""
    import random
    rng = random.Random(0)
    sampler = Sampler(eos_token_ids=[3])
    for trial in range(50):
        seqs = []
        for _ in range(6):
            out = [rng.randrange(V) for _ in range(rng.randint(0, 6))]
            params = dict(temperature=rng.choice([0.0, 0.5, 1.0, 1.7]), top_k=rng.choice([0, 0, 1, 5, 20]),
                          top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.05]), min_p=rng.choice([0.0, 0.0, 0.1]),
                          repetition_penalty=rng.choice([1.0, 1.3, 0.8]), presence_penalty=rng.choice([0.0, 0.5]),
                          frequency_penalty=rng.choice([0.0, -0.4, 0.3]), min_tokens=rng.choice([0, 0, 3, 8]),
                          max_tokens=16, stop_token_ids=rng.choice([[], [7]]),
                          logit_bias=rng.choice([None, {rng.randrange(V): rng.uniform(-100, 100)},
                                                 {rng.randrange(V): 5.0, rng.randrange(V): -5.0}]))
            seqs.append(seq(prompt=[rng.randrange(V) for _ in range(4)], output=out, **params))
        logits = rand_logits(len(seqs), seed=trial)
        got = sampler.process(logits, seqs)
        for i, s in enumerate(seqs):
            want = _reference_row(logits[i], s)
            assert torch.equal(got[i].isinf(), want.isinf()), (trial, i, s.params)
            finite = ~want.isinf()
            torch.testing.assert_close(got[i][finite], want[finite], rtol=1e-5, atol=1e-5)


def test_a_row_that_is_no_distribution_fails_alone():
    # a logits processor's NaN, or every token filtered out, must not fail the draw of the other rows
    logits = rand_logits(3)
    logits[1] = float("nan")
    logits[2] = float("-inf")
    logits[2, 7] = float("inf")
    seqs = [seq(temperature=1.0), seq(temperature=1.0), seq(temperature=1.0, seed=3)]
    out = Sampler()(logits, seqs)
    assert 0 <= out.token_ids[0] < V and out.token_ids[2] == 7
