"""SmoothQuant (Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training Quantization
for Large Language Models"): per-token int8 activations lose the small channels of a token to its
few outlier channels, which are the same channels on every token; dividing each input channel by
``s_j`` (folded into the op producing x) and multiplying the weight's column j by it moves that range
into the weights, which are quantized per output row and tolerate it ("migrate the quantization
difficulty"). alpha sets how much moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from llmc.ir.quant import QuantFormat, QuantizedWeight, quantize_rtn
from llmc.passes.manager import register_pass
from llmc.passes.quantize.materialize import QuantizePass, entry_format, fold_input_scale, head_tie, linear_name

EPS = 1e-5  # floor for the statistics and the scales: a dead channel must not give s = 0 or 1/0


def smoothquant_scales(act_absmax: torch.Tensor, ws: list[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """The smoothing factors ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` of input channel j.

    Args:
        act_absmax: ``max |x_j|`` [K] per input channel over the calibration tokens.
        ws: the weights [N_i, K] of the linears reading x (q, k, v; or gate, up): one s is folded
            into their shared input, so ``max|W_j|`` is over all of their rows.
        alpha: the migration strength in [0, 1] (0.5 suits most models; more for larger outliers).

    Returns:
        s [K] fp32, at least 1e-5. Activations become ``x / s`` (the caller folds 1/s into the op
        producing x), weights ``W * s`` (`smoothquant_quantize`).

    Example:
        >>> s = smoothquant_scales(torch.tensor([8.0, 0.5]), [torch.tensor([[0.5, 2.0]])])
        >>> s.tolist()
        [4.0, 0.5]
    """
    if not 0 <= alpha <= 1:
        raise ValueError(f"SmoothQuant's alpha is in [0, 1], not {alpha}")
    w_absmax = torch.stack([w.float().abs().amax(0) for w in ws]).amax(0)  # [K]
    s = act_absmax.float().clamp_min(EPS).pow(alpha) / w_absmax.clamp_min(EPS).pow(1 - alpha)
    return s.clamp_min(EPS)


def smoothquant_quantize(w: torch.Tensor, s: torch.Tensor,
                         fmt: QuantFormat = QuantFormat("w8a8", 8)) -> QuantizedWeight:
    """Quantize ``W * s`` (s scales input columns) per output channel into a W8A8 format.

    Args:
        w: the weight [N, K].
        s: smoothing factors [K] (from `smoothquant_scales`).
        fmt: "w8a8" (int8) or "fp8": both quantize activations per token, which is what smoothing helps.

    Returns:
        The `QuantizedWeight` of ``W * s``; the layer computes it on ``x / s``.

    Example:
        >>> smoothquant_quantize(torch.randn(32, 128), torch.ones(128)).qweight.dtype
        torch.int8
    """
    if fmt.kind == "int":
        raise ValueError(f"SmoothQuant smooths activations for formats that quantize them (w8a8, fp8), not the "
                         f"weight-only {fmt.label}, whose activations stay in the model dtype; use AWQ or GPTQ")
    return quantize_rtn(w.float() * s.float(), fmt)


@register_pass
@dataclass
class SmoothQuantize(QuantizePass):
    """W8A8 with activation outliers migrated into the weights: per group of linears reading one
    input, s from the calibration max |x| and the weights (strength alpha), 1/s folded into the
    input's producer, int8 weights of ``W * s`` per channel. Where the producer cannot take s
    (o_proj's input), the layer is plain per-channel int8 over unsmoothed activations."""

    name: ClassVar[str] = "quantize_smoothquant"
    method: ClassVar[str] = "smoothquant"

    def input_scale(self, g, ctx, x, items):
        s = smoothquant_scales(self.stats(ctx, x).abs_max.cpu(), [self.weight(g, n) for n, _ in items],
                               self.config.alpha)
        tie = head_tie(g, x)
        s = tie(s) if tie is not None else s
        if fold_input_scale(g, x, [n for n, _ in items], s) is None:
            ctx.note(f"{self.name}: %{x.name} ({', '.join(linear_name(n) for n, _ in items)}): its producer cannot "
                     "take a scale; not smoothed")
            return None
        return s

    def quantize_group(self, g, ctx, x, items, s):
        out = []
        for n, e in items:
            w = self.weight(g, n)
            out.append((n, smoothquant_quantize(w, s if s is not None else torch.ones(w.shape[1]), entry_format(e))))
        return out
