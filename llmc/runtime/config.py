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
    max_prefill_tokens: int | None = None  # a step with no decode to run; None: max_num_batched_tokens
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
    warm_up: bool = True  # at load, on a GPU: capture the decode graphs, compile the mixed steps' kernels

    def validate(self) -> None:
        """Raise LLMCError naming the first option out of range."""
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_tokens", "block_size", "num_blocks",
                     "max_model_len", "tensor_parallel_size", "pipeline_parallel_size", "multi_step"):
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


PACE_PROMPTS = 2.0  # LLMC_PACE_PROMPTS=1: SchedulerConfig.pace_prompts (benchmarks/schedule_sim.py --paced)
PACED_FLOOR = 256  # ... and its budget for steps with decodes where the compile timed no GEMMs


def paced_floor(tuning: dict | None) -> int:
    """The budget of steps with decodes under paced prompts: the smallest row count the compile timed the GEMMs
    at (tuning.json "token_budget" gemm_ms; 256 on an H200), below which a step costs about its weights' read."""
    rec = (tuning or {}).get("token_budget") or {}
    try:
        sizes = [int(m) for m in rec["gemm_ms"]]
    except (KeyError, TypeError, ValueError, AttributeError):
        return PACED_FLOOR
    return min(sizes) if sizes and min(sizes) >= 1 else PACED_FLOOR


@dataclass(frozen=True)
class StepBudget:
    """Tokens for a step that carries decodes, chosen per step from what the compile measured.

    A step costs its GEMMs (`gemm_ms`: milliseconds of every linear at M rows, tuning.json
    "token_budget") plus a part that does not grow with the prompt chunk it takes: reading its decodes'
    K/V (`kv_ms_per_token` per context token, from the measured HBM rate). Prompts are done in fewer
    steps with larger chunks, and each step pays that fixed part once; so the chunk is the smallest of
    the measured sizes whose cost per prompt token, (GEMMs of decodes + chunk rows + fixed) / chunk,
    is within `slack` of the best. Many decodes with long contexts take larger chunks; a few short ones
    keep near `floor` (the compile's budget), so their wait stays short.

    Opt-in (`LLMC_STEP_BUDGET=1`): a step of d decodes beside a power-of-two chunk holds d more tokens than the
    chunk, so on a GPU it runs on the piecewise graphs of twice the chunk (their GEMMs over up to twice its
    rows). On an H200 the 8B shape's mixed workload ran 1.31x slower under it than at 2,048 tokens a step
    (benchmarks/RESULTS.md, 2026-12-04; benchmarks/schedule_sim.py).

    Example:
        >>> b = StepBudget(((256, 1.0), (512, 1.6), (1024, 3.0), (2048, 5.9)), kv_ms_per_token=1e-4, floor=512)
        >>> b(0, 0), b(128, 600_000)
        (512, 2176)
    """

    gemm_ms: tuple[tuple[int, float], ...]  # (rows, ms), rows ascending, at least two
    kv_ms_per_token: float
    floor: int
    slack: float = 1.1

    @classmethod
    def of(cls, tuning: dict | None, kv_bytes_per_token: float, floor: int) -> "StepBudget | None":
        """The budget of an artifact's tuning.json contents, None where its compile did not measure the
        GEMMs at several sizes and the HBM rate (older artifacts, CPU compiles)."""
        rec = (tuning or {}).get("token_budget") or {}
        try:
            gemm = tuple(sorted((int(m), float(t)) for m, t in rec["gemm_ms"].items()))
            gb_s = float(rec["hbm_gb_s"])
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if len(gemm) < 2 or gb_s <= 0 or any(m < 1 or t <= 0 for m, t in gemm):
            return None
        return cls(gemm, kv_bytes_per_token / (gb_s * 1e6), floor)

    def gemm(self, m: int) -> float:
        """The GEMMs' milliseconds at m rows: flat below the smallest measured size (the weights' read
        bounds it), linear between sizes and past the largest."""
        pts = self.gemm_ms
        if m <= pts[0][0]:
            return pts[0][1]
        for (m0, t0), (m1, t1) in zip(pts, pts[1:]):
            if m <= m1:
                return t0 + (t1 - t0) * (m - m0) / (m1 - m0)
        (m0, t0), (m1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (m - m1) / (m1 - m0)

    def __call__(self, decodes: int, context: int) -> int:
        """Tokens for a step whose decodes take `decodes` tokens and read `context` tokens of K/V."""
        fixed = self.kv_ms_per_token * context
        cost = {c: (self.gemm(decodes + c) + fixed) / c for c, _ in self.gemm_ms}
        best = min(cost.values())
        chunk = min(c for c, g in cost.items() if g <= self.slack * best)
        return max(self.floor, decodes + chunk)


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()
