"""The engine: `step()` = schedule ▸ run ▸ postprocess (the offline `LLM` API over it: llmc/runtime/llm.py)."""
from __future__ import annotations

import itertools
import logging
import operator
import os
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence as Seq

import torch

from llmc.artifact import Artifact, load_artifact
from llmc.errors import LLMCError, RequestError
from llmc.runtime import heap
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.config import DEFAULT_TOKEN_BUDGET, PACE_PROMPTS, EngineConfig, StepBudget, paced_floor, token_budget
from llmc.runtime.distributed import DistributedExecutor
from llmc.runtime.executor import Executor, Feed, Launched, StepBatch, StepInput, StepResult, make_executor
from llmc.runtime.profiling import StepProfiler
from llmc.runtime.sampler import Sampler, target_logprobs
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from llmc.runtime.sequence import SequenceGroup, SequenceStatus
from llmc.runtime.spec_decode import SpecConfig, SpecDecoder
from llmc.runtime.step_graphs import graphs_captured
from llmc.runtime.stop import StopChecker
from llmc.tokenizer import check_text

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]


@dataclass
class CompletionOutput:
    """One of the n samples of a request: totals so far, and what is new since the last output.

    With `SamplingParams(logprobs=k)`: `logprobs[i]` is the natural log-probability of `token_ids[i]`, and
    with k > 0 `top_logprobs[i]` maps the k most likely token ids at that position to theirs, most likely
    first (the chosen token among them only if it is one of the k). Both are of the distribution the token
    was drawn from (see `SamplingParams`); a stream's new entries are the last `len(delta_token_ids)`.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """A request's state after a step (streaming) or at the end; `.text` etc. refer to sample 0.

    With `SamplingParams(prompt_logprobs=k)`, from the step that computes the prompt's last chunk on
    (so on the final output, and the first streamed one after the prompt): `prompt_logprobs[i]` is
    the natural log-probability of prompt token i given the tokens before it, None for the first;
    with k > 0 `prompt_top_logprobs[i]` maps the k most likely token ids at position i to their
    log-probabilities, most likely first (vLLM's `prompt_logprobs` dict, less the prompt token's own
    entry). Both None before that, or when the request ended before its prompt was computed.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class _Request:
    group: SequenceGroup
    prompt: str | None
    sent_tokens: list[int]  # per sample: tokens already reported
    sent_chars: list[int]  # per sample: characters of text already reported
    scored: tuple[list, list | None] | None = None  # the outputs' prompt_logprobs fields, once complete


@dataclass
class _InFlight:
    """A step launched on the device and not waited for (`LLMEngine.step`, overlapped steps)."""

    out: SchedulerOutput
    launched: Launched
    # seq_id -> (position of the token the step samples for it, its row in the step's tokens); filled when
    # the step is booked, with a stand-in token whose value `_resolve` writes
    pending: dict[int, tuple[int, int]] = field(default_factory=dict)


