"""NgramProposer against a brute-force search; AdaptiveK's choice of k from acceptance and batch size."""
import random

import pytest

from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence
from llmc.runtime.spec_decode.adaptive import AdaptiveK, best_k
from llmc.runtime.spec_decode.ngram import NgramProposer


def make_seq(prompt: list[int], output: list[int] = ()) -> Sequence:
    seq = Sequence("r", prompt, SamplingParams())
    for t in output:
        seq.append_token(t)
    return seq


def brute_force(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The documented rule, read literally: longest tail first, then its latest earlier occurrence."""
    end = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        tail = tokens[end - n:]
        if n >= end:
            continue
        for e in range(end - 1, n - 1, -1):
            if tokens[e - n:e] == tail:
                return tokens[e:e + k]
    return []


# ---- NgramProposer ----

def test_ngram_proposes_what_followed_the_tail():
    seq = make_seq([10, 11, 12, 13, 14, 15, 99, 11, 12])
    assert NgramProposer().propose([seq], [3])[0].tokens == [13, 14, 15]
    assert NgramProposer().propose([seq], [3])[0].probs is None


def test_ngram_prefers_longest_match_over_more_recent_shorter_one():
    # tail (1, 2, 3): the 3-gram occurred at 0..2 (then 7); the 1-gram 3 occurred later (then 8)
    seq = make_seq([1, 2, 3, 7, 5, 3, 8, 6, 1, 2, 3])
    assert NgramProposer(max_ngram=3).propose([seq], [2])[0].tokens == [7, 5]
    assert NgramProposer(max_ngram=1).propose([seq], [2])[0].tokens == [8, 6]


def test_ngram_prefers_most_recent_occurrence():
    seq = make_seq([4, 5, 1, 4, 5, 2, 4, 5, 3, 0, 4, 5])
    assert NgramProposer(max_ngram=2).propose([seq], [2])[0].tokens == [3, 0]


def test_ngram_match_may_overlap_the_tail():
    seq = make_seq([7, 7, 7])
    assert NgramProposer().propose([seq], [4])[0].tokens == [7]  # (7, 7) ended at 2: one token followed


def test_ngram_empty_when_no_match_or_k_zero():
    p = NgramProposer(max_ngram=3, min_ngram=2)
    assert p.propose([make_seq([1, 2, 3, 4, 5])], [4])[0].tokens == []
    assert p.propose([make_seq([1, 2, 3, 1])], [4])[0].tokens == []  # 1-gram matches, but min_ngram is 2
    assert p.propose([make_seq([9])], [4])[0].tokens == []
    assert p.propose([make_seq([1, 2, 1, 2])], [0])[0].tokens == []


def test_ngram_k_larger_than_what_followed():
    seq = make_seq([1, 2, 3, 4, 1, 2])
    assert NgramProposer().propose([seq], [10])[0].tokens == [3, 4, 1, 2]


def test_ngram_one_proposal_per_sequence_in_order():
    a, b = make_seq([1, 2, 1]), make_seq([5, 6, 7, 5])
    props = NgramProposer().propose([a, b, a], [1, 2, 0])
    assert [p.tokens for p in props] == [[2], [6, 7], []]


@pytest.mark.parametrize("max_ngram,min_ngram", [(4, 1), (3, 2), (1, 1)])
def test_ngram_incremental_index_matches_brute_force(max_ngram, min_ngram):
    rng = random.Random(max_ngram * 10 + min_ngram)
    proposer = NgramProposer(max_ngram, min_ngram)
    for trial in range(30):
        vocab = rng.choice([2, 3, 5, 50])
        seq = make_seq([rng.randrange(vocab) for _ in range(rng.randint(1, 20))])
        for _ in range(60):
            action = rng.random()
            if action < 0.6:
                for _ in range(rng.randint(1, 5)):
                    seq.append_token(rng.randrange(vocab))
            elif seq.num_output_tokens:
                # a rollback, seen either shrunk or already regrown (not deeper than the tail check)
                drop = rng.randint(1, seq.num_output_tokens)
                seq.truncate(seq.num_tokens - drop)
                if drop <= 32 and rng.random() < 0.5:
                    for _ in range(rng.randint(0, drop + 3)):
                        seq.append_token(rng.randrange(vocab))
            k = rng.randint(1, 8)
            got = proposer.propose([seq], [k])[0].tokens
            assert got == brute_force(seq.token_ids, k, max_ngram, min_ngram), (trial, seq.token_ids, k)
        proposer.release(seq)


def test_ngram_rollback_regrown_differently_is_seen():
    p = NgramProposer(max_ngram=2)
    seq = make_seq([1, 2, 3], [1, 2])
    assert p.propose([seq], [1])[0].tokens == [3]
    seq.truncate(3)  # drop (1, 2), then grow (5, 1, 2, 5) before the next call
    for t in (5, 1, 2, 5):
        seq.append_token(t)
    # tokens 1 2 3 5 1 2 5: tail (2, 5) occurs nowhere else; stale (1, 2) at 3..4 must not leak
    assert p.propose([seq], [2])[0].tokens == brute_force(seq.token_ids, 2, 2, 1) == [1, 2]


def test_ngram_release_drops_state():
    p = NgramProposer()
    a, b = make_seq([1, 2, 1]), make_seq([3, 4, 3])
    p.propose([a, b], [1, 1])
    assert set(p._indexes) == {a.seq_id, b.seq_id}
    p.release(a)
    p.release(a)  # twice is harmless
    assert set(p._indexes) == {b.seq_id}
    p.accepted(b, 1)  # a no-op
    assert p.propose([a], [1])[0].tokens == [2]  # a released sequence is re-indexed if asked again


def test_ngram_rejects_bad_lengths():
    with pytest.raises(ValueError):
        NgramProposer(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError):
        NgramProposer(min_ngram=0)


# ---- AdaptiveK ----

def test_best_k_follows_the_formula():
    def ratio(a, c, k):
        return sum(a ** i for i in range(k + 1)) / (1 + c * k)
    for a in (0.0, 0.05, 0.3, 0.6, 0.9, 0.99, 1.0):
        for c in (0.0, 0.1, 0.25, 1.0):
            k = best_k(a, c, 8)
            assert all(ratio(a, c, k) >= ratio(a, c, j) - 1e-12 for j in range(9)), (a, c, k)
    assert best_k(0.1, 0.1, 8) == 0 and best_k(0.11, 0.1, 8) >= 1  # k = 1 pays only when a > c
    assert best_k(1.0, 0.1, 8) == 8 and best_k(0.0, 0.1, 8, k_min=2) == 2


def test_adaptive_high_acceptance_grows_k_to_k_max():
    policy, seq = AdaptiveK(k_max=6, cost=0.1), make_seq([1])
    ks = []
    for _ in range(30):
        k = policy.choose([seq])[0]
        ks.append(k)
        policy.observe(seq, k, k)
    assert 0 < ks[0] < 6 and ks[-1] == 6
    assert ks == sorted(ks)


@pytest.mark.parametrize("cost", [0.1, 0.25])  # n-gram, draft model: one lucky probe is not enough at 0.25
def test_adaptive_zero_acceptance_drops_to_zero_then_probes_and_recovers(cost):
    policy, seq = AdaptiveK(k_max=8, cost=cost, probe_every=5), make_seq([1])
    ks = []
    for _ in range(80):
        k = policy.choose([seq])[0]
        ks.append(k)
        policy.observe(seq, k, 0)
    first_zero = ks.index(0)
    assert ks[first_zero - 1] > 0 and first_zero < 15
    # from then on: five zero steps, then a one-token probe (that fails), and again
    assert ks[first_zero:first_zero + 12] == [0] * 5 + [1] + [0] * 5 + [1]
    # the text turns repetitive: accepted probes bring the sequence back, probing again at once
    for _ in range(20):
        k = policy.choose([seq])[0]
        ks.append(k)
        policy.observe(seq, k, k)
    assert max(ks[-5:]) >= 4
    recovery = ks[80:]
    probe = recovery.index(1)
    assert all(k > 0 for k in recovery[probe:])


def test_adaptive_switches_off_above_max_batch():
    policy = AdaptiveK(k_max=4, max_batch=3)
    seqs = [make_seq([i]) for i in range(4)]
    assert policy.choose(seqs) == [0, 0, 0, 0]
    assert all(k > 0 for k in policy.choose(seqs[:3]))
    assert AdaptiveK.fixed(5, max_batch=3).choose(seqs) == [0] * 4
    assert AdaptiveK.fixed(5, max_batch=None).choose(seqs * 100) == [5] * 400


def test_adaptive_fixed_ignores_acceptance():
    for policy in (AdaptiveK.fixed(3), AdaptiveK(k_max=3, k_min=3)):
        seq = make_seq([1])
        for _ in range(50):
            assert policy.choose([seq]) == [3]
            policy.observe(seq, 3, 0)
        assert policy.is_fixed


def test_adaptive_rate_is_per_sequence_and_release_forgets():
    policy = AdaptiveK(k_max=8, init_rate=0.6)
    good, bad = make_seq([1]), make_seq([2])
    for _ in range(20):
        policy.observe(good, 4, 4)
        policy.observe(bad, 4, 0)
    assert policy.acceptance_rate(good) > 0.95 and policy.acceptance_rate(bad) < 0.05
    k_good, k_bad = policy.choose([good, bad])
    assert k_good == 8 and k_bad == 0
    policy.observe(good, 0, 0)  # nothing proposed: nothing learnt
    policy.release(bad)
    assert policy.acceptance_rate(bad) == 0.6
    with pytest.raises(ValueError):
        policy.observe(good, 2, 3)


def test_adaptive_counts_only_observed_positions():
    # 2 of 8 accepted: two successes and one failure were seen, the 5 positions after it were not
    policy, seq = AdaptiveK(init_rate=0.5, ema=0.5), make_seq([1])
    policy.observe(seq, 8, 2)
    assert policy.acceptance_rate(seq) == pytest.approx((1 - 0.25 * 0.5) * 0.5)
