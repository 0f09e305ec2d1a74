"""Speculative decoding: propose k tokens per sequence, verify all k + 1 positions in one target step,
keep what the rejection sampler accepts (lossless: see rejection.py).

The algorithm stays visible in three pieces: a proposer (ngram.py: prompt lookup; draft.py: a small
model with its own KV cache), the number of tokens to propose (adaptive.py: from each sequence's
observed acceptance, off under load), and the verify step (rejection.py). `SpecDecoder` joins them;
batching, budgets and rollback belong to the engine and scheduler (a verify entry is budgeted as
k + 1 tokens, and blocks past the accepted tokens are freed after the step).

    >>> llm = LLM("tiny-py.llmc", speculative={"method": "draft", "draft": "tiny-py-draft.llmc",
    ...                                         "num_speculative_tokens": "auto"})     # doctest: +SKIP
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmc.codegen.autotune import JOINT_BUCKETS, bucket_size
from llmc.errors import LLMCError
from llmc.intmath import next_pow2
from llmc.runtime.sampler import Sampler, plain_greedy
from llmc.runtime.sequence import Sequence
from llmc.runtime.spec_decode.base import Proposal, Proposer
from llmc.runtime.spec_decode.rejection import accept_greedy, verify

METHODS = ("draft", "ngram", "multi")
# the most rows a step with proposals verifies: the steps of up to 64 rows share one GEMM choice at compile
# (autotune.JOINT_BUCKETS), and a speculating engine's target runs the generated kernel there even where
# cuBLAS was recorded faster (Tuner.from_artifact's `invariant`), so a sequence's sums, hence its greedy
# tokens, are those of plain decoding; a wider step runs library GEMMs that pick their kernels by size, and
# bf16 tokens then part (0.84 of them the same at batch 32 with n-gram proposals on an H200)
VERIFY_ROWS = bucket_size(JOINT_BUCKETS[-1])


@dataclass
class SpecConfig:
    """Options of speculative decoding (`LLM(..., speculative={...})`, `llmc run --spec/--draft`)."""

    method: str = "ngram"  # ngram, draft, or multi (n-gram hints checked by the draft, then the target)
    draft: str | Path | None = None  # the draft artifact (methods draft and multi)
    num_speculative_tokens: int | str = "auto"  # k, or "auto": adaptive per sequence
    max_batch: int | None = 32  # with "auto": no speculation when more sequences decode at once
    max_verify_rows: int | None = VERIFY_ROWS  # proposals cut to keep a step within this many rows; None: uncut
    max_ngram: int = 4

    @classmethod
    def from_options(cls, options: dict[str, Any] | SpecConfig | None,
                     bundled_draft: Path | None = None) -> SpecConfig | None:
        """`options` as a SpecConfig; a draft method without a draft takes the target's bundled one."""
        if options is None or isinstance(options, SpecConfig):
            return options
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise LLMCError(f"unknown speculative options {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        cfg = cls(**options)
        if cfg.draft is None and bundled_draft is not None:
            cfg.draft = bundled_draft
        if cfg.method not in METHODS:
            raise LLMCError(f"speculative method must be one of {', '.join(METHODS)}, not {cfg.method!r}")
        if cfg.method in ("draft", "multi") and cfg.draft is None:
            raise LLMCError(f"speculative method {cfg.method} needs a draft artifact (speculative={{'draft': PATH}}, "
                            "`llmc run --draft ART`, or one bundled by `llmc compile TARGET --draft DRAFT`)")
        k = cfg.num_speculative_tokens
        if k != "auto" and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16):
            raise LLMCError(f"num_speculative_tokens must be 1..16 or 'auto', not {k!r}")
        return cfg


