"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"): a few input channels carry much larger activations than the rest, and their
weights matter most; scaling those weight columns up by s before rounding (and the activations down
by 1/s, folded into the op that produces them) shrinks their relative rounding error at almost no
cost to the others. The scale is searched, not derived: ``s = mean|x|^alpha`` (or AutoAWQ's "duo"
``mean|x|^alpha / mean|W|^(1 - alpha)``) over a grid of alpha. Then each (row, group) of ``W * s``
gets a clipping range, also searched ("search clip").

Both searches minimise an output error on the calibration tokens, ``||X (W - Q)^T||^2``, read through
the Gram matrix ``X^T X`` (``||X D^T||^2 = sum((D X^T X) * D)`` for a weight difference D)
accumulated over every calibration token, so each candidate costs ``N K^2`` whatever the number of
tokens. Where the reference implementation differs, the choices here all serve that objective:

- each scale candidate is scored by the error of the weights as they will be stored, clipped by the
  clip search run for that candidate, so the scale search never picks a scale that the clip search
  then makes worse than s = 1;
- gate and up are scored by their error where it lands, in down_proj's output (through the SwiGLU
  product: `swiglu_row_weights`), not each on its own output: a channel that silu mostly turns off,
  or that down_proj reads with small weights, matters less;
- the clip search chooses the groups of a row together (coordinate descent over the groups, with
  the cross terms of ``X^T X`` between them), not each group against its own diagonal block: the
  inputs of neighbouring groups are correlated, and one group's rounding error can cancel another's;
  ``X^T X`` is damped as GPTQ damps its Hessian (`damped`), so those cross terms, estimated on a
  finite calibration set, are not fitted past what they generalise to;
- a clipped range keeps the format's whole code range (a symmetric 4-bit group rounds to -8 .. 7
  steps, not -7 .. 7), and the ranges tried are finer (21 in [0.5, 1] rather than 10).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from llmc.ir.quant import QuantFormat, QuantizedWeight, pack, quantize_int_with, quantize_rtn, range_scales
from llmc.passes.manager import register_pass
from llmc.passes.quantize.calibrate import STATS
from llmc.passes.quantize.materialize import (QuantizePass, entry_format, fold_input_scale, head_tie, linear_name,
                                              scale_dtype)

CLIP_GRID, MAX_SHRINK, SWEEPS = 20, 0.5, 4  # the clip search's defaults (see `awq_clip_search`)
DAMP = 0.1  # X^T X + DAMP * mean(diag) * I, as GPTQ damps its Hessian (QuantConfig.damp's default)
CHUNK = 1 << 24  # candidate weight elements held at once by the clip search (64 MiB in fp32)


def awq_search(ws: list[torch.Tensor], gram: torch.Tensor, x_mean: torch.Tensor, fmt: QuantFormat, *,
               grid: int = 20, duo: bool = False, clip: bool = True, tie=None,
               row_weights: list[torch.Tensor] | None = None,
               scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, float]:
    """Search the per-input-channel AWQ scales for the linears that read one input x ("search scale").

    For each alpha in ``linspace(0, 1, grid)``: ``s = mean|x|^alpha``, normalised to
    ``s / sqrt(max(s) * min(s))`` so that it scales up as much as it scales down; each W is stored as
    ``Q(W * s)`` (clipped by `awq_clip_search` when `clip`) and the error is
    ``sum_W sum_n r_n ||x w_n^T - (x / s) Q(W * s)_n^T||^2`` over W's output rows n (r: `row_weights`).
    alpha = 0 is s = 1, so the result is never worse than no scale on the calibration tokens.

    Args:
        ws: the weights [N_i, K] of the linears reading x (q, k, v; or gate, up), searched jointly
            because one s is folded into their shared input.
        gram: ``X^T X`` [K, K] of the calibration inputs X [M, K] (any positive multiple).
        x_mean: ``mean|X|`` per input channel [K].
        fmt: the int format the weights will be stored in.
        grid: number of alpha values tried.
        duo: ``s = mean|x|^alpha / mean|W|^(1 - alpha)`` (AutoAWQ's "duo scaling", with |W| relative to
            its group's max), instead of ``mean|x|^alpha``.
        clip: score each s with the clipping range searched for it (as the weights will be stored).
        tie: a projection of each candidate s onto the scales x's producer can take (`head_tie`).
        row_weights: per W, the weight [N_i] of each output row's error (`swiglu_row_weights`); None: 1.
        scale_dtype: the dtype scales are stored in (the search rounds like the final weights will).

    Returns:
        (s [K] fp32, alpha). The caller divides the op producing x by s (a norm's weight, or the
        previous linear's output rows) and stores ``awq_quantize(W, s, fmt, shrink=...)``.

    Example:
        >>> x = torch.randn(512, 128); x[:, :4] *= 20
        >>> s, alpha = awq_search([torch.randn(32, 128)], x.T @ x, x.abs().mean(0), QuantFormat("int", 4, 64))
        >>> s.shape, 0 <= alpha <= 1
        (torch.Size([128]), True)
    """
    _, s, alpha = _search(ws, gram, x_mean, fmt, grid, duo, clip, tie, row_weights, scale_dtype)
    return s, alpha


