"""Linear layers with a fused epilogue, tuned for decode: y = epilogue(x @ w.T + b), w [N, K].

At decode M is 1..64 tokens and a linear is a weight stream (memory-bound): what matters is
reading w once with enough programs in flight to saturate HBM. The N tiles alone are too few
programs for 132 SMs, so split-K spreads K over more programs (fp32 partials; the split that
finishes a tile last sums them in split order and applies the epilogue, so split-K is still one
launch and its result does not depend on timing). Up to 64 tokens a program covers all the step's
16-row tiles, one dot per tile with each w tile it loads (`m_tiles`): w is read once whatever the
batch, and a row's sums are the same 16-row dots alone or among others. The epilogue (bias, silu,
gelu, ...) runs on the fp32 accumulator, so y is written once and never read back. Tiles come from
`autotune.Tuner` per M bucket; `prefer_cublas` records where cuBLAS wins.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from llmc.codegen.autotune import JOINT_MARGIN, Tuner, bucket_size, fit_stages, m_bucket, timing_io
from llmc.codegen.elementwise import (HELPERS, UNARY_OPS, _freeze_attrs, cast_expr, cast_helpers, compiled,
                                      interpreting, op_expr)
from llmc.codegen.kernels import KernelSpec, tile_counters
from llmc.errors import CompileError
from llmc.intmath import cdiv, next_pow2
from llmc.ir.ops import get_op
from llmc.ir.types import dtype_name, torch_dtype

EPILOGUE_OPS = tuple(op for op in UNARY_OPS if op != "cast")
# a program covers up to this many row tiles, each w tile it loads feeding one dot per row tile:
# at up to 64 tokens a step reads w once, with the 16-row tiles of batch 1 (see `m_tiles`)
MAX_M_TILES = 4
# experimental (LLMC_PDL_PREFETCH=1, read once per process; with programmatic dependent launch, kernels.pdl_enabled):
# a matmul of up to 64 rows sends for the first columns of its weight rows into L2 before it waits on the kernel
# before it, PREFETCH_BYTES in all over its programs, so that the weight stream does not stop between kernels
PDL_PREFETCH = os.environ.get("LLMC_PDL_PREFETCH") == "1"
PREFETCH_BYTES = 4 << 20
PREFETCH_LINES = 2  # 128-byte lines of a weight row per prefetch step
PROLOGUES = ("", "silu_mul")  # x as loaded, or silu(gate) * up formed from two inputs (`silu_mul_linear`)


def _norm_epilogue(epilogue: Sequence) -> tuple:
    out = []
    for e in epilogue:
        op, attrs = (e, ()) if isinstance(e, str) else (e[0], _freeze_attrs(e[1] if len(e) > 1 else ()))
        if op not in EPILOGUE_OPS:
            raise CompileError(f"matmul epilogue: {op!r} cannot be fused into a matmul; unary ops only: "
                               f"{', '.join(EPILOGUE_OPS)}")
        out.append((op, attrs))
    return tuple(out)


@dataclass(frozen=True)
class MatmulSpec(KernelSpec):
    """y = epilogue(x @ w.T + b) for x, w, b, y of `dtype`; epilogue: unary op names or (op, attrs) pairs;
    prologue "silu_mul": x is silu(gate) * up, formed from two inputs as each tile is loaded."""

    template = "matmul.py.jinja"
    dtype: str
    has_bias: bool
    epilogue: tuple = ()
    prologue: str = ""
    gated: bool = False

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "epilogue", _norm_epilogue(self.epilogue))
        if self.prologue not in PROLOGUES:
            raise CompileError(f"matmul prologue: {self.prologue!r} is not one of {PROLOGUES}")
        if self.gated and (self.epilogue or self.prologue):
            raise CompileError("matmul: the SwiGLU epilogue (gated) takes no other epilogue op and no prologue")

    def key(self, n: int, k: int) -> str:
        """The autotune key: this kernel at a static weight shape [n, k] (gated: n is the gate and up rows)."""
        epi = "+".join(op + "".join(f"[{k_}={v}]" for k_, v in at) for op, at in self.epilogue) or "none"
        epi = "silu_mul" if self.gated else epi
        pro = f",prologue={self.prologue}" if self.prologue else ""
        return f"matmul[{self.dtype},bias={int(self.has_bias)},epilogue={epi}{pro}]N{n}K{k}"

    def context(self) -> dict[str, Any]:
        helpers: set[str] = set()
        lines = [f"acc = {op_expr(op, ['acc'], dict(at), helpers)}" for op, at in self.epilogue]
        # the interpreter's tl.dot runs np.matmul on bf16's raw uint16 bits: feed it fp32 there
        # fp32 on the GPU: "ieee" keeps full precision (tf32 would miss the 1e-4 tolerance)
        def dot(b: str) -> str:
            if self.dtype == "bf16" and interpreting():
                return f"tl.dot(a.to(tl.float32), {b}.to(tl.float32), acc)"
            if self.dtype == "f32":
                return f'tl.dot(a, {b}, acc, input_precision="ieee")'
            return f"tl.dot(a, {b}, acc)"
        e = torch_dtype(self.dtype).itemsize
        bytes_comment = (f"bytes: w read once ({e}NK), x ({e}MK, from L2 per N tile), y written once ({e}MN); "
                         f"unfused, each of the {len(self.epilogue) + self.has_bias} epilogue ops would read and "
                         f"write y again ({2 * e}MN each)")
        summary = ("(silu(gate) * up)" if self.prologue else "x") + " @ w.T" + (" + b" if self.has_bias else "")
        for op, _ in self.epilogue:
            summary = f"{op}({summary})"
        if self.gated:
            summary = f"silu(gate) * up of [gate | up] = {summary}"
        # the product as the unfused elementwise kernel computes and stores it (fp32, then x's dtype)
        prologue_expr = cast_expr(op_expr("silu_mul", ["g", "u"], {}, helpers), self.dtype) if self.prologue else ""
        return {"has_bias": self.has_bias, "epilogue_lines": lines, "dot": dot("b"), "max_m_tiles": MAX_M_TILES,
                "gated": self.gated, "dot_up": dot("bu"), "gate_round": cast_expr("acc", self.dtype),
                "up_round": cast_expr("accu", self.dtype), "glu_expr": op_expr("silu_mul", ["g", "u"], {}, helpers),
                "prologue": self.prologue, "prologue_expr": prologue_expr,
                "pdl_defer": PDL_PREFETCH, "line_elems": 128 // e, "prefetch_lines": PREFETCH_LINES,
                "bytes_comment": bytes_comment, "store_cast": cast_expr("acc", self.dtype), "summary": summary,
                "helpers": [HELPERS[h] for h in sorted(helpers)] + cast_helpers([self.dtype])}


def _cfg(bm, bn, bk, split_k, warps, stages) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split_k, "num_warps": warps, "num_stages": stages}


def candidates(bucket: str, shared: bool = True) -> list[dict]:
    """Configs to try for an M bucket, the default first (the default is what CPU and interpreter use).

    Up to 16 tokens, and up to 64 when the bucket shares its choice with smaller ones (`shared`,
    see `JOINT_BUCKETS`), the tiles are 16 rows tall whatever M is: a row's sum then does not
    depend on how many rows share its tile grid.
    """
    m = bucket_size(bucket)
    if m <= 16 or m <= 64 and shared:  # weight streaming: narrow N tiles and split-K for enough programs
        return [_cfg(16, 64, 128, 1, 4, 4), _cfg(16, 32, 128, 1, 4, 4), _cfg(16, 64, 256, 1, 4, 3),
                _cfg(16, 128, 128, 1, 4, 3), _cfg(16, 64, 128, 2, 4, 4), _cfg(16, 32, 256, 2, 4, 3),
                _cfg(16, 64, 128, 4, 4, 4), _cfg(16, 32, 128, 4, 4, 4), _cfg(16, 64, 256, 4, 4, 3),
                _cfg(16, 32, 128, 8, 4, 4), _cfg(16, 64, 64, 8, 4, 4), _cfg(16, 128, 64, 1, 4, 4)]
    if m <= 64:
        return [_cfg(m, 64, 64, 1, 4, 4), _cfg(m, 128, 64, 1, 4, 4), _cfg(m, 64, 128, 1, 4, 3),
                _cfg(m, 128, 128, 1, 8, 3), _cfg(m, 64, 64, 2, 4, 4), _cfg(m, 128, 64, 2, 4, 4),
                _cfg(m, 64, 128, 4, 4, 3), _cfg(m, 32, 128, 2, 4, 4)]
    return [_cfg(64, 128, 64, 1, 4, 4), _cfg(128, 128, 64, 1, 8, 3), _cfg(128, 64, 64, 1, 4, 4),
            _cfg(64, 64, 64, 1, 4, 4), _cfg(128, 256, 64, 1, 8, 3), _cfg(64, 256, 64, 1, 8, 3)]


def silu_mul_product(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up by the generated elementwise kernel, as the unfused graph computes it: the input
    of a `silu_mul_linear` step that runs on cuBLAS (a prologue has no place there), and the output of a
    `linear_silu_mul` step that does (`out`: a contiguous tensor of gate's shape to write it into)."""
    from llmc.codegen.elementwise import fused_elementwise
    return fused_elementwise(_silu_mul_spec(dtype_name(gate.dtype)), [gate, up], None if out is None else [out])[0]


