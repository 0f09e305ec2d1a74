"""The engine: `step()` = schedule ▸ run ▸ postprocess, and the offline `LLM` API over it."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence as Seq

import torch

from llmc.errors import RequestError
from llmc.runtime.artifact import Artifact, load_artifact
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.model_runner import ModelRunner, StepInput
from llmc.runtime.sampler import Sampler, SamplerOutput
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Scheduler, SchedulerConfig
from llmc.runtime.sequence import SequenceGroup
from llmc.runtime.stop import StopChecker

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]


@dataclass
class CompletionOutput:
    """One of the n samples of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None


@dataclass
class RequestOutput:
    """A request's state after a step (streaming) or at the end; `.text` etc. refer to sample 0."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool

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
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_dtype: str | None = None  # None: as compiled
    backend: str = "auto"
    device: str | None = None  # None: cuda when present
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    num_cpu_blocks: int = 0
    kv_memory_fraction: float = 0.5
    max_model_len: int | None = None
    cuda_graphs: bool = True


class LLMEngine:
    """Continuous-batching engine over a compiled artifact.

    Example:
        >>> eng = LLMEngine(llmc.load("tiny.llmc"))                      # doctest: +SKIP
        >>> eng.add_request("def f(x):", SamplingParams(max_tokens=8))   # doctest: +SKIP
        >>> while eng.has_unfinished():                                   # doctest: +SKIP
        ...     for out in eng.step(): print(out.text)
    """

    def __init__(self, artifact: Artifact, config: EngineConfig | None = None):
        cfg = self.config = config or EngineConfig()
        self.artifact = artifact
        meta = artifact.graph.meta
        self.tokenizer = artifact.tokenizer() if artifact.tokenizer_dir else None
        device = cfg.device or ("cuda" if torch.cuda.is_available() and cfg.backend in ("auto", "cuda") else "cpu")
        self.max_model_len = min(cfg.max_model_len or 1 << 30, int(meta.get("max_position_embeddings") or 2048))
        kv_dtype = cfg.kv_cache_dtype or meta.get("kv_cache_dtype", "auto")
        self.runner = ModelRunner(artifact.graph, device, cfg.block_size, cfg.num_blocks, kv_dtype,
                                  cfg.kv_memory_fraction, cfg.backend, cfg.num_cpu_blocks, artifact.tuning,
                                  cfg.cuda_graphs)
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                          cfg.num_cpu_blocks)
        budget = cfg.max_num_batched_tokens if cfg.enable_chunked_prefill else max(cfg.max_num_batched_tokens,
                                                                                      self.max_model_len)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, budget, cfg.enable_chunked_prefill,
                                                   cfg.preemption_mode, self.max_model_len), self.block_manager)
        eos = meta.get("eos_token_id")
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        decode = _decoder(self.tokenizer) if self.tokenizer else None
        self.stop = StopChecker(self.max_model_len, eos, decode)
        self.sampler = Sampler()
        self.groups: dict[str, tuple[SequenceGroup, str | None]] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.num_steps = 0
        self.timings: dict[str, float] = {}  # seconds per phase, summed over steps

    # -- requests ---------------------------------------------------------------------------------
    def encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty; give some text to continue")
            if self.tokenizer is None:
                raise RequestError("this artifact has no tokenizer: pass token ids instead of text")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = [int(t) for t in prompt]
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
        if request_id in self.groups:
            raise RequestError(f"request id {request_id!r} is already in use")
        group = SequenceGroup(request_id, ids, params)
        self.scheduler.add(group)
        self.groups[request_id] = (group, text)
        return request_id

    def abort(self, request_id: str) -> bool:
        ok = self.scheduler.abort(request_id)
        self.groups.pop(request_id, None)
        return ok

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One iteration: schedule ▸ run ▸ postprocess. Returns outputs of requests that progressed
        (streaming), or with `finished_only` of those that finished in this step."""
        t = time.perf_counter()
        out = self.scheduler.schedule()
        self.timings["schedule"] = self.timings.get("schedule", 0.0) + time.perf_counter() - t
        self.num_preemptions += len(out.preempted)
        if not out.is_empty:
            self._run(out)
        self.num_steps += 1
        touched = {e.seq.request_id for e in out.scheduled}
        done = {g.request_id for g in self.scheduler.pop_finished()}
        report = done if finished_only else touched | done
        results = [self._output(rid) for rid in sorted(report) if rid in self.groups]
        for rid in done:
            self.groups.pop(rid, None)
        return results

    def _run(self, out) -> None:
        self.runner.swap_out(out.blocks_to_swap_out)
        self.runner.swap_in(out.blocks_to_swap_in)
        self.runner.copy_blocks(out.blocks_to_copy)
        batch = []
        for e in out.scheduled:
            c = e.seq.num_computed_tokens
            batch.append(StepInput(e.seq.token_ids[c:c + e.num_new_tokens], c, e.seq.block_table,
                                   1 if e.sample else 0))
        repeats = out.logits_repeats
        one_row_each = all(r == 1 for r in repeats)
        # rows that need only their argmax get it from the runner (inside the decode graph), which
        # reads back the tokens instead of the logits
        greedy = bool(out.sampled_seqs) and one_row_each and Sampler.argmax_only(out.sampled_seqs)
        t0 = time.perf_counter()
        result = self.runner.execute(batch, greedy=greedy)  # tokens [rows] or logits [rows, V]
        t1 = time.perf_counter()
        if out.sampled_seqs:
            if greedy:
                ids = result.tolist()
                res = SamplerOutput(ids, [0.0] * len(ids))
            else:
                rows = result if one_row_each else \
                    result.repeat_interleave(torch.tensor(repeats, device=result.device), dim=0)
                res = self.sampler(rows, out.sampled_seqs)
            t2 = time.perf_counter()
            self.scheduler.update_after_step(out, res.token_ids, res.logprobs, self.stop)
        else:
            t2 = time.perf_counter()
            self.scheduler.update_after_step(out, [], None, self.stop)
        t3 = time.perf_counter()
        # where a step's host time goes (waiting for the GPU falls in execute on the greedy path,
        # in sample otherwise)
        for k, dt in (("execute", t1 - t0), ("sample", t2 - t1), ("update", t3 - t2)):
            self.timings[k] = self.timings.get(k, 0.0) + dt

    def _output(self, request_id: str) -> RequestOutput:
        group, prompt = self.groups[request_id]
        outs = [CompletionOutput(i, s.output_text, list(s.output_token_ids), s.finish_reason,
                                 list(s.output_logprobs) if s.params.logprobs else None)
                for i, s in enumerate(group.seqs)]
        return RequestOutput(request_id, prompt, group.prompt_token_ids, outs, group.is_finished)

    def stats(self) -> dict[str, int]:
        bm = self.block_manager
        return {
            "prefix_cache_hit_tokens": bm.stats.prefix_cache_hit_tokens,
            "prefix_cache_query_tokens": bm.stats.prefix_cache_query_tokens,
            "num_preemptions": self.num_preemptions,
            "blocks_total": bm.num_blocks,
            "blocks_used": bm.num_used_blocks,
            "kv_cache_bytes": self.runner.kv_bytes,
            "cow_copies": bm.stats.cow_copies,
            "steps": self.num_steps,
            **{f"ms_per_step_{k}": round(v * 1e3 / max(1, self.num_steps), 4) for k, v in self.timings.items()},
        }


