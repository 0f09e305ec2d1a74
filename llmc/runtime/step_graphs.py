"""CUDA graphs of whole steps, one per step shape: decode and prefill buckets.

A decode step of B sequences and one sequence's prefill chunk of up to 2,048 tokens (512 with
LLMC_LONG_PREFILL_GRAPHS=0) each replay a graph of the next bucket up. Eager, a step's
few hundred launches cost more host time than the GPU spends on them. A speculative verify step reaches
the executor as one-token rows (see executor.py), so it replays a decode graph.
"""
from __future__ import annotations

import itertools
import logging
import os
from typing import Callable

import numpy as np
import torch

from llmc.errors import LLMCError
from llmc.ir.types import dim_eval, torch_dtype

log = logging.getLogger(__name__)

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_captured = 0  # CUDA graphs this process has captured (a step that captures one is no measure of a step's cost)


def graphs_captured() -> int:
    """How many step graphs this process has captured so far (target's and draft's alike)."""
    return _captured

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
# one sequence's prefill of up to 2,048 tokens on a graph too, in steps of 256 so that padding stays under 256
# rows (LLMC_LONG_PREFILL_GRAPHS=0: eager above 512). Eager, a 2,048-token prompt's launches cost the host
# more than the GPU's time on a 1B model: its time to first token on an H200 is 8.0-8.4 ms on a graph against
# 11.4-17.1 ms eager (8B: 49.7 against 50.3 ms; benchmarks/prefill_flags.py). Each such graph, captured on
# first use, keeps an arena of its own.
LONG_PREFILL_BUCKETS = tuple(range(768, 2049, 256))


# decode graphs per context bucket (LLMC_DECODE_CONTEXT_GRAPHS=0: one per batch bucket, sized for the model's limit):
# a decode graph's attention launch is sized for the longest context it may meet, one program per 256-key split of
# it for each sequence and kv head, and the programs past a sequence's own splits return at once. Under the model's
# limit (16 splits at 4,096 keys) a step of 512-key contexts starts 8x the programs it uses. A step whose contexts
# all fit a bucket replays that bucket's graph instead; its partition follows the model's limit as every decode
# graph's does, so every sum stays the same. On an H200 (benchmarks/RESULTS.md, 2026-12-05) buckets of 1,024 and
# 2,048 keys took a 1B decode step of 128 x 512 keys from 2.22-2.41 to 2.02-2.04 ms (its kernels 2.066 -> 1.876 ms)
# and the issue tool's 1B mixed workload from 37,289-38,292 to 39,155-39,274 out tok/s. A 512-key bucket besides
# them left that step's kernels as they were (1.874-1.877 ms), so it is not captured.
DECODE_CONTEXT_BUCKETS = (1024, 2048)


# mixed steps (prompt chunks beside decodes, several sequences) of up to 2,048 tokens on whole-step graphs too,
# (LLMC_MIXED_STEP_GRAPHS=0 turns them off). Their attention launches are sized for the bucket's
# tokens and sequences, not for the step's rows (`paged_attention`'s `rows`: the decode kernel over every row,
# the prefill kernel on a packed grid), so one graph per token bucket (and decode context bucket) runs any such
# step, with the bits of the eager step. Elsewhere these steps run on piecewise graphs (piecewise.py), whose
# attention runs eagerly once per layer: on the H200 a 1B step of 128 decodes and a few hundred prompt tokens
# cost the host 3.5-4 ms of launches against 2.7-3.5 ms of GPU time (benchmarks/RESULTS.md, 2026-12-05).
# On the H200 the whole-step graphs took those 1B steps from 6.2-8.8 to 3.2-3.8 ms of wall time each (the host's
# launch from 4.6-6.8 to 1.0-1.5 ms). The 1B steps of 1,025-2,048 tokens, bound by the GPU, still waited 0.08 ms
# each for the pieces' launches (3.9 ms of host launch): on graphs up to 2,048 tokens the issue tool's 1B mixed
# workload ran 34,148-34,677 out tok/s against 31,912-34,120 up to 1,024 (H100, alternating; RESULTS.md,
# 2026-12-05). The 8B shape's steps of 1,025-2,048 tokens take 50 ms of GPU time against 6 ms of host launch: the
# graphs take nothing from them (not measured at 2,048; at 1,024, 5,727 against 5,726 out tok/s off). Larger
# steps stay on the pieces. LLMC_MIXED_STEP_GRAPHS=N (any of the buckets) names the largest.
MIXED_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
MIXED_LARGEST = 2048


