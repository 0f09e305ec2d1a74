"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"): a few input channels carry much larger activations than the rest, and their
weights matter most; scaling those weight columns up by s before rounding (and the activations down
by 1/s, folded into the op that produces them) shrinks their relative rounding error at almost no
cost to the others. The scale is searched, not derived: ``s = mean|x|^alpha`` over a grid of alpha.

Errors are measured through the Gram matrix ``X^T X``: ``||X D^T||^2 = sum((D X^T X) * D)`` for a
weight difference D, so the calibration tokens are read once and each candidate costs ``N K^2``
instead of ``M N K`` (calibration sets have far more tokens M than input channels K).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from llmc.ir.quant import QuantFormat, QuantizedWeight, quantize_rtn
from llmc.passes.manager import register_pass
from llmc.passes.quantize.materialize import (QuantizePass, entry_format, fold_input_scale, head_tie, linear_name,
                                              scale_dtype)


def awq_search(ws: list[torch.Tensor], x: torch.Tensor, fmt: QuantFormat, *, grid: int = 20,
               scale_dtype: torch.dtype = torch.bfloat16, duo: bool = False) -> tuple[torch.Tensor, float]:
    """Search the per-input-channel AWQ scales for the linears that read one input x ("search scale").

    For each alpha in ``linspace(0, 1, grid)``: ``s = mean|x|^alpha``, normalised to
    ``s / sqrt(max(s) * min(s))`` so that it scales up as much as it scales down; each W is
    quantized as ``Q(W * s)`` (round-to-nearest in `fmt`) and the error is
    ``sum_W ||x W^T - (x / s) Q(W * s)^T||^2``. alpha = 0 is s = 1, plain RTN, so the result is never
    worse than RTN on the calibration tokens.

    Args:
        ws: the weights [N_i, K] of the linears reading x (q, k, v; or gate, up), searched jointly
            because one s is folded into their shared input.
        x: calibration inputs [M, K] (or [..., K]).
        fmt: the int format the weights will be stored in.
        grid: number of alpha values tried.
        scale_dtype: the dtype scales are stored in (the search rounds like the final weights will).
        duo: ``s = mean|x|^alpha / mean|W|^(1 - alpha)`` (AutoAWQ's default "duo scaling", with
            |W| relative to its group's max), instead of ``mean|x|^alpha``.

    Returns:
        (s [K] fp32, alpha). The caller divides the op producing x by s (a norm's weight, or the
        previous linear's output rows) and stores ``awq_quantize(W, s, fmt)``.

    Example:
        >>> x = torch.randn(512, 128); x[:, :4] *= 20
        >>> s, alpha = awq_search([torch.randn(32, 128)], x, QuantFormat("int", 4, group_size=64))
        >>> s.shape, 0 <= alpha <= 1
        (torch.Size([128]), True)
    """
    _, s, alpha = _search(ws, x, fmt, grid, scale_dtype, duo)
    return s, alpha


def _search(ws, x, fmt, grid, scale_dtype, duo, tie=None):
    """(error, s, alpha) of the best grid point; `tie` projects each candidate s onto the scales the
    input's producer can take."""
    _require_int(fmt)
    if grid < 1:
        raise ValueError(f"AWQ's scale search needs at least one grid point, not {grid}")
    xf = x.reshape(-1, x.shape[-1]).float()
    x_mean = xf.abs().mean(0)  # [K]
    gram = xf.T @ xf  # [K, K]
    w_mean = _weight_scale(ws, fmt) if duo else None
    best_err, best_s, best_alpha = float("inf"), None, 0.0
    for alpha in torch.linspace(0, 1, grid).tolist():
        s = x_mean.pow(alpha).clamp_min(1e-4)  # a channel that is always 0 would get s = 0
        if duo:
            s = (s / (w_mean.pow(1 - alpha) + 1e-4)).clamp_min(1e-4)
        if tie is not None:
            s = tie(s)
        s = s / (s.max() * s.min()).sqrt()
        err = sum(_output_error(w.float() - awq_quantize(w, s, fmt, scale_dtype=scale_dtype).dequantize() / s, gram)
                  for w in ws)
        if err < best_err:
            best_err, best_s, best_alpha = err, s, alpha
    return best_err, best_s, best_alpha


def _weight_scale(ws, fmt) -> torch.Tensor:
    """Mean over output rows of |W| relative to its group's max, per input channel (the weight side of
    AutoAWQ's "duo scaling": channels whose weights are small within their group can take more scale)."""
    w = torch.cat([w.float() for w in ws])
    g = fmt.group_size or w.shape[1]
    wg = w.abs().reshape(w.shape[0], -1, g)
    return (wg / wg.amax(-1, keepdim=True).clamp_min(1e-10)).reshape(w.shape).mean(0)


