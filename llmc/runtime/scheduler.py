"""Iteration-level continuous batching: which tokens of which sequences run in the next step.

Pure CPU logic over `Sequence` and `BlockManager`, so every policy here is unit-tested without a
model. Each `schedule()` builds one step under two budgets, `max_num_seqs` sequences and
`max_num_batched_tokens` tokens, in this order:
  1. running decodes (1 token each), then running prefills (the next chunk of a long prompt);
  2. swapped sequences, swapped back in (only if nothing was preempted in this step);
  3. waiting requests, admitted in priority order (only if nothing was preempted and nothing is
     still swapped: admitting more would just thrash). A waiting request that does not fit, for
     want of sequence slots or of blocks, preempts running sequences of a worse key (a worse
     priority or a later arrival, never a sibling of its own request): priority means the same
     whichever resource is short. A request whose prompt continues its cached prefix with a block
     that an admitted sequence is still computing waits a step and then shares that block, so a
     common prefix among requests admitted together is computed once.
A running decode may carry speculated tokens (`Sequence.spec_token_ids`, set by a proposer): it is
then scheduled, and budgeted, as 1 + k tokens, all with logits (a verify entry); after the step the
accepted prefix advances its computed tokens and blocks past them are freed (`BlockManager.trim`).
With `enable_chunked_prefill` a prompt larger than the remaining budget is split across steps
(only the final chunk is sampled). The token budget bounds how long a step makes running decodes wait;
a step with no decode to run when it starts (nothing running past its prompt, nothing swapped out) takes
`max_prefill_tokens` instead, where that is larger: a prompt alone runs in fewer, larger chunks. (A request
admitted in such a step whose context is a prefix-cache hit up to its last token, a preempted sample of a
forked request, then decodes in that larger step.) With `step_budget` a step
that carries decodes and has prompt work takes what it says, where that is larger: the decodes' cost
per step (their rows, their K/V reads) is then spread over enough prompt tokens (config.StepBudget).
With `pace_prompts` (a factor f) such a step instead takes d + f * P / L tokens, rounded up to a power of
two, where that is larger than the budget: d its decode tokens, P the prompt tokens still to compute
(running prefills' and waiting requests', the latter summed as they join and leave the queue) and L the
most tokens a running decode may still make (the steps the batch runs anyway); a pending prompt whose own
output is long must be done sooner, so each one's share of P over the steps before its output would
outlast L counts too (the waiting requests through their head, and the longest output among them where
it is not the head's: the queue keeps both as they join and leave). The budget is then kept
small (steps of decodes cost about their weights' read up to a few hundred rows, so prompt tokens ride
along with them at about half the price of a large chunk), and grows only as far as the prompts need to
finish within those steps; never past `max_prefill_tokens`.
Without chunking a prompt runs whole, so the config then requires `max_num_batched_tokens >= max_model_len`: a recomputed
sequence must always fit in one step.

Prompt log-probabilities (`SamplingParams.prompt_logprobs`): position p's logits score prompt token
p + 1, so a chunk of such a request also asks for the logits of its positions not scored yet (up to
the prompt's second last; `ScheduledSeq.prompt_logits`), whichever step computes them. Such a
request takes no prefix-cache hit until its prompt is scored: a hit skips computing those positions,
and with them their logits (its own blocks still join the cache, for others, once computed). The
scored positions therefore always end each chunk, before its sampled row, and a request preempted
by recompute midway does not score a position twice.

Prompt blocks are allocated in full at admission (a request's footprint is known at once; chunks
then never need blocks). When a running sequence cannot get a block, the worst running sequence is
preempted: by "recompute" (blocks freed, `num_computed_tokens = 0`, back to waiting with its output
kept so the prefill covers prompt+output) or by "swap" (blocks copied to host memory).

Priority and starvation. Sequences are ordered by the key
    (arrival_step + priority * aging_steps, arrival)
i.e. a request of priority p is treated as if it had arrived p * aging_steps steps later (a
"virtual deadline"). Lower priority values go first, and a waiting request ages: one arriving
aging_steps * (p - q) steps after it with the better priority q no longer overtakes it. The same
key orders admission (waiting/swapped heads are never bypassed: if the head does not fit, nothing
behind it is admitted) and picks preemption victims (the worst key). Guarantee: with priorities
bounded below (by q_min) and every request finite (max_tokens, max_model_len), a request R is
overtaken only by requests arriving within aging_steps * (p_R - q_min) steps of it — finitely
many — each of which finishes; blocks are freed as they finish, R reaches the head, is admitted
without bypass, and is preempted only for sequences with a better key. `aging_steps=None` gives
strict priority (FCFS within a priority), which *can* starve a low priority under a steady stream
of higher ones. A key never changes once a request has arrived, so each queue (`KeyedQueue`) keeps
its order as sequences join and leave: no step sorts or scans the waiting requests, and a step's host
work grows with the running batch, not with the queue (admission looks at the requests it admits,
the head that stops it, and any it passes over because they wait for a prefix being computed).
Requests that could never run (prompt or full length larger than the whole cache,
prompt not shorter than max_model_len) are rejected in `add()` with `RequestError`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from llmc.errors import RequestError
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.keyed_queue import KeyedQueue
from llmc.runtime.sequence import Sequence, SequenceGroup, SequenceStatus

StopFn = Callable[[Sequence], "str | None"]


@dataclass
class SchedulerConfig:
    """Budgets and policies of the scheduler (see the module docstring)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    max_model_len: int = 2048
    aging_steps: int | None = 64  # waited steps worth one priority level; None = strict
    max_prefill_tokens: int | None = None  # a step with no decode to run; None = max_num_batched_tokens
    # a step whose decodes take d tokens reading c tokens of K/V, with prompt work to do, takes
    # max(max_num_batched_tokens, step_budget(d, c)) tokens (config.StepBudget); None = the fixed budget
    step_budget: Callable[[int, int], int] | None = None
    # a factor f: a step with decodes and prompt work takes the prompts' pace, d + f * P / L (module docstring)
    pace_prompts: float | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError(
                "max_num_seqs and max_num_batched_tokens must be >= 1, max_model_len >= 2"
            )
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.pace_prompts is not None and not self.pace_prompts > 0:
            raise ValueError(f"pace_prompts must be > 0, got {self.pace_prompts}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len, "
                "else a long (re)computed prompt could never be scheduled"
            )


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: K/V for positions [computed, computed + num_new_tokens)."""

    seq: Sequence
    num_new_tokens: int
    is_prefill: bool
    sample: bool  # False for a non-final prefill chunk: no logits row
    forks: list[Sequence] = field(default_factory=list)  # siblings sampled from seq's logits row
    copies: list[tuple[int, int]] = field(default_factory=list)  # this seq's COW pairs
    spec: list[int] = field(default_factory=list)  # speculated tokens run after the last one, to verify
    prompt_logits: int = 0  # rows that score prompt tokens: the last ones of the chunk before its sampled row

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step feeds: the uncomputed ones, then the speculated ones."""
        c = self.seq.num_computed_tokens
        if not self.spec:
            return self.seq.token_ids[c:c + self.num_new_tokens]
        return self.seq.token_ids[c:c + self.num_new_tokens - len(self.spec)] + self.spec

    @property
    def num_logits(self) -> int:
        """Logits rows this entry samples from (after its `prompt_logits` rows): none for a non-final chunk,
        one per fed token when verifying."""
        return (1 + len(self.spec)) if self.sample else 0


