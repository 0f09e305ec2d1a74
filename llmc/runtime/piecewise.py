"""CUDA graphs for mixed steps (prompt chunks with decodes): the plan captured in pieces between its
attention ops, per token bucket, attention run eagerly between the pieces.

A step of several sequences with prompt chunks fits no whole-step graph (step_graphs.py): its attention
depends on every sequence's length. Everything else in a layer (norms, GEMMs, rope and KV writes,
activations, tensor-parallel all_reduces) depends only on the step's token count. So the tokens are
padded to a bucket (16 .. 8192; padding rows: token 0 at position 0, no KV write, in no sequence),
each run of steps between two attention ops is one captured graph, and each attention op runs
eagerly on the step's real metadata, writing its output where the next piece reads it. The steps after
the last attention op (the last layer's MLP, the final norm, the logits rows and the LM head) run
eagerly: they depend on the number of logits rows. On a GPU this removes the host's launch cost of all
but one layer's attention and the tail; eager, a mixed step of an 8B model launches ~600 kernels.

A bucket is captured on its first step, which also runs eagerly over the padded inputs (compiling
every kernel for the bucket's shapes) and returns that step's outputs.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from llmc.ir.interpreter import bind_dims
from llmc.ir.types import dim_eval, torch_dtype

log = logging.getLogger(__name__)

# powers of two: up to 64 a step's linears keep the tuned choice of its own token count (a padded step's
# count is in the same tuning bucket, autotune.m_bucket, as the real one; steps of up to 64 tokens share the
# batch-invariant generated kernel), so padding changes no sum there
MIXED_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
BREAKS = ("attend_paged", "paged_attention")  # depend on each sequence's length: run eagerly
PADDED = {"input_ids": 0, "positions": 0, "slot_mapping": -1}  # the token-count inputs and their padding


class _Bucket:
    """One token bucket's captured pieces and the tensors they read and write, at fixed addresses."""

    def __init__(self):
        self.pieces: list = []  # graph k: the steps before attention op k
        self.env: dict[str, torch.Tensor] = {}  # every value a piece, an attention op or the tail reads
        self.buffers: dict[str, torch.Tensor] = {}  # the padded token inputs
        self.break_out: dict[int, torch.Tensor] = {}  # where attention step i writes
        self.arena = None


