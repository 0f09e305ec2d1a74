"""Multi-level proposals: n-gram lookup's guesses checked by the draft model, then by the target.

Prompt lookup is free but often wrong; the draft is right more often but pays a step per guess. In
a cascade the draft takes lookup's guesses as hints: one draft step checks them all and keeps the
prefix its own sampling would keep (so the proposal is still distributed as the draft's), then it
guesses on alone. Where the text repeats, several guesses cost one draft step.
"""
from __future__ import annotations

from llmc.runtime.sequence import Sequence
from llmc.runtime.spec_decode.base import Proposal
from llmc.runtime.spec_decode.draft import DraftProposer
from llmc.runtime.spec_decode.ngram import NgramProposer


class CascadeProposer:
    """n-gram hints, checked and extended by a draft model.

    Example:
        >>> llm = LLM("tiny-py.llmc", speculative={"method": "multi", "draft": "tiny-py-draft.llmc"})  # doctest: +SKIP
    """

    def __init__(self, lookup: NgramProposer, draft: DraftProposer):
        self.lookup, self.draft = lookup, draft

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        hints = self.lookup.propose(seqs, [max(0, k - 1) for k in ks])
        return self.draft.propose(seqs, ks, hints=[h.tokens for h in hints])

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        self.lookup.accepted(seq, num_accepted)
        self.draft.accepted(seq, num_accepted)

    def release(self, seq: Sequence) -> None:
        self.lookup.release(seq)
        self.draft.release(seq)