class SpecDecoder:
    """Proposes before a step and verifies after it, for the engine.

    Args:
        proposer: a `Proposer`.
        chooser: how many tokens to propose per sequence (an `AdaptiveK`).
        max_model_len: proposals never run past the context.
        max_rows: proposals are cut so that a step verifies at most this many rows (`VERIFY_ROWS`).
    """

    def __init__(self, proposer: Proposer, chooser, max_model_len: int, sampler: Sampler,
                 max_rows: int | None = VERIFY_ROWS):
        self.proposer, self.chooser, self.max_model_len, self.sampler = proposer, chooser, max_model_len, sampler
        self.max_rows = max_rows  # the most rows a step with proposals verifies (None: no limit)
        self.q: dict[int, torch.Tensor | None] = {}  # seq_id -> the draft distributions of its proposal
        self.steps = 0  # verified proposals
        self.proposed = self.accepted = 0  # proposed tokens, and those the target kept
        # By batch bucket, the latest measurements (see "What speculation costs" below). Plain calls: seconds
        # each (their median is used); calls in the speculative regime: a `_Window`, as how many tokens a
        # call gives varies with what is accepted, so their rate is a ratio of sums over SPEC_WINDOW
        # sequence-steps, never a median.
        self.plain_s: dict[int, deque] = {}
        self.window: dict[int, _Window] = {}
        self.since_plain: dict[int, int] = {}  # speculative calls since the bucket's last plain measurement
        self.since_spec: dict[int, int] = {}  # plain calls since the bucket's last speculative measurement
        self.unmeasured: dict[int, int] = {}  # speculative calls since the bucket's last speculative measurement
        self.blocked: set[int] = set()  # buckets whose speculative calls went PROBE calls unmeasured
        self.probe_gap: dict[int, int] = {}  # plain calls between two probes where the gate is closed
        self.closed_for: dict[int, set[int]] = {}  # by bucket, the sequences a closed gate's verdict measured
        self.costs: dict[int, deque] = {}  # by batch bucket, the latest (mean k, call time / plain call time)
        self.prior_cost = chooser.cost
        self._accepted_seen = 0
        self._regime = False  # the call `propose` just planned is in the speculative regime
        self._last: tuple[str, float] | None = None  # the last call's kind and when it ended

    @classmethod
    def build(cls, cfg: SpecConfig, target_info, max_model_len: int, sampler: Sampler, executor_options: dict):
        from llmc.runtime.spec_decode.adaptive import AdaptiveK
        if cfg.method in ("draft", "multi"):
            from llmc.runtime.spec_decode.draft import DraftProposer
            proposer = DraftProposer(cfg.draft, target_info, sampler=sampler, **executor_options)
            cost = 0.25  # a draft token against a target step, until measured (observe_step)
            if cfg.method == "multi":
                from llmc.runtime.spec_decode.cascade import CascadeProposer
                from llmc.runtime.spec_decode.ngram import NgramProposer
                proposer = CascadeProposer(NgramProposer(cfg.max_ngram), proposer)
        else:
            from llmc.runtime.spec_decode.ngram import NgramProposer
            proposer, cost = NgramProposer(cfg.max_ngram), 0.05
        k = cfg.num_speculative_tokens
        chooser = AdaptiveK(k_max=8, cost=cost, max_batch=cfg.max_batch) if k == "auto" else \
            AdaptiveK(k_min=k, k_max=k, cost=cost, max_batch=None)
        return cls(proposer, chooser, max_model_len, sampler, cfg.max_verify_rows)

    def propose(self, seqs: list[Sequence]) -> None:
        """Set `spec_token_ids` on the decoding sequences that get a proposal this step (and clear it on the
        others: a proposal made for a step that did not schedule its sequence is not reused)."""
        for seq in seqs:
            seq.spec_token_ids = []
            self.q.pop(seq.seq_id, None)
        self._regime = False
        if not seqs or self._off_under_load(len(seqs)) or self._calibrating(len(seqs)) \
                or not self._paying(len(seqs)):
            return  # a plain call: under load, timing plain steps, or where speculation does not pay
        self._regime = True
        costs = self.costs.get(self._bucket(len(seqs)))
        self.chooser.overhead, self.chooser.cost = fit_cost(costs) if costs else (0.0, self.prior_cost)
        ks = self.chooser.choose(seqs)
        ks = [min(k, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
              for seq, k in zip(seqs, ks)]
        ks = within_rows(ks, self.max_rows) if self.max_rows is not None else ks
        todo = [(s, k) for s, k in zip(seqs, ks) if k > 0]
        if not todo:
            return
        for (seq, k), prop in zip(todo, self.proposer.propose([s for s, _ in todo], [k for _, k in todo])):
            seq.spec_token_ids = list(prop.tokens[:k])
            self.q[seq.seq_id] = None if prop.probs is None else prop.probs[:len(seq.spec_token_ids)]

    # What speculation costs, measured. The engine's throughput is what counts, so each call of the engine's
    # step is timed from the end of the call before it to its own end (`observe_step`): a plain call that
    # overlaps its step with the host's work costs what the GPU's step costs, a speculative one (whose
    # step is waited for, as the next proposals need its tokens) its host work too. A call is measured
    # only where the call before it was of the same kind (a decode step, plain or in the speculative
    # regime), so that neither pays for the other's step in flight; a call with a prefill chunk, or one
    # that did one-time work (captured a CUDA graph: 50 times a step, once), is measured not at all.
    # The calls of the speculative regime give the gate its tokens per second (`_gate_open`), whether
    # they proposed or not; those that proposed also give the chooser's cost model 1 + f + c * k
    # (adaptive.py), their time against a plain call's over their mean k, fitted per batch bucket over its
    # latest COST_POINTS calls (`fit_cost`). The prior (f = 0; c = 0.05 for n-gram lookup, 0.25 for a
    # draft) is only where it starts: on a GPU a small draft is launch-bound, and what a step with it
    # costs is mostly f, whatever k is. After CALIBRATE speculative calls of a batch bucket without a
    # plain measurement, plain calls measure one; after CALIBRATE plain calls, speculative calls do.
    # Speculative calls that go PROBE calls without a measurement (each after a prefill, or capturing a
    # graph) stop for CALIBRATE plain calls: what is not measured never runs on for long. A probe costs
    # about two plain steps (the first call also waits out the plain step in flight), so each probe that
    # finds the gate still closed doubles the gap to the next one, up to MAX_GAP; one that opens it
    # brings the gap back to CALIBRATE. A closed verdict of a call of at most FEW sequences holds for the
    # sequences it measured: once they have all finished (`release`), the bucket's speculative measurements
    # go and the next calls measure again, so a hard request does not keep speculation off for the easy ones
    # after it. A verdict over more sequences stands for the workload, whose next requests are drawn
    # alike: measuring it again at every turnover would run speculation at a loss each time (at batch 32,
    # n-gram lookup on 66% of steps for 0.91x, against 10% and 1.01x with the verdict kept).
    # The gate compares calls, not tokens: a decode step reads the weights once for all its sequences, so a
    # plain call of 17 sequences takes about what one of 32 takes (4.4 and 4.8 ms, an 8B shape on an H200),
    # and a bucket's plain time per token, measured at the tail of a batch, would make speculation at its
    # full width look up to twice as good as it is. Each speculative call counts the tokens it gave per
    # sequence (1 + accepted / sequences), against one plain call.
    # Speculation must win by MARGIN to go on: near break-even what it costs outside the calls measured (the
    # first call of each run waiting out a plain step, verify rows in steps with prefill chunks, the graphs
    # its shapes capture) decides, and those are losses; where speculation pays it pays far more (2-3x at
    # batch 1).
    MARGIN = 0.1
    FEW = 4  # the most sequences of a call whose closed verdict ends with them
    CALIBRATE = 64
    COST_POINTS = 32
    WARM = 3  # measurements of a kind in a bucket before they decide (the first plain calls calibrate)
    PROBE = 8
    MAX_GAP = 1024
    KEEP = 9  # plain measurements kept per bucket
    # the sequence-steps (a call's sequences, summed) of the latest speculative calls whose tokens per second
    # decide whether speculation pays: 256 calls of one sequence, where one call's luck varies most, 8 of 32
    SPEC_WINDOW = 256

    def may_propose(self, n: int) -> bool:
        """Whether a decode step of `n` sequences may get proposals (`propose` decides; this only looks).
        The engine reads the tokens of a step in flight before such a step: a proposal continues each
        sequence's real last token, not the stand-in that a launched step leaves until it is read."""
        if self._off_under_load(n):
            return False
        if self.chooser.is_fixed:
            return True
        return not self._calibrating(n) and self._paying(n)

    def may_overlap(self, n: int) -> bool:
        """Whether the step just planned may be launched without the host waiting for it (the engine's
        overlapped steps): not one whose tokens the next step's proposals would wait for (`n`: the
        sequences it samples, which decode next)."""
        return not self.may_propose(n)

    def _off_under_load(self, n: int) -> bool:
        return self.chooser.max_batch is not None and n > self.chooser.max_batch

    @staticmethod
    def _bucket(n: int) -> int:
        return next_pow2(n)

    def _calibrating(self, n: int) -> bool:
        if self.chooser.is_fixed:
            return False
        b = self._bucket(n)
        return len(self.plain_s.get(b, ())) < self.WARM or self.since_plain.get(b, 0) >= self.CALIBRATE

    def _paying(self, n: int) -> bool:
        """Whether speculation gives MARGIN more tokens per second than plain decoding at this batch size, as
        measured (the per-sequence cost model cannot see everything a wider step changes: the overlap of
        host and device that a plain step keeps, a verify step past the largest captured graph running
        eagerly, a larger GEMM tile, compute-bound steps). Until both are measured it does; where it does
        not, speculative calls measure again after CALIBRATE plain ones."""
        if self.chooser.is_fixed:
            return True
        b = self._bucket(n)
        probing = self.since_spec.get(b, 0) >= self.probe_gap.get(b, self.CALIBRATE)
        if b in self.blocked and not probing:
            return False
        return self._gate_open(b) or probing

    def _gate_open(self, b: int) -> bool:
        plain, spec = self.plain_s.get(b, ()), self.window.get(b)
        if len(plain) < self.WARM or spec is None or len(spec.calls) < self.WARM:
            return True
        return spec.seconds * (1 + self.MARGIN) <= _median(plain) * spec.gain

    def observe_step(self, out, now: float, one_time: bool = False) -> None:
        """The engine's call that planned `out` ended at `now` (seconds, `time.perf_counter`); `one_time`: it
        captured a CUDA graph (the target's or the draft's). See "What speculation costs" above."""
        gained, self._accepted_seen = self.accepted - self._accepted_seen, self.accepted
        if self.chooser.is_fixed:
            return
        decode = bool(out.scheduled) and not any(e.is_prefill for e in out.scheduled)
        kind = "other" if one_time or not decode else "spec" if self._regime else "plain"
        last, self._last = self._last, (kind, now)
        if kind == "other":
            if self._regime and out.scheduled:
                self._unmeasured(self._bucket(len(out.scheduled)))
            return
        n = len(out.scheduled)
        b = self._bucket(n)
        if kind == "spec":
            self.since_plain[b] = self.since_plain.get(b, 0) + 1
            self.blocked.discard(b)
        else:
            self.since_spec[b] = self.since_spec.get(b, 0) + 1
        if last is None or last[0] != kind:
            if kind == "spec":
                self._unmeasured(b)
            return
        took = now - last[1]
        if kind == "plain":
            self.plain_s.setdefault(b, deque(maxlen=self.KEEP)).append(took)
            self.since_plain[b] = 0
            return
        window = self.window.setdefault(b, _Window())
        window.add(took, n + gained, n, self.SPEC_WINDOW)
        self.since_spec[b] = self.unmeasured[b] = 0
        if len(window.calls) >= self.WARM:  # a verdict
            if self._gate_open(b):
                self.probe_gap[b] = self.CALIBRATE
                self.closed_for.pop(b, None)
            else:
                self.probe_gap[b] = min(self.MAX_GAP, 2 * self.probe_gap.get(b, self.CALIBRATE))
                if b <= self.FEW:
                    self.closed_for[b] = {e.seq.seq_id for e in out.scheduled}
        spec = [e for e in out.scheduled if e.spec]
        if spec and self.plain_s.get(b):
            k = sum(len(e.spec) for e in spec) / len(spec)
            ratio = min(1 + 4.0 * (k + 1), took / _median(self.plain_s[b]))  # (a stall caps at 4 steps a token)
            self.costs.setdefault(b, deque(maxlen=self.COST_POINTS)).append((k, ratio))

    def _unmeasured(self, b: int) -> None:
        """A speculative call in bucket `b` that measured nothing; PROBE in a row block the bucket."""
        self.unmeasured[b] = self.unmeasured.get(b, 0) + 1
        if self.unmeasured[b] >= self.PROBE:
            self.blocked.add(b)
            self.since_spec[b] = self.unmeasured[b] = 0

    def verify(self, seq: Sequence, spec: list[int], rows: torch.Tensor | None,
               row_tokens: list[int] | None) -> tuple[list[int], list[float] | None, list[dict] | None]:
        """The new tokens of a verified sequence, their log-probabilities and alternatives (see
        `rejection.verify`): `rows` are its k + 1 target logits rows, or, when the step returned only argmax
        tokens (greedy, nothing asked), `row_tokens`."""
        q = self.q.pop(seq.seq_id, None)
        if row_tokens is not None:
            tokens, logprobs, top = accept_greedy(spec, row_tokens), None, None
        else:
            tokens, logprobs, top = verify(rows, seq, spec, q.to(rows.device) if q is not None else None,
                                           self.sampler)
        self.steps += 1
        self.proposed += len(spec)
        self.accepted += len(tokens) - 1
        self.chooser.observe(seq, len(spec), len(tokens) - 1)
        self.proposer.accepted(seq, len(tokens) - 1)
        return tokens, logprobs, top

    def release(self, seq: Sequence) -> None:
        """Forget `seq` (finished, aborted or preempted). Once every sequence that a closed gate's verdict
        measured is gone, the bucket's measurements are of requests no longer there (at batch 1, the
        request before): they are dropped, and the new sequences' calls decide afresh."""
        self.q.pop(seq.seq_id, None)
        self.chooser.release(seq)
        self.proposer.release(seq)
        for b, ids in list(self.closed_for.items()):
            ids.discard(seq.seq_id)
            if not ids:
                del self.closed_for[b]
                self.window.pop(b, None)
                self.probe_gap[b] = self.CALIBRATE


class _Window:
    """A bucket's latest speculative calls, (seconds, tokens per sequence, sequences) each, and their sums:
    the gate reads them on every engine call, so they are kept as calls come and go, not summed again.
    `gain` sums the calls' tokens per sequence: what as many plain calls would have given is 1 a call."""

    def __init__(self) -> None:
        self.calls: deque = deque()
        self.seconds = self.gain = 0.0
        self.seqs = 0

    def add(self, seconds: float, tokens: int, seqs: int, keep: int) -> None:
        """One more call; the oldest leave while the rest hold at least `keep` sequence-steps."""
        g = tokens / seqs
        self.calls.append((seconds, g, seqs))
        self.seconds, self.gain, self.seqs = self.seconds + seconds, self.gain + g, self.seqs + seqs
        while self.seqs - self.calls[0][2] >= keep:
            t, m, q = self.calls.popleft()
            self.seconds, self.gain, self.seqs = self.seconds - t, self.gain - m, self.seqs - q


def within_rows(ks: list[int], rows: int) -> list[int]:
    """The proposal lengths `ks` cut so that the step's rows (one per sequence and one per proposed token) are
    at most `rows`: the longest lose a token first, so the shortest keep theirs."""
    ks = list(ks)
    excess = len(ks) + sum(ks) - rows
    if len(ks) >= rows:
        return [0] * len(ks)
    while excess > 0:
        i = max(range(len(ks)), key=ks.__getitem__)
        ks[i] -= 1
        excess -= 1
    return ks


def fit_cost(points) -> tuple[float, float]:
    """(f, c) of step time / plain step time = 1 + f + c * k by least squares over (k, ratio) points, both at
    least 0 (c at least 0.005). Where the points' k hardly vary the two cannot be told apart, and f = 0
    (all of it per token, as the one-term model: more cautious about large k)."""
    n = len(points)
    mk = sum(k for k, _ in points) / n
    my = sum(r - 1 for _, r in points) / n
    var = sum((k - mk) ** 2 for k, _ in points) / n
    if var > 0.25:
        c = max(0.005, sum((k - mk) * (r - 1 - my) for k, r in points) / (n * var))
        if my - c * mk >= 0:
            return my - c * mk, c
    return 0.0, max(0.005, my / mk)  # k too alike, or a slope past the mean: all of it per token


def _median(xs) -> float:
    v = sorted(xs)
    return v[len(v) // 2]


__all__ = ["SpecConfig", "SpecDecoder", "Proposal", "Proposer", "plain_greedy"]
