"""Per-token dynamic quantization of activations (`quantize_act`): the codes and scales that W8A8 and FP8
linears (`llmc/codegen/qmatmul.py`) dot against their weights' codes.

Each row of x [M, K] gets the scale max|x| / qmax and codes round(x / scale), int8 (w8a8) or e4m3 (fp8),
rounded exactly as torch rounds them (`act_code`, which the norm kernels that emit codes beside their output
share: llmc/codegen/norm.py), so the generated kernels, the interpreter and the golden model
(`llmc.ir.quant.quantize_activations`) agree code for code. A row of up to `ACT_ONE_PASS` values stays in
registers for one pass over x; wider rows are read twice (the max, then the codes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmc.codegen.elementwise import HELPERS, cast_expr, cast_helpers, compiled, interpreting, op_expr
from llmc.codegen.kernels import KernelSpec
from llmc.intmath import next_pow2
from llmc.ir.quant import FP8_MAX, INT8_MAX
from llmc.ir.types import dtype_name

ACT_ONE_PASS = 16384  # the widest row `quantize_act` quantizes in one pass (16 warps of 32 values a thread)


def act_code(kind: str) -> tuple[str, float, list[str]]:
    """(the expression of an activation code from `v` = x / scale clamped, qmax, helper sources) for
    "w8a8" (int8) or "fp8" (e4m3) codes: torch's rounding, bit for bit, on every backend."""
    if kind == "w8a8":
        return "_rint(v).to(tl.int8)", float(INT8_MAX), [RINT]
    if interpreting():
        return "_rne_e4m3(v).to(tl.float8e4nv)", float(FP8_MAX), [RNE_E4M3]
    return "v.to(tl.float8e4nv)", float(FP8_MAX), []  # cvt.rn.satfinite: to nearest, ties to even, as torch


@dataclass(frozen=True)
class QuantizeActSpec(KernelSpec):
    """Per-token dynamic quantization of x [M, K] (`dtype`) to int8 (`kind` "w8a8") or e4m3 ("fp8") codes."""

    template = "qmatmul_quantize_act.py.jinja"
    kind: str
    dtype: str
    silu_mul: bool = False  # x is silu(gate) * up of two inputs, made here (`silu_mul_quant`)

    def context(self) -> dict[str, Any]:
        code, qmax, helpers = act_code(self.kind)
        ew: set[str] = set()
        silu = cast_expr(op_expr("silu_mul", ["g", "u"], {}, ew), self.dtype)
        helpers = helpers + [HELPERS[h] for h in sorted(ew)] + (cast_helpers([self.dtype]) if self.silu_mul else [])
        return {"kind": self.kind, "qmax": qmax, "code": code, "helpers": helpers, "dtype": self.dtype,
                "silu_mul": self.silu_mul, "round_silu_mul": silu,
                "x_bytes": {"bf16": 2, "f16": 2, "f32": 4}[self.dtype] * (2 if self.silu_mul else 1)}


RINT = '''@triton.jit
def _rint(v):
    # round half to even, as torch.round: after adding 1.5 * 2^23 no fraction bits are left, and
    # the addition rounds to nearest even (|v| <= 2^22)
    return (v + 12582912.0) - 12582912.0'''

RNE_E4M3 = '''@triton.jit
def _rne_e4m3(v):
    # |v| <= 448 rounded to the nearest e4m3 value, ties to even, as fp32: the interpreter's own
    # fp32 -> fp8 cast does not round to nearest; the cast of the value returned is exact
    a = tl.abs(v)
    u = a.to(tl.uint32, bitcast=True)
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    sub = (a + 16384.0) - 16384.0  # below 2^-6 the step is 2^-9, the fp32 step at 2^14
    r = tl.where(a < 0.015625, sub, normal)
    return tl.where(v < 0, -r, r)'''


def quantize_act(x: torch.Tensor, kind: str, up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantization of x [..., K] with a generated kernel, as quant.quantize_activations.

    Args:
        x: [..., K] activations (bf16, f16 or f32; unit column stride).
        kind: "w8a8" (int8 codes, max|x| / 127 scales) or "fp8" (e4m3 codes, max|x| / 448 scales).
        up: when given (x's shape and dtype), the codes are of silu(x) * up, rounded to x's dtype
            first as the unfused elementwise kernel stores it (the `silu_mul_quant` op).

    Returns:
        (codes [..., K] contiguous, scales [..., 1] fp32).

    Example:
        >>> q, s = quantize_act(torch.randn(3, 64), "w8a8")
    """
    K = x.shape[-1]
    x2 = x.reshape(-1, K) if x.stride(-1) == 1 else x.contiguous().view(-1, K)
    M = x2.shape[0]
    q = torch.empty((M, K), dtype=torch.int8 if kind == "w8a8" else torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M and K:
        mod = compiled(QuantizeActSpec(kind, dtype_name(x.dtype), up is not None))
        u2: tuple = ()
        if up is not None:
            u = up.reshape(-1, K) if up.stride(-1) == 1 else up.contiguous().view(-1, K)
            u2 = (u, u.stride(0))
        block = next_pow2(K)
        one = block <= ACT_ONE_PASS  # the row in registers (32 values a thread), else two passes over it
        block = block if one else 2048
        mod.quantize_act_kernel[(M,)](x2, *u2, q, s, x2.stride(0), K, BLOCK_K=block, ONE_PASS=one,
                                      num_warps=max(4, block // 1024))
    return q.view(x.shape), s.view(*x.shape[:-1], 1)
