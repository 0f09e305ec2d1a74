"""Speculative verify: greedy equals token-by-token greedy decoding, sampling is lossless (chi-square
against the target distribution, with broken acceptance rules as negative controls), seeds repeat."""

import pytest
import torch

from llmc.runtime.sampler import Sampler
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence
from llmc.runtime.spec_decode import rejection
from llmc.runtime.spec_decode.rejection import verify

V = 50


@pytest.fixture(autouse=True)
def one_thread():
    # tiny tensors: on a busy machine each intra-op parallel region waits for a second thread (ms a call)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def seq(prompt=(1, 2, 3), output=(), seed=None, **params):
    s = Sequence("r", list(prompt), SamplingParams(seed=seed, **params), seed=seed)
    for t in output:
        s.append_token(t)
    return s


def extended(s, tokens):
    """A fresh copy of `s` with `tokens` appended: the state one-at-a-time decoding would be in."""
    return seq(s.prompt_token_ids, s.output_token_ids + list(tokens), **vars(s.params))


def rand_logits(n, v=V, seed=0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def sequential_greedy(logits, s, draft):
    """Non-speculative greedy decoding fed the same rows: one Sampler call per token, stop at a mismatch."""
    tokens, logprobs = [], []
    for j in range(len(draft) + 1):
        out = Sampler()(logits[j:j + 1], [extended(s, tokens)])
        tokens.append(out.token_ids[0])
        logprobs.append(out.logprobs[0])
        if j == len(draft) or tokens[-1] != draft[j]:
            break
    return tokens, logprobs


# --- greedy -------------------------------------------------------------------------------------

def test_greedy_accepts_the_argmax_chain_then_corrects():
    k = 4
    logits = rand_logits(k + 1)
    logits[2] = 0.0
    logits[2, [9, 4, 30]] = 5.0  # a tie: the argmax is the lowest id
    chain = logits.argmax(-1).tolist()
    assert chain[2] == 4
    for m in range(k + 1):
        draft = chain[:m] + [(t + 1) % V for t in chain[m:k]]
        tokens, logprobs, _ = verify(logits, seq(temperature=0.0), draft, None, Sampler())
        assert tokens == chain[:m + 1]
        assert tokens == sequential_greedy(logits, seq(temperature=0.0), draft)[0]
        assert logprobs == [0.0] * (m + 1)  # logprobs not asked for, as the Sampler reports them


def test_greedy_penalty_sees_the_draft_token_before_it():
    logits = torch.zeros(3, 8)
    logits[0, 5] = 4.0  # row 0 picks 5
    logits[1, 5], logits[1, 2] = 3.0, 2.5  # raw argmax of row 1 is 5 again ...
    logits[2, 7] = 1.0
    s = seq(prompt=(1, 0), temperature=0.0, repetition_penalty=2.0)
    # ... but after draft[0] = 5 the penalty halves its logit: 1.5 < 2.5, so row 1 picks 2
    tokens, _, _ = verify(logits, s, [5, 5], None, Sampler())
    assert tokens == [5, 2]
    assert tokens == sequential_greedy(logits, s, [5, 5])[0]
    assert verify(logits, s, [5, 2], None, Sampler())[0] == [5, 2, 7]
    assert s.token_ids == [1, 0] and s.output_token_ids == []  # seq is not modified


@pytest.mark.parametrize("trial", range(6))
def test_greedy_equals_sequential_decoding_with_penalties_and_filters(trial):
    g = torch.Generator().manual_seed(trial)
    k = 5
    logits = torch.randn(k + 1, 12, generator=g)  # a small vocabulary: penalties often flip the argmax
    s = seq(prompt=torch.randint(0, 12, (6,), generator=g).tolist(), output=[3, 3], temperature=0.0,
            repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3, top_k=4, top_p=0.9,
            logprobs=True)
    chain = []  # the greedy chain, one Sampler call per token
    for j in range(k + 1):
        chain.append(Sampler()(logits[j:j + 1], [extended(s, chain)]).token_ids[0])
    m = trial % (k + 1)
    draft = chain[:m] + [(t + 1) % 12 for t in chain[m:k]]
    tokens, logprobs, _ = verify(logits, s, draft, None, Sampler())
    expected_tokens, expected_logprobs = sequential_greedy(logits, s, draft)
    assert tokens == expected_tokens == chain[:m + 1]
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)


# --- sampled: losslessness ----------------------------------------------------------------------

