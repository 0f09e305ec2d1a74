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
from llmc.ir.types import torch_dtype
from llmc.passes.paged_kv import kv_cache_inputs, set_kv_cache_dtype

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


def select_backend(backend: str) -> str:
    if backend == "auto":
        return "reference"  # the generated-kernel backends register here as they land
    if backend != "reference":
        raise LLMCError(f"backend {backend!r} is not available in this build; use auto or reference")
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
                 num_cpu_blocks: int = 0):
        if not graph.meta.get("paged"):
            raise ArtifactError("this artifact was compiled without the paged_kv pass; recompile it with the "
                                "default pipeline to run it")
        self.backend = select_backend(backend)
        self.device = torch.device(device)
        if kv_cache_dtype != graph.meta.get("kv_cache_dtype", "auto"):
            graph = set_kv_cache_dtype(graph.clone(), kv_cache_dtype)
        if kv_cache_dtype == "fp8" and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise LLMCError("an fp8 KV cache needs a GPU with fp8 support (compute capability 8.9+); use int8")
        self.graph, self.block_size = graph, block_size
        self.caches = kv_cache_inputs(graph)
        per_block = sum(2 * block_size * c.type.shape[3] * c.type.shape[4] * torch_dtype(c.type.dtype).itemsize
                        for c in self.caches)
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
        for v in graph.inputs:
            if v.name.startswith("kv_scale."):
                self.kv[v.name] = torch.zeros((2, self.num_blocks, v.type.shape[2]), dtype=torch.float32,
                                              device=self.device)
        self.host_kv = {k: torch.zeros((t.shape[0], num_cpu_blocks, *t.shape[2:]), dtype=t.dtype)
                        for k, t in self.kv.items()} if num_cpu_blocks else {}
        self.kv_bytes = per_block * self.num_blocks
        self.plan = Interpreter(graph, self.device)

    # -- steps ------------------------------------------------------------------------------------
    def build_inputs(self, batch: list[StepInput]) -> dict[str, torch.Tensor]:
        ids, pos, qsl, lens, slots, logit_rows = [], [], [0], [], [], []
        max_blocks = max(len(s.block_table) for s in batch)
        tables = torch.zeros((len(batch), max(max_blocks, 1)), dtype=torch.int32)
        for i, s in enumerate(batch):
            n = len(s.token_ids)
            end = s.start_pos + n
            if (end + self.block_size - 1) // self.block_size > len(s.block_table):
                raise LLMCError(f"sequence {i}: {end} tokens need more blocks than its table has")
            ids += s.token_ids
            pos += range(s.start_pos, end)
            slots += [s.block_table[p // self.block_size] * self.block_size + p % self.block_size
                      for p in range(s.start_pos, end)]
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
    def execute(self, batch: list[StepInput]) -> torch.Tensor:
        """Run one step; returns float32 logits [sum(num_logits), V] in batch order."""
        if not batch:
            return torch.empty(0)
        return self.plan.run(self.build_inputs(batch))[0].float()

    # -- block movement ---------------------------------------------------------------------------
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate each src block into dst (all layers, K and V, scales)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for t in self.kv.values():
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
            h = self.host_kv[k]
            if to_host:
                h[:, host_idx] = t[:, dev_idx.to(t.device)].cpu()
            else:
                t[:, dev_idx.to(t.device)] = h[:, host_idx].to(t.device)
