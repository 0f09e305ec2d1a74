"""Executors: run one scheduled step on a backend. The only device code of the runtime.

The engine hands an executor a `StepBatch` (each sequence's new tokens, where they start, its block
table, how many logits rows it wants, and the block moves to apply first) and gets a `StepResult`
(fp32 logits, or argmax tokens when every sampled row is greedy). The protocol is all the engine
knows: one implementation per backend, and a multi-process (sharded) executor fits behind it
without the scheduler or block manager learning about ranks.

Attention metadata is built here from the batch and passed to the plan as explicit graph inputs
(see llmc/passes/paged_kv.py for the flat layout), never through module globals.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from llmc.errors import ArtifactError, LLMCError
from llmc.intmath import cdiv
from llmc.ir.graph import Graph
from llmc.runtime.kv_cache import KVCache, with_kv_cache_dtype
from llmc.runtime.step_graphs import StepGraphCache, TableRows, decode_rows, mixed_buckets, step_rows, token_slots
from llmc.runtime.transfer import to_device

log = logging.getLogger(__name__)

BACKENDS = ("auto", "cuda", "triton-interpret", "reference")


@dataclass
class StepInput:
    """One sequence's share of a step: its new tokens, where they start, its blocks, how many logits.

    `num_logits` asks for the logits of the last `num_logits` new tokens: 0 for a prefill chunk that
    samples nothing, 1 to sample the next token, k + 1 to verify k speculated tokens, and a prompt
    chunk's rows that score prompt tokens on top. `prefill` marks a prompt (or recomputed) chunk: it
    runs as one multi-token step even when every row wants logits (see `as_decode_rows`).
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_logits: int = 1
    prefill: bool = False


@dataclass
class StepBatch:
    """One step: block moves (applied in this order: swap-out, swap-in, copies), then the forward."""

    seqs: list[StepInput]
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks
    greedy: bool = False  # return each logits row's argmax instead of the logits
    # verify-shaped entries (k fed tokens, k logits rows) are chains: only their first token is known,
    # and token j + 1 is row j's argmax; the executor runs them as k decode steps (greedy only)
    chain: bool = False

    @property
    def num_logits(self) -> int:
        return sum(s.num_logits for s in self.seqs)


@dataclass
class StepResult:
    """Rows in batch order, `num_logits` per sequence: fp32 `logits` [rows, V], or with a greedy
    batch the argmax `tokens` [rows] on the host (ties to the lowest id)."""

    logits: torch.Tensor | None = None
    tokens: torch.Tensor | None = None


@dataclass
class Feed:
    """Tokens that a step takes from the previous step's argmax on the device, not from the host: the
    step's flat token index `dst[i]` gets row `src[i]` of `tokens` (see `LocalExecutor.launch`)."""

    tokens: torch.Tensor  # the previous step's argmax rows, on the device
    dst: list[int]
    src: list[int]

    def apply(self, input_ids: torch.Tensor) -> None:
        """Overwrite the fed rows of a step's `input_ids` (on its device, in stream order: no host wait)."""
        if self.dst:
            idx = to_device(self.dst + self.src, input_ids.device, torch.int64)
            n = len(self.dst)
            input_ids.index_copy_(0, idx[:n], self.tokens.index_select(0, idx[n:]))


class Launched:
    """A step started on the device: its token rows stay there (the next step's `Feed`), and a copy to the
    host is on its way; `wait()` waits for it."""

    def __init__(self, tokens: torch.Tensor):
        self.device_tokens = tokens
        cuda = tokens.device.type == "cuda"
        self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=cuda)
        self.host.copy_(tokens, non_blocking=cuda)
        self.done = torch.cuda.Event() if cuda else None
        if self.done is not None:
            self.done.record()

    def wait(self) -> torch.Tensor:
        """The token rows on the host, once copied."""
        if self.done is not None:
            self.done.synchronize()
        return self.host

    def tokens(self) -> list[int]:
        return self.wait().tolist()