class LLMEngine:
    """Continuous-batching engine over a compiled artifact: `step()` = schedule ▸ run ▸ postprocess.

    Overlapped steps (`overlap`, on by default): when every row of a step wants only its argmax, or a draw
    that needs nothing from the host (`Sampler.on_device`: no seed, penalty or logprobs), the step is
    launched and not waited for. The next `step()` books it (computed tokens, a stand-in for each new
    token), schedules and launches the following step, whose inputs take those tokens from the device,
    and only then waits for the first step's tokens and checks them for stops. The host's scheduling and
    input preparation run while the device computes, and a step's outputs reach the caller one `step()`
    later. A sequence that stops at step N still ran in step N + 1; that row is dropped (its K/V landed
    in blocks already freed, which no one reads). Steps that sample on the host (a seed, a penalty,
    logprobs, n > 1, prompt scores) or verify speculation run as before, after the step in flight is
    resolved. With speculation, a plain step is launched only where the next step gets no proposals
    (under load, or where speculation does not pay: `SpecDecoder.may_overlap`), and a step in flight is
    read before any proposal, which continues each sequence's real last token.

    Never left broken: a request that fails validation changes nothing, and a step that raises aborts
    the requests it held (their blocks return) before the exception leaves `step()`.

    Args:
        artifact: a loaded artifact (`llmc.load`).
        config: engine options (defaults: `EngineConfig()`).
        speculative: speculative decoding: options (`SpecConfig` fields: method, draft,
            num_speculative_tokens) or a built `SpecDecoder`; None: off.

    Example:
        >>> eng = LLMEngine(llmc.load("tiny.llmc"))                      # doctest: +SKIP
        >>> eng.add_request("def f(x):", SamplingParams(max_tokens=8))   # doctest: +SKIP
        >>> while eng.has_unfinished():                                   # doctest: +SKIP
        ...     for out in eng.step(): print(out.outputs[0].delta_text, end="")
    """

    def __init__(self, artifact: Artifact, config: EngineConfig | None = None,
                 speculative: dict | SpecConfig | SpecDecoder | None = None):
        cfg = self.config = config or EngineConfig()
        cfg.validate()
        self.artifact, self.info = artifact, artifact.info
        self.tokenizer = artifact.tokenizer() if artifact.tokenizer_dir else None
        self.max_model_len = min(cfg.max_model_len or 1 << 30, self.info.max_model_len)
        kv_dtype = cfg.kv_cache_dtype or self.info.kv_cache_dtype
        if cfg.tensor_parallel_size * cfg.pipeline_parallel_size > 1:
            self.executor: Executor = DistributedExecutor(
                artifact, cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.backend, cfg.device,
                cfg.block_size, cfg.num_blocks, kv_dtype, cfg.kv_memory_fraction, cfg.num_cpu_blocks,
                self.info.max_model_len, expert_parallel=cfg.expert_parallel, cuda_graphs=cfg.cuda_graphs)
        else:
            self.executor = make_executor(
                artifact.graph, cfg.backend, cfg.device, cfg.block_size, cfg.num_blocks, kv_dtype,
                cfg.kv_memory_fraction, cfg.num_cpu_blocks, artifact.tuning, cfg.cuda_graphs, self.info.max_model_len,
                invariant=speculative is not None)  # verify steps sum as plain ones: see Tuner.from_artifact
        try:  # the artifact's files checked (a check in the background, beside moving the weights) before any run
            artifact.wait_verified()
        except BaseException:
            close = getattr(self.executor, "close", None)
            if close is not None:
                close()
            raise
        self.block_manager = BlockManager(self.executor.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                          cfg.num_cpu_blocks)
        prefill_budget, step_budget, pace = cfg.max_prefill_tokens, None, None
        if cfg.max_num_batched_tokens is None:
            # the compile's measured budget, at least the default and enough for a decode of every sequence. On
            # an H200 the 8B shape's measured 512 tokens, a floor under the per-step budget below, ran the mixed
            # workload 1.31x slower than 2,048 tokens every step (benchmarks/RESULTS.md, 2026-12-04): its steps
            # of 128 decodes beside a 4,096-token chunk ran on the 8,192-token piecewise graphs, their GEMMs over
            # twice the rows (benchmarks/schedule_sim.py), where a power-of-two budget fills its bucket
            measured = max(token_budget(artifact.tuning), cfg.max_num_seqs)
            cfg.max_num_batched_tokens = max(measured, DEFAULT_TOKEN_BUDGET)
            if os.environ.get("LLMC_PACE_PROMPTS", "0") == "1":
                # opt-in, not yet measured on a GPU: steps with decodes keep to the smallest size the compile
                # timed (their GEMMs cost about the weights' read there) and grow with the prompts' pace
                # (SchedulerConfig.pace_prompts); a step with none takes the default budget
                prefill_budget = prefill_budget or cfg.max_num_batched_tokens
                cfg.max_num_batched_tokens = max(paced_floor(artifact.tuning), cfg.max_num_seqs)
                pace = PACE_PROMPTS
            elif os.environ.get("LLMC_STEP_BUDGET", "0") == "1":
                # opt-in: the measured budget for steps with decodes, grown per step to spread their cost
                # (StepBudget), and the default for a step with none
                prefill_budget = prefill_budget or cfg.max_num_batched_tokens
                cfg.max_num_batched_tokens = measured
                kv_per_token = self.executor.kv_bytes / max(1, self.executor.num_blocks * cfg.block_size)
                step_budget = StepBudget.of(artifact.tuning, kv_per_token, measured)
        budget = cfg.max_num_batched_tokens if cfg.enable_chunked_prefill else max(cfg.max_num_batched_tokens,
                                                                                      self.max_model_len)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, budget, cfg.enable_chunked_prefill,
                                                   cfg.preemption_mode, self.max_model_len,
                                                   max_prefill_tokens=prefill_budget, step_budget=step_budget,
                                                   pace_prompts=pace),
                                   self.block_manager)
        self.warm_up_s, self.warm_up_steps = 0.0, 0
        if cfg.warm_up and getattr(self.executor, "device", None) is not None and \
                self.executor.device.type == "cuda" and hasattr(self.executor, "warm_up"):
            # the largest step the scheduler makes: its budget, a lone prompt's chunk, or decodes beside the
            # step budget's largest chunk
            top = max(budget, prefill_budget or 0,
                      step_budget.gemm_ms[-1][0] + cfg.max_num_seqs if step_budget is not None else 0)
            t0 = time.perf_counter()
            self.warm_up_steps = self.executor.warm_up(cfg.max_num_seqs, top, self.max_model_len - 1)
            self.warm_up_s = time.perf_counter() - t0
            log.info("warm-up: %d step shapes in %.2f s", self.warm_up_steps, self.warm_up_s)
        eos = list(self.info.eos_token_ids)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = [self.tokenizer.eos_token_id]
        self.decode = _decoder(self.tokenizer) if self.tokenizer else None
        self.stop = StopChecker(self.max_model_len, eos, self.decode)
        self.sampler = Sampler(eos)  # min_tokens holds the end of sequence off
        self.spec = speculative if isinstance(speculative, SpecDecoder) or speculative is None else \
            SpecDecoder.build(SpecConfig.from_options(speculative, artifact.bundled_draft), self.info,
                              self.max_model_len, self.sampler,
                              {"backend": cfg.backend, "device": cfg.device, "block_size": cfg.block_size})
        if cfg.multi_step > 1 and self.spec is not None:
            raise LLMCError("multi_step and speculative decoding both run several tokens per step: use one")
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.num_steps = 0
        self.timings: dict[str, float] = {}  # seconds per phase, summed over steps
        self.overlap = cfg.overlap and getattr(self.executor, "overlaps", False) and cfg.multi_step == 1
        self._inflight: _InFlight | None = None
        self.num_overlapped = 0  # steps launched without the host waiting for them
        # LLMC_PROFILE_DIR: a window of steps profiled (llmc/runtime/profiling.py); workers profile their own
        self._profiler = StepProfiler.from_env("engine") if getattr(self.executor.device, "type", "") == "cuda" \
            else None
        if self._profiler is not None:  # a window the runs did not reach the end of: written when the engine goes
            weakref.finalize(self, self._profiler.finish)
        # ready: on a GPU its heap goes out of the collector's way until it is done (llmc/runtime/heap.py)
        self.heap_token = heap.freeze() if getattr(self.executor.device, "type", "") == "cuda" else None
        if self.heap_token is not None:  # used without an LLM around it, and freed (at exit, heap.py thaws all)
            weakref.finalize(self, heap.release, self.heap_token).atexit = False

    # -- requests ---------------------------------------------------------------------------------
    def encode(self, prompt: str | Seq[int]) -> list[int]:
        """Tokenize a text prompt, or check a list of token ids; raises RequestError."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty; give some text to continue")
            if self.tokenizer is None:
                raise RequestError("this artifact has no tokenizer: pass token ids instead of text")
            ids = self.tokenizer.encode(check_text(prompt, "the prompt"), add_special_tokens=False)
        elif isinstance(prompt, (bytes, bytearray)):
            raise RequestError("a prompt must be a string or a list of integer token ids, got bytes: decode them "
                               "first (e.g. prompt.decode('utf-8'))")
        else:
            try:
                ids = [operator.index(t) for t in prompt]
            except TypeError:
                raise RequestError("a prompt must be a string or a list of integer token ids") from None
            vocab = self.info.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"token id {bad} is outside this model's vocabulary [0, {vocab})")
        if not ids:
            raise RequestError("the prompt is empty; give some text to continue")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens but the model's context is {self.max_model_len} "
                               "tokens (room is needed for at least one generated token); shorten the prompt")
        return ids

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; a bad one raises RequestError and changes nothing."""
        params = params or SamplingParams()
        params.validate()
        return self._add(self.encode(prompt), params, request_id, prompt if isinstance(prompt, str) else None)

    def _add(self, ids: list[int], params: SamplingParams, request_id: str | None, text: str | None) -> str:
        """Queue an already validated and tokenized request."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        params.check_vocab(self.info.vocab_size)
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        group = SequenceGroup(request_id, ids, params)
        self.scheduler.add(group)
        self.requests[request_id] = _Request(group, text, [0] * params.n, [0] * params.n)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state and free its blocks; its final output (finish_reason "abort") comes
        from the next `step()`. False if the request is unknown or already finished."""
        return self.scheduler.abort(request_id)

    def rollback(self, request_id: str, num_tokens: int, index: int = 0) -> None:
        """Drop the last `num_tokens` generated tokens of sample `index` of a request: their K/V go, blocks
        left empty are freed, the prefix cache keeps none of them. Text already streamed is not recalled."""
        seq = self.requests[request_id].group.seqs[index]
        self._drain()
        self.scheduler.rollback(seq, num_tokens)
        if self.decode is not None:
            seq.set_text(self.decode(seq.output_token_ids))

    def has_unfinished(self) -> bool:
        """True while a request is queued or running, or has a final output not yet returned by step()."""
        return self.scheduler.has_unfinished() or self.scheduler.has_finished()

    # -- the step ---------------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One iteration: schedule ▸ run ▸ postprocess. Returns outputs of requests that progressed
        (streaming: each carries its delta since the last), or with `finished_only` of those that
        finished (or were aborted) since the last step. With overlapped steps (see the class) a step's
        tokens are returned by the next call."""
        if self._profiler is not None:
            self._profiler.tick()
        t, captured = time.perf_counter(), graphs_captured()
        flying, self._inflight = self._inflight, None
        if flying is not None:
            self._book(flying)
        read = None  # a step in flight whose tokens were read before proposing
        if self.spec is not None:
            if flying is not None and self.spec.may_propose(sum(not s.is_prefill for s in self.scheduler.running)):
                self._resolve(flying)  # proposals continue each sequence's real last token, not its stand-in
                read, flying = flying, None
            self.spec.propose([s for s in self.scheduler.running if not s.is_prefill])
            self._time("propose", t)
        proposed = time.perf_counter()
        chained = self._plan_chains()
        out = self.scheduler.schedule()
        for seq in chained:
            seq.spec_token_ids = []  # the entries hold them; a later step plans afresh
        self._time("schedule", proposed)
        self.num_preemptions += len(out.preempted)
        touched = {e.seq.request_id for f in (flying, read) if f is not None for e in f.out.scheduled}
        if not out.is_empty and self._overlaps(out):
            self._launch(out, flying)
        if flying is not None:
            self._resolve(flying)
            if self._inflight is None:  # `out` runs now: a sequence that stopped with those tokens runs no further
                out.scheduled = [e for e in out.scheduled if not e.seq.is_finished]
        if self._inflight is None and (not out.is_empty or out.blocks_to_swap_out or out.blocks_to_swap_in):
            touched |= {e.seq.request_id for e in out.scheduled}
            try:
                self._run(out)
            except BaseException:
                self._abort_step(out)
                raise
        if self.spec is not None:  # what speculation costs here, measured: the calls' wall times
            self.spec.observe_step(out, time.perf_counter(), one_time=graphs_captured() != captured)
        self.num_steps += 1
        if self._inflight is not None and all(e.seq.is_finished for e in self._inflight.out.scheduled):
            # every sequence in it stopped: its tokens are read and dropped now (an executor of several processes
            # returns each launched step's result in order, and the next read must find the next step's)
            self._drain()
        t_out = time.perf_counter()
        finished = self.scheduler.pop_finished()
        done = {g.request_id for g in finished}
        if self.spec is not None:
            for g in finished:
                for seq in g.seqs:
                    self.spec.release(seq)
        report = done if finished_only else touched | done
        results = [self._output(rid) for rid in sorted(report) if rid in self.requests]
        for rid in done:
            self.requests.pop(rid, None)
        self._time("outputs", t_out)
        return results

    # -- overlapped steps (see the class docstring) --------------------------------------------------
    def _overlaps(self, out: SchedulerOutput) -> bool:
        """Whether `out` can run without the host waiting for it: every row it samples is a plain argmax, or
        (where the executor samples on the device) a draw that needs nothing from the host
        (`Sampler.on_device`)."""
        if not self.overlap or out.has_spec or out.scores_prompts or any(r != 1 for r in out.logits_repeats):
            return False
        if self.spec is not None and not self.spec.may_overlap(len(out.sampled_seqs)):
            return False  # a plain step speculation times, or one whose tokens the next step's proposals need
        seqs = out.sampled_seqs
        return Sampler.argmax_only(seqs) or (getattr(self.executor, "samples_on_device", False)
                                             and all(Sampler.on_device(s) for s in seqs))

    def _launch(self, out: SchedulerOutput, flying: _InFlight | None) -> None:
        """Start `out` on the device; tokens that `flying` computes come to it there (a Feed)."""
        t0 = time.perf_counter()
        batch = self._batch(out)
        batch.greedy = True
        feed = None
        if flying is not None and flying.pending:
            dst, src, offset = [], [], 0
            for e in out.scheduled:
                c = e.seq.num_computed_tokens
                pos, row = flying.pending.get(e.seq.seq_id, (-1, 0))
                if c <= pos < c + e.num_new_tokens:
                    dst.append(offset + pos - c)
                    src.append(row)
                offset += e.num_new_tokens
            feed = Feed(flying.launched.device_tokens, dst, src) if dst else None
        seqs = out.sampled_seqs
        sample = None if Sampler.argmax_only(seqs) else (lambda logits: self.sampler.tokens_on_device(logits, seqs))
        try:
            self._inflight = _InFlight(out, self.executor.launch(batch, feed, sample))
            self.num_overlapped += 1
        except BaseException:
            self._abort_step(out)  # its requests end, as a failed step's do; the one in flight is still waited for
            if flying is not None:
                self._resolve(flying)
            raise
        self._time("execute", t0)

    def _book(self, flying: _InFlight) -> None:
        """Record a launched step before its tokens are known, as `update_after_step` does: computed tokens
        advance (full blocks join the prefix cache), and each sampled sequence gets a stand-in token. A
        sequence whose stand-in ends it by length is scheduled no further."""
        t0, row = time.perf_counter(), 0
        for e in flying.out.scheduled:
            seq = e.seq
            row += e.sample
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted since the launch
            seq.num_computed_tokens += e.num_new_tokens
            self.block_manager.mark_computed(seq)
            if e.sample:
                flying.pending[seq.seq_id] = (seq.num_tokens, row - 1)
                seq.append_token(0)
                seq.ends_in_flight = seq.num_output_tokens >= seq.params.max_tokens or \
                    seq.num_tokens >= self.max_model_len
        self._time("update", t0)

    def _resolve(self, flying: _InFlight) -> None:
        """Wait for a launched step's tokens, write them over the stand-ins and check each for a stop."""
        t0 = time.perf_counter()
        try:
            tokens = flying.launched.tokens()
        except BaseException:
            self._abort_step(flying.out)
            raise
        t1 = time.perf_counter()
        for e in flying.out.scheduled:
            seq = e.seq
            pos, row = flying.pending.get(seq.seq_id, (-1, 0))
            if pos < 0:
                continue
            seq.set_token(pos, tokens[row])
            seq.ends_in_flight = False
            if not seq.is_finished:  # (a victim preempted since is checked too: it may have stopped)
                reason = self.stop(seq)
                if reason is not None:
                    self.scheduler.finish(seq, reason)
        self.timings["wait"] = self.timings.get("wait", 0.0) + t1 - t0
        self._time("update", t1)

    def _drain(self) -> None:
        """Book and resolve the step in flight, if any: every sequence's tokens are then on the host."""
        flying, self._inflight = self._inflight, None
        if flying is not None:
            self._book(flying)
            self._resolve(flying)

    def _plan_chains(self) -> list:
        """Multi-step decoding (`multi_step` k > 1): when every sequence is decoding, nothing waits that a
        free sequence slot could admit, and every token is a plain argmax, each running sequence is
        scheduled as a chain of k tokens (k - 1 placeholders after its last token, as a verify entry of
        k - 1 speculated tokens is): the executor runs k decode steps back to back on the device and the
        engine's per-step host work (schedule, postprocess, outputs) is paid once for the k. A chain is
        all accepted; tokens after a stop are dropped as after a rejected speculation. Returns the
        sequences given placeholders."""
        k, sch = self.config.multi_step, self.scheduler
        running = list(sch.running)
        # a waiting request is admitted only where a sequence slot is free: with every slot taken, chains
        # delay its admission by at most k - 1 steps (a chain ends before the next schedule)
        admissible = len(sch.waiting) and len(running) < self.config.max_num_seqs
        if k < 2 or not running or admissible or len(sch.swapped) or any(s.is_prefill for s in running) \
                or not Sampler.argmax_only(running):
            return []
        # one length for every chain (the device replays one graph k times): short of the context's end
        # and of the step's token budget
        k = min(k, self.config.max_num_batched_tokens // len(running),
                *(self.max_model_len - s.num_tokens + 1 for s in running))
        if k < 2:
            return []
        for seq in running:
            seq.spec_token_ids = [0] * (k - 1)
        return running

    def _abort_step(self, out: SchedulerOutput) -> None:
        """The step failed midway: its sequences' K/V (and any swapped out in it) are in doubt, so their
        requests end as aborted; every other request is untouched."""
        for rid in {s.request_id for s in out.preempted if s.status is SequenceStatus.SWAPPED} | \
                {e.seq.request_id for e in out.scheduled}:
            self.scheduler.abort(rid)

    @staticmethod
    def _batch(out: SchedulerOutput) -> StepBatch:
        return StepBatch([StepInput(e.token_ids, e.seq.num_computed_tokens, e.seq.block_table,
                                    e.prompt_logits + e.num_logits, e.is_prefill) for e in out.scheduled],
                         out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)

    def _run(self, out: SchedulerOutput) -> None:
        batch = self._batch(out)
        # each logits row and the sequences it is sampled for: the last row for a sequence and the siblings
        # forked off it (a verified sequence has a row per fed token, see _postprocess_verify)
        row_seqs, repeats = out.sampled_seqs, out.logits_repeats
        one_row_each = all(r == 1 for r in repeats)
        # rows that need only their argmax get it from the executor, which reads back tokens, not logits
        batch.greedy = bool(row_seqs) and one_row_each and Sampler.argmax_only(row_seqs) and not out.scores_prompts
        batch.chain = out.has_spec and self.spec is None  # placeholders of _plan_chains, not proposals
        batch.greedy |= batch.chain
        t0 = time.perf_counter()
        result = self.executor.execute(batch)
        t1 = time.perf_counter()
        if out.scores_prompts:
            result = StepResult(logits=self._score_prompts(out, result.logits))
        top = None
        if batch.chain:  # each chain's k rows are its k new tokens, all kept
            ids, tokens, logprobs, r = result.tokens.tolist(), [], None, 0
            for e in out.scheduled:
                if e.sample:
                    tokens.append(ids[r:r + e.num_logits] if e.spec else ids[r])
                    r += e.num_logits
        elif out.has_spec:
            tokens, logprobs, top = self._postprocess_verify(out, result)
        elif not row_seqs:
            tokens, logprobs = [], None
        elif batch.greedy:
            tokens, logprobs = result.tokens.tolist(), None
        else:
            rows = result.logits if one_row_each else \
                result.logits.repeat_interleave(torch.tensor(repeats, device=result.logits.device), dim=0)
            res = self.sampler(rows, row_seqs)
            tokens, logprobs, top = res.token_ids, res.logprobs, res.top
        t2 = time.perf_counter()
        self.scheduler.update_after_step(out, tokens, logprobs, self.stop, top)
        t3 = time.perf_counter()
        # where a step's host time goes (waiting for the GPU falls in execute on the greedy path,
        # in sample otherwise)
        for k, dt in (("execute", t1 - t0), ("sample", t2 - t1), ("update", t3 - t2)):
            self.timings[k] = self.timings.get(k, 0.0) + dt

    @staticmethod
    def _score_prompts(out: SchedulerOutput, logits: torch.Tensor) -> torch.Tensor:
        """Record the log-probabilities of the prompt tokens this step scored (an entry's `prompt_logits` rows
        come before its sampled ones); returns the sampled rows, as a step that scores nothing lays them out."""
        scoring, rows, targets, keep, r = [], [], [], [], 0
        for e in out.scheduled:
            if e.prompt_logits:
                first = e.seq.num_computed_tokens + e.num_new_tokens - e.num_logits - e.prompt_logits
                assert first == len(e.seq.prompt_logprobs.logprobs), "prompt positions scored out of order"
                scoring.append(e)
                rows += range(r, r + e.prompt_logits)
                targets += e.seq.prompt_token_ids[first + 1:first + 1 + e.prompt_logits]  # position p scores p + 1
                r += e.prompt_logits
            keep += range(r, r + e.num_logits)
            r += e.num_logits
        dev = logits.device
        chosen, top = target_logprobs(logits[torch.tensor(rows, device=dev)], targets,
                                      max(e.seq.prompt_logprobs.num_top for e in scoring))
        i = 0
        for e in scoring:
            pl, j = e.seq.prompt_logprobs, i + e.prompt_logits
            pl.logprobs += chosen[i:j]
            if pl.num_top:
                pl.top += [dict(itertools.islice(d.items(), pl.num_top)) for d in top[i:j]]
            i = j
        return logits[torch.tensor(keep, dtype=torch.int64, device=dev)]

    def _postprocess_verify(self, out: SchedulerOutput, result) -> tuple[list, list, list]:
        """Per sampled sequence its new tokens, their log-probabilities and alternatives: a verified entry's
        k + 1 rows go to the speculative decoder (the accepted tokens and one more); the other rows are
        sampled together, as in a plain step."""
        rows_of, r = [], 0  # per sampled entry: its first logits row
        for e in out.scheduled:
            if e.sample:
                rows_of.append(r)
                r += e.num_logits
        entries = [e for e in out.scheduled if e.sample]
        ids = result.tokens.tolist() if result.tokens is not None else None
        plain = [(e, i) for e, i in zip(entries, rows_of) if not e.spec]
        sampled: list = []
        if plain and ids is None:
            idx = torch.tensor([i for _, i in plain], device=result.logits.device)
            reps = torch.tensor([1 + len(e.forks) for e, _ in plain], device=result.logits.device)
            res = self.sampler(result.logits[idx].repeat_interleave(reps, dim=0),
                               [s for e, _ in plain for s in (e.seq, *e.forks)])
            sampled = list(zip(res.token_ids, res.logprobs, res.top or [None] * len(res.token_ids)))
        tokens, logprobs, top, j = [], [], [], 0
        for e, i in zip(entries, rows_of):
            if e.spec:
                rows = slice(i, i + len(e.spec) + 1)
                toks, lps, tops = self.spec.verify(e.seq, e.spec, None if ids is not None else result.logits[rows],
                                                   ids[rows] if ids is not None else None)
                tokens.append(toks)
                logprobs.append(lps if lps is not None else [0.0] * len(toks))
                top.append(tops)
                continue
            for _ in range(1 + len(e.forks)):
                if ids is not None:
                    tokens.append(ids[i])
                    logprobs.append(0.0)
                    top.append(None)
                else:
                    tokens.append(sampled[j][0])
                    logprobs.append(sampled[j][1])
                    top.append(sampled[j][2])
                    j += 1
        return tokens, logprobs, top

    def _time(self, key: str, since: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - since

    def _output(self, request_id: str) -> RequestOutput:
        req = self.requests[request_id]
        outs = []
        sent_chars, sent_tokens = req.sent_chars, req.sent_tokens
        for i, s in enumerate(req.group.seqs):
            self.stop.settle(s)
            text = s.output_text
            if s.params.stop and not s.is_finished:
                text = _settled(text, s.params.stop_strings)
            ids, k = s.output_token_ids, s.params.num_logprobs
            outs.append(CompletionOutput(i, text, ids[:], s.finish_reason,
                                         s.output_logprobs[:] if k is not None else None,
                                         text[sent_chars[i]:], ids[sent_tokens[i]:],
                                         s.output_top_logprobs[:] if k else None))
            if len(text) > sent_chars[i]:
                sent_chars[i] = len(text)
            sent_tokens[i] = len(ids)
        return RequestOutput(request_id, req.prompt, req.group.prompt_token_ids, outs, req.group.is_finished,
                             *self._prompt_logprobs(req))

    @staticmethod
    def _prompt_logprobs(req: _Request) -> tuple[list | None, list | None]:
        """The request's prompt log-probabilities once all are computed: built once, then shared by the
        request's later outputs (a stream's steps do not copy the prompt's again)."""
        pl, prompt = req.group.prompt_logprobs, req.group.prompt_token_ids
        if req.scored is None and pl is not None and len(pl.logprobs) == len(prompt) - 1:
            req.scored = ([None, *pl.logprobs], [None, *pl.top] if pl.num_top else None)
        return req.scored or (None, None)

    def stats(self) -> dict[str, int]:
        bm = self.block_manager
        return {
            "prefix_cache_hit_tokens": bm.stats.prefix_cache_hit_tokens,
            "prefix_cache_query_tokens": bm.stats.prefix_cache_query_tokens,
            "num_preemptions": self.num_preemptions,
            "blocks_total": bm.num_blocks,
            "blocks_used": bm.num_used_blocks,
            "kv_cache_bytes": self.executor.kv_bytes,
            "cow_copies": bm.stats.cow_copies,
            "steps": self.num_steps,
            "overlapped_steps": self.num_overlapped,
            "warm_up_s": round(self.warm_up_s, 3),
            **_spec_stats(self.spec),
            **{f"ms_per_step_{k}": round(v * 1e3 / max(1, self.num_steps), 4) for k, v in self.timings.items()},
        }


def _spec_stats(spec: SpecDecoder | None) -> dict:
    proposed, accepted = (spec.proposed, spec.accepted) if spec is not None else (0, 0)
    return {"spec_proposed_tokens": proposed, "spec_accepted_tokens": accepted,
            "spec_steps": spec.steps if spec is not None else 0,
            "spec_acceptance_rate": round(accepted / proposed, 4) if proposed else 0.0}


def _settled(text: str, stops: tuple[str, ...]) -> str:
    """The text a running sequence may show: without a tail that could still become a stop string."""
    hold = max((len(s) for s in stops), default=1) - 1
    return text[:len(text) - hold] if hold else text


def load_model(model: str | Path | Artifact) -> Artifact:
    """An artifact for an engine: one given, or loaded from a path with its files checked in the background
    while the engine moves the weights to the device (the engine waits for the check before it runs)."""
    return model if isinstance(model, Artifact) else load_artifact(model, verify="background")


def engine_config(**options) -> EngineConfig:
    """EngineConfig from keyword options; an unknown name is an error that lists the known ones."""
    unknown = set(options) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown engine options {sorted(unknown)}; known: {sorted(EngineConfig.__dataclass_fields__)}")
    return EngineConfig(**options)


def _decoder(tokenizer):
    """ids -> text: the Rust tokenizer directly (a third of transformers' per-call cost, and the
    detokenizer calls it twice per token) where that gives the same text, i.e. when transformers
    would not run its clean-up pass after it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