class LLM:
    """Offline generation over a compiled artifact.

    Args:
        model: an artifact path (or a loaded Artifact).
        max_num_seqs, max_num_batched_tokens: the scheduler's per-step budgets.
        block_size, num_blocks: the paged KV cache (num_blocks None: sized from memory).
        kv_cache_dtype: auto, int8 or fp8 (None: as compiled).
        backend: auto or reference.

    Example:
        >>> llm = LLM("tiny.llmc", max_num_seqs=8)                                    # doctest: +SKIP
        >>> llm.generate(["def add(a, b):"], SamplingParams(max_tokens=16))[0].text   # doctest: +SKIP
    """

    def __init__(self, model: str | Path | Artifact, **kwargs):
        unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"LLM got unknown options {sorted(unknown)}")
        art = model if isinstance(model, Artifact) else load_artifact(model)
        self.engine = LLMEngine(art, EngineConfig(**kwargs))

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in the order of `prompts`.

        Every request is validated before any runs: one bad request raises RequestError and
        nothing is generated.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        for p in plist:
            p.validate()
        encoded = [self.engine.encode(pr) for pr in prompts]  # all checked before any is queued
        ids = [self.engine._add(e, p, None, pr if isinstance(pr, str) else None)
               for e, p, pr in zip(encoded, plist, prompts)]
        final: dict[str, RequestOutput] = {}
        bar = _bar(progress, len(ids))
        while self.engine.has_unfinished():
            for o in self.engine.step(finished_only=True):
                if o.finished:
                    final[o.request_id] = o
                    bar(1)
        bar(None)
        return [final[i] for i in ids]

    def stats(self) -> dict[str, int]:
        return self.engine.stats()


def _decoder(tokenizer):
    """ids -> text: the Rust tokenizer directly (a third of transformers' per-call cost, and the
    detokenizer calls it twice per token) where that gives the same text, i.e. when transformers
    would not run its clean-up pass after it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _bar(enabled: bool, total: int):
    if not enabled:
        return lambda n: None
    from rich.progress import Progress
    p = Progress(transient=True)
    p.start()
    task = p.add_task("generating", total=total)

    def advance(n):
        if n is None:
            p.stop()
        else:
            p.advance(task, n)
    return advance
