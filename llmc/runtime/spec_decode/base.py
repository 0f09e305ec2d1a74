"""What a speculative proposer gives and what the engine asks of it.

A proposer guesses the next k tokens of each running sequence; the target model checks all k + 1
positions in one step and the rejection sampler keeps a prefix (see rejection.py). A proposal may
carry the distribution each token was drawn from (a draft model's `q`); a deterministic proposer
(n-gram lookup) gives none, which means q is one-hot at the proposed token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from llmc.runtime.sequence import Sequence


@dataclass
class Proposal:
    """k proposed tokens for one sequence (possibly fewer than asked, possibly none)."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] fp32: q of each token (after the request's
    #                                   sampling transforms); None: each token was chosen deterministically


class Proposer(Protocol):
    """Guesses continuations; told what the target accepted so it can keep its own state in step."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """One proposal per sequence, at most `ks[i]` tokens each (0: propose nothing)."""
        ...

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        """The target kept `num_accepted` of the last proposal for `seq` (and appended one more token)."""
        ...

    def release(self, seq: Sequence) -> None:
        """`seq` finished, was aborted or preempted: drop whatever the proposer holds for it."""
        ...
