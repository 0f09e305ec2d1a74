"""The model runner: the only device code of the runtime.

It owns the KV caches, turns one scheduled step into the flat inputs and attention metadata of the
paged graph (see llmc/passes/paged_kv.py), runs the compiled plan and returns the logits of the
rows that are sampled. Metadata goes in as explicit graph inputs, never through module globals.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.errors import ArtifactError, LLMCError
from llmc.ir.graph import Graph
from llmc.ir.interpreter import Interpreter
from llmc.ir.paged_attention import scale_width
from llmc.ir.types import torch_dtype
from llmc.passes.paged_kv import kv_cache_inputs, set_kv_cache_dtype
from llmc.runtime.block_manager import slot_for

DEFAULT_CPU_KV_BYTES = 512 << 20


@dataclass
class StepInput:
    """One sequence's share of a step: its new tokens, where they start, its blocks, whether to sample.

    `num_logits` > 1 asks for the logits of the last `num_logits` new tokens (speculative verification).
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_logits: int = 1


BACKENDS = ("auto", "cuda", "triton-interpret", "reference")
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# one sequence's prefill (or chunk) of up to 512 new tokens replays a graph of the next bucket up:
# eager, its few hundred launches cost more host time than the GPU spends on them
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


def blocks_covering(i: int, s: StepInput, block_size: int) -> int:
    """How many blocks sequence i's context covers after this step; an error if its table is shorter."""
    end = s.start_pos + len(s.token_ids)
    used = (end + block_size - 1) // block_size
    if used > len(s.block_table):
        raise LLMCError(f"sequence {i}: {end} tokens need more blocks than its table has")
    return used


def select_backend(backend: str, device: str | torch.device | None = None) -> str:
    """auto: cuda when a GPU is present, else reference. triton-interpret runs the generated kernels
    on the CPU, which needs TRITON_INTERPRET=1 before triton is first imported."""
    import os
    import sys
    if backend not in BACKENDS:
        raise LLMCError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        on_gpu = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
        return "cuda" if on_gpu else "reference"
    if backend == "cuda" and not torch.cuda.is_available():
        raise LLMCError("the cuda backend needs an NVIDIA GPU, and torch sees none; use --backend reference "
                        "or triton-interpret")
    if backend == "triton-interpret" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise LLMCError("the triton-interpret backend needs TRITON_INTERPRET=1 before triton is imported; "
                            "set it in the environment of this process")
        os.environ["TRITON_INTERPRET"] = "1"
    return backend