def mixed_buckets() -> tuple[int, ...] | None:
    """The token buckets of whole-step mixed graphs, or None where they are off (LLMC_MIXED_STEP_GRAPHS=0): up
    to MIXED_LARGEST tokens (unset or 1), or up to the bucket it names."""
    v = os.environ.get("LLMC_MIXED_STEP_GRAPHS", "1").strip()
    if v == "0":
        return None
    largest = MIXED_LARGEST if v in ("", "1") else int(v) if v.isdigit() else -1
    if largest not in MIXED_BUCKETS:
        raise LLMCError(f"LLMC_MIXED_STEP_GRAPHS={v!r}: use 0 (mixed steps on the pieces), 1 (whole-step graphs "
                        f"for steps of up to {MIXED_LARGEST} tokens) or the largest step's tokens, one of "
                        f"{', '.join(map(str, MIXED_BUCKETS))}")
    return tuple(b for b in MIXED_BUCKETS if b <= largest)


def decode_contexts(max_model_len: int) -> tuple[int, ...]:
    """The context buckets of decode graphs: DECODE_CONTEXT_BUCKETS below `max_model_len`, then it; with
    LLMC_DECODE_CONTEXT_GRAPHS=0, `max_model_len` alone."""
    if os.environ.get("LLMC_DECODE_CONTEXT_GRAPHS", "1") == "0":
        return (max_model_len,)
    return tuple(c for c in DECODE_CONTEXT_BUCKETS if c < max_model_len) + (max_model_len,)


def prefill_buckets() -> tuple[int, ...]:
    """The prefill graphs' token buckets: PREFILL_BUCKETS, then LONG_PREFILL_BUCKETS unless
    LLMC_LONG_PREFILL_GRAPHS=0."""
    return PREFILL_BUCKETS + (LONG_PREFILL_BUCKETS if os.environ.get("LLMC_LONG_PREFILL_GRAPHS", "1") != "0" else ())


def blocks_covering(i: int, token_ids: list[int], start_pos: int, table: list[int], block_size: int) -> int:
    """How many blocks sequence i's context covers after this step; an error if its table is shorter."""
    end = start_pos + len(token_ids)
    used = (end + block_size - 1) // block_size
    if used > len(table):
        raise LLMCError(f"sequence {i}: {end} tokens need more blocks than its table has")
    return used


def step_rows(seqs, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(new tokens, start positions, block-table lengths, query start offsets [n + 1]) of a step's sequences, int64;
    an error naming the first sequence whose table holds too few blocks for its context after the step."""
    n = len(seqs)
    new = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
    start = np.fromiter((s.start_pos for s in seqs), np.int64, n)
    width = np.fromiter((len(s.block_table) for s in seqs), np.int64, n)
    end = start + new
    short = np.flatnonzero((end + block_size - 1) // block_size > width)
    if short.size:
        i = int(short[0])
        raise LLMCError(f"sequence {i}: {int(end[i])} tokens need more blocks than its table has")
    qsl = np.zeros(n + 1, np.int64)
    np.cumsum(new, out=qsl[1:])
    return new, start, width, qsl


def token_slots(seqs, new: np.ndarray, start: np.ndarray, qsl: np.ndarray, tables: np.ndarray,
                block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, positions, cache slots) of a step's tokens, flat in sequence order, from `step_rows` and the
    sequences' block tables (a row each)."""
    T = int(qsl[-1])
    seq = np.repeat(np.arange(len(seqs)), new)  # each token's sequence
    pos = np.arange(T) - np.repeat(qsl[:-1] - start, new)
    slots = tables[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
    ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), np.int64, T)
    return ids, pos, slots