K = 2
P = torch.tensor([  # target logits by position, whatever came before ("context-free")
    [1.2, 0.3, 2.0, -0.5, 0.8, 0.0],
    [0.1, 1.7, -0.3, 1.1, 0.6, 1.4],
    [0.9, -0.2, 0.4, 1.6, 1.3, 0.2],
    [1.5, 0.7, 1.0, 0.3, -0.4, 1.1],
    [0.2, 1.3, 0.5, 1.0, 1.6, -0.3],
])
Q = torch.tensor([  # draft distributions by position: unlike p, with mass where p is filtered and none on some p tokens
    [0.05, 0.30, 0.10, 0.25, 0.30, 0.00],
    [0.40, 0.05, 0.25, 0.00, 0.10, 0.20],
    [0.10, 0.35, 0.15, 0.05, 0.00, 0.35],
    [0.30, 0.00, 0.20, 0.25, 0.15, 0.10],
])
D = [2, 4, 3, 1]  # a deterministic proposer's tokens by position (4 is outside row 1's top 3)
N = 6000  # samples a case: ~1 s on an idle core; the wrong rules below fail by p < 1e-30 at 3000
CASES = {
    "temperature": (dict(temperature=0.7), Q, 11),
    "top_k": (dict(top_k=3), Q, None),
    "top_p": (dict(top_p=0.8), Q, 12),
    "min_p": (dict(min_p=0.1), Q, None),
    "all_filters": (dict(temperature=0.7, top_k=3, top_p=0.8, min_p=0.1), Q, 13),
    "deterministic_proposer": (dict(temperature=0.7, top_k=3), None, 14),
}


def target_probs(params):
    """[3, V]: the target's distribution of each of the first three tokens (one Sampler row each)."""
    return torch.softmax(Sampler().process(P[:3], [seq(**params)] * 3), -1).double()


def speculate(params, q, seed, n=N):
    """Counts [V, V, V] of the first three tokens of n independent generations by verify steps of K drafts
    (three tokens: a step's bonus token is among them)."""
    torch.manual_seed(1000 + (seed or 0))  # the unseeded cases draw from torch's default generator
    s = seq(seed=seed, **params)  # no penalties: the target ignores the history, so one seq serves all
    g = torch.Generator().manual_seed(7)
    if q is None:
        drafts = {t: [D[t:t + K]] * n for t in range(3)}
    else:
        drafts = {t: torch.stack([torch.multinomial(q[t + j], n, replacement=True, generator=g)
                                  for j in range(K)], 1).tolist() for t in range(3)}
    sampler, counts = Sampler(), torch.zeros(len(P[0]), len(P[0]), len(P[0]))
    for i in range(n):
        out, t = [], 0
        while len(out) < 3:
            tokens, _, _ = verify(P[t:t + K + 1], s, drafts[t][i], None if q is None else q[t:t + K], sampler)
            out, t = out + tokens, t + len(tokens)
        counts[out[0], out[1], out[2]] += 1
    return counts.double()


def pvalues(counts, p):
    """Chi-square p-values of the first token, the first two and the first three against the i.i.d. target."""
    pair = p[0][:, None] * p[1][None, :]
    return (chi2_pvalue(counts.sum((1, 2)), p[0]), chi2_pvalue(counts.sum(2), pair),
            chi2_pvalue(counts, pair[:, :, None] * p[2][None, None, :]))


def chi2_pvalue(counts, probs):
    """Pearson's chi-square goodness of fit; cells expected under 5 pooled; 0 if an impossible cell occurs."""
    counts, expected = counts.flatten(), probs.flatten() * counts.sum()
    if counts[expected == 0].sum() > 0:
        return 0.0
    small = (expected > 0) & (expected < 5)
    big = expected >= 5
    counts = torch.cat([counts[big], counts[small].sum()[None]]) if small.any() else counts[big]
    expected = torch.cat([expected[big], expected[small].sum()[None]]) if small.any() else expected[big]
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(len(counts) - 1, dtype=torch.float64)
    return torch.special.gammaincc(df / 2, stat / 2).item()  # the chi-square survival function


@pytest.mark.parametrize("case", CASES)
def test_emitted_tokens_follow_the_target_distribution(case):
    params, q, seed = CASES[case]
    p = target_probs(params)
    assert ((p > 0).sum(1) >= 2).all(), "the filters must leave a choice to test"
    assert min(pvalues(speculate(params, q, seed), p)) > 1e-4