class PiecewiseGraphs:
    """Mixed steps of a kernel plan on per-bucket piecewise CUDA graphs.

    Args:
        plan: the kernel plan (llmc/codegen/lower.py).
        warm: runs a callable outside any capture (kernels compiled, library handles set up):
            `StepGraphCache._warm`.
        capture: captures a callable's launches into a replayable graph without running them, returning
            (graph, outputs): `StepGraphCache._capture_only`. CPU tests pass stand-ins for both.
    """

    def __init__(self, plan, warm: Callable, capture: Callable):
        self.plan, self.warm, self.capture = plan, warm, capture
        self.breaks = [i for i, st in enumerate(plan.steps) if st.node.op in BREAKS]
        self.buckets: dict[int, _Bucket] = {}
        self.refused: set[int] = set()  # buckets whose capture ran out of device memory

    def bucket(self, inputs: dict[str, torch.Tensor]) -> int | None:
        """The token bucket a step of these inputs replays, or None (too many tokens, or no attention op)."""
        T = int(inputs["input_ids"].shape[0])
        if not self.breaks or T > MIXED_BUCKETS[-1]:
            return None
        return next(b for b in MIXED_BUCKETS if b >= T)

    def run(self, inputs: dict[str, torch.Tensor], hints: dict) -> list[torch.Tensor] | None:
        """The plan's outputs for a step (inputs as `build_inputs` makes them, `hints` the step's attention
        hints), or None when no bucket fits. Valid until the next step, as `Plan.run`'s."""
        size = self.bucket(inputs)
        if size is None:
            return None
        if size in self.refused:
            return None
        b = self.buckets.get(size)
        if b is None:
            b = self.buckets[size] = _Bucket()
            try:
                return self._capture(b, size, inputs, hints)
            except torch.cuda.OutOfMemoryError as e:
                # the bucket's arena, warm-up runs or graphs did not fit: its steps run eagerly (the caller's
                # plan runs this one again whole, rewriting the same K/V), and it is not tried again
                del self.buckets[size]
                self.refused.add(size)
                torch.cuda.empty_cache()
                log.warning("no piecewise graphs for mixed steps of up to %d tokens: their capture ran out of "
                            "device memory (%s); they run eagerly", size, str(e).splitlines()[0][:200])
                return None
        T = int(inputs["input_ids"].shape[0])
        for name, pad in PADDED.items():
            buf = b.buffers[name]
            buf[:T].copy_(inputs[name])
            buf[T:].fill_(pad)
        env = b.env
        env.update({k: v for k, v in inputs.items() if k not in PADDED})  # this step's metadata and caches
        plan = self.plan
        # the bucket's token count with this step's sequences and logits rows
        dims = {**bind_dims(plan.graph, {**inputs, **b.buffers}), **hints}
        for graph, i in zip(b.pieces, self.breaks):
            graph.replay()
            plan.steps[i].into([env[name] for name in plan._ins[i]], dims, [b.break_out[i]])
        return self._run(b, self.breaks[-1] + 1, len(plan.steps), dict(env), dims)

    def _run(self, b: _Bucket, first: int, end: int, env: dict, hints: dict, views=None,
             cap: dict | None = None) -> list:
        """Steps first..end-1 over `env` (updated): attention steps into their fixed outputs, the others into
        the capture's arena views (`views`, with the capture's dims `cap`) where they have one, else into
        fresh tensors. Returns the graph's outputs that env holds."""
        plan = self.plan
        for i in range(first, end):
            st, xs = plan.steps[i], [env[name] for name in plan._ins[i]]
            if i in b.break_out:
                out = st.into(xs, hints, [b.break_out[i]])
            elif views is not None and views[i] is not None:
                out = st.into(xs, cap, views[i])
            else:
                out = st.fn(xs, cap if views is not None else hints)
            names = plan._outs[i]
            if len(names) == 1:
                env[names[0]] = out
            else:
                env.update(zip(names, out))
        return [env.get(v.name) for v in plan.graph.outputs]

    def _capture(self, b: _Bucket, size: int, inputs: dict, hints: dict) -> list[torch.Tensor]:
        plan, g = self.plan, self.plan.graph
        T = int(inputs["input_ids"].shape[0])
        for name, pad in PADDED.items():
            src = inputs[name]
            b.buffers[name] = torch.full((size,), pad, dtype=src.dtype, device=src.device)
            b.buffers[name][:T].copy_(src)
        x = {**inputs, **b.buffers}
        cap = {**bind_dims(g, x), **hints}  # the pieces' dims: the bucket's token count
        b.arena = plan.new_arena(x, cap)
        views = plan._output_views(cap, b.arena) if b.arena is not None else [None] * len(plan.steps)
        for i in self.breaks:  # each attention output at an address every later piece reads
            v = plan.steps[i].node.outputs[0]
            b.break_out[i] = views[i][0] if views[i] is not None else torch.empty(
                [dim_eval(d, cap) for d in v.type.shape], dtype=torch_dtype(v.type.dtype), device=plan.device)
        env = {**plan.params, **{v.name: x[v.name] for v in g.inputs}}
        pieces, first = [], 0
        for i in self.breaks:
            def piece(first=first, end=i):
                self._run(b, first, end, env, cap, views, cap)
                return []
            pieces.append((piece, i))
            first = i + 1
        # 1. warm-up runs of every piece. Their inputs are not this step's yet (an attention output not
        # computed, a region a later value shares), so what they write into the KV cache is wrong, but only
        # in this step's own slots, which 2. writes again
        for i in self.breaks:
            b.break_out[i].zero_()
        for piece, i in pieces:
            self.warm(piece)
            env[plan._outs[i][0]] = b.break_out[i]
        # 2. eagerly over the padded inputs: this step's outputs and KV, the attention outputs where the pieces
        # will read them
        eager = dict(env)
        result = self._run(b, 0, len(plan.steps), eager, cap, views, cap)
        # 3. each piece captured, nothing run: it reads the padded inputs, the weights, earlier pieces' values
        # and the attention outputs, all at fixed addresses, and leaves its own values in env
        for piece, i in pieces:
            graph, _ = self.capture(piece)
            b.pieces.append(graph)
            # what the attention step returns: its output buffer seen in the layout its consumers read (the
            # kernel writes [T, H, D] rows into a [1, H, T, D] value); the same view at every step
            env[plan._outs[i][0]] = eager[plan._outs[i][0]]
        b.env = env
        return result