def graph_kind(batch, prefill: tuple[int, ...] | None = None, mixed: tuple[int, ...] | None = None,
               max_seqs: int = 0) -> tuple[str, int] | None:
    """(kind, bucket) of the graph that can run `batch` (a list of StepInput), or None: run eager. `prefill`:
    the prefill buckets (default `prefill_buckets()`, what a StepGraphCache holds); `mixed`: the mixed graphs'
    token buckets (None: none), for steps of up to `mixed_seqs(bucket, max_seqs)` sequences."""
    prefill = prefill_buckets() if prefill is None else prefill
    if all(len(s.token_ids) == 1 and s.num_logits == 1 for s in batch) and len(batch) <= DECODE_BUCKETS[-1]:
        return "decode", _bucket(DECODE_BUCKETS, len(batch))
    if len(batch) == 1 and batch[0].num_logits == 1 and len(batch[0].token_ids) <= prefill[-1]:
        return "prefill", _bucket(prefill, len(batch[0].token_ids))
    if mixed:
        T = sum(len(s.token_ids) for s in batch)
        if T <= mixed[-1] and all(s.num_logits <= 1 for s in batch):
            size = _bucket(mixed, T)
            if len(batch) <= mixed_seqs(size, max_seqs):
                return "mixed", size
    return None


def mixed_seqs(size: int, max_seqs: int) -> int:
    """The sequences a mixed graph of `size` tokens holds: as many as its tokens, at most the engine's
    `max_seqs` (its logits rows: padding rows cost the LM head little next to its weights' read)."""
    return min(size, max_seqs)


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    return next(b for b in buckets if b >= n)


