"""Prompt lookup decoding: propose what followed the last earlier occurrence of a sequence's tail.

Text that quotes its prompt (summaries, code edits, retrieval answers) or repeats itself makes the
next tokens easy to guess without a draft model: find where the last n tokens occurred before and
propose the tokens that came after them. The guesses are deterministic (`Proposal.probs is None`),
so the target verifies them as one-hot proposals.

Each sequence keeps an index `n-gram -> end position of its most recent earlier occurrence`, filled
in as tokens are appended, so a step costs O(new tokens * ngram lengths), not O(len^2).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from llmc.runtime.sequence import Sequence
from llmc.runtime.spec_decode.base import Proposal

# How many trailing indexed tokens are compared with the sequence each call to notice a rollback
# that was regrown past the indexed length before we were called again (see NgramProposer).
_TAIL_CHECK = 32


@dataclass
class _Index:
    last: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of latest occurrence
    upto: int = 0  # every end position e < upto is indexed (e < num_tokens when indexed)
    tail: list[int] = field(default_factory=list)  # the tokens just before `upto`, to spot rollbacks


class NgramProposer:
    """Proposes, for each sequence, the tokens that followed the latest earlier occurrence of its tail.

    Matching rules:
      - The tail is the last n tokens of `seq.token_ids` (prompt + output), n from `max_ngram` down
        to `min_ngram`: a longer match wins over a shorter one, even a more recent shorter one.
      - Among occurrences of the same n-gram, the most recent one wins (largest end position). An
        occurrence must end before the last token, so that at least one token followed it; it may
        overlap the tail itself (in `a b a b a` the tail `a b a` matches at 0..2 and proposes `b a`).
      - The proposal is what followed, up to k tokens: fewer when the occurrence is near the end
        (it is not extended periodically), none when no n-gram matched or k is 0.

    A sequence that shrank (`Sequence.truncate`) since the last call has its index rebuilt; so has
    one whose last `_TAIL_CHECK` indexed tokens changed (a rollback regrown before this call). A
    deeper rollback regrown past the indexed length between two calls goes unnoticed and can
    only make proposals worse, never outputs wrong: the target verifies every proposed token.

    Args:
        max_ngram: longest tail to look up.
        min_ngram: shortest tail to look up (1 proposes after any earlier occurrence of the last token).

    Example:
        >>> from llmc.runtime.sampling_params import SamplingParams
        >>> seq = Sequence("r0", [1, 2, 3, 4, 9, 1, 2, 3], SamplingParams())
        >>> NgramProposer().propose([seq], [2])[0].tokens
        [4, 9]
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, "
                             f"max_ngram={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._indexes: dict[int, _Index] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """One proposal per sequence, at most `ks[i]` tokens each.

        Args:
            seqs: the sequences to continue.
            ks: how many tokens to propose for each (0: none, and the sequence is not even indexed).

        Returns:
            a `Proposal(tokens, probs=None)` per sequence, `tokens` possibly empty.
        """
        return [self._propose_one(seq, k) if k > 0 else Proposal([]) for seq, k in zip(seqs, ks, strict=True)]

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        """Nothing to do: the accepted tokens are appended to `seq`, and the next call indexes them."""

    def release(self, seq: Sequence) -> None:
        """Drop the index of `seq` (finished, aborted or preempted)."""
        self._indexes.pop(seq.seq_id, None)

    def _propose_one(self, seq: Sequence, k: int) -> Proposal:
        tokens = seq.token_ids
        index = self._update(seq.seq_id, tokens)
        end = len(tokens)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            e = index.last.get(tuple(tokens[end - n:]))
            if e is not None:
                return Proposal(tokens[e:e + k])
        return Proposal([])

    def _update(self, seq_id: int, tokens: list[int]) -> _Index:
        """Bring the index of `seq_id` up to `tokens`: rebuild after a rollback, else index the new ends."""
        index = self._indexes.get(seq_id)
        if index is None or len(tokens) < index.upto or \
                tokens[index.upto - len(index.tail):index.upto] != index.tail:
            index = self._indexes[seq_id] = _Index()
        end = len(tokens)
        if end > index.upto:
            last = index.last
            # per n, the keys of ends upto..end-1 in order, so later (more recent) ends overwrite earlier ones
            for n in range(self.min_ngram, self.max_ngram + 1):
                lo = max(index.upto, n)
                if lo < end:
                    last.update(zip(zip(*(tokens[lo - n + i:end - n + i] for i in range(n))), range(lo, end)))
            index.upto = end
            index.tail = tokens[max(0, end - _TAIL_CHECK):end]
        return index
