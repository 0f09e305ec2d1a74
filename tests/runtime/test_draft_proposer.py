"""DraftProposer on the shipped target/draft pair (reference backend): its guesses are the draft model's own
greedy continuation through verification rounds and rollbacks, its probs are the distributions drawn
from, and its blocks come back."""
from __future__ import annotations

import pytest
import torch

import llmc
from llmc.errors import LLMCError
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence
from llmc.runtime.spec_decode.draft import DraftProposer

from tests.conftest import CODE_PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def draft_artifact(tmp_path_factory):
    return llmc.compile("builtin:tiny-py-draft", tmp_path_factory.mktemp("draft") / "tiny-py-draft.llmc")


@pytest.fixture(scope="module")
def draft_llm(draft_artifact):
    return llmc.LLM(draft_artifact, backend="reference", max_num_seqs=8)


@pytest.fixture(scope="module")
def tokenizer(draft_artifact):
    return draft_artifact.tokenizer()


def proposer(draft_artifact, tiny_py_artifact, **kw) -> DraftProposer:
    kw = {"backend": "reference", "block_size": 4, "num_blocks": 256, **kw}
    return DraftProposer(draft_artifact, tiny_py_artifact.info, **kw)


def target_seqs(tokenizer, prompts, params=GREEDY) -> list[Sequence]:
    return [Sequence(f"r{i}", tokenizer.encode(p, add_special_tokens=False), params, seed=i)
            for i, p in enumerate(prompts)]