def _search(ws, gram, x_mean, fmt, grid, duo, clip, tie, row_weights, scale_dtype):
    """(error, s, alpha) of the best grid point."""
    _require_int(fmt)
    if grid < 1:
        raise ValueError(f"AWQ's scale search needs at least one grid point, not {grid}")
    gram, x_mean = gram.float(), x_mean.float()
    rws = row_weights or [torch.ones(w.shape[0]) for w in ws]
    w_mean = _weight_scale(ws, fmt) if duo else None
    best_err, best_s, best_alpha = float("inf"), None, 0.0
    for alpha in torch.linspace(0, 1, grid).tolist():
        s = x_mean.pow(alpha).clamp_min(1e-4)  # a channel that is always 0 would get s = 0
        if duo:
            s = (s / (w_mean.pow(1 - alpha) + 1e-4)).clamp_min(1e-4)
        if tie is not None:
            s = tie(s)
        s = s / (s.max() * s.min()).sqrt()
        err = sum(float((_row_errors(w, s, gram, fmt, clip, scale_dtype) * r).sum()) for w, r in zip(ws, rws))
        if err < best_err:
            best_err, best_s, best_alpha = err, s, alpha
    return best_err, best_s, best_alpha


def _row_errors(w, s, gram, fmt, clip, scale_dtype) -> torch.Tensor:
    """``||X (w_n - Q(W * s)_n / s)^T||^2`` per output row n [N], W stored by `awq_quantize` (clip-searched
    if `clip`)."""
    if clip:
        return _clip_search(w.float() * s, _scaled_gram(gram, s), fmt, CLIP_GRID, MAX_SHRINK, SWEEPS, scale_dtype)[1]
    d = w.float() - awq_quantize(w, s, fmt, scale_dtype=scale_dtype).dequantize() / s
    return ((d @ gram) * d).sum(-1)