class Executor(Protocol):
    """What the engine needs of a backend. An executor whose `overlaps` is true also offers `launch(batch, feed,
    sample=None) -> Launched`, a step whose tokens are chosen on the device and not waited for (the engine's
    overlapped steps, engine.py); `sample` only where `samples_on_device` is true."""

    num_blocks: int  # device KV blocks (the block manager's pool)
    kv_bytes: int

    def execute(self, batch: StepBatch) -> StepResult: ...


def select_backend(backend: str, device: str | torch.device | None = None) -> str:
    """auto: cuda when a GPU is present, else reference. triton-interpret runs the generated kernels on the
    CPU, which needs TRITON_INTERPRET=1 in the environment before triton is first imported."""
    if backend not in BACKENDS:
        raise LLMCError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        on_gpu = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
        return "cuda" if on_gpu else "reference"
    if backend == "cuda" and not torch.cuda.is_available():
        raise LLMCError("the cuda backend needs an NVIDIA GPU, and torch sees none; use the reference or "
                        "triton-interpret backend")
    if backend == "triton-interpret" and os.environ.get("TRITON_INTERPRET") != "1":
        raise LLMCError("the triton-interpret backend needs TRITON_INTERPRET=1 in the environment before triton "
                        "is imported: run `TRITON_INTERPRET=1 python ...` (`llmc run --backend triton-interpret` "
                        "sets it itself)")
    return backend


def make_executor(graph: Graph, backend: str = "auto", device: str | None = None, block_size: int = 16,
                  num_blocks: int | None = None, kv_cache_dtype: str = "auto", memory_fraction: float = 0.5,
                  num_cpu_blocks: int = 0, tuning: dict | None = None, cuda_graphs: bool = True,
                  max_model_len: int | None = None, invariant: bool = False) -> "LocalExecutor":
    """The executor for `backend` over a paged graph; the one place that maps backend names to classes.
    `invariant`: linears keep the generated kernels at every step width that shares a tuned choice
    (`Tuner.from_artifact`; speculative decoding's target).

    Example:
        >>> ex = make_executor(art.graph, "reference", num_blocks=64)                  # doctest: +SKIP
        >>> ex.execute(StepBatch([StepInput([1, 2, 3], 0, [0])])).logits.shape          # doctest: +SKIP
    """
    if not graph.meta.get("paged"):
        raise ArtifactError("this artifact was compiled without the paged_kv pass; recompile it with the "
                            "default pipeline to run it")
    backend = select_backend(backend, device)
    dev = torch.device("cuda" if backend == "cuda" and (device is None or torch.device(device).type != "cuda")
                       else "cpu" if backend == "triton-interpret" else device or "cpu")
    if dev.type == "cpu":  # "cpu:0" is the CPU, but compares unequal to "cpu": tensors .to() it would be copies
        dev = torch.device("cpu")
    graph = with_kv_cache_dtype(graph, kv_cache_dtype, dev)
    cache = KVCache(graph, dev, block_size, num_blocks, memory_fraction, num_cpu_blocks)
    max_len = max_model_len or int(graph.meta.get("max_position_embeddings") or 4096)
    if backend == "reference":
        return ReferenceExecutor(graph, cache)
    return KernelExecutor(graph, cache, tuning, interpret=backend == "triton-interpret",
                          cuda_graphs=backend == "cuda" and cuda_graphs, max_model_len=max_len, invariant=invariant)