@pytest.mark.parametrize("broken", ["accept_always", "resample_from_p"])
def test_a_wrong_rule_fails_the_same_check(broken, monkeypatch):
    if broken == "accept_always":
        monkeypatch.setattr(rejection, "_accept_probs", lambda p_x, q_x: torch.ones_like(p_x))
    else:
        monkeypatch.setattr(rejection, "_residual", lambda p, q: p)
    params, q, seed = CASES["temperature"]
    assert min(pvalues(speculate(params, q, seed, n=3000), target_probs(params))) < 1e-4


# --- sampled: seeds, logprobs, edge cases --------------------------------------------------------

def test_same_seed_same_tokens_and_the_seed_matters():
    logits = rand_logits(4, 1000, seed=0) / 3  # a broad target: two seeds disagree almost surely
    q = torch.softmax(logits[:3] + rand_logits(3, 1000, seed=1) / 3, -1)  # near p: some accepted, some not
    draft = [int(torch.multinomial(q[j], 1, generator=torch.Generator().manual_seed(j))) for j in range(3)]

    def run(seed):
        s = seq(seed=seed)
        return [verify(logits, s, draft, q, Sampler()) for _ in range(8)]
    first = run(123)
    assert 1 < len({len(tokens) for tokens, _, _ in first}), "acceptance must vary, or the uniforms go untested"
    torch.manual_seed(0)
    assert run(123) == first
    # a seeded request draws only from its own generator: torch's default one is where it was
    assert torch.rand(1).item() == torch.rand(1, generator=torch.Generator().manual_seed(0)).item()
    assert run(124) != first


@pytest.mark.parametrize("trial", range(8))
def test_logprobs_are_those_of_the_processed_rows(trial):
    g = torch.Generator().manual_seed(trial)
    k, v = 3, 10
    logits = torch.randn(k + 1, v, generator=g) * 2
    q = torch.softmax(torch.randn(k, v, generator=g), -1)
    draft = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(k)]
    s = seq(output=[4, 4, 7], seed=trial, temperature=0.8, top_k=6, min_p=0.05,
            repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.2)
    tokens, logprobs, _ = verify(logits, s, draft, q, Sampler())
    assert 1 <= len(tokens) <= k + 1 and tokens[:-1] == draft[:len(tokens) - 1]
    for j, (t, lp) in enumerate(zip(tokens, logprobs)):
        row = Sampler().process(logits[j:j + 1], [extended(s, tokens[:j])])[0]  # history: draft[:j]
        assert lp == pytest.approx(torch.log_softmax(row, -1)[t].item(), abs=1e-5)


def test_filtered_draft_tokens_zero_q_and_empty_residual():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    for seed in range(100):
        # token 4 is outside row 0's top 2: p = 0 rejects it even when q puts all its mass there
        q = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
        for qq in (q, None):
            tokens, _, _ = verify(logits, seq(seed=seed, top_k=2), [4], qq, Sampler())
            assert len(tokens) == 1 and tokens[0] in (0, 1)
        # q(x) = 0 for a token the target allows (not drawn from q): min(1, p/0) accepts it
        tokens, _, _ = verify(logits, seq(seed=seed), [3], q, Sampler())
        assert tokens[:1] == [3] and len(tokens) == 2
        # q == p: the residual max(0, p - q) is all zero, so the token after a rejection comes from p
        p0 = torch.softmax(Sampler().process(logits[:1], [seq(top_k=2)])[0], -1)
        tokens, logprobs, _ = verify(logits, seq(seed=seed, top_k=2), [4], p0[None], Sampler())
        assert len(tokens) == 1 and tokens[0] in (0, 1) and all(lp > -10 for lp in logprobs)
    # k = 0: one token from row 0
    assert verify(logits[:1], seq(temperature=0.0), [], None, Sampler())[0] == [0]
    assert len(verify(logits[:1], seq(seed=1), [], torch.zeros(0, 5), Sampler())[0]) == 1


def test_min_tokens_threshold_inside_a_draft_masks_only_the_rows_before_it():
    """Row j of a verify step is the sequence with draft[:j] appended: with 2 tokens out and min_tokens 4 the
    end of sequence is held off for rows 0 and 1 only."""
    s = seq(output=(10, 11), temperature=0.0, min_tokens=4)
    views = rejection.row_views(s, [5, 6, 7])
    assert [len(v.output_token_ids) for v in views] == [2, 3, 4, 5]
    processed = Sampler(eos_token_ids=[3]).process(torch.zeros(4, 16), views)
    assert processed[:, 3].isneginf().tolist() == [True, True, False, False]
    far = seq(output=(10,), temperature=0.0, min_tokens=9)  # every row held off: one view serves them all
    assert rejection.row_views(far, [5, 6]) == [far] * 3
