"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): quantize a linear's weight one input column at a time, and after each column move
its rounding error onto the columns not yet quantized, weighted by the inverse Hessian of the
layer's output error (the Optimal Brain Surgeon update), so the layer's *outputs* on calibration
data stay close even where single weights cannot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from llmc.errors import CompileError
from llmc.ir.quant import QuantFormat, QuantizedWeight, int_scales, pack, quantize_int_with, range_scales
from llmc.passes.manager import register_pass
from llmc.passes.quantize.materialize import QuantizePass, entry_format, scale_dtype


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, fmt: QuantFormat, *, damp: float = 0.01,
                  act_order: bool = False, block_size: int = 128, scale_dtype: torch.dtype = torch.bfloat16,
                  search: int = 0) -> QuantizedWeight:
    """Quantize w [N, K] into an int format, minimising ``||X W^T - X Q^T||`` on calibration inputs X.

    The paper's three steps: columns are quantized in a fixed order (step 1, "arbitrary order");
    the error feedback reaches the columns after the current block once per block, as one GEMM
    (step 2, "lazy batch-updates"); the rows of the inverse Hessian that the feedback needs are the
    rows of the upper Cholesky factor of ``H^-1``, computed once (step 3, "Cholesky
    reformulation"), which is also what keeps the many rank-1 eliminations numerically stable.

    A grouped format's scales (and zero points) come from `int_scales` on the group's columns as
    error feedback has left them when the loop reaches the group's first column, so later groups
    absorb earlier groups' error in their range. With `act_order` the columns go in order of
    decreasing ``H_ii`` (the inputs with most energy first, while many columns remain to absorb
    their error); llmc's formats have no ``g_idx`` (a group is always contiguous input columns), so
    there every group's scales are fixed up front from the original weights ("static groups") and
    each column uses its own group's scales whenever its turn comes.

    Args:
        w: the weight [N, K] (any float dtype; the work is in fp32).
        hessian: ``H = 2 X^T X`` [K, K] summed over the calibration tokens X [M, K] (or divided by
            M, as the reference implementation accumulates it): any positive multiple gives the same
            result, since the damping is relative to ``mean(diag H)`` and the update uses ratios of
            inverse-Hessian entries.
        fmt: an int format (kind "int", 4 or 8 bits, per channel or grouped, with or without zeros).
        damp: added to the diagonal as ``damp * mean(diag H)``, so that H is invertible even when
            the calibration tokens do not span every input direction.
        act_order: quantize columns in order of decreasing ``H_ii`` (with static groups).
        block_size: columns per lazy batch-update; changes speed, not the result (up to rounding).
        scale_dtype: the dtype scales are stored in; codes are computed against the stored scales.
        search: 0: min-max scales; n > 0: each row's group range is shrunk by the best of n factors in
            [0.8, 1] ("mse" in the reference implementation; here the squared rounding error of the
            group's columns weighted by ``H_ii``), so that a group's few large weights do not coarsen
            the grid for the rest.

    Returns:
        The `QuantizedWeight`; its `dequantize()` is the quantized weight.

    Raises:
        ValueError: fmt is not an int format, or the shapes disagree.
        CompileError: the damped Hessian is not positive definite (raise `damp`).

    Example:
        >>> x, w = torch.randn(512, 128), torch.randn(32, 128)
        >>> qw = gptq_quantize(w, 2 * x.T @ x, QuantFormat("int", 4, group_size=64))
        >>> qw.qweight.shape, qw.scales.shape
        (torch.Size([32, 64]), torch.Size([32, 2]))
    """
    if fmt.kind != "int":
        raise ValueError(f"GPTQ quantizes to weight-only int formats (kind 'int', 4 or 8 bits), not {fmt.label}; "
                         f"quantize {fmt.kind} weights with quantize_rtn (or smoothquant_quantize)")
    n, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"GPTQ: the Hessian is {tuple(hessian.shape)}, expected [{k}, {k}] for a weight "
                         f"{tuple(w.shape)}")
    n_groups = fmt.groups(k)
    g = k // n_groups
    W = w.float().clone()  # [N, K]: the columns not yet quantized, error-updated in place
    H = hessian.double().clone()
    dead = H.diagonal() == 0  # inputs that are always 0: H_ii = 1 keeps H invertible, and W_i does not matter
    H[dead, dead] = 1
    W[:, dead] = 0
    scales = torch.empty(n, n_groups, dtype=scale_dtype, device=W.device)
    zeros = torch.empty(n, n_groups, dtype=torch.uint8, device=W.device) if fmt.has_zeros else None
    order = None
    if act_order:
        scales, zeros = group_scales(W, fmt, scale_dtype, search, H.diagonal().float())  # static groups
        perm = torch.argsort(H.diagonal(), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
        order = perm.tolist()
    H.diagonal().add_(damp * H.diagonal().mean())
    U = _inverse_cholesky(H, damp)  # [K, K] upper, in the processing order
    Q = torch.empty(n, k, dtype=torch.uint8, device=W.device)  # codes, in the processing order
    zero_point = float(1 << (fmt.bits - 1))
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()  # [N, B]: the block, kept current by in-block feedback
        Err1 = torch.zeros_like(W1)  # [N, B]: each column's scaled error, for the lazy update
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            grp = order[col] // g if act_order else col // g
            if not act_order and col % g == 0:
                cur = W1[:, i:min(col + g, i2) - i1]
                if col + g > i2:  # the group outruns the block: its later columns still lack this block's update
                    cur = torch.cat([cur, W[:, i2:col + g] - Err1[:, :i] @ U[i1:col, i2:col + g]], dim=1)
                s, z = group_scales(cur, fmt, scale_dtype, search, H.diagonal()[col:col + cur.shape[1]].float())
                scales[:, grp:grp + 1] = s
                if zeros is not None:
                    zeros[:, grp:grp + 1] = z
            s = scales[:, grp:grp + 1]
            z = zeros[:, grp:grp + 1] if zeros is not None else None
            q = quantize_int_with(W1[:, i:i + 1], fmt, s, z)  # [N, 1]
            Q[:, col] = q[:, 0]
            dq = (q.float() - (z.float() if z is not None else zero_point)) * s.float()
            err = (W1[:, i] - dq[:, 0]) / U1[i, i]
            W1[:, i + 1:] -= err[:, None] * U1[i, i + 1:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    if act_order:
        Q = Q[:, torch.argsort(perm)]
    return QuantizedWeight(fmt, pack(fmt, Q), scales, zeros)


def group_scales(w: torch.Tensor, fmt: QuantFormat, scale_dtype: torch.dtype, search: int,
                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group scales (and zeros) of w [N, C]: min-max (`search` 0), or per row and group the shrink
    factor, of `search` in [0.8, 1], with the least rounding error sum((w - Q(w))^2 * weight)."""
    if not search:
        return int_scales(w, fmt, scale_dtype)
    n, c = w.shape
    wg = w.float().reshape(n, fmt.groups(c), -1)
    lo, hi = wg.amin(-1), wg.amax(-1)
    wt = weight.reshape(1, wg.shape[1], -1)
    s = z = best = None
    for p in torch.linspace(1.0, 0.8, search).tolist():
        sp, zp = range_scales(lo * p, hi * p, fmt, scale_dtype)
        q = quantize_int_with(w, fmt, sp, zp).float().reshape(wg.shape)
        zero = zp.float()[..., None] if zp is not None else float(1 << (fmt.bits - 1))
        err = (((q - zero) * sp.float()[..., None] - wg) ** 2 * wt).sum(-1)
        if best is None:
            s, z, best = sp, zp, err
            continue
        better = err < best
        best = torch.where(better, err, best)
        s = torch.where(better, sp, s)
        z = torch.where(better, zp, z) if z is not None else None
    return s, z


def _inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor (fp32) of the damped Hessian's inverse, factored in fp64."""
    L, info = torch.linalg.cholesky_ex(H)
    if not info:
        U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
    if info:
        raise CompileError(f"GPTQ: the damped Hessian is not positive definite (Cholesky failed at column "
                           f"{int(info)}); raise the damping (damp={damp}) or calibrate on more tokens")
    return U.float()


@register_pass
@dataclass
class GPTQQuantize(QuantizePass):
    """Each planned linear by `gptq_quantize` with its input's calibration Hessian."""

    name: ClassVar[str] = "quantize_gptq"
    method: ClassVar[str] = "gptq"

    def quantize_group(self, g, ctx, x, items, s):
        h = self.stats(ctx, x).gptq_hessian()
        return [(n, gptq_quantize(self.weight(g, n), h, entry_format(e), damp=self.config.damp,
                                  act_order=self.config.act_order, scale_dtype=scale_dtype(g, n),
                                  search=self.config.scale_search))
                for n, e in items]
