"""Engine options and their defaults, written once: `LLM`, `AsyncLLM` and the CLI all read them here.

Kept free of torch so that `llmc --help` starts fast.
"""
from __future__ import annotations

from dataclasses import dataclass

from llmc.errors import LLMCError


@dataclass
class EngineConfig:
    """Every engine option and its default, written once (`LLM`, `AsyncLLM` and the CLI take these)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: the budget the compile measured (`token_budget`)
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_memory_fraction of free device memory
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
    tensor_parallel_size: int = 1  # ranks that split each layer (llmc/ir/sharding.py)
    pipeline_parallel_size: int = 1  # stages of consecutive layers (llmc/ir/stages.py)
    expert_parallel: bool = False  # MoE experts split by expert over the tensor-parallel ranks
    multi_step: int = 1  # greedy decode steps run back to back on the device per engine step (engine.py)
    overlap: bool = True  # greedy steps: schedule step N + 1 while the device runs step N (engine.py)

    def validate(self) -> None:
        """Raise LLMCError naming the first option out of range."""
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "max_model_len",
                     "tensor_parallel_size", "pipeline_parallel_size", "multi_step"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise LLMCError(f"{name} must be an integer >= 1, not {v!r}")
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise LLMCError("expert_parallel spreads the experts over the tensor-parallel ranks: set "
                            "tensor_parallel_size >= 2 (--expert-parallel -tp 2)")
        if self.multi_step > 1 and self.pipeline_parallel_size > 1:
            raise LLMCError("multi_step runs on one pipeline stage (tensor parallelism is fine): leave it at 1 "
                            "with pipeline_parallel_size > 1")
        if not isinstance(self.num_cpu_blocks, int) or self.num_cpu_blocks < 0:
            raise LLMCError(f"num_cpu_blocks must be an integer >= 0, not {self.num_cpu_blocks!r}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise LLMCError(f"kv_memory_fraction must be in (0, 1], not {self.kv_memory_fraction!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise LLMCError(f"preemption_mode must be recompute or swap, not {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.num_cpu_blocks == 0:
            raise LLMCError("preemption_mode swap needs host blocks: set num_cpu_blocks > 0")
        if self.kv_cache_dtype not in (None, "auto", "int8", "fp8"):
            raise LLMCError(f"kv_cache_dtype must be auto, int8 or fp8, not {self.kv_cache_dtype!r}")
        if self.device is not None and str(self.device).startswith("cuda") and not _has_cuda():
            raise LLMCError("device cuda was asked for, but torch sees no GPU; use the cpu device")


DEFAULT_TOKEN_BUDGET = 2048  # tokens per step where the artifact carries no measured budget (compiled on a CPU)


def token_budget(tuning: dict | None) -> int:
    """Tokens per step for an artifact: what its compile measured on the GPU (tuning.json "token_budget",
    compiler._measure_token_budget), else DEFAULT_TOKEN_BUDGET."""
    rec = (tuning or {}).get("token_budget") or {}
    n = rec.get("tokens") if isinstance(rec, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else DEFAULT_TOKEN_BUDGET


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()