def awq_clip_search(w: torch.Tensor, x: torch.Tensor, fmt: QuantFormat, *, s: torch.Tensor | None = None,
                    grid: int = 20, max_shrink: float = 0.5,
                    scale_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Search a clipping range per output row and group ("search clip"): clipping a group's few
    largest weights makes its scale finer for all the others, which can lower the output error.

    Candidates are ``max|W_group| * (1 - i / grid)`` for ``i < max_shrink * grid`` (i = 0 is no
    clipping); each (row, group) keeps the one with the least error of that group's contribution to
    the output, ``||x_group (W_group - Q(clip(W_group)))^T||^2``.

    Args:
        w: the weight [N, K].
        x: calibration inputs [M, K] (or [..., K]).
        fmt: the int format the weight will be stored in.
        s: the AWQ scales from `awq_search`, if any: the search is then over ``W * s`` against
            ``x / s``, the clip values are in ``W * s`` units, as `awq_quantize` expects them.
        grid, max_shrink: the candidate clip ratios, as above.
        scale_dtype: the dtype scales are stored in.

    Returns:
        Clip values [N, G] fp32 (G groups; 1 per channel), for ``awq_quantize(w, s, fmt, clip=...)``.

    Example:
        >>> x, w = torch.randn(512, 128), torch.randn(32, 128)
        >>> awq_clip_search(w, x, QuantFormat("int", 4, group_size=64)).shape
        torch.Size([32, 2])
    """
    _require_int(fmt)
    n, k = w.shape
    n_groups = fmt.groups(k)
    xf = x.reshape(-1, k).float()
    wf = w.float()
    if s is not None:
        xf, wf = xf / s.float(), wf * s.float()
    xg = xf.reshape(-1, n_groups, k // n_groups)  # [M, G, g]
    gram = torch.einsum("mgi,mgj->gij", xg, xg)  # [G, g, g]: the groups' diagonal blocks of X^T X
    wmax = wf.reshape(n, n_groups, -1).abs().amax(-1)  # [N, G]
    best_err = torch.full_like(wmax, float("inf"))
    best = wmax.clone()
    for i in range(max(1, int(max_shrink * grid))):
        clip = wmax * (1 - i / grid)
        d = (wf - quantize_rtn(_clip(wf, clip), fmt, scale_dtype).dequantize()).reshape(n, n_groups, -1)
        err = (torch.einsum("ngi,gij->ngj", d, gram) * d).sum(-1)  # [N, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, clip, best)
    return best


def awq_quantize(w: torch.Tensor, s: torch.Tensor, fmt: QuantFormat, *, clip: torch.Tensor | None = None,
                 scale_dtype: torch.dtype = torch.bfloat16) -> QuantizedWeight:
    """Round-to-nearest of ``W * s`` (s scales input columns), clamped to ``[-clip, clip]`` per
    (row, group) if given. The stored layer computes ``(x / s) Q(W * s)^T``: the caller folds 1/s
    into the op producing x.

    Args:
        w: the weight [N, K].
        s: AWQ scales [K] (from `awq_search`).
        fmt: an int format.
        clip: clip values [N, G] in ``W * s`` units (from `awq_clip_search`), or None.
        scale_dtype: the dtype scales are stored in.

    Returns:
        The `QuantizedWeight` of ``W * s``.

    Example:
        >>> w = torch.randn(32, 128)
        >>> awq_quantize(w, torch.ones(128), QuantFormat("int", 8)).qweight.shape
        torch.Size([32, 128])
    """
    _require_int(fmt)
    ws = w.float() * s.float()
    return quantize_rtn(ws if clip is None else _clip(ws, clip), fmt, scale_dtype)


def _clip(w: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
    c = clip.float().repeat_interleave(w.shape[1] // clip.shape[1], dim=1)
    return torch.clamp(w, -c, c)


def _output_error(d: torch.Tensor, gram: torch.Tensor) -> float:
    """``||X D^T||^2`` for a weight difference D [N, K], from ``gram = X^T X``."""
    return float(((d @ gram) * d).sum())


def _require_int(fmt: QuantFormat) -> None:
    if fmt.kind != "int":
        raise ValueError(f"AWQ scales weight-only int formats (kind 'int', 4 or 8 bits), not {fmt.label}; "
                         "for W8A8 or FP8, whose activations are quantized too, use SmoothQuant")


@register_pass
@dataclass
class AWQQuantize(QuantizePass):
    """Searches one scale per group of linears that read one input (q/k/v, gate/up, o, down), folds
    1/s into the input's producer (the norm's weight; v_proj's rows for o_proj, one scale per KV head
    and dim; up_proj's rows for down_proj), then stores ``Q(W * s)`` with a clipping range searched
    per row and group. An input whose producer cannot absorb a scale keeps s = 1 and only the clip
    search."""

    name: ClassVar[str] = "quantize_awq"
    method: ClassVar[str] = "awq"
    clip: bool = True

    def input_scale(self, g, ctx, x, items):
        rows = self.stats(ctx, x).rows_sample()
        fmt = entry_format(items[0][1])
        ws, sd = [self.weight(g, n) for n, _ in items], scale_dtype(g, items[0][0])
        tie = head_tie(g, x)
        _, s, alpha, duo = min(((*_search(ws, rows, fmt, 20, sd, duo, tie), duo) for duo in (False, True)),
                               key=lambda r: r[0])
        if alpha == 0 and not duo:  # s = 1: plain RTN is best here
            return None
        where = fold_input_scale(g, x, [n for n, _ in items], s)
        if where is None:
            ctx.note(f"{self.name}: %{x.name} ({', '.join(linear_name(n) for n, _ in items)}): its producer cannot "
                     "take a scale; s = 1")
            return None
        return s

    def quantize_group(self, g, ctx, x, items, s):
        rows = self.stats(ctx, x).rows_sample()
        out = []
        for n, e in items:
            w, fmt, sd = self.weight(g, n), entry_format(e), scale_dtype(g, n)
            ones = torch.ones(w.shape[1])
            s_n = s if s is not None else ones
            clip = awq_clip_search(w, rows, fmt, s=s_n, scale_dtype=sd) if self.clip else None
            out.append((n, awq_quantize(w, s_n, fmt, clip=clip, scale_dtype=sd)))
        return out
