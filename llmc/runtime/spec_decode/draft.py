"""A draft model as a speculative proposer: a small compiled artifact with a paged KV cache of its own.

For each target sequence the proposer keeps a draft-side `Sequence` (same prompt, params and generator)
holding the target's tokens the draft has caught up to, then the guesses of its last proposal. Its blocks
live in the draft's own BlockManager over the draft executor's cache. One round:

    catch up   one batched step feeds every sequence's target tokens the draft has no K/V for (a whole
               prompt after admission; the accepted guess and the correction after verification); each
               sequence's last logits row gives its guess 1
    draft      k - 1 more one-token steps, all sequences together (those with a smaller k drop out)
    accepted   the target kept n guesses: keep the K/V of the first n, drop the rest, free emptied blocks

Before catching up, the draft state is checked against the target's tokens: when they no longer extend
it (the target rolled back or was recomputed, or `accepted` was not called) the draft rolls back to the
common prefix. K/V at position p depends only on tokens[:p + 1], so all of that prefix stays valid.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from llmc.artifact import Artifact, ModelInfo, load_artifact
from llmc.errors import ArtifactError
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.executor import StepBatch, StepInput, make_executor
from llmc.runtime.sampler import Sampler, draw
from llmc.runtime.sequence import Sequence
from llmc.runtime.spec_decode.base import Proposal
from llmc.runtime.spec_decode.rejection import row_views, verify


@dataclass
class _Draft:
    seq: Sequence  # prompt + the target's tokens caught up to + the pending guesses
    num_target: int  # leading tokens of `seq` that are the target's; the rest are guesses not yet judged


class DraftProposer:
    """Proposes with a separate draft artifact (same tokenizer as the target) over its own paged KV cache.

    Draws use the target sequence's own `seq.generator` (shared, not copied): a seeded request draws
    the same guesses for the same schedule, and an unseeded one uses torch's global generator. Guesses
    are drawn from the draft's logits after the request's sampling transforms (`Sampler.process`:
    penalties over the context including earlier guesses, temperature, top-k/top-p/min-p); greedy
    requests take the argmax and give no probs. The draft's eos ids may differ from the target's: the
    draft proposes through its own eos, and the target's stop check decides where a sequence ends.
    Running out of draft blocks shortens a proposal, or empties it; it never raises.

    Args:
        draft: the draft artifact, or its path.
        target_info: the target's `ModelInfo`; the vocabularies must match.
        backend, device: as for the engine (`make_executor`).
        block_size, num_blocks: the draft cache's geometry (None: sized from `kv_memory_fraction`).
        kv_memory_fraction: share of free device memory for the draft cache when `num_blocks` is None.
        sampler: the transforms applied to draft logits (default: `Sampler()`).

    Example:
        >>> target = llmc.load("tiny-py.llmc")                                          # doctest: +SKIP
        >>> p = DraftProposer("tiny-py-draft.llmc", target.info, backend="reference")    # doctest: +SKIP
        >>> p.propose([seq], [4])[0].tokens  # 4 guesses continuing seq.token_ids       # doctest: +SKIP
        >>> p.accepted(seq, 2); p.release(seq)                                          # doctest: +SKIP
    """

    def __init__(self, draft: Artifact | str | Path, target_info: ModelInfo, backend: str = "auto",
                 device: str | None = None, block_size: int = 16, num_blocks: int | None = None,
                 kv_memory_fraction: float = 0.1, sampler: Sampler | None = None):
        self.artifact = draft if isinstance(draft, Artifact) else load_artifact(draft)
        info = self.artifact.info
        if info.vocab_size != target_info.vocab_size:
            raise ArtifactError(f"the draft model has a vocabulary of {info.vocab_size} tokens but the target's "
                                f"has {target_info.vocab_size}: a draft must share the target's tokenizer; "
                                "compile a draft trained with the target's tokenizer")
        self.max_model_len = info.max_model_len
        self.executor = make_executor(self.artifact.graph, backend, device, block_size, num_blocks,
                                      info.kv_cache_dtype, kv_memory_fraction, tuning=self.artifact.tuning,
                                      max_model_len=info.max_model_len)
        self.block_manager = BlockManager(self.executor.num_blocks, block_size, enable_prefix_caching=True)
        self.sampler = sampler or Sampler()
        self.drafts: dict[int, _Draft] = {}  # target seq_id -> its draft state

    def propose(self, seqs: list[Sequence], ks: list[int], hints: list[list[int]] | None = None) -> list[Proposal]:
        """Up to `ks[i]` guesses continuing `seqs[i].token_ids` (fewer when draft blocks run short).

        `hints[i]`: tokens another proposer guessed (a cascade: n-gram lookup checked by the draft). They
        are fed with the catch-up in the first step and the draft keeps the prefix its own sampling would
        (rejection sampling against its q, so the guesses are still distributed as the draft's), then it
        continues on its own: several guesses for the price of one draft step when the hints hold."""
        assert len(seqs) == len(ks), (len(seqs), len(ks))
        hints = hints or [[] for _ in seqs]
        bm = self.block_manager
        out = [Proposal([]) for _ in seqs]
        live: list[tuple[int, Sequence, int]] = []  # (index in seqs, draft seq, k)
        copies: list[tuple[int, int]] = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            # guess j is fed back at position T + j - 1, so k guesses need T + k - 1 positions
            k = min(k, self.max_model_len - seq.num_tokens + 1)
            d = self._catch_up_state(seq) if k > 0 else None
            if d is None:
                continue
            while k > 0 and not bm.can_append(d, d.num_uncomputed_tokens + k - 1):
                k -= 1
            if k > 0:
                copies += bm.append_slots(d, d.num_uncomputed_tokens + k - 1)
                live.append((i, d, k))
        rows: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        if any(hints[i] for i, *_ in live):
            live, copies = self._check_hints(live, [hints[i] for i, *_ in live], copies, out, rows)
        for step in range(max((k - len(out[i].tokens) for i, _, k in live), default=0)):
            live = [x for x in live if x[2] > len(out[x[0]].tokens)]
            dseqs = [d for _, d, _ in live]
            # first step: each sequence's catch-up chunk; later: its last guess, one token
            batch = StepBatch([StepInput(d.token_ids[d.num_computed_tokens:], d.num_computed_tokens, d.block_table)
                               for d in dseqs], copies=copies if step == 0 else [])
            tokens, probs = self._sample(batch, dseqs)
            for (i, d, _), t, p in zip(live, tokens, probs):
                first = not out[i].tokens
                d.num_computed_tokens = d.num_tokens
                if first:
                    bm.mark_computed(d)  # only the target's tokens are computed yet: real prefixes to share
                d.append_token(t)
                out[i].tokens.append(t)
                rows[i].append(p)
        for prop, r in zip(out, rows):
            if r and r[0] is not None:
                prop.probs = torch.stack(r)  # [k, V] fp32
        return out

    def _check_hints(self, live, hints, copies, out, rows):
        """First step of a cascade: the catch-up chunk and each sequence's hints in one draft step, every
        hint's row included; keep the hint prefix the draft's own sampling keeps, plus its next token."""
        bm, seqs, kept, copies_after = self.block_manager, [], [], []
        for (_, d, k), h in zip(live, hints):
            h = h[:k - 1]  # every guess but the last is fed back: the slots reserved for k guesses hold them
            seqs.append((d, d.num_tokens, h))
            for t in h:
                d.append_token(t)
        batch = StepBatch([StepInput(d.token_ids[d.num_computed_tokens:], d.num_computed_tokens, d.block_table,
                                     1 + len(h)) for d, _, h in seqs], copies=copies)
        logits = self.executor.execute(batch).logits  # [sum(1 + len(h)), V] fp32
        r = 0
        for (i, _, k), (d, n, h) in zip(live, seqs):
            rows_i, r = logits[r:r + 1 + len(h)], r + 1 + len(h)
            # d as it was before its hints: what the draft's own sampling saw
            view = SimpleNamespace(params=d.params, token_ids=d.token_ids[:n],
                                   output_token_ids=d.output_token_ids[:len(d.output_token_ids) - len(h)],
                                   generator=d.generator)
            tokens = verify(rows_i, view, h, None, self.sampler)[0]
            d.num_computed_tokens = d.num_tokens
            if not h:  # with hints in it, d holds tokens the target has not confirmed
                bm.mark_computed(d)
            self._truncate(d, n + len(tokens) - 1)  # keep the K/V of the hints it kept
            d.append_token(tokens[-1])
            # the truncation freed the blocks reserved past it: reserve again for the guesses still to come
            more = k - len(tokens)
            while more > 0 and not bm.can_append(d, more):
                more -= 1
            if more > 0:
                copies_after += bm.append_slots(d, more)
            kept.append((i, d, len(tokens) + more))
            out[i].tokens.extend(tokens)
            if d.params.greedy:
                rows[i].extend([None] * len(tokens))
            else:
                q = torch.softmax(self.sampler.process(rows_i[:len(tokens)], row_views(view, h)[:len(tokens)]), -1)
                rows[i].extend(q)
        return kept, copies_after

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        """Keep the K/V of the first `num_accepted` guesses of the last proposal for `seq`; drop the rest."""
        st = self.drafts.get(seq.seq_id)
        if st is None:
            return
        keep = st.num_target + max(0, min(num_accepted, st.seq.num_tokens - st.num_target))
        if keep < st.seq.num_tokens:
            self._truncate(st.seq, keep)
        st.num_target = st.seq.num_tokens

    def release(self, seq: Sequence) -> None:
        """Free every draft block held for `seq`."""
        st = self.drafts.pop(seq.seq_id, None)
        if st is not None:
            self.block_manager.free(st.seq)

    # -- internals --------------------------------------------------------------------------------
    def _catch_up_state(self, seq: Sequence) -> Sequence | None:
        """The draft seq holding exactly `seq.token_ids`, with at least the last one uncomputed; None when
        a new sequence's blocks do not fit."""
        st = self.drafts.get(seq.seq_id)
        if st is None:
            # the draft's own log-probabilities are never reported: asking none keeps its greedy steps argmax-only
            d = Sequence(seq.request_id, seq.prompt_token_ids, replace(seq.params, logprobs=None))
            d.generator = seq.generator
            for t in seq.output_token_ids:
                d.append_token(t)
            if not self.block_manager.can_allocate(d):
                return None
            self.block_manager.allocate(d)  # prefix-cache hits count as computed
            st = self.drafts[seq.seq_id] = _Draft(d, d.num_tokens)
        d, target = st.seq, seq.token_ids
        common = _common_prefix(d.token_ids, target)
        if common < d.num_tokens:
            self._truncate(d, common)
        for t in target[d.num_tokens:]:
            d.append_token(t)
        # the last token is fed again even when its K/V are there: its logits row gives guess 1
        d.num_computed_tokens = min(d.num_computed_tokens, d.num_tokens - 1)
        st.num_target = d.num_tokens
        return d

    def _truncate(self, d: Sequence, n: int) -> None:
        """Keep d's first n tokens and their K/V (truncate alone would drop the last one's); free blocks past."""
        computed = d.num_computed_tokens
        d.truncate(n)
        d.num_computed_tokens = min(computed, n)
        self.block_manager.rollback(d)

    def _sample(self, batch: StepBatch, dseqs: list[Sequence]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Run the step and draw one guess per row: (tokens [B], per row the probs [V] it was drawn from or
        None for a greedy row)."""
        if Sampler.argmax_only(dseqs):
            batch.greedy = True  # only argmaxes leave the device
            return self.executor.execute(batch).tokens.tolist(), [None] * len(dseqs)
        logits = self.sampler.process(self.executor.execute(batch).logits, dseqs)  # [B, V] fp32
        probs = torch.softmax(logits, dim=-1)  # [B, V]
        tokens = logits.argmax(dim=-1)  # [B]; greedy rows keep it (ties to the lowest id)
        for r, d in enumerate(dseqs):
            if not d.params.greedy:
                tokens[r] = draw(probs[r], d.generator)
        return tokens.tolist(), [None if d.params.greedy else probs[r] for r, d in enumerate(dseqs)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (the target only extended the draft): one C-speed comparison
        return n
    return next(i for i in range(n) if a[i] != b[i])