def swiglu_row_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, gram_x: torch.Tensor,
                       gram_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight of each gate and up output row's error in down_proj's output, for `awq_search`.

    An error e in up's output channel n reaches down_proj's output as ``W_down[:, n] * silu(g_n) * e``,
    one in gate's as ``W_down[:, n] * u_n * silu'(g_n) * e``; with the token-wise factors taken as
    independent of e and the cross terms between channels dropped, their weights are
    ``||W_down[:, n]||^2 E[silu(g_n)^2]`` and ``||W_down[:, n]||^2 E[(u_n silu'(g_n))^2]``. Both
    expectations are estimated from second moments the calibration already holds:
    ``E[silu(g)^2] ~ E[h^2] / E[u^2]`` and ``E[(u silu'(g))^2] ~ E[h^2] / E[g^2]`` (h = silu(g) * u,
    down_proj's input).

    Args:
        w_gate, w_up: [I, H]; w_down: [H, I].
        gram_x: ``X^T X / M`` [H, H] of the MLP's input; gram_h: ``H^T H / M`` [I, I] of down_proj's input.

    Returns:
        (weights of gate's rows [I], weights of up's rows [I]).

    Example:
        >>> x = torch.randn(256, 16); wg, wu, wd = torch.randn(32, 16), torch.randn(32, 16), torch.randn(16, 32)
        >>> h = torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)
        >>> [r.shape for r in swiglu_row_weights(wg, wu, wd, x.T @ x / 256, h.T @ h / 256)]
        [torch.Size([32]), torch.Size([32])]
    """
    c = w_down.float().square().sum(0) * gram_h.float().diagonal()  # [I]: ||W_down[:, n]||^2 E[h_n^2]

    def second_moment(w):  # E[(x w_n^T)^2] per row n
        w = w.float()
        return ((w @ gram_x.float()) * w).sum(-1).clamp_min(1e-12)
    return c / second_moment(w_gate), c / second_moment(w_up)


def damped(gram: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """``X^T X + damp * mean(diag) * I``: the clip search's cross terms between groups, estimated from a
    finite calibration set, are trusted as GPTQ trusts its Hessian (its damping default, 0.1)."""
    return gram + damp * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)


def _weight_scale(ws, fmt) -> torch.Tensor:
    """Mean over output rows of |W| relative to its group's max, per input channel (the weight side of
    AutoAWQ's "duo scaling": channels whose weights are small within their group can take more scale)."""
    w = torch.cat([w.float() for w in ws])
    g = fmt.group_size or w.shape[1]
    wg = w.abs().reshape(w.shape[0], -1, g)
    return (wg / wg.amax(-1, keepdim=True).clamp_min(1e-10)).reshape(w.shape).mean(0)


def awq_clip_search(w: torch.Tensor, gram: torch.Tensor, fmt: QuantFormat, *, s: torch.Tensor | None = None,
                    grid: int = CLIP_GRID, max_shrink: float = MAX_SHRINK, sweeps: int = SWEEPS,
                    scale_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Search a clipping range per output row and group ("search clip"): shrinking a group's range
    clips its few largest weights and makes the grid finer for all the others, which can lower the
    output error.

    Each (row, group) takes one of ``grid + 1`` shrink factors r, evenly spaced from 1 (no clipping)
    down to ``1 - max_shrink``: the group is rounded on the grid spanning r times its range, with
    the format's whole code range (values past it are clipped). The factors of one row are chosen
    together for that row's whole output error ``||X (w_row - q_row)^T||^2``: first each group on its
    own (the reference implementation's choice), then up to `sweeps` rounds of coordinate descent
    over the groups, each group against the others' current rounding errors.

    Args:
        w: the weight [N, K].
        gram: ``X^T X`` [K, K] of the calibration inputs.
        fmt: the int format the weight will be stored in.
        s: the AWQ scales from `awq_search`, if any: the search is then over ``W * s`` against
            ``x / s``, as `awq_quantize` stores it.
        grid, max_shrink: the candidate shrink factors, as above.
        sweeps: most rounds of coordinate descent (it stops early once no choice changes).
        scale_dtype: the dtype scales are stored in.

    Returns:
        Shrink factors [N, G] fp32 (G groups; 1 per channel), for ``awq_quantize(w, s, fmt, shrink=...)``.

    Example:
        >>> x, w = torch.randn(512, 128), torch.randn(32, 128)
        >>> awq_clip_search(w, x.T @ x, QuantFormat("int", 4, group_size=64)).shape
        torch.Size([32, 2])
    """
    _require_int(fmt)
    s = torch.ones(w.shape[1]) if s is None else s.float()
    return _clip_search(w.float() * s, _scaled_gram(gram.float(), s), fmt, grid, max_shrink, sweeps, scale_dtype)[0]


def _scaled_gram(gram: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The Gram matrix of x / s."""
    return gram / s[:, None] / s[None, :]


def _clip_search(w, gram, fmt, grid, max_shrink, sweeps, scale_dtype):
    """(shrink [N, G], output error per row [N]) for w [N, K] against gram [K, K], rows in chunks."""
    n, k = w.shape
    ratios = [1 - max_shrink * i / grid for i in range(grid + 1)] if grid else [1.0]
    rows = max(1, CHUNK // (len(ratios) * k))
    parts = [_clip_rows(w[i:i + rows], gram, fmt, ratios, sweeps, scale_dtype) for i in range(0, n, rows)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _clip_rows(w, gram, fmt, ratios, sweeps, scale_dtype):
    n, k = w.shape
    n_groups = fmt.groups(k)
    g = k // n_groups
    wg = w.reshape(n, n_groups, g)
    lo, hi = wg.amin(-1), wg.amax(-1)  # [N, G]
    d = torch.stack([_rounded(w, fmt, lo * r, hi * r, scale_dtype) - w for r in ratios])  # [C, N, K]: errors
    d = d.reshape(len(ratios), n, n_groups, g)
    blocks = torch.stack([gram[j * g:(j + 1) * g, j * g:(j + 1) * g] for j in range(n_groups)])  # [G, g, g]
    own = (torch.einsum("cngi,gij->cngj", d, blocks) * d).sum(-1)  # [C, N, G]: each group's error on its own
    choice = own.argmin(0)  # [N, G]
    rows = torch.arange(n)
    cur = torch.stack([d[choice[:, j], rows, j] for j in range(n_groups)], dim=1)  # [N, G, g]
    for _ in range(sweeps if n_groups > 1 else 0):
        changed = False
        for j in range(n_groups):
            cols = slice(j * g, (j + 1) * g)
            others = cur.reshape(n, k) @ gram[:, cols] - cur[:, j] @ blocks[j]  # [N, g]: the other groups' pull
            c = (own[:, :, j] + 2 * (d[:, :, j] * others).sum(-1)).argmin(0)  # [N]
            changed = changed or bool((c != choice[:, j]).any())
            choice[:, j] = c
            cur[:, j] = d[c, rows, j]
        if not changed:
            break
    e = cur.reshape(n, k)
    shrink = torch.tensor(ratios)[choice]
    return shrink, ((e @ gram) * e).sum(-1)


def _rounded(w, fmt, lo, hi, scale_dtype) -> torch.Tensor:
    """w [N, K] rounded on the grid of each (row, group) range [lo, hi] [N, G], dequantized (fp32)."""
    s, z = range_scales(lo, hi, fmt, scale_dtype)
    g = w.shape[1] // s.shape[1]
    zero = z.float() if z is not None else torch.full_like(s, float(1 << (fmt.bits - 1)), dtype=torch.float32)
    q = quantize_int_with(w, fmt, s, z).float()
    return (q - zero.repeat_interleave(g, 1)) * s.float().repeat_interleave(g, 1)


def awq_quantize(w: torch.Tensor, s: torch.Tensor, fmt: QuantFormat, *, shrink: torch.Tensor | None = None,
                 scale_dtype: torch.dtype = torch.bfloat16) -> QuantizedWeight:
    """Round-to-nearest of ``W * s`` (s scales input columns), each (row, group) on the grid of its range
    shrunk by `shrink` if given. The stored layer computes ``(x / s) Q(W * s)^T``: the caller folds 1/s
    into the op producing x.

    Args:
        w: the weight [N, K].
        s: AWQ scales [K] (from `awq_search`).
        fmt: an int format.
        shrink: shrink factors [N, G] of each group's range (from `awq_clip_search`), or None (min-max).
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
    if shrink is None:
        return quantize_rtn(ws, fmt, scale_dtype)
    wg = ws.reshape(ws.shape[0], fmt.groups(ws.shape[1]), -1)
    scales, zeros = range_scales(wg.amin(-1) * shrink, wg.amax(-1) * shrink, fmt, scale_dtype)
    return QuantizedWeight(fmt, pack(fmt, quantize_int_with(ws, fmt, scales, zeros)), scales, zeros)


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
    search. gate and up are scored by their error in down_proj's output (`swiglu_row_weights`)."""

    name: ClassVar[str] = "quantize_awq"
    method: ClassVar[str] = "awq"
    clip: bool = True

    def input_scale(self, g, ctx, x, items):
        st = self.stats(ctx, x)
        gram, x_mean = damped(st.gram()), st.abs_mean
        fmt = entry_format(items[0][1])
        ws, sd = [self.weight(g, n) for n, _ in items], scale_dtype(g, items[0][0])
        tie, rws = head_tie(g, x), self.row_weights(g, ctx, items)
        _, s, alpha, duo = min(((*_search(ws, gram, x_mean, fmt, 20, duo, self.clip, tie, rws, sd), duo)
                                for duo in (False, True)), key=lambda r: r[0])
        if alpha == 0 and not duo:  # s = 1: no scale is best here
            return None
        where = fold_input_scale(g, x, [n for n, _ in items], s)
        if where is None:
            ctx.note(f"{self.name}: %{x.name} ({', '.join(linear_name(n) for n, _ in items)}): its producer cannot "
                     "take a scale; s = 1")
            return None
        return s

    def row_weights(self, g, ctx, items):
        """`swiglu_row_weights` in the items' order when they are the gate and up of ``down(silu_mul(gate,
        up))`` with down_proj's input calibrated; else None (every row's error counts the same)."""
        users = g.users()
        outs = [n.out for n, _ in items]
        prods = [u for u in users.get(outs[0], []) if u.op == "silu_mul"] if len(items) == 2 else []
        if len(prods) != 1 or set(prods[0].inputs) != set(outs):
            return None
        p = prods[0]
        downs = users.get(p.out, [])
        if len(downs) != 1 or downs[0].op != "linear" or p.out.name not in ctx.state.get(STATS, {}):
            return None
        gate, up = sorted((n for n, _ in items), key=lambda n: p.inputs.index(n.out))
        rw = dict(zip((gate, up), swiglu_row_weights(self.weight(g, gate), self.weight(g, up), self.weight(g, downs[0]),
                                                      self.stats(ctx, items[0][0].inputs[0]).gram(),
                                                      self.stats(ctx, p.out).gram())))
        return [rw[n] for n, _ in items]

    def quantize_group(self, g, ctx, x, items, s):
        gram = damped(self.stats(ctx, x).gram())
        out = []
        for n, e in items:
            w, fmt, sd = self.weight(g, n), entry_format(e), scale_dtype(g, n)
            s_n = s if s is not None else torch.ones(w.shape[1])
            shrink = awq_clip_search(w, gram, fmt, s=s_n, scale_dtype=sd) if self.clip else None
            out.append((n, awq_quantize(w, s_n, fmt, shrink=shrink, scale_dtype=sd)))
        return out