@dataclass
class SchedulerOutput:
    """One step's plan. The runner applies, in order: swap-out, swap-in, copies, forward."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def blocks_to_copy(self) -> list[tuple[int, int]]:  # (src, dst) device blocks
        return [pair for e in self.scheduled for pair in e.copies]

    @property
    def num_batched_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.scheduled)

    @property
    def sampled_seqs(self) -> list[Sequence]:
        """Sequences that receive a token this step, in sampler-row order."""
        return [s for e in self.scheduled if e.sample for s in (e.seq, *e.forks)]

    @property
    def logits_repeats(self) -> list[int]:
        """Per logits row (one per entry with sample=True): how many sampler rows it feeds."""
        return [1 + len(e.forks) for e in self.scheduled if e.sample]

    @property
    def has_spec(self) -> bool:
        return any(e.spec for e in self.scheduled)

    @property
    def scores_prompts(self) -> bool:
        return any(e.prompt_logits for e in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides each step's batch; see the module docstring for the policy.

    Example (the engine's step):
        >>> out = scheduler.schedule()
        >>> logits = runner.run(out)  # [len(out.logits_repeats), V]
        >>> rows = logits.repeat_interleave(torch.tensor(out.logits_repeats), dim=0)
        >>> sampled = sampler(rows, out.sampled_seqs)
        >>> scheduler.update_after_step(out, sampled.token_ids, sampled.logprobs, stop_checker)
        >>> done = scheduler.pop_finished()
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        # in key order as sequences join and leave (keys are fixed at arrival): no step sorts a queue
        # .total: the tokens they have to compute; .top(): the most output tokens one of them may make
        self.waiting = KeyedQueue(self._key, weight=lambda seq: seq.num_tokens, top=lambda seq: seq.params.max_tokens)
        self.running = KeyedQueue(self._key)
        self.swapped = KeyedQueue(self._key)
        self.groups: dict[str, SequenceGroup] = {}
        self._finished: list[SequenceGroup] = []
        self._step = 0
        self._arrivals = 0

    # ---- requests ------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        """Queue a request; raises `RequestError` if it is invalid or could never run."""
        cfg, params, prompt_len = self.config, group.params, len(group.prompt_token_ids)
        params.validate(cfg.max_model_len)
        if group.request_id in self.groups:
            raise RequestError(f"request id {group.request_id!r} is already in use.")
        if prompt_len == 0:
            raise RequestError("the prompt is empty; give at least one token.")
        if prompt_len >= cfg.max_model_len:
            raise RequestError(
                f"the prompt has {prompt_len} tokens but the model's context is "
                f"{cfg.max_model_len}; shorten the prompt to leave room for output."
            )
        # The last generated token never needs K/V, hence the - 1.
        longest = min(prompt_len + params.max_tokens, cfg.max_model_len) - 1
        if self.bm.blocks_for(longest) > self.bm.num_blocks:
            raise RequestError(
                f"the request needs up to {self.bm.blocks_for(longest)} KV blocks "
                f"({longest} tokens) but the cache has only {self.bm.num_blocks}; shorten the "
                "prompt or max_tokens, or give the engine more KV-cache blocks (num_blocks; --num-blocks)."
            )
        if params.n > cfg.max_num_seqs:
            raise RequestError(f"n={params.n} exceeds max_num_seqs={cfg.max_num_seqs}.")
        for seq in group.seqs:
            seq.arrival, seq.arrival_step = self._arrivals, self._step
        self._arrivals += 1
        self.groups[group.request_id] = group
        self.waiting.add(group.leader)

    def abort(self, request_id: str) -> bool:
        """Finish every sequence of the request with reason "abort", in any state."""
        group = self.groups.get(request_id)
        if group is None:
            return False
        for seq in group.seqs:
            if not seq.is_finished:
                self.finish(seq, "abort")
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished ("stop", "length" or "abort") and free its blocks."""
        group = self.groups[seq.request_id]
        for queue in (self.waiting, self.running, self.swapped):
            queue.discard(seq)
        self.bm.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.for_reason(reason), reason
        if seq is group.leader and not group.forked:  # its siblings can never be forked now
            for sibling in group.pending_forks(seq):
                sibling.status, sibling.finish_reason = seq.status, reason
        if group.is_finished:
            del self.groups[group.request_id]
            self._finished.append(group)

    def pop_finished(self) -> list[SequenceGroup]:
        """Requests finished since the last call (for the engine to return to callers)."""
        done, self._finished = self._finished, []
        return done

    def take_finished(self, request_ids: set[str]) -> list[SequenceGroup]:
        """Remove and return the finished requests among `request_ids` (the others stay to be popped)."""
        taken = [g for g in self._finished if g.request_id in request_ids]
        self._finished = [g for g in self._finished if g.request_id not in request_ids]
        return taken

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def has_finished(self) -> bool:
        """Whether finished requests wait to be popped."""
        return bool(self._finished)

    # ---- the step ------------------------------------------------------------------------
    def _key(self, seq: Sequence) -> tuple[int, int, int]:
        aging = self.config.aging_steps
        if aging is None:
            return (seq.priority, seq.arrival, seq.seq_id)
        return (seq.arrival_step + seq.priority * aging, seq.arrival, seq.seq_id)

    def _slots(self, seq: Sequence) -> int:
        return 1 + len(self.groups[seq.request_id].pending_forks(seq))

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        if not seq.is_prefill:
            return min(1 + len(seq.spec_token_ids), budget)
        todo = seq.num_uncomputed_tokens
        if self.config.enable_chunked_prefill:
            return min(todo, budget)
        return todo if todo <= budget else 0

    def _entry(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> ScheduledSeq:
        prefill = seq.is_prefill
        spec = seq.spec_token_ids[:n - 1] if seq.spec_token_ids and not prefill else []
        sample = seq.num_computed_tokens + n - len(spec) == seq.num_tokens
        forks = self.groups[seq.request_id].pending_forks(seq) if sample and prefill else []
        return ScheduledSeq(seq, n, prefill, sample, forks, copies, spec, _prompt_logits(seq, n))

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see module docstring); mutates queues and block tables."""
        self._step += 1
        out, budget = SchedulerOutput(), self.config.max_num_batched_tokens
        entries: dict[int, ScheduledSeq] = {}  # seq_id -> entry, in scheduling order

        decodes, prefills = [], []
        for s in self.running:
            (prefills if s.is_prefill else decodes).append(s)
        if not decodes and not self.swapped:  # no decode waits on this step: it may take more tokens
            budget = max(budget, self.config.max_prefill_tokens or 0)
        elif self.config.pace_prompts is not None and (prefills or self.waiting):
            budget = max(budget, self._paced(decodes, prefills))
        elif self.config.step_budget is not None and (prefills or self.waiting):
            budget = max(budget, self.config.step_budget(sum(1 + len(s.spec_token_ids or ()) for s in decodes),
                                                         sum(s.num_tokens for s in decodes)))
        for seq in decodes + prefills:
            if seq.status is not SequenceStatus.RUNNING or seq.ends_in_flight:
                continue  # preempted earlier in this loop, or ending with the token the device computes
            n = self._num_new_tokens(seq, budget)
            if n == 0:
                continue
            copies = self.bm.try_append(seq, n)
            while copies is None and seq.status is SequenceStatus.RUNNING:
                victim = self.running[-1]  # the worst key
                budget += self._preempt(victim, entries, out)
                if seq.status is SequenceStatus.RUNNING:
                    copies = self.bm.try_append(seq, n)
            if copies is not None:
                entries[seq.seq_id] = self._entry(seq, n, copies)
                budget -= n

        slots = sum(self._slots(s) for s in self.running)
        swapped_in: set[int] = set()
        if not out.preempted:
            while self.swapped and budget > 0:
                seq = self.swapped[0]
                n, need = self._num_new_tokens(seq, budget), self._slots(seq)
                if n == 0 or slots + need > self.config.max_num_seqs:
                    break
                if not self.bm.can_swap_in(seq, n):
                    break
                out.blocks_to_swap_in.extend(self.bm.swap_in(seq).items())
                swapped_in.add(seq.seq_id)
                self._move(seq, self.swapped, SequenceStatus.RUNNING)
                entries[seq.seq_id] = self._entry(seq, n, self.bm.append_slots(seq, n))
                budget, slots = budget - n, slots + need

        if not out.preempted and not self.swapped:
            preempted: set[int] = set()  # a sequence preempted in this step waits at least one step
            i = 0  # walks the waiting queue in key order: admitted ones leave it, victims join behind
            while i < len(self.waiting) and budget > 0:
                seq = self.waiting[i]
                if seq.seq_id in preempted or self.bm.waits_for_prefix(seq):
                    i += 1  # waits_for_prefix: an admitted request is computing its prefix, shared next step
                    continue
                need = self._slots(seq)
                while slots + need > self.config.max_num_seqs or not self.bm.can_allocate(seq):
                    # priority means the same whichever resource is short: preempt a worse running one
                    # never one swapped in by this step (its swap-out would run before its swap-in), and
                    # only for a better request, not a sibling of the same one
                    victim = next((s for s in reversed(self.running) if s.seq_id not in swapped_in), None)
                    if victim is None or self.running.key(victim)[:2] <= self.waiting.key(seq)[:2]:
                        break
                    slots -= self._slots(victim)
                    preempted.add(victim.seq_id)
                    # after a swap-in, by recompute: host blocks it freed may not be reused by a swap-out
                    # of the same step (swap-outs run first)
                    budget += self._preempt(victim, entries, out, allow_swap=not out.blocks_to_swap_in)
                if slots + need > self.config.max_num_seqs or not self.bm.can_allocate(seq):
                    break  # the head does not fit: nothing behind it is admitted either
                if not self.config.enable_chunked_prefill and seq.num_tokens > budget:
                    break  # checked before allocating: without chunking it runs whole or not
                self.bm.allocate(seq)
                n = self._num_new_tokens(seq, budget)
                self._move(seq, self.waiting, SequenceStatus.RUNNING)
                entries[seq.seq_id] = self._entry(seq, n, self.bm.append_slots(seq, n))
                budget, slots = budget - n, slots + need

        out.scheduled = list(entries.values())
        return out

    def _paced(self, decodes: list[Sequence], prefills: list[Sequence]) -> int:
        """The tokens of a step whose decodes leave prompt work to spread over the steps they take anyway
        (`pace_prompts`, see the module docstring): a power of two, at most `max_prefill_tokens`."""
        cfg = self.config
        tokens = sum(1 + len(s.spec_token_ids or ()) for s in decodes)
        pending = self.waiting.total + sum(s.num_uncomputed_tokens for s in prefills)
        left = max((s.params.max_tokens - s.num_output_tokens for s in decodes), default=1)
        rate = pending / max(1, left)
        # a prompt whose own output is long must be done sooner, or it makes the run longer: it has the steps
        # until its output would outlast the decodes' for itself and the prompts ahead of it. The waiting queue's
        # head counts so; where a longer output waits behind it (requests not queued longest first), the waiting
        # requests count as one, with all their tokens and that output (no step scans them)
        ahead = 0
        for s in prefills + ([self.waiting[0]] if self.waiting else []):
            ahead += s.num_uncomputed_tokens
            rate = max(rate, ahead / max(1, left - s.params.max_tokens))
        if self.waiting and self.waiting.top() > self.waiting[0].params.max_tokens:
            rate = max(rate, pending / max(1, left - self.waiting.top()))
        need = tokens + math.ceil(cfg.pace_prompts * rate)
        cap = max(cfg.max_num_batched_tokens, cfg.max_prefill_tokens or 0)
        return min(cap, 1 << max(0, need - 1).bit_length())

    def _move(self, seq: Sequence, source: KeyedQueue, status: SequenceStatus) -> None:
        source.remove(seq)
        seq.status = status
        {SequenceStatus.RUNNING: self.running, SequenceStatus.WAITING: self.waiting,
         SequenceStatus.SWAPPED: self.swapped}[status].add(seq)

    def _preempt(
        self, victim: Sequence, entries: dict[int, ScheduledSeq], out: SchedulerOutput,
        allow_swap: bool = True,
    ) -> int:
        """Preempt `victim`; returns the token budget it gives back if it was already scheduled.

        With prompts allocated whole at admission only decodes (taken in key order) need blocks,
        so a victim is never already scheduled today; the refund keeps this correct if that
        changes (incremental prefill allocation, multi-token speculative decodes)."""
        entry = entries.pop(victim.seq_id, None)
        victim.spec_token_ids = []  # a proposal is for the step it was made for
        # A victim with copy-on-write pairs this step cannot be swapped: its swap-out would copy
        # the destination block before the COW copy filled it (swap-outs run first).
        swap = (
            self.config.preemption_mode == "swap"
            and allow_swap
            and not (entry and entry.copies)
            and self.bm.can_swap_out(victim)
        )
        if swap:
            out.blocks_to_swap_out.extend(self.bm.swap_out(victim).items())
            self._move(victim, self.running, SequenceStatus.SWAPPED)
        else:
            self.bm.free(victim)
            victim.num_computed_tokens = 0
            self._move(victim, self.running, SequenceStatus.WAITING)
        out.preempted.append(victim)
        return entry.num_new_tokens if entry else 0

    def update_after_step(
        self,
        out: SchedulerOutput,
        token_ids: list[int] | list[list[int]],
        logprobs: list[float] | list[list[float]] | None = None,
        check_stop: StopFn | None = None,
        top_logprobs: list[dict[int, float]] | list[list[dict[int, float]]] | None = None,
    ) -> list[Sequence]:
        """Record a finished step: advance computed tokens, fork siblings, append sampled tokens.

        Args:
            out: the plan `schedule()` returned for this step.
            token_ids: per `out.sampled_seqs` entry, in that order, its new token, or the list of its new
                tokens: for an entry that verified k speculated tokens, the accepted ones and then one
                more (1 to k + 1 tokens); the K/V of the rejected ones are dropped.
            logprobs: matching log-probabilities (same nesting), kept if the request asked for them.
            check_stop: e.g. a `StopChecker`; returns "stop"/"length"/None for a sequence. Checked after
                each appended token: tokens after a stop are discarded.
            top_logprobs: each token's alternatives (same nesting), kept if the request asked for them.
        Returns:
            the sequences that finished in this step.
        """
        assert len(token_ids) == len(out.sampled_seqs), "one token (or list) per sampled sequence"
        finished, row = [], 0
        for e in out.scheduled:
            seq = e.seq
            targets = (seq, *e.forks) if e.sample else ()
            row += len(targets)
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted between schedule() and now
            first = row - len(targets)
            if e.spec:  # verified: K/V stand for the fed tokens up to the last accepted one
                seq.num_computed_tokens += len(token_ids[first])  # the last fed + the accepted ones
                self.bm.trim(seq)  # (registered below, once the accepted tokens are in the sequence)
            else:
                seq.num_computed_tokens += e.num_new_tokens
                self.bm.mark_computed(seq)
            if e.forks:
                self.groups[seq.request_id].forked = True
                for child in e.forks:
                    self.bm.fork(seq, child)
                    child.status = SequenceStatus.RUNNING
                    self.running.add(child)
            for i, target in enumerate(targets, start=first):
                wants = target.params.num_logprobs
                toks = token_ids[i]
                lps = logprobs[i] if logprobs is not None and wants is not None else None
                tops = top_logprobs[i] if top_logprobs is not None and wants else None
                if not isinstance(toks, list):  # the common case: one token
                    toks, lps, tops = (toks,), None if lps is None else (lps,), None if tops is None else (tops,)
                for j, tok in enumerate(toks):
                    target.append_token(tok, None if lps is None else lps[j], None if tops is None else tops[j])
                    reason = check_stop(target) if check_stop is not None else None
                    if reason is not None:
                        self.finish(target, reason)
                        finished.append(target)
                        break
            if e.spec and seq.status is SequenceStatus.RUNNING:
                self.bm.mark_computed(seq)
        return finished

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the last `num_tokens` output tokens of a running or waiting sequence: their K/V are
        dropped, blocks left empty are freed, and no prefix-cache entry keeps a dropped token."""
        if not 0 <= num_tokens <= seq.num_output_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {seq.num_output_tokens} output tokens")
        if seq.is_finished or seq.status is SequenceStatus.SWAPPED:
            raise ValueError(f"cannot roll back a {seq.status.name.lower()} sequence")
        seq.truncate(seq.num_tokens - num_tokens)
        self.bm.rollback(seq)


def _prompt_logits(seq: Sequence, n: int) -> int:
    """Rows of the chunk [c, c + n) that score prompt tokens: from the first position not scored yet to
    the prompt's second last. A suffix of the chunk (then its sampled row, position P - 1, if any),
    since c never passes the first unscored position while one is left (no prefix-cache hit skips it)."""
    if not seq.scores_prompt:
        return 0
    c = seq.num_computed_tokens
    return max(0, min(c + n, seq.num_prompt_tokens - 1) - max(c, len(seq.prompt_logprobs.logprobs)))