def bound_dims(graph, tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """The symbolic dims that `tensors` (some of graph's inputs, by name) fix."""
    dims: dict[str, int] = {}
    for v in graph.inputs:
        t = tensors.get(v.name)
        if t is not None:
            dims.update({d.name: n for d, n in zip(v.type.shape, t.shape) if not isinstance(d, int)})
    return dims


def row_dims(batch) -> dict[str, int]:
    """The symbolic dims of a step's rows: its tokens (T), sequences (N) and logits rows (L)."""
    return {"T": sum(len(s.token_ids) for s in batch), "N": len(batch), "L": sum(s.num_logits for s in batch)}


class StepGraphCache:
    """Captures and replays step graphs over a plan's `run(inputs, hints, arena=...)`.

    Args:
        plan: the kernel plan; its `run` returns the graph outputs (logits first).
        kv: the KV cache tensors (graph inputs that every step shares).
        block_size, max_model_len: fix the block-table width of every captured graph.
        receives: a pipeline stage's inputs that the previous stage sends (llmc/ir/stages.py); each
            graph keeps a buffer per value that `run_stage` fills before the replay.
    """

    def __init__(self, plan, kv: dict[str, torch.Tensor], block_size: int, max_model_len: int,
                 device: torch.device, argmax: Callable[[torch.Tensor], torch.Tensor], receives: list = ()):
        self.plan, self.kv, self.block_size, self.max_model_len = plan, kv, block_size, max_model_len
        self.device, self.argmax = device, argmax
        self.receives = list(receives)
        self.graphs: dict[tuple[str, int, object], _StepGraph] = {}
        self.refused: set[tuple] = set()  # graphs whose capture ran out of device memory: their steps run eagerly
        self._pool = None
        self.prefill = prefill_buckets()
        self.contexts = decode_contexts(max_model_len)
        self.mixed: tuple[int, ...] | None = None  # the mixed graphs' token buckets, where the executor turns them on
        self.max_seqs = 256  # the engine's max_num_seqs (the warm-up sets it): a mixed graph's sequences
        self.split_decodes = True  # a mixed step's decodes on the decode kernel (the executor's LLMC_SPLIT_DECODES)
        self._mixed_arenas: dict[int, torch.Tensor | None] = {}  # one per token bucket, whatever the context

    def run(self, batch, greedy: bool, feed=None) -> torch.Tensor | None:
        """Replay (capturing on first use) the graph for `batch`: argmax tokens [rows] with `greedy`, else fp32
        logits [rows, V], on the device and not waited for (copies: the graph's output buffer is reused by
        its next replay). None when no graph shape fits the batch. `feed` (executor.Feed) overwrites input
        tokens with the previous step's argmax rows on the device."""
        kind = graph_kind(batch, self.prefill, self.mixed, self.max_seqs)
        dg = self._graph(kind, False, self._context(kind, batch)) if kind is not None else None
        if dg is None:
            return None
        dg.load(batch, self.block_size)
        if feed is not None:  # after the copy of the step's inputs, and before the replay that reads them
            feed.apply(dg.inputs["input_ids"])
        dg.graph.replay()
        rows = sum(s.num_logits for s in batch)
        tokens, logits = dg.out
        return tokens[:rows].clone() if greedy else logits[:rows].float()

    def run_chain(self, batch, k: int) -> torch.Tensor | None:
        """k greedy decode steps of `batch` (one-token sequences at their first step's positions) on one
        decode graph: step j + 1 feeds each row step j's argmax on the device, so the host syncs once.
        The host writes step j + 1's positions and slots while the device runs step j. Returns the
        tokens [len(batch), k] on the host, or None when no decode graph fits the batch."""
        kind = graph_kind(batch, self.prefill)
        dg = self._graph(kind, False, self._context(kind, batch, k)) if kind is not None and kind[0] == "decode" \
            else None
        if dg is None:
            return None
        n = len(batch)
        tokens = torch.empty(k, n, dtype=torch.int64, device=self.device)
        for j in range(k):
            dg.load(batch, self.block_size, offset=j)
            if j:  # after the copy of the step's inputs, and before the replay that reads them
                dg.inputs["input_ids"][:n].copy_(tokens[j - 1])
            dg.graph.replay()
            tokens[j].copy_(dg.out[0][:n])
        return tokens.t().cpu()

    def captured(self, batch) -> bool | None:
        """Whether `run_stage` would replay a graph captured before (None: no graph fits the batch). A capture
        must not overlap another stream's NCCL work: the caller lets pending sends finish first."""
        kind = graph_kind(batch, self.prefill)
        return None if kind is None or (*kind, "stage") in self.refused else (*kind, "stage") in self.graphs

    def run_stage(self, batch, received: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """A pipeline stage's share of a step on its graph, or None when no graph fits the batch.

        `received`: the previous stage's values for the batch's rows, in `receives` order, each copied
        into the graph's buffer (rows past them are padding rows, in no sequence). Returns every output of
        the stage's graph cut to the batch's rows: the values the next stage receives, or, on the last
        stage, the logits rows. They are views of the graph's buffers, valid until its next replay."""
        kind = graph_kind(batch, self.prefill)
        dg = self._graph(kind, True) if kind is not None else None
        if dg is None:
            return None
        dg.load(batch, self.block_size)
        for v, t in zip(self.receives, received):
            dg.recv[v.name][tuple(slice(0, n) for n in t.shape)].copy_(t)
        dg.graph.replay()
        rows = row_dims(batch)
        return [o[tuple(slice(0, dim_eval(d, rows)) for d in v.type.shape)]
                for o, v in zip(dg.out, self.plan.graph.outputs)]

    def _context(self, kind: tuple[str, int], batch, steps: int = 1) -> int | None:
        """The context bucket of a decode batch's graph (`steps` decode steps from its positions), or of a mixed
        batch's decode rows (its leading one-token sequences); None for the model's limit (every step's graph
        where context graphs are off)."""
        if kind[0] not in ("decode", "mixed") or len(self.contexts) == 1:
            return None
        if kind[0] == "mixed":
            d = decode_rows(batch, self.split_decodes)
            longest = max((s.start_pos + 1 for s in batch[:d]), default=1)
        else:
            longest = max(s.start_pos for s in batch) + steps
        c = next((c for c in self.contexts if c >= longest), self.max_model_len)
        return None if c == self.max_model_len else c

    def _graph(self, kind: tuple[str, int], stage: bool, context: int | None = None) -> "_StepGraph | None":
        """The graph for `kind` (captured on first use) that returns what `_capture` says for `stage`, its
        attention launched for contexts of up to `context` keys (None: the model's limit). None where its
        capture ran out of device memory (its arena, warm-up runs or graph did not fit): that shape's steps
        then run eagerly, as those of a shape with no graph, and the engine goes on; it is not tried again."""
        key = (*kind, "stage" if stage else "sample") + (() if context is None else (context,))
        dg = self.graphs.get(key)
        if dg is None and key not in self.refused:
            try:
                dg = self.graphs[key] = self._capture(*kind, stage, context)
            except torch.cuda.OutOfMemoryError as e:
                self.refused.add(key)
                torch.cuda.empty_cache()
                log.warning("no CUDA graph for %s steps of %d: its capture ran out of device memory (%s); they run "
                            "eagerly", kind[0], kind[1], str(e).splitlines()[0][:200])
        return dg

    def _capture(self, kind: str, size: int, stage: bool, context: int | None = None) -> "_StepGraph":
        """A graph for `kind` at `size` that returns (argmax tokens, logits), or every output of the plan
        (`stage`: a pipeline stage's). Greedy and sampled steps share the one graph: a second graph per shape
        would double the captures at load (each a few eager runs and a capture) and the arenas, for an argmax
        that costs a sampled step microseconds."""
        max_blocks = (self.max_model_len + self.block_size - 1) // self.block_size
        dg = _StepGraph(kind, size, max_blocks, self.device, mixed_seqs(size, self.max_seqs), self.split_decodes)
        # fixed for the capture: keys per split follow the longest context the model allows (also in a context
        # bucket's graph, whose launch holds only the splits of its bucket)
        hints = {"max_seqlen_q": dg.q, "max_seqlen_k": context or self.max_model_len,
                 "context_limit": self.max_model_len}
        if kind == "mixed":  # attention launched for any step of the bucket: its rows split on the device
            hints["mixed_rows"] = (dg.inputs["decode_qsl"], dg.inputs["prompt_qsl"])
        if self.receives:
            dims = bound_dims(self.plan.graph, dg.inputs)
            dg.recv = {v.name: torch.zeros([dim_eval(d, dims) for d in v.type.shape], dtype=torch_dtype(v.type.dtype),
                                           device=self.device) for v in self.receives}
        inputs = {**{v.name: dg.inputs[v.name] for v in self.plan.graph.inputs if v.name in dg.inputs}, **self.kv,
                  **dg.recv}
        if kind != "mixed":
            dg.arena = self.plan.new_arena(inputs, hints)  # the graph's own intermediates, for its lifetime
        else:  # a token bucket's graphs (one per context bucket) never run at once: they share one arena
            if size not in self._mixed_arenas:
                self._mixed_arenas[size] = self.plan.new_arena(inputs, hints)
            dg.arena = self._mixed_arenas[size]

        def step():
            outs = self.plan.run(inputs, hints, arena=dg.arena)
            return outs if stage else (self.argmax(outs[0]), outs[0])
        dg.graph, dg.out = self._record(step)
        return dg

    def _record(self, step: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
        """(graph, its outputs) of `step` captured (every graph shares one memory pool), after a warm-up run."""
        self._warm(step)
        return self._capture_only(step)

    @staticmethod
    def _warm(step: Callable[[], object], times: int = 1) -> None:
        """Run `step` on a side stream: every kernel compiled (a tuned choice made) and library handles set up
        before a capture. One run does all of that; each more cost a load's warm-up an eager step per graph."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(times):
                step()
        torch.cuda.current_stream().wait_stream(stream)

    def _capture_only(self, step: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
        """(graph, its outputs) of `step` captured; nothing runs."""
        global _captured
        _captured += 1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step()
        self._pool = graph.pool()
        return graph, out


class TableRows:
    """Block tables kept in the rows of a host array across steps, each row rewritten only where it changed since
    it last held a table: a step's Python writes then grow with the blocks its sequences gained, not with every
    block they hold.

    A sequence's table list is only ever appended to in place (any other change assigns a new list:
    Sequence.block_table), so the same list in the same row needs only its new blocks; another list, the whole
    row, and zeros over what the row held past it. The rows keep their lists, so no list that was freed can pass
    for one still here."""

    def __init__(self):
        self.held: list[tuple[list[int] | None, int]] = []  # per row: its list, and how many of its blocks
        self.array = np.zeros((0, 0), np.int32)  # `rows`' own, for holders without a buffer of their own

    def rows(self, n: int, cols: int) -> np.ndarray:
        """The first n rows of this object's own array, every column (at least `cols`; the array grown, its rows
        kept, as needed): for `write`."""
        r, c = self.array.shape
        if n > r or cols > c:
            grown = np.zeros((max(n, 2 * r), max(cols, c)), np.int32)
            grown[:r, :c] = self.array
            self.array = grown
        return self.array[:n]

    def write(self, tables: np.ndarray, lists: list[list[int]], lengths: list[int]) -> None:
        """Row i of `tables` holds lists[i][:lengths[i]], then zeros up to the longest table the row held."""
        held = self.held
        if len(held) < len(lists):
            held.extend([(None, 0)] * (len(lists) - len(held)))
        for i, (t, u) in enumerate(zip(lists, lengths)):
            was, have = held[i]
            if t is not was:
                tables[i, :u] = t[:u]
                if have > u:
                    tables[i, u:have] = 0
                held[i] = (t, u)
            elif u > have:
                tables[i, have:u] = t[have:u]
                held[i] = (t, u)


def decode_rows(batch, split: bool = True) -> int:
    """How many leading sequences of a step have one token: its decodes (the scheduler puts them first), which
    attention runs on its decode kernel; 0 where decodes are not split off (LLMC_SPLIT_DECODES=0: every row on
    the prefill kernel)."""
    return next((i for i, s in enumerate(batch) if len(s.token_ids) != 1), len(batch)) if split else 0


class _StepGraph:
    """A step captured for T token rows of N sequences:
      decode:  N = T sequences of one token each, N logits rows;
      prefill: one sequence (N = 1) of up to T new tokens, the logits of its last token;
      mixed:   up to N sequences (`seqs`) of up to T tokens in all, at most one logits row each: N rows, the
               step's first, then padding rows (the logits of token 0, dropped);

    The step's inputs live in one device buffer, filled from one pinned host buffer by a single
    asynchronous copy per step; the host side is written through numpy views, so preparing a step
    costs a few microseconds and no device work. Token rows past the step's tokens are padding:
    token 0 at position 0, no KV write (slot -1), in no sequence (past query_start_loc's end), or, for
    decode, a sequence of its own with a one-token context.
    """

    def __init__(self, kind: str, size: int, max_blocks: int, device: torch.device, seqs: int = 0,
                 split: bool = True):
        self.kind = kind
        self.split = split  # a mixed step's decodes on the decode kernel (else every row on the prefill kernel)
        T, N = size, {"prefill": 1, "mixed": seqs}.get(kind, size)
        self.q = 1 if kind == "decode" else size  # query tokens per sequence at most (the attention hint)
        layout = [("input_ids", torch.int64, (T,)), ("positions", torch.int64, (T,)),
                  ("slot_mapping", torch.int64, (T,)), ("logits_indices", torch.int64, (N,)),
                  ("query_start_loc", torch.int32, (N + 1,)), ("seq_lens", torch.int32, (N,)),
                  ("block_tables", torch.int32, (N, max_blocks))]
        if kind == "mixed":  # the rows split for attention (attention.mixed_rows)
            layout += [("decode_qsl", torch.int32, (N + 1,)), ("prompt_qsl", torch.int32, (N + 1,))]
        offsets, nbytes = [], 0
        for _, dtype, shape in layout:
            # 16-byte aligned like any fresh tensor: Triton specializes kernels on pointer alignment,
            # so eager steps and graphs then share compiled variants
            nbytes = -(-nbytes // 16) * 16
            offsets.append(nbytes)
            nbytes += dtype.itemsize * int(np.prod(shape))
        cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        host_np = self.host.numpy()
        self.inputs, self.np = {}, {}
        for (name, dtype, shape), off in zip(layout, offsets):
            size_b = dtype.itemsize * int(np.prod(shape))
            self.inputs[name] = self.dev[off:off + size_b].view(dtype).view(shape)
            self.np[name] = host_np[off:off + size_b].view(np.dtype(str(dtype).removeprefix("torch."))).reshape(shape)
        self.np["query_start_loc"][:] = np.arange(N + 1) if kind != "mixed" else 0
        self.np["logits_indices"][:] = np.arange(N) if kind != "mixed" else 0
        self.np["slot_mapping"][:] = -1
        self.np["seq_lens"][:] = 1
        self.dev.copy_(self.host)
        self.copied = torch.cuda.Event() if cuda else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple | list | None = None  # (tokens, logits), or a pipeline stage's outputs
        self.arena: torch.Tensor | None = None
        self.recv: dict[str, torch.Tensor] = {}  # a pipeline stage's received values (StepGraphCache.run_stage)
        self.rows = T  # token rows holding a token in the last step (the rest are padding)
        self.table_rows = TableRows()  # what each row of block_tables holds (decode steps)

    def load(self, batch, block_size: int, offset: int = 0) -> None:
        """Write the batch into the pinned buffer and start its one copy to the device (a decode batch
        `offset` positions on: a chain's later steps)."""
        if self.copied is not None:  # the previous step's copy must have left the pinned buffer
            self.copied.synchronize()
        if self.kind == "decode":
            self._load_decode(batch, block_size, offset)
        elif self.kind == "mixed":
            self._load_mixed(batch, block_size)
        else:
            self._load_prefill(batch, block_size)
        self.dev.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def _load_decode(self, batch, block_size: int, offset: int) -> None:
        n = len(batch)
        p = np.fromiter((s.start_pos for s in batch), np.int64, n) + offset
        used = p // block_size + 1  # the blocks the context covers; a longer table's tail is unused
        self.np["input_ids"][:n] = np.fromiter((s.token_ids[0] for s in batch), np.int64, n)
        self.np["positions"][:n] = p
        self.np["seq_lens"][:n] = p + 1
        tables = self.np["block_tables"]
        self.table_rows.write(tables, [s.block_table for s in batch], used.tolist())
        self.np["slot_mapping"][:n] = tables[np.arange(n), used - 1].astype(np.int64) * block_size + p % block_size
        if n < self.rows:  # rows that held sequences last step become padding again
            self.np["input_ids"][n:], self.np["positions"][n:], self.np["slot_mapping"][n:] = 0, 0, -1
            self.np["seq_lens"][n:] = 1
        self.rows = n

    def _load_mixed(self, batch, block_size: int) -> None:
        from llmc.codegen.attention import mixed_rows
        n = len(batch)
        new, start, _, qsl = step_rows(batch, block_size)
        T = int(qsl[n])
        self.table_rows.write(self.np["block_tables"], [s.block_table for s in batch],
                              ((start + new + block_size - 1) // block_size).tolist())  # the blocks each covers
        ids, pos, slots = token_slots(batch, new, start, qsl, self.np["block_tables"], block_size)
        self.np["input_ids"][:T], self.np["positions"][:T], self.np["slot_mapping"][:T] = ids, pos, slots
        self.np["query_start_loc"][:n + 1] = qsl
        self.np["query_start_loc"][n + 1:] = T  # padding sequences: no tokens
        qsl = self.np["query_start_loc"]
        if T < self.rows:
            self.np["input_ids"][T:], self.np["positions"][T:], self.np["slot_mapping"][T:] = 0, 0, -1
        self.rows = T
        self.np["seq_lens"][:n] = start + new
        self.np["seq_lens"][n:] = 1
        k = np.fromiter((s.num_logits for s in batch), np.int64, n)
        rows = (qsl[1:n + 1] - 1)[k > 0]  # a sequence's logits row: its last token
        self.np["logits_indices"][:rows.size] = rows
        self.np["logits_indices"][rows.size:] = 0
        self.np["decode_qsl"][:], self.np["prompt_qsl"][:] = mixed_rows(qsl, decode_rows(batch, self.split))

    def _load_prefill(self, batch, block_size: int) -> None:
        s = batch[0]
        n, p0 = len(s.token_ids), s.start_pos
        end = p0 + n
        used = blocks_covering(0, s.token_ids, p0, s.block_table, block_size)
        table = np.asarray(s.block_table[:used], dtype=np.int64)
        pos = np.arange(p0, end)
        self.np["input_ids"][:n] = s.token_ids
        self.np["positions"][:n] = pos
        self.np["slot_mapping"][:n] = table[pos // block_size] * block_size + pos % block_size
        if n < self.rows:
            self.np["input_ids"][n:], self.np["positions"][n:], self.np["slot_mapping"][n:] = 0, 0, -1
        self.rows = n
        self.np["query_start_loc"][1] = n
        self.np["seq_lens"][0] = end
        self.np["logits_indices"][0] = n - 1
        self.np["block_tables"][0, :used] = table
