"""How many tokens to speculate for each sequence, from the acceptance it has shown so far.

Model: each proposed token is accepted with probability a, independently, until the first
rejection. Proposing k tokens then yields, per target step, the accepted prefix plus the target's
own next token:

    E[tokens](k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

at a cost, in units of one plain decode step, of

    cost(0) = 1,   cost(k) = 1 + f + c * k   (k >= 1)

where c is the relative cost of one proposed token (its share of the draft work plus the extra
verified position) and f what a speculative step costs whatever its k (the draft catching up on the
tokens the last step accepted, the verify step's own extra work). Both are measured (SpecDecoder fits
them); before that f = 0 and c is a prior: ~0.05 for n-gram lookup, ~0.25 for a draft model. On an
H200 the shipped draft measures f ~ 0.27 and c ~ 0.015 for an 8B-sized target: a step with a draft
costs a quarter of a step more, and each drafted token little. The policy picks k in [k_min, k_max]
maximising E[tokens](k) / cost(k) (the smallest such k on ties). With f = 0, k = 1 beats k = 0 only
when (1 + a) / (1 + c) > 1, i.e. a > c: below that a sequence stops speculating.

a is an exponential moving average per sequence, started optimistic (`init_rate`), updated once
per verified position with weight `ema`: each accepted token pulls it towards 1, the first
rejected one towards 0; positions after the first rejection are not observed and leave it alone.

A sequence at k = 0 would never show its acceptance recover (repetitive text often arrives late),
so every `probe_every` steps at k = 0 it proposes one token; a probe that is accepted is followed by
another probe on the next step, so two lucky probes in a row are enough to come back. Probes go on
even where the cost says that no k pays: the cost is measured (spec_decode.SpecDecoder) from the
steps that speculate, and a probe is what measures it again after a run of slow steps.

Above `max_batch` sequences per step, every k is 0: the target step is then compute-bound, the
verified positions cost nearly as much as real tokens and speculation lowers throughput.
`AdaptiveK.fixed(k)` always proposes k (still 0 above `max_batch`, unless that is None).
"""
from __future__ import annotations

from dataclasses import dataclass

from llmc.runtime.sequence import Sequence


def best_k(rate: float, cost: float, k_max: int, k_min: int = 0, overhead: float = 0.0) -> int:
    """The k in [k_min, k_max] maximising (1 + a + ... + a^k) / (1 + overhead + cost * k), k = 0 costing 1;
    the smallest on ties."""
    best, best_value = k_min, 0.0
    expected, power = 0.0, 1.0
    for k in range(k_max + 1):
        expected += power  # 1 + a + ... + a^k, well defined at a = 1 too
        power *= rate
        value = expected / (1.0 + (overhead + cost * k if k else 0.0))
        if k >= k_min and value > best_value * (1 + 1e-12):
            best, best_value = k, value
    return best


@dataclass
class _Stats:
    rate: float  # EMA of the per-token acceptance rate
    idle: int = 0  # steps chosen at k = 0 since the last probe
    probing: bool = False  # the last k given was a probe


class AdaptiveK:
    """Chooses the number of speculative tokens per sequence from its observed acceptance.

    Args:
        k_max: most tokens to propose for one sequence in one step.
        k_min: fewest (k_min == k_max: a fixed k).
        max_batch: above this many sequences in a step propose nothing; None: never switch off.
        cost: relative cost c of one proposed token against one decode step (see the module docstring).
        init_rate: the acceptance rate a new sequence is assumed to have.
        ema: weight of one verified position in the moving average of the acceptance rate.
        probe_every: steps at k = 0 between two one-token probes.

    Example:
        >>> from llmc.runtime.sampling_params import SamplingParams
        >>> seq = Sequence("r0", [1, 2, 3], SamplingParams())
        >>> policy = AdaptiveK(k_max=8, cost=0.1)
        >>> policy.choose([seq])
        [3]
        >>> for _ in range(20):
        ...     policy.observe(seq, proposed=8, accepted=8)
        >>> policy.choose([seq])
        [8]
    """

    def __init__(self, k_max: int = 8, k_min: int = 0, max_batch: int | None = 32, cost: float = 0.1,
                 init_rate: float = 0.6, ema: float = 0.15, probe_every: int = 6) -> None:
        if not 0 <= k_min <= k_max:
            raise ValueError(f"need 0 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
        if max_batch is not None and max_batch < 0:
            raise ValueError(f"max_batch must be >= 0 or None, got {max_batch}")
        if cost < 0 or not 0 <= init_rate <= 1 or not 0 < ema <= 1 or probe_every < 1:
            raise ValueError(f"need cost >= 0, 0 <= init_rate <= 1, 0 < ema <= 1, probe_every >= 1; got "
                             f"cost={cost}, init_rate={init_rate}, ema={ema}, probe_every={probe_every}")
        self.k_max, self.k_min, self.max_batch = k_max, k_min, max_batch
        self.cost, self.init_rate, self.ema, self.probe_every = cost, init_rate, ema, probe_every
        self.overhead = 0.0  # f: what a speculative step costs whatever its k (measured by SpecDecoder)
        self._stats: dict[int, _Stats] = {}

    @classmethod
    def fixed(cls, k: int, max_batch: int | None = 32) -> AdaptiveK:
        """Always propose `k` tokens (0 when a step has more than `max_batch` sequences; None: never)."""
        return cls(k_max=k, k_min=k, max_batch=max_batch)

    @property
    def is_fixed(self) -> bool:
        return self.k_min == self.k_max

    def choose(self, seqs: list[Sequence]) -> list[int]:
        """How many tokens to propose for each sequence in this step.

        Args:
            seqs: the decoding sequences of this step (their count is the batch compared with max_batch).

        Returns:
            one k per sequence, in [0, k_max]; all 0 when `len(seqs) > max_batch`.
        """
        if self.max_batch is not None and len(seqs) > self.max_batch:
            return [0] * len(seqs)
        if self.is_fixed:
            return [self.k_max] * len(seqs)
        return [self._choose_one(seq) for seq in seqs]

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """The target accepted the first `accepted` of the `proposed` tokens proposed for `seq`."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted={accepted} must lie in [0, proposed={proposed}]")
        if proposed == 0:
            return
        st = self._stats_of(seq)
        keep = 1.0 - self.ema
        # `accepted` successes, then (unless all were accepted) one failure; later positions unseen
        st.rate = 1.0 - keep ** accepted * (1.0 - st.rate)
        if accepted < proposed:
            st.rate *= keep
        if st.probing and accepted == proposed:
            st.idle = self.probe_every  # a probe that worked: probe again next step
        st.probing = False

    def release(self, seq: Sequence) -> None:
        """Forget `seq` (finished, aborted or preempted)."""
        self._stats.pop(seq.seq_id, None)

    def acceptance_rate(self, seq: Sequence) -> float:
        """The current estimate of the per-token acceptance rate of `seq`."""
        return self._stats_of(seq).rate

    def _stats_of(self, seq: Sequence) -> _Stats:
        st = self._stats.get(seq.seq_id)
        if st is None:
            st = self._stats[seq.seq_id] = _Stats(self.init_rate)
        return st

    def _choose_one(self, seq: Sequence) -> int:
        st = self._stats_of(seq)
        st.probing = False
        k = best_k(st.rate, self.cost, self.k_max, self.k_min, self.overhead)
        if k > 0:
            st.idle = 0
            return k
        st.idle += 1
        if st.idle <= self.probe_every:
            return 0
        st.idle, st.probing = 0, True
        return 1