def swiglu_of(y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of a gate/up projection's output y = [gate | up] (the product kernel)."""
    half = y.shape[-1] // 2
    return silu_mul_product(y[..., :half], y[..., half:], out)


@functools.lru_cache(maxsize=None)
def _silu_mul_spec(dtype: str):
    from llmc.codegen.elementwise import spec_from_ops
    return spec_from_ops([("g", dtype, "full"), ("u", dtype, "full")], [("silu_mul", ["g", "u"], {}, "y")], ["y"])


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, epilogue: Sequence = (),
              out: torch.Tensor | None = None, up: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """The same computation with torch (cuBLAS on the GPU) and the IR ops' reference implementations.
    `out`: a contiguous [..., N] tensor to write y into. `up`: x is the gate of silu(x) * up, formed in
    fp32 and rounded to x's dtype once (as the generated kernels form it). `gated`: y is silu(gate) * up
    of [gate | up] = x @ w.T + b, by the product kernel (as the unfused graph runs it)."""
    if gated:
        return swiglu_of(reference(x, w, b), out)
    if up is not None:
        x = (F.silu(x.float()) * up.float()).to(x.dtype)
    if out is not None and not epilogue and x.is_contiguous():
        x2, y2 = x.view(-1, x.shape[-1]), out.view(-1, w.shape[0])
        if b is None:
            torch.mm(x2, w.t(), out=y2)
        else:
            torch.addmm(b, x2, w.t(), out=y2)
        return out
    y = F.linear(x, w, b)
    for op, at in _norm_epilogue(epilogue):
        opdef = get_op(op)
        y = opdef.ref([y], opdef.complete_attrs(dict(at)), None)
    return y if out is None else out.copy_(y)


def m_tiles(m: int, block_m: int) -> int:
    """Row tiles per program: at up to 64 tokens (decode and short prefill steps) all of the step's
    rows when they fit in MAX_M_TILES tiles, rounded up to a power of two so that a few compiled
    variants serve every M; else one (prefill tiles are tall already)."""
    tiles = cdiv(m, block_m)
    return next_pow2(tiles) if m <= 64 and tiles <= MAX_M_TILES else 1


def prefetch_columns(M: int, K: int, grid: tuple[int, int, int], cfg: dict, itemsize: int) -> int:
    """Weight columns each program of a launch prefetches into L2 before it waits (LLMC_PDL_PREFETCH): about
    PREFETCH_BYTES over all programs, in whole steps of PREFETCH_LINES lines of 128 bytes a row, at most a
    program's share of K; none above 64 rows, where a step is no longer a weight stream."""
    step = PREFETCH_LINES * 128 // itemsize
    per_split = -(-K // (cfg["SPLIT_K"] * cfg["BLOCK_K"])) * cfg["BLOCK_K"]
    if M > 64:
        return 0
    cols = PREFETCH_BYTES // (grid[0] * grid[1] * grid[2] * cfg["BLOCK_N"] * itemsize)
    return min(cols // step * step, -(-per_split // step) * step)


def _launch(spec: MatmulSpec, x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y2: torch.Tensor,
            cfg: dict, u2: torch.Tensor | None = None) -> None:
    mod = compiled(spec)
    M, K = x2.shape
    N = w.shape[0] // 2 if spec.gated else w.shape[0]  # the output's columns
    split_k = cfg["SPLIT_K"]
    mt = m_tiles(M, cfg["BLOCK_M"])
    # a stage's tiles: w's (two with the gated epilogue's up rows) and x's per row tile (and up's with the prologue)
    w_tiles, x_tiles = (2 if spec.gated else 1), mt * (2 if spec.prologue else 1)
    cfg = fit_stages(cfg, (w_tiles * cfg["BLOCK_N"] + x_tiles * cfg["BLOCK_M"]) * cfg["BLOCK_K"] * x2.element_size(),
                     x2.device)
    grid = (cdiv(M, cfg["BLOCK_M"] * mt), cdiv(N, cfg["BLOCK_N"]), split_k)
    ws = torch.empty((split_k, M, w.shape[0]) if split_k > 1 else (1,), dtype=torch.float32, device=x2.device)
    counts = tile_counters(x2.device, grid[0] * grid[1]) if split_k > 1 else ws
    bias = (b,) if spec.has_bias else ()
    pre = prefetch_columns(M, K, grid, cfg, x2.element_size()) if PDL_PREFETCH else 0
    up = (u2,) if spec.prologue else ()
    mod.matmul_kernel[grid](x2, *up, w, *bias, y2, ws, counts, x2.stride(0), w.stride(0), y2.stride(0), M, N, K, pre,
                            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split_k,
                            M_TILES=mt, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _rows(t: torch.Tensor, K: int) -> torch.Tensor:
    """t [..., K] as [M, K] with a unit column stride (a view where one exists)."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t.view(-1, K) if t.dim() == 2 or t.is_contiguous() else t.reshape(-1, K)


def matmul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, epilogue: Sequence = (), *,
           tuner: Tuner | None = None, config: dict | None = None, out: torch.Tensor | None = None,
           up: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """y = epilogue(x @ w.T + b) with a generated Triton kernel; with `up`, y = epilogue((silu(x) * up) @ w.T + b);
    `gated`, y = silu(gate) * up of [gate | up] = x @ w.T + b.

    Args:
        x: [..., K] activations (any row stride, unit column stride).
        w: [N, K] weight (nn.Linear layout), x's dtype.
        b: optional [N] bias.
        epilogue: unary llmc ops applied in order, names or (name, attrs):
            ("silu",), (("gelu", {"approximate": "tanh"}),).
        tuner: chooses (on a GPU: times once, records, then reuses) the tiles for this shape's M bucket;
            None: the bucket's default tiles, untimed.
        config: a fixed config instead (a dict as in `candidates`).
        out: a contiguous [..., N] tensor to write y into; allocated when None.
        up: x's shape and dtype: x is then the gate of the SwiGLU product, which the kernel forms as it loads
            each tile (rounded to x's dtype, as the product kernel stores it). Typically x and up are the two
            halves of a fused gate/up projection's output, so they share a row stride.
        gated: w (and b) hold N gate rows, then N up rows: the SwiGLU product in the epilogue (`linear_silu_mul`),
            gate and up each rounded to x's dtype first, as the unfused projection stores them.

    Returns:
        y [..., N] of x's dtype (gated: [..., N / 2] for w of N rows).

    Example:
        >>> y = matmul(torch.randn(3, 64), torch.randn(32, 64), torch.randn(32), ("silu",))
    """
    K = x.shape[-1]
    N = w.shape[0]
    assert w.dim() == 2 and w.shape[1] == K, f"matmul: weight {list(w.shape)} does not match x's last dim {K}"
    assert w.dtype == x.dtype and (b is None or (b.shape == (N,) and b.dtype == x.dtype)), "matmul: mixed dtypes"
    assert up is None or (up.shape == x.shape and up.dtype == x.dtype), "matmul: up differs from x"
    assert not gated or N % 2 == 0, f"matmul: a gated weight has gate and up rows, not {N}"
    spec = MatmulSpec(dtype_name(x.dtype), b is not None, tuple(epilogue), "silu_mul" if up is not None else "", gated)
    x2 = _rows(x, K)
    u2 = _rows(up, K) if up is not None else None
    if u2 is not None and u2.stride(0) != x2.stride(0):  # the kernel steps both by x's row stride
        x2, u2 = x2.contiguous(), u2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    b = b.contiguous() if b is not None else None
    M = x2.shape[0]
    n_out = N // 2 if gated else N
    y = out if out is not None else torch.empty(x.shape[:-1] + (n_out,), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    y2 = y.view(-1, n_out)
    if K == 0:
        return y.copy_(reference(x, w, b, epilogue, up=up, gated=gated))
    if config is None and tuner is None:
        config = candidates(m_bucket(M))[0]
    elif config is None:
        bucket = m_bucket(M)
        group = tuner.joint if bucket in tuner.joint else (bucket,)
        if spec.prologue:  # gate and up as the halves of one [m, 2K] output, as a fused gate/up writes them
            io = timing_io(group, 2 * K, N, x2.dtype, x2.device)
            bench = lambda cfg: [_launch(spec, xi[:, :K], w, b, yi, cfg, xi[:, K:]) for xi, yi in io()]
            baseline = lambda: [reference(silu_mul_product(xi[:, :K], xi[:, K:]), w, b, spec.epilogue)
                                for xi, _ in io()]
        else:  # gated: the unfused baseline writes the [m, N] projection, then the product kernel its half
            io = timing_io(group, K, N, x2.dtype, x2.device)
            bench = lambda cfg: [_launch(spec, xi, w, b, yi[:, :n_out], cfg) for xi, yi in io()]
            baseline = lambda: [reference(xi, w, b, spec.epilogue, gated=gated) for xi, _ in io()]
        config = tuner.choose(spec.key(N, K), group, candidates(bucket, len(group) > 1), bench=bench,
                              baseline=baseline, margin=JOINT_MARGIN if len(group) > 1 else 0.97)
    _launch(spec, x2, w, b, y2, config, u2)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, epilogue: Sequence = (), *,
           tuner: Tuner | None = None, out: torch.Tensor | None = None, up: torch.Tensor | None = None,
           prologue: bool = True, gated: bool = False, fused: bool = True) -> torch.Tensor:
    """`matmul`, or cuBLAS (torch) where the tuner recorded that cuBLAS is faster for this shape bucket,
    or where a frozen tuner (an artifact's) has no record for it. With `up` the cuBLAS path runs the SwiGLU
    product kernel first (`silu_mul_product`), so both paths give the same x; `prologue=False` does so on
    the generated path too, with the tiles tuned for the prologue (the unfused form, to compare with).
    `gated`: the cuBLAS path runs the product kernel after the projection; `fused=False` does so on the
    generated path too, with the tiles tuned for the gated kernel (the unfused form, to compare with)."""
    rec, M = None, x.numel() // max(1, x.shape[-1])
    if tuner is not None:
        spec = MatmulSpec(dtype_name(x.dtype), b is not None, tuple(epilogue), "silu_mul" if up is not None else "",
                          gated)
        rec = tuner.lookup(spec.key(w.shape[0], w.shape[1]), m_bucket(M))
        if rec.prefer_cublas if rec is not None else tuner.frozen:
            return reference(x if up is None else silu_mul_product(x, up), w, b, epilogue, out, gated=gated)
    if (up is not None and not prologue) or (gated and not fused):
        cfg = dict(rec.config) if rec is not None else candidates(m_bucket(M))[0]
        if gated:
            return swiglu_of(matmul(x, w, b, config=cfg), out)
        return matmul(silu_mul_product(x, up), w, b, epilogue, out=out, config=cfg)
    return matmul(x, w, b, epilogue, tuner=tuner, out=out, up=up, gated=gated)