class LocalExecutor:
    """An executor in this process: a KV cache and a plan that runs the paged graph over it."""

    overlaps = True  # `launch` works (the engine's overlapped steps)
    samples_on_device = True  # and takes a `sample` function (sampled rows drawn on the device)

    def __init__(self, graph: Graph, cache: KVCache):
        self.graph, self.cache = graph, cache
        self.device, self.block_size = cache.device, cache.block_size
        self.num_blocks, self.kv_bytes = cache.num_blocks, cache.bytes

    @property
    def kv(self) -> dict[str, torch.Tensor]:
        return self.cache.tensors

    def close(self) -> None:
        """Release what this executor holds on its device (KV cache, the plan's weights, step graphs) now, not
        when it is collected: a process can then load the next model on the same GPU. It runs no more
        steps after."""
        self.cache = self.plan = self.step_graphs = self.piecewise = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def warm_up(self, max_num_seqs: int, max_tokens: int, max_chunk: int | None = None) -> int:
        """Run the steps of `warm_up_batches`, greedy and not, so that an engine's first requests do not pay
        for what a step shape costs once on a GPU: each decode graph captured, each kernel specialization
        of mixed steps compiled (and each piecewise bucket captured). The engine calls it at load on a GPU
        only. Their K/V lands in block 0, which holds nothing yet. Returns the steps run.

        LLMC_WARM_UP_AHEAD=1 (experimental, off until measured on a GPU): their kernels are compiled first, on
        threads or worker processes (`compile_ahead`), as a compile's tuning compiles its choices; the steps
        then find them in Triton's cache instead of compiling each in turn."""
        graphs = getattr(self, "step_graphs", None)
        if graphs is not None:
            graphs.max_seqs = max_num_seqs
        batches = warm_up_batches(max_num_seqs, max_tokens, self.block_size, max_chunk,
                                  graphs.contexts if graphs is not None else (),
                                  graphs.mixed if graphs is not None else None)
        if os.environ.get("LLMC_WARM_UP_AHEAD") == "1":
            self.compile_ahead(batches)
        for batch in batches:
            for greedy in (True, False):
                t0 = time.perf_counter()
                self._warm_step(batch, greedy)
                if log.isEnabledFor(logging.DEBUG):  # where a load's warm-up goes, step shape by step shape
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    log.debug("warm-up step of %d sequences, %d tokens, %s: %.3f s", len(batch.seqs),
                              sum(len(s.token_ids) for s in batch.seqs), "greedy" if greedy else "logits",
                              time.perf_counter() - t0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return 2 * len(batches)

    def _warm_step(self, batch: StepBatch, greedy: bool) -> None:
        batch.greedy = greedy
        self.execute(batch)

    def compile_ahead(self, batches: list[StepBatch]) -> int:
        """Compile the kernels of `batches` before they run; returns how many. Here nothing: only a GPU's plan
        compiles kernels (`KernelExecutor.compile_ahead`)."""
        return 0

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepResult:
        seqs = self._begin(batch)
        if not seqs:
            return _empty(batch.greedy)
        if batch.chain:
            assert batch.greedy, "a chain feeds each row's argmax to the next step"
            return StepResult(tokens=self.chain(seqs))
        if any(_verifies(s) for s in seqs):
            seqs = as_decode_rows(seqs)
        if batch.num_logits == 0:
            self._forward(_one_row(seqs), False)
            return _empty(batch.greedy)
        return self._forward(seqs, batch.greedy)

    @torch.inference_mode()
    def launch(self, batch: StepBatch, feed: Feed | None = None, sample=None) -> Launched:
        """Start a step whose rows' tokens are chosen on the device (`batch.greedy`; no chains or verify rows)
        and return without waiting for it: the engine schedules the next step while this one runs. The
        tokens are the rows' argmax, or `sample(fp32 logits rows)` (the sampler's `tokens_on_device`).
        `feed` gives tokens that the previous launched step computed on the device, which the host does
        not know yet."""
        assert batch.greedy and not batch.chain, "a launched step's tokens are chosen on the device"
        seqs = self._begin(batch)
        assert not any(_verifies(s) for s in seqs), "verify rows are sampled on the host"
        if seqs and batch.num_logits == 0:
            self._token_rows(_one_row(seqs), feed)
            seqs = []
        return Launched(self._token_rows(seqs, feed, sample) if seqs else
                        torch.empty(0, dtype=torch.int64, device=self.device))

    def _begin(self, batch: StepBatch) -> list[StepInput]:
        """Apply the step's block moves (swap-out, swap-in, copies); returns its sequences."""
        if self.cache is None:
            raise LLMCError("this engine was closed (LLM.close, or the end of its `with` block): create a new LLM "
                            "to run more requests")
        self.cache.swap_out(batch.swap_out)
        self.cache.swap_in(batch.swap_in)
        self.cache.copy_blocks(batch.copies)
        return batch.seqs

    def _forward(self, seqs: list[StepInput], greedy: bool) -> StepResult:
        if greedy:
            return StepResult(tokens=self._token_rows(seqs).cpu())
        return StepResult(logits=self._logits(self.build_inputs(seqs), seqs).float())

    def _token_rows(self, seqs: list[StepInput], feed: Feed | None = None, sample=None) -> torch.Tensor:
        """Each logits row's token, left on the device: its argmax, or `sample(fp32 logits rows)`."""
        inputs = self.build_inputs(seqs)
        if feed is not None:
            feed.apply(inputs["input_ids"])
        logits = self._logits(inputs, seqs)
        return logits.argmax(dim=-1) if sample is None else sample(logits.float())

    def _logits(self, inputs: dict[str, torch.Tensor], seqs: list[StepInput]) -> torch.Tensor:
        raise NotImplementedError

    def chain(self, seqs: list[StepInput]) -> torch.Tensor:
        """The argmax rows of a chain batch (see `StepBatch.chain`), in batch order: the first step runs
        every entry with a chain's first token alone; step j then runs the chains longer than j, each
        fed its own previous token. Chains of unequal length are allowed."""
        first = [StepInput(s.token_ids[:1], s.start_pos, s.block_table, 1) if _verifies(s) else s for s in seqs]
        rows = self._forward(first, True).tokens.tolist()
        out, r = [], 0
        for s in first:
            out.append(rows[r:r + s.num_logits])
            r += s.num_logits
        k = max(len(s.token_ids) for s in seqs if _verifies(s))
        for j in range(1, k):
            live = [i for i, s in enumerate(seqs) if _verifies(s) and len(s.token_ids) > j]
            step = [StepInput([out[i][-1]], seqs[i].start_pos + j, seqs[i].block_table, 1) for i in live]
            for i, t in zip(live, self._forward(step, True).tokens.tolist()):
                out[i].append(t)
        return torch.tensor([t for row in out for t in row], dtype=torch.int64)

    _rows: TableRows | None = None  # build_inputs' block-table rows, kept across steps

    def build_inputs(self, seqs: list[StepInput]) -> dict[str, torch.Tensor]:
        """The flat step inputs and attention metadata of the paged graph, with the KV caches.

        Built with numpy over the step's tokens at once (a few Python operations per sequence, none
        per token): a mixed step's thousands of positions and slots cost what its sequences do."""
        n = len(seqs)
        new, start, width, qsl = step_rows(seqs, self.block_size)
        end = start + new
        # the table's width (its row stride in the attention kernels) rounded up to 16: Triton specializes an
        # integer argument on being 1 or a multiple of 16, so an unrounded width compiled a kernel variant for
        # each of 1, multiples of 16 and the rest as steps met them. The rows are kept across steps
        # (step_graphs.TableRows: a row rewritten only where its sequence's table changed), zero past each table
        if self._rows is None:
            self._rows = TableRows()
        cols = cdiv(max(1, int(width.max())), 16) * 16
        kept = self._rows.rows(n, cols)
        self._rows.write(kept, [s.block_table for s in seqs], width.tolist())
        tables = kept[:, :cols].copy()  # this step's own: the next step rewrites the kept rows
        ids, pos, slots = token_slots(seqs, new, start, qsl, tables, self.block_size)
        k = np.fromiter((s.num_logits for s in seqs), np.int64, n)
        first = np.repeat(qsl[1:] - k, k)  # the sequence's first logits row, per row
        logit_rows = first + np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
        dev = self.device

        def put(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return to_device(a, dev, dtype)
        return {
            "input_ids": put(ids, torch.int64),
            "positions": put(pos, torch.int64),
            "query_start_loc": put(qsl, torch.int32),
            "seq_lens": put(end, torch.int32),
            "block_tables": put(tables, torch.int32),
            "slot_mapping": put(slots, torch.int64),
            "logits_indices": put(logit_rows, torch.int64),
            **self.kv,
        }


class ReferenceExecutor(LocalExecutor):
    """The IR interpreter (the golden model) over the paged graph."""

    def __init__(self, graph: Graph, cache: KVCache):
        from llmc.ir.interpreter import Interpreter
        super().__init__(graph, cache)
        self.plan = Interpreter(graph, self.device)

    def outputs(self, inputs: dict[str, torch.Tensor], seqs: list[StepInput]) -> list[torch.Tensor]:
        """Every output of the plan (a pipeline stage's are the values it hands the next stage)."""
        return self.plan.run(inputs)

    def _logits(self, inputs, seqs):
        return self.outputs(inputs, seqs)[0]


class KernelExecutor(LocalExecutor):
    """The generated-kernel plan: Triton kernels and cuBLAS on a GPU (with CUDA graphs per step shape),
    or the same kernels on the CPU under Triton's interpreter."""

    def __init__(self, graph: Graph, cache: KVCache, tuning: dict | None, interpret: bool, cuda_graphs: bool,
                 max_model_len: int, invariant: bool = False):
        from llmc.codegen.autotune import Tuner
        from llmc.codegen.lower import Plan
        super().__init__(graph, cache)
        self.plan = Plan(graph, self.device, Tuner.from_artifact(tuning, invariant), triton_matmul=interpret)
        self.max_model_len = max_model_len
        # a mixed step's decodes on the decode attention kernel (LLMC_SPLIT_DECODES=0: in the prefill kernel's launch)
        self.split_decodes = os.environ.get("LLMC_SPLIT_DECODES", "1") != "0"
        self.step_graphs = self.piecewise = None
        self.use_cuda_graphs = cuda_graphs  # benchmarks turn it off to time eager steps side by side
        if cuda_graphs:
            from llmc.codegen.sampling import argmax
            receives = set(graph.meta.get("pipeline", {}).get("receives", []))  # a pipeline stage's
            self.step_graphs = StepGraphCache(self.plan, self.kv, self.block_size, max_model_len, self.device,
                                              argmax, [v for v in graph.inputs if v.name in receives])
            # mixed steps on piecewise graphs (not on a stage that receives: its received rows would need padding
            # to the bucket too); buckets are captured on first use, so a plan that never runs one costs nothing.
            # `mixed_graphs` switches them per step (benchmarks flip it on a live engine)
            if not receives:
                from llmc.runtime.piecewise import PiecewiseGraphs
                self.piecewise = PiecewiseGraphs(self.plan, self.step_graphs._warm, self.step_graphs._capture_only)
        # on by default on one GPU, where it was measured; a tensor-parallel shard's pieces would capture its
        # collectives, not yet measured there: LLMC_MIXED_GRAPHS=1 turns them on, 0 off everywhere
        from llmc.ir.ops import FAMILIES
        collective = any(n.op in FAMILIES.get("collective", ()) for n in graph.nodes)
        self.mixed_graphs = os.environ.get("LLMC_MIXED_GRAPHS", "0" if collective else "1") != "0"
        if cuda_graphs and not receives and not collective:  # whole-step mixed graphs (LLMC_MIXED_STEP_GRAPHS=0: off)
            self.step_graphs.mixed, self.step_graphs.split_decodes = mixed_buckets(), self.split_decodes

    def compile_ahead(self, batches: list[StepBatch]) -> int:
        """Compile the kernels that `batches` (greedy and not) run eagerly: each step run once with nothing
        launched (`precompile.collect`: the KV cache and every graph untouched), then each distinct kernel
        compiled once, in LLMC_TUNE_PROCESSES worker processes where that is set (`precompile.CompilePool`: off
        the GIL), else on `tune_threads` threads. Returns how many."""
        from concurrent.futures import ThreadPoolExecutor

        from llmc.codegen import precompile, triton_setup
        from llmc.codegen.autotune import tune_threads
        n, processes = tune_threads(), precompile.tune_processes()
        if not self.use_cuda_graphs or max(n, processes) < 2 or not triton_setup.enabled():
            return 0  # graphs off (no GPU here, or none wanted), or nothing to compile on in parallel
        triton_setup.ready()
        graphs, self.use_cuda_graphs = self.use_cuda_graphs, False  # every step eager: its kernels, not a capture's
        calls = [functools.partial(self._warm_step, b, g) for b in batches for g in (True, False)]
        try:
            if processes:
                with precompile.CompilePool(processes) as pool:
                    return pool.compile(calls)
            with ThreadPoolExecutor(n, thread_name_prefix="llmc-warm") as threads:
                return precompile.compile_ahead(calls, threads)
        finally:
            self.use_cuda_graphs = graphs
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()

    def _forward(self, seqs, greedy):
        if self.step_graphs is not None and self.use_cuda_graphs and not greedy:
            out = self.step_graphs.run(seqs, greedy)
            if out is not None:
                return StepResult(logits=out)
        return super()._forward(seqs, greedy)

    def _token_rows(self, seqs, feed=None, sample=None):
        if self.step_graphs is not None and self.use_cuda_graphs:
            out = self.step_graphs.run(seqs, sample is None, feed)
            if out is not None:
                return out if sample is None else sample(out)
        return super()._token_rows(seqs, feed, sample)

    def chain(self, seqs: list[StepInput]) -> torch.Tensor:
        # decode chains of one length replay their decode graph k times, each step's tokens fed to the
        # next on the device: one host sync for the k steps
        if self.step_graphs is not None and self.use_cuda_graphs and all(
                _verifies(s) and len(s.token_ids) == len(seqs[0].token_ids) for s in seqs):
            out = self.step_graphs.run_chain([StepInput(s.token_ids[:1], s.start_pos, s.block_table, 1)
                                              for s in seqs], len(seqs[0].token_ids))
            if out is not None:
                return out.flatten()
        return super().chain(seqs)

    def outputs(self, inputs: dict[str, torch.Tensor], seqs: list[StepInput]) -> list[torch.Tensor]:
        """Every output of the plan (a pipeline stage's are the values it hands the next stage)."""
        # decode_rows: the step's leading one-token sequences (the scheduler runs decodes first), which
        # attention runs on its decode kernel beside the prompt rows; context_limit: the decode graphs' longest
        # context, so that kernel splits a context as they do
        hints = {"max_seqlen_q": max(len(s.token_ids) for s in seqs),
                 "max_seqlen_k": max(s.start_pos + len(s.token_ids) for s in seqs),
                 "decode_rows": decode_rows(seqs, self.split_decodes),
                 "context_limit": self.max_model_len}
        if self.piecewise is not None and self.use_cuda_graphs and self.mixed_graphs:
            out = self.piecewise.run(inputs, hints)
            if out is not None:
                return out
        return self.plan.run(inputs, hints)

    def _logits(self, inputs, seqs):
        return self.outputs(inputs, seqs)[0]


WARM_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def warm_up_batches(max_num_seqs: int, max_tokens: int, block_size: int, max_chunk: int | None = None,
                    contexts: tuple[int, ...] = (), mixed: tuple[int, ...] | None = None) -> list[StepBatch]:
    """The step shapes an engine of up to `max_num_seqs` sequences and `max_tokens` tokens a step meets, one
    step each, every sequence on block 0: a decode step of each decode graph's bucket up to max_num_seqs'
    (each captures its graph), and mixed steps of T = each of WARM_TOKENS up to max_tokens, T - 1 and
    max_tokens (Triton specializes a kernel on whether a size divides by 16; piecewise graphs are captured
    per bucket), each T // 4 decodes (at most max_num_seqs - 1) beside prompt chunks of at most `max_chunk`
    tokens (a sequence's context; a step of several prompts may hold more), so that the logits rows' count
    takes the widths between the decode buckets. `contexts`: the decode graphs' context buckets
    (step_graphs.decode_contexts), each past the first met by decodes at its last position, also in a mixed step
    of each of `mixed`'s token buckets (whole-step mixed graphs, where they are on)."""
    from llmc.runtime.step_graphs import DECODE_BUCKETS
    top = next((b for b in DECODE_BUCKETS if b >= max_num_seqs), DECODE_BUCKETS[-1])
    batches = [StepBatch([StepInput([0], pos, [0] * (pos // block_size + 1)) for _ in range(b)])
               for pos in [0] + [c - 1 for c in contexts[1:]] for b in DECODE_BUCKETS if b <= top]
    sizes = sorted({n for b in WARM_TOKENS if b <= max_tokens for n in (b - 1, b)} | {max_tokens})
    max_chunk = max_chunk or max_tokens
    at_contexts = [(T, 0) for T in sizes] + [(T, c - 1) for T in (mixed or ()) if T <= max_tokens for c in contexts[1:]]
    for T, pos in at_contexts:
        d = min(max_num_seqs - 1, T // 4)
        while d > 0 and d + -(-(T - d) // max_chunk) > max_num_seqs:
            d -= 1
        if -(-(T - d) // max_chunk) > max_num_seqs - d or (pos and not d):
            continue  # no step of max_num_seqs sequences holds T tokens (beside a decode)
        seqs = [StepInput([0], pos, [0] * (pos // block_size + 1)) for _ in range(d)]
        for at in range(0, T - d, max_chunk):
            n = min(max_chunk, T - d - at)
            seqs.append(StepInput([0] * n, 0, [0] * -(-n // block_size), 1, True))
        batches.append(StepBatch(seqs))
    return batches


def as_decode_rows(seqs: list[StepInput]) -> list[StepInput]:
    """A verify entry (k + 1 fed tokens, every row's logits) as k + 1 one-token sequences over the same
    blocks: row j attends over positions up to start + j, exactly as the decode step at that position
    would, with the decode kernel. A verify step then sums as plain decoding does, so speculation with
    greedy requests gives decoding's tokens in low precision too (a multi-token attention kernel adds
    in another order, and bf16 near-ties flip), and it replays a decode-step CUDA graph. All K/V of the
    step are written before any row attends, so row j sees the rows before it. A prompt chunk that
    wants every row (to score its tokens) stays whole: it is a prefill, as it would be without."""
    out = []
    for s in seqs:
        if _verifies(s):
            out += [StepInput([t], s.start_pos + j, s.block_table, 1) for j, t in enumerate(s.token_ids)]
        else:
            out.append(s)
    return out


def _one_row(seqs: list[StepInput]) -> list[StepInput]:
    """A step that samples nothing (a long prompt's first chunks) still writes its K/V; the graph wants at
    least one logits row, so the step computes its last token's and drops it."""
    return seqs[:-1] + [StepInput(seqs[-1].token_ids, seqs[-1].start_pos, seqs[-1].block_table, 1)]


def _verifies(s: StepInput) -> bool:
    return len(s.token_ids) > 1 and s.num_logits == len(s.token_ids) and not s.prefill


def _empty(greedy: bool) -> StepResult:
    return StepResult(tokens=torch.empty(0, dtype=torch.int64)) if greedy else StepResult(logits=torch.empty(0, 0))
