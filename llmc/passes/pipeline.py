"""The default compile pipeline: one list, in phases.

Users insert their own passes with `pipeline(extra, before=NAME)` / `after=NAME`.
"""
from __future__ import annotations

from llmc.errors import CompileError
from llmc.passes.dead_code import DeadCode
from llmc.passes.fold_constants import FoldConstants
from llmc.passes.lift_patterns import LiftPatterns
from llmc.passes.manager import Pass
from llmc.passes.paged_kv import PagedKV
from llmc.passes.fuse_add_rmsnorm import FuseAddRmsNorm
from llmc.passes.fuse_elementwise import FuseElementwise
from llmc.passes.fuse_linear_epilogue import FuseLinearEpilogue
from llmc.passes.fuse_linear_prologue import FuseLinearPrologue  # noqa: F401  (opt-in: --pass fuse_linear_prologue)
from llmc.passes.fuse_act_quant import FuseActQuant
from llmc.passes.fuse_parallel_linears import FuseParallelLinears
from llmc.passes.fuse_rope_kv_write import FuseRopeKVWrite
from llmc.passes.shard import Shard  # noqa: F401  (not in the default list: the runtime shards at load)


def default_passes(options: dict | None = None) -> list[Pass]:
    opts = options or {}
    return [
        # phase 0: canonicalize and lift LLM patterns
        DeadCode(),
        FoldConstants(),
        LiftPatterns(),
        DeadCode(),
        # phase 1: flatten tokens, attention onto the paged KV cache
        *([PagedKV(kv_cache_dtype=opts.get("kv_cache_dtype", "auto"))] if opts.get("paged_kv", True) else []),
        # phase 2: quantization: plan, calibrate, materialize             (quantize/*)
        *quantize_passes(opts.get("quant")),
        # phase 3: fusion: horizontal, then vertical
        *([FuseParallelLinears(), FuseAddRmsNorm(), FuseRopeKVWrite(), FuseLinearEpilogue(), FuseActQuant(),
           FuseElementwise(),
           DeadCode()] if opts.get("fuse", True) else []),
        # phase 4: lower and plan memory                                  (codegen)
    ]


def quantize_passes(quant) -> list[Pass]:
    """Phase 2 for a QuantConfig (or a method name, or a dict of its options): the precision plan,
    calibration where the method needs it, and the method's materializing pass."""
    from llmc.passes.quantize.config import QuantConfig
    cfg = QuantConfig.coerce(quant)
    if cfg is None:
        return []
    from llmc.passes.quantize.assign import AssignPrecision
    from llmc.passes.quantize.awq import AWQQuantize
    from llmc.passes.quantize.calibrate import Calibrate
    from llmc.passes.quantize.fp8 import FP8Quantize
    from llmc.passes.quantize.gptq import GPTQQuantize
    from llmc.passes.quantize.mixed import MixedPrecision
    from llmc.passes.quantize.rtn import RTNQuantize
    from llmc.passes.quantize.smoothquant import SmoothQuantize
    method = {"rtn": RTNQuantize, "gptq": GPTQQuantize, "awq": AWQQuantize, "smoothquant": SmoothQuantize,
              "fp8": FP8Quantize, "mixed": MixedPrecision}[cfg.method]
    from llmc.passes.quantize.embedding import QuantizeEmbeddings
    return [AssignPrecision(cfg), *([Calibrate(cfg)] if cfg.needs_calibration else []), method(cfg),
            *([QuantizeEmbeddings(cfg)] if cfg.embeddings else [])]


def pipeline(extra: list[Pass] | None = None, before: str | None = None, after: str | None = None,
             options: dict | None = None) -> list[Pass]:
    """The default passes with `extra` inserted before/after the named pass (default: at the end).

    Example:
        >>> from llmc.passes import pipeline, DeadCode
        >>> [p.name for p in pipeline([DeadCode()], after="lift_patterns")][:5]
        ['dead_code', 'fold_constants', 'lift_patterns', 'dead_code', 'dead_code']
    """
    passes = default_passes(options)
    extra = list(extra or [])
    if before and after:
        raise CompileError("give before= or after=, not both")
    anchor = before or after
    if anchor is None:
        return passes + extra
    idx = [i for i, p in enumerate(passes) if p.name == anchor]
    if not idx:
        raise CompileError(f"no pass named {anchor!r} in the pipeline: {[p.name for p in passes]}")
    at = idx[0] if before else idx[0] + 1
    return passes[:at] + extra + passes[at:]