class ModelRunner:
    """Runs the paged graph over a block-structured KV cache.

    Args:
        graph: a graph produced by the paged_kv pass (weights attached).
        block_size: KV slots per block.
        num_blocks: blocks per layer; None sizes the cache from `kv_memory_fraction` of free
            device memory (CUDA) or `DEFAULT_CPU_KV_BYTES` (CPU).
        kv_cache_dtype: auto (the model dtype), int8 or fp8.
    """

    def __init__(self, graph: Graph, device: str = "cpu", block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_dtype: str = "auto", kv_memory_fraction: float = 0.5, backend: str = "auto",
                 num_cpu_blocks: int = 0, tuning: dict | None = None, use_cuda_graphs: bool = True):
        if not graph.meta.get("paged"):
            raise ArtifactError("this artifact was compiled without the paged_kv pass; recompile it with the "
                                "default pipeline to run it")
        self.backend = select_backend(backend, device)
        if self.backend == "cuda":
            device = "cuda" if torch.device(device).type != "cuda" else device
        elif self.backend == "triton-interpret":
            device = "cpu"
        self.device = torch.device(device)
        if kv_cache_dtype != "auto" or graph.meta.get("kv_cache_dtype", "auto") != "auto":
            # a quantized cache always gets the current scale layout, whatever the artifact declared
            graph = set_kv_cache_dtype(graph.clone(), kv_cache_dtype)
        if kv_cache_dtype == "fp8" and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise LLMCError("an fp8 KV cache needs a GPU with fp8 support (compute capability 8.9+); use int8")
        self.graph, self.block_size = graph, block_size
        self.caches = kv_cache_inputs(graph)
        # quantized caches: kv_scale [NB, Hkv, 2D + 2BS] each, in the model dtype
        scales = {v.name: ((v.type.shape[1], scale_width(c.type.shape[4], block_size)), torch_dtype(v.type.dtype))
                  for v in graph.inputs if v.name.startswith("kv_scale.")
                  for c in self.caches if c.name.split(".", 1)[1] == v.name.split(".", 1)[1]}
        per_block = (sum(2 * block_size * c.type.shape[3] * c.type.shape[4] * torch_dtype(c.type.dtype).itemsize
                         for c in self.caches) + sum(h * w * dt.itemsize for (h, w), dt in scales.values()))
        if num_blocks is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * kv_memory_fraction)
            else:
                budget = DEFAULT_CPU_KV_BYTES
            num_blocks = max(16, budget // per_block)
        self.num_blocks = int(num_blocks)
        self.kv = {c.name: torch.zeros((2, self.num_blocks, block_size, c.type.shape[3], c.type.shape[4]),
                                       dtype=torch_dtype(c.type.dtype), device=self.device) for c in self.caches}
        for name, (shape, dt) in scales.items():
            self.kv[name] = torch.zeros((self.num_blocks, *shape), dtype=dt, device=self.device)
        self.host_kv = {k: torch.zeros((num_cpu_blocks, *t.shape[1:]) if t.dim() == 3 else
                                       (t.shape[0], num_cpu_blocks, *t.shape[2:]), dtype=t.dtype)
                        for k, t in self.kv.items()} if num_cpu_blocks else {}
        self.kv_bytes = per_block * self.num_blocks
        self.max_model_len = int(graph.meta.get("max_position_embeddings") or 4096)
        # (kind, bucket, greedy) -> graph; kind "decode": B sequences of one token, "prefill": one
        # sequence of up to `bucket` tokens
        self.graphs: dict[tuple[str, int, bool], _StepGraph] = {}
        self.use_cuda_graphs = self.backend == "cuda" and use_cuda_graphs
        if self.backend == "reference":
            self.plan = Interpreter(graph, self.device)
        else:
            from llmc.codegen.autotune import Tuner
            from llmc.codegen.lower import Plan
            tuner = Tuner.from_artifact(tuning)
            self.plan = Plan(graph, self.device, tuner, triton_matmul=self.backend == "triton-interpret")

    # -- steps ------------------------------------------------------------------------------------
    def build_inputs(self, batch: list[StepInput]) -> dict[str, torch.Tensor]:
        ids, pos, qsl, lens, slots, logit_rows = [], [], [0], [], [], []
        max_blocks = max(len(s.block_table) for s in batch)
        tables = torch.zeros((len(batch), max(max_blocks, 1)), dtype=torch.int32)
        for i, s in enumerate(batch):
            n = len(s.token_ids)
            end = s.start_pos + n
            blocks_covering(i, s, self.block_size)
            ids += s.token_ids
            pos += range(s.start_pos, end)
            slots += [slot_for(s.block_table, p, self.block_size) for p in range(s.start_pos, end)]
            logit_rows += range(qsl[-1] + n - s.num_logits, qsl[-1] + n)
            qsl.append(qsl[-1] + n)
            lens.append(end)
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        dev = self.device
        return {
            "input_ids": torch.tensor(ids, dtype=torch.int64, device=dev),
            "positions": torch.tensor(pos, dtype=torch.int64, device=dev),
            "query_start_loc": torch.tensor(qsl, dtype=torch.int32, device=dev),
            "seq_lens": torch.tensor(lens, dtype=torch.int32, device=dev),
            "block_tables": tables.to(dev),
            "slot_mapping": torch.tensor(slots, dtype=torch.int64, device=dev),
            "logits_indices": torch.tensor(logit_rows, dtype=torch.int64, device=dev),
            **self.kv,
        }

    @torch.inference_mode()
    def execute(self, batch: list[StepInput], greedy: bool = False) -> torch.Tensor:
        """Run one step.

        Returns float32 logits [sum(num_logits), V] in batch order or, with `greedy`, the argmax
        token of each of those rows as a host int64 tensor (ties to the lowest id): a decode step
        then reads back a few bytes instead of the vocabulary-wide logits.
        """
        if not batch:
            return torch.empty(0, dtype=torch.int64 if greedy else torch.float32)
        if self.use_cuda_graphs:
            if all(len(s.token_ids) == 1 and s.num_logits == 1 for s in batch):
                if len(batch) <= DECODE_BUCKETS[-1]:
                    return self._replay("decode", batch, greedy)
            elif len(batch) == 1 and batch[0].num_logits == 1 and len(batch[0].token_ids) <= PREFILL_BUCKETS[-1]:
                return self._replay("prefill", batch, greedy)
        inputs = self.build_inputs(batch)
        if self.backend == "reference":
            logits = self.plan.run(inputs)[0]
        else:
            hints = {"max_seqlen_q": max(len(s.token_ids) for s in batch),
                     "max_seqlen_k": max(s.start_pos + len(s.token_ids) for s in batch)}
            logits = self.plan.run(inputs, hints)[0]
        return logits.argmax(dim=-1).cpu() if greedy else logits.float()

    # -- CUDA graphs: one per decode batch bucket and per prefill token bucket ----------------------
    def _capture(self, kind: str, size: int, greedy: bool) -> "_StepGraph":
        max_blocks = (self.max_model_len + self.block_size - 1) // self.block_size
        dg = _StepGraph(size, size if kind == "decode" else 1, max_blocks, self.device)
        # fixed for the capture: keys per split follow the longest context the model allows
        hints = {"max_seqlen_q": 1 if kind == "decode" else size, "max_seqlen_k": self.max_model_len}
        inputs = {**dg.inputs, **self.kv}
        dg.arena = self.plan.new_arena(inputs, hints)  # the graph's own intermediates, for its lifetime

        def step():
            logits = self.plan.run(inputs, hints, arena=dg.arena)[0]
            if greedy:
                from llmc.codegen.sampling import argmax
                return argmax(logits)
            return logits
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and warm every kernel outside the capture
                step()
        torch.cuda.current_stream().wait_stream(stream)
        dg.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(dg.graph, pool=getattr(self, "_pool", None)):
            dg.out = step()
        self._pool = dg.graph.pool()
        return dg

    def _replay(self, kind: str, batch: list[StepInput], greedy: bool) -> torch.Tensor:
        n = len(batch) if kind == "decode" else len(batch[0].token_ids)
        size = next(b for b in (DECODE_BUCKETS if kind == "decode" else PREFILL_BUCKETS) if b >= n)
        dg = self.graphs.get((kind, size, greedy))
        if dg is None:
            dg = self.graphs[(kind, size, greedy)] = self._capture(kind, size, greedy)
        if kind == "decode":
            dg.load(batch, self.block_size)
        else:
            dg.load_prefill(batch[0], self.block_size)
        dg.graph.replay()
        rows = len(batch)
        if greedy:
            return dg.read_tokens(rows)
        return dg.out[:rows].float()  # fp32 logits alias the graph's output: read before the next step

    # -- block movement ---------------------------------------------------------------------------
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate each src block into dst (all layers, K and V, scales)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for t in map(_by_block, self.kv.values()):
            t[:, dst] = t[:, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block, host block) pairs to host memory (swap preemption)."""
        self._swap(pairs, to_host=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (host block, device block) pairs back to the device."""
        self._swap([(d, h) for h, d in pairs], to_host=False)

    def _swap(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        if not pairs:
            return
        if not self.host_kv:
            raise LLMCError("swap preemption needs host blocks: set num_cpu_blocks > 0")
        dev_idx = torch.tensor([p[0] for p in pairs])
        host_idx = torch.tensor([p[1] for p in pairs])
        for k, t in self.kv.items():
            t, h = _by_block(t), _by_block(self.host_kv[k])
            if to_host:
                h[:, host_idx] = t[:, dev_idx.to(t.device)].cpu()
            else:
                t[:, dev_idx.to(t.device)] = h[:, host_idx].to(t.device)


def _by_block(t: torch.Tensor) -> torch.Tensor:
    """A view with blocks on dim 1: caches [2, NB, ...] as they are, scales [NB, ...] as [1, NB, ...]."""
    return t if t.dim() == 5 else t.unsqueeze(0)


class _StepGraph:
    """A step captured for T token rows of N sequences: decode (N = T sequences of one token each)
    or one sequence's prefill (N = 1, up to T new tokens).

    The step's inputs live in one device buffer, filled from one pinned host buffer by a single
    asynchronous copy per step; the host side is written through numpy views, so preparing a step
    costs a few microseconds and no device work. Token rows past the step's tokens are padding:
    token 0 at position 0, no KV write (slot -1), in no sequence (past query_start_loc's end), or, for
    decode, a sequence of its own with a one-token context.
    """

    def __init__(self, T: int, N: int, max_blocks: int, device: torch.device):
        import numpy as np
        layout = [("input_ids", torch.int64, (T,)), ("positions", torch.int64, (T,)),
                  ("slot_mapping", torch.int64, (T,)), ("logits_indices", torch.int64, (N,)),
                  ("query_start_loc", torch.int32, (N + 1,)), ("seq_lens", torch.int32, (N,)),
                  ("block_tables", torch.int32, (N, max_blocks))]
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
            size = dtype.itemsize * int(np.prod(shape))
            self.inputs[name] = self.dev[off:off + size].view(dtype).view(shape)
            self.np[name] = host_np[off:off + size].view(np.dtype(str(dtype).removeprefix("torch."))).reshape(shape)
        self.np["query_start_loc"][:] = np.arange(N + 1)
        self.np["logits_indices"][:] = np.arange(N)
        self.np["slot_mapping"][:] = -1
        self.np["seq_lens"][:] = 1
        self.dev.copy_(self.host)
        self.copied = torch.cuda.Event() if cuda else None
        self.tokens_host = torch.zeros(N, dtype=torch.int64, pin_memory=cuda)
        self.read = torch.cuda.Event() if cuda else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.arena: torch.Tensor | None = None
        self.rows = T  # token rows holding a token in the last step (the rest are padding)

    def _host_free(self) -> None:
        """Wait until the previous step's copy has left the pinned buffer."""
        if self.copied is not None:
            self.copied.synchronize()

    def _send(self) -> None:
        """Start the one asynchronous copy of the step's inputs to the device."""
        self.dev.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def load(self, batch: list[StepInput], block_size: int) -> None:
        """Write the batch into the pinned buffer and start its copy to the device."""
        self._host_free()
        ids, pos, slots = self.np["input_ids"], self.np["positions"], self.np["slot_mapping"]
        lens, tables = self.np["seq_lens"], self.np["block_tables"]
        for i, s in enumerate(batch):
            p = s.start_pos
            ids[i], pos[i], lens[i] = s.token_ids[0], p, p + 1
            slots[i] = slot_for(s.block_table, p, block_size)
            used = p // block_size + 1  # the blocks the context covers; a longer table's tail is unused
            tables[i, :used] = s.block_table[:used]
        n = len(batch)
        if n < self.rows:  # rows that held sequences last step become padding again
            ids[n:], pos[n:], slots[n:], lens[n:] = 0, 0, -1, 1
        self.rows = n
        self._send()

    def load_prefill(self, s: StepInput, block_size: int) -> None:
        """Write one sequence's new tokens (at most T, the logits of the last one) and start the copy."""
        import numpy as np
        self._host_free()
        n, p0 = len(s.token_ids), s.start_pos
        end = p0 + n
        used = blocks_covering(0, s, block_size)
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
        self._send()

    def read_tokens(self, n: int) -> torch.Tensor:
        """The argmax tokens of the first n rows, on the host."""
        self.tokens_host.copy_(self.out, non_blocking=True)
        if self.read is not None:
            self.read.record()
            self.read.synchronize()
        return self.tokens_host[:n].clone()
