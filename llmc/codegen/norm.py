"""RMSNorm kernels: one program per row, optionally fused with the residual add before it.

Semantics are `_rms_norm_ref`'s exactly: statistics in fp32; with `weight_first_cast` the
normalized row is rounded to the input dtype before the weight multiply (Llama), else the product
is formed in fp32 and rounded once. With a residual, `h = x + r` is rounded to the input dtype (as
torch's bf16 add is) and both `h` (the new residual stream) and `rms_norm(h) * w` are written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmc.codegen.act_quant import act_code
from llmc.codegen.elementwise import cast_expr, cast_helpers, compiled
from llmc.codegen.kernels import KernelSpec
from llmc.intmath import next_pow2
from llmc.ir.types import dtype_name, torch_dtype


@dataclass(frozen=True)
class RmsNormSpec(KernelSpec):
    """rms_norm over rows of `hidden` columns of `dtype`; `weight_dtype` None means `dtype`."""

    template = "rms_norm.py.jinja"
    hidden: int
    dtype: str
    residual: bool
    weight_first_cast: bool = True
    weight_dtype: str | None = None
    quant: str = ""  # "w8a8" / "fp8": the output as per-token codes and scales (rms_norm_quant)

    @property
    def out_dtype(self) -> str:
        """The IR's rule: `w * normed.to(x)` promotes (an f32 weight gives an f32 result); else x's dtype."""
        wd = self.weight_dtype or self.dtype
        if not self.weight_first_cast:
            return self.dtype
        return dtype_name(torch.promote_types(torch_dtype(self.dtype), torch_dtype(wd)))

    @property
    def block(self) -> int:
        return next_pow2(self.hidden)

    @property
    def num_warps(self) -> int:
        return 4 if self.block <= 1024 else 8 if self.block <= 4096 else 16

    def context(self) -> dict[str, Any]:
        e = torch_dtype(self.dtype).itemsize
        w = torch_dtype(self.weight_dtype or self.dtype).itemsize
        o = torch_dtype(self.out_dtype).itemsize
        if self.residual:
            comment = (f"bytes per row: read x, r ({2 * e}H), write h, out ({e + o}H), w from L2; unfused add then "
                       f"norm moves {3 * e}H + {e + o}H: one read of H and a launch saved")
        else:
            comment = f"bytes per row: read x ({e}H), write out ({o}H); w ({w}H) is shared by all rows (L2)"
        helpers = cast_helpers([self.dtype, self.out_dtype])
        quant = {}
        if self.quant:
            code, qmax, code_helpers = act_code(self.quant)
            quant = {"code": code, "qmax": qmax}
            helpers += code_helpers
            comment += f"; {self.quant} codes (1 byte) and a 4-byte scale written instead of out"
        return {**super().context(), "bytes_comment": comment, "h_cast": cast_expr("x + r", self.dtype),
                "normed_cast": cast_expr("normed", self.dtype), "out_cast": cast_expr("y", self.out_dtype),
                "out_dtype": self.out_dtype, "helpers": helpers, **quant}


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """t as [rows, hidden] with unit column stride, keeping its row stride when a view allows it."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, hidden)
    except RuntimeError:
        return t.reshape(-1, hidden)


def rms_norm_quant(x: torch.Tensor, w: torch.Tensor, kind: str, eps: float = 1e-6,
                   residual: torch.Tensor | None = None, weight_first_cast: bool = True,
                   outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The `rms_norm_quant` / `add_rms_norm_quant` ops: [codes, scales] (+ [h] with a residual) of
    rms_norm(x (+ residual), w) quantized per token for a `kind` ("w8a8" / "fp8") linear, in one kernel.

    Example:
        >>> codes, scales = rms_norm_quant(torch.randn(3, 64), torch.ones(64), "w8a8")
    """
    H = x.shape[-1]
    spec = RmsNormSpec(H, dtype_name(x.dtype), residual is not None, weight_first_cast, dtype_name(w.dtype), kind)
    x2 = _rows(x, H)
    if outs is None:
        outs = [torch.empty(x.shape, dtype=torch.int8 if kind == "w8a8" else torch.float8_e4m3fn, device=x.device),
                torch.empty(x.shape[:-1] + (1,), dtype=torch.float32, device=x.device)]
        if residual is not None:
            outs.append(torch.empty_like(x, memory_format=torch.contiguous_format))
    _launch(spec, x2, w, eps, outs[0].view(-1, H), residual, outs[2] if residual is not None else None,
            outs[1].view(-1))
    return outs


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None,
             weight_first_cast: bool = True, out: torch.Tensor | None = None,
             h_out: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the last dim of `x`, optionally after adding `residual`.

    Args:
        x: [..., H] activations (any leading dims, any row stride).
        w: [H] weight.
        eps: added to the mean square.
        residual: [..., H] of x's dtype and shape; when given, h = x + residual is normalized.
        weight_first_cast: Llama's order (round, then multiply by w), as the IR op's attribute.
        out, h_out: contiguous tensors to write the results into (the static buffer plan's);
            allocated when None.

    Returns:
        out [..., H], or (out, h) with a residual: h is the new residual stream.

    Example:
        >>> x, r, w = torch.randn(3, 64), torch.randn(3, 64), torch.ones(64)
        >>> out, h = rms_norm(x, w, 1e-6, residual=r)
    """
    H = x.shape[-1]
    assert w.shape == (H,), f"rms_norm: weight of shape {list(w.shape)} for hidden size {H}"
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype), \
        "rms_norm: residual must have x's shape and dtype"
    assert w.device == x.device and (residual is None or residual.device == x.device), "rms_norm: mixed devices"
    spec = RmsNormSpec(H, dtype_name(x.dtype), residual is not None, weight_first_cast, dtype_name(w.dtype))
    x2 = _rows(x, H)
    if out is None:
        out = torch.empty(x.shape, dtype=torch_dtype(spec.out_dtype), device=x.device)
    out2 = out.view(-1, H)
    h = None
    if residual is not None:
        h = h_out if h_out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(spec, x2, w, eps, out2, residual, h)
    return (out, h) if residual is not None else out


def _launch(spec: RmsNormSpec, x2: torch.Tensor, w: torch.Tensor, eps: float, out2: torch.Tensor,
            residual: torch.Tensor | None = None, h: torch.Tensor | None = None,
            scales: torch.Tensor | None = None) -> None:
    """One program per row of x2 [rows, H]: out2 (the normed rows, or their codes with `scales`), and h."""
    if x2.shape[0] == 0:
        return
    kernel, grid, w = compiled(spec).rms_norm_kernel, (x2.shape[0],), w.contiguous()
    s = (scales,) if scales is not None else ()
    if residual is not None:
        r2, h2 = _rows(residual, spec.hidden), h.view(-1, spec.hidden)
        kernel[grid](x2, r2, h2, w, out2, *s, x2.stride(0), r2.stride(0), h2.stride(0), out2.stride(0), eps,
                     BLOCK=spec.block, num_warps=spec.num_warps)
    else:
        kernel[grid](x2, w, out2, *s, x2.stride(0), out2.stride(0), eps, BLOCK=spec.block, num_warps=spec.num_warps)