def draft_greedy(llm, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
    """The draft model's own greedy continuation of each sequence's tokens, k tokens each."""
    todo = [(s, k) for s, k in zip(seqs, ks) if k > 0]
    outs = iter(llm.generate([list(s.token_ids) for s, _ in todo],
                             [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for _, k in todo]))
    return [next(outs).token_ids if k > 0 else [] for k in ks]


def verify(seq: Sequence, guesses: list[int], n: int, vocab: int) -> None:
    """What the target does after verification: keep n guesses and append a correction that is not guess n+1."""
    for t in guesses[:n]:
        seq.append_token(t)
    seq.append_token((guesses[n] + 1) % vocab if n < len(guesses) else 17)


def test_greedy_proposals_follow_the_draft_through_rounds_and_rollbacks(draft_artifact, tiny_py_artifact,
                                                                        draft_llm, tokenizer):
    p = proposer(draft_artifact, tiny_py_artifact)
    vocab = tiny_py_artifact.info.vocab_size
    seqs = target_seqs(tokenizer, CODE_PROMPTS[:4])
    rounds = [([4, 2, 0, 5], [1, 2, 0, 0]),  # a k of 0 proposes nothing
              ([3, 5, 2, 1], [3, 0, 2, 1]),  # every guess accepted: the bonus token follows them
              ([6, 1, 4, 3], [2, 1, 0, 3])]
    for ks, accept in rounds:
        props = p.propose(seqs, ks)
        assert [q.tokens for q in props] == draft_greedy(draft_llm, seqs, ks)
        assert all(q.probs is None for q in props)
        for s, q, n in zip(seqs, props, accept):
            n = min(n, len(q.tokens))
            verify(s, q.tokens, n, vocab)
            p.accepted(s, n)
    # the target rolls back (rejected tokens, a recompute): the draft drops what no longer matches
    seqs[0].truncate(seqs[0].num_tokens - 3)
    seqs[1].truncate(seqs[1].num_prompt_tokens)
    seqs[2].truncate(seqs[2].num_tokens - 1)
    seqs[2].append_token(5)
    ks = [4, 3, 5, 2]
    props = p.propose(seqs, ks)
    assert [q.tokens for q in props] == draft_greedy(draft_llm, seqs, ks)
    # a round whose accepted() never came: the next proposal still continues the target's tokens
    for s, q in zip(seqs, props):
        verify(s, q.tokens, 1, vocab)
    ks = [2, 4, 1, 3]
    assert [q.tokens for q in p.propose(seqs, ks)] == draft_greedy(draft_llm, seqs, ks)


def test_one_step_per_draft_position_and_rejected_guesses_free_blocks(draft_artifact, tiny_py_artifact, tokenizer):
    p = proposer(draft_artifact, tiny_py_artifact)
    bm = p.block_manager
    calls = []
    execute = p.executor.execute
    p.executor.execute = lambda batch: calls.append([len(s.token_ids) for s in batch.seqs]) or execute(batch)
    seqs = target_seqs(tokenizer, CODE_PROMPTS[4:7])
    p.propose(seqs, [3, 1, 9])
    # the catch-up of all prompts is one step that also gives guess 1; then one step per further position
    assert calls[0] == [s.num_tokens for s in seqs] and calls[1:] == [[1, 1]] * 2 + [[1]] * 6
    s = seqs[2]
    held = len(p.drafts[s.seq_id].seq.block_table)
    assert held == bm.blocks_for(s.num_tokens + 8)  # K/V for the prompt and guesses 1..8
    verify(s, p.drafts[s.seq_id].seq.token_ids[s.num_tokens:], 0, 8192)
    p.accepted(s, 0)
    d = p.drafts[s.seq_id].seq
    assert d.token_ids == s.token_ids[:-1] and d.num_computed_tokens == d.num_tokens
    assert len(d.block_table) == bm.blocks_for(d.num_tokens) < held


def test_prefix_sharing_between_sequences_and_copy_on_write(draft_artifact, tiny_py_artifact, draft_llm, tokenizer):
    p = proposer(draft_artifact, tiny_py_artifact)
    bm = p.block_manager
    ids = tokenizer.encode(CODE_PROMPTS[2] + "\n        self.items = []", add_special_tokens=False)
    a, b = Sequence("a", ids[:8], GREEDY), Sequence("b", ids[:12], GREEDY)  # a's prompt fills 2 blocks of 4
    p.propose([a], [2])
    p.accepted(a, 0)  # a's draft holds K/V of its whole prompt, both blocks registered
    p.propose([b], [1])
    assert bm.stats.prefix_cache_hit_tokens == 8  # b shares a's two blocks
    # a's next round feeds its last prompt token again (for its logits) into the shared block: a copy
    ks = [3, 2]
    assert [q.tokens for q in p.propose([a, b], ks)] == draft_greedy(draft_llm, [a, b], ks)
    assert bm.stats.cow_copies == 1


def test_sampled_proposals_carry_their_distributions(draft_artifact, tiny_py_artifact, tokenizer):
    params = SamplingParams(temperature=0.8, top_k=20, seed=3)
    ks = [5, 3]

    def run():
        p = proposer(draft_artifact, tiny_py_artifact)
        return p.propose(target_seqs(tokenizer, CODE_PROMPTS[:2], params), ks)

    props = run()
    for q, k in zip(props, ks):
        assert len(q.tokens) == k and q.probs.shape == (k, 8192) and q.probs.dtype == torch.float32
        assert torch.allclose(q.probs.sum(-1), torch.ones(k), atol=1e-5)
        assert ((q.probs > 0).sum(-1) <= 20).all()  # top-k applied
        assert (q.probs[torch.arange(k), q.tokens] > 0).all()
    # drawn with each sequence's seeded generator: the same seeds draw the same guesses
    assert [q.tokens for q in run()] == [q.tokens for q in props]


def test_out_of_draft_blocks_proposes_less_and_release_frees_every_block(draft_artifact, tiny_py_artifact,
                                                                        tokenizer):
    p = proposer(draft_artifact, tiny_py_artifact, num_blocks=6)  # 24 token slots
    bm = p.block_manager
    short, long_ = target_seqs(tokenizer, ["def f(x):", "class Stack:\n    def __init__(self):\n" * 3])
    assert long_.num_tokens > 24
    props = p.propose([long_, short], [4, 30])
    assert props[0].tokens == [] and props[0].probs is None
    assert 0 < len(props[1].tokens) < 30  # shortened to the blocks left
    p.release(short)
    p.release(long_)  # held nothing: a no-op
    assert bm.num_used_blocks == 0

    p = proposer(draft_artifact, tiny_py_artifact)
    seqs = target_seqs(tokenizer, CODE_PROMPTS)
    for s, q in zip(seqs, p.propose(seqs, [3] * len(seqs))):
        verify(s, q.tokens, 1, 8192)
        p.accepted(s, 1)
    p.propose(seqs, [2] * len(seqs))
    assert p.block_manager.num_used_blocks > 0
    for s in seqs:
        p.release(s)
    assert p.block_manager.num_used_blocks == 0 and not p.drafts


def test_a_draft_with_another_vocabulary_is_refused(llama_artifact, tiny_py_artifact):
    with pytest.raises(LLMCError, match=r"320 tokens.*8192.*share the target's tokenizer"):
        DraftProposer(llama_artifact, tiny_py_artifact.info, backend="reference", num_blocks=8)
