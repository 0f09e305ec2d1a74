"""Automatic per-layer mixed precision under a bits budget.

Every group of linears that read one input (q/k/v, gate/up, o, down: a group shares a format, so
that it still fuses into one GEMM) gets one of three candidates: int4 g128, int8 per channel (both
by GPTQ) or the model dtype; int4 is no candidate for a group with a member it cannot take (an odd
number of input features). Its sensitivity to each is measured on the calibration data as the
output error the quantized weight causes, ``E = mean_t ||x_t (W - Q)^T||^2 = tr(D H D^T) / 2`` with
``H = 2 X^T X / tokens`` (GPTQ's Hessian). The choice minimises the summed error subject to the
average bits per weight (scales included, over all planned linears) staying within the budget:
starting from int4 everywhere, the upgrade with the most error removed per extra bit is taken while
it fits (the greedy solution of this multiple-choice knapsack, exact on its convex hull).
The chosen plan, with each group's measured errors, replaces the candidates in the artifact's plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from llmc.ir.quant import QuantFormat
from llmc.passes.manager import PassResult, register_pass
from llmc.passes.quantize.assign import fit_format
from llmc.passes.quantize.gptq import gptq_quantize
from llmc.passes.quantize.materialize import (QuantizePass, by_input, linear_name, plan_entry, planned,
                                              replace_with_qlinear, scale_dtype, weight_bits)

CANDIDATES = (QuantFormat("int", 4, 128), QuantFormat("int", 8, 0), None)  # None: the model dtype


def output_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    d = (w.float() - q.float()).double()
    return float(((d @ h.double()) * d).sum() / 2)


def choose(groups: list[dict], budget: float) -> list[int]:
    """The candidate index per group minimising the summed error within `budget` average bits.

    Each group: {"params": n, "bits": [bits per candidate], "error": [error per candidate]},
    candidates in increasing bits."""
    pick = [0] * len(groups)
    total = sum(g["params"] for g in groups)
    used = sum(g["bits"][0] * g["params"] for g in groups)
    while True:
        best, best_gain = None, 0.0
        for i, g in enumerate(groups):
            j = pick[i]
            for nxt in range(j + 1, len(g["bits"])):  # the best next step on this group's hull
                cost = (g["bits"][nxt] - g["bits"][j]) * g["params"]
                if used + cost > budget * total + 1e-6:
                    continue
                gain = (g["error"][j] - g["error"][nxt]) / max(cost, 1e-12)
                if gain > best_gain:
                    best, best_gain = (i, nxt, cost), gain
        if best is None:
            return pick
        i, nxt, cost = best
        pick[i], used = nxt, used + cost


@register_pass
@dataclass
class MixedPrecision(QuantizePass):
    name: ClassVar[str] = "quantize_mixed"
    method: ClassVar[str] = "mixed"

    def run(self, g, ctx):
        groups = by_input(planned(g, self.method))
        if not groups:
            return PassResult(g, False)
        plan = g.meta["quant_plan"]
        measured, units = [], []
        status = ctx.state.get("status") or (lambda msg: None)
        for k, (x, items) in enumerate(groups.items()):
            status(f"pass {self.name}: measuring input {k + 1}/{len(groups)} at each precision")
            h = self.stats(ctx, x).gptq_hessian()
            options = []
            for cand in CANDIDATES:
                if cand is None:
                    options.append((None, [None] * len(items), 0.0))
                    continue
                fmts = [fit_format(cand, self.weight(g, n).shape[1])[0] for n, _ in items]
                if None in fmts:  # a member cannot take it (int4 over an odd width): not a choice for the group
                    continue
                qws, err = [], 0.0
                for (n, _), fmt in zip(items, fmts):
                    w = self.weight(g, n)
                    qw = gptq_quantize(w, h, fmt, damp=self.config.damp, act_order=self.config.act_order,
                                       scale_dtype=scale_dtype(g, n), search=self.config.scale_search)
                    qws.append(qw)
                    err += output_error(w, qw.dequantize(), h)
                options.append((cand, qws, err))
            ws = [self.weight(g, n) for n, _ in items]
            params = sum(w.numel() for w in ws)
            bits = [sum(weight_bits(None if q is None else q.fmt, w) * w.numel() for w, q in zip(ws, qws)) / params
                    for _, qws, _ in options]
            measured.append(options)
            units.append({"params": params, "bits": bits, "error": [o[2] for o in options]})
        pick = choose(units, self.config.bits_budget)
        total = sum(u["params"] for u in units)
        floor, top = (sum(u["bits"][k] * u["params"] for u in units) / total for k in (0, -1))
        budget = self.config.bits_budget
        if budget < floor:
            ctx.note(f"{self.name}: --bits-budget {budget:g} is below the cheapest plan's {floor:.3f} bits per weight "
                     "(int4 wherever a layer takes it, int8 where not, scales included); that plan is used")
        elif budget >= top:
            ctx.note(f"{self.name}: --bits-budget {budget:g} affords the model dtype's {top:.3f} bits per weight: "
                     "every linear stays unquantized")
        done = 0
        for items, options, j in zip(groups.values(), measured, pick):
            _, qws, _ = options[j]
            errors = {("dense" if c is None else c.label): round(err, 6) for c, _, err in options}  # the group's
            for (n, _), qw in zip(items, qws):
                name = linear_name(n)
                note = "mixed: " + ("kept in the model dtype" if qw is None else qw.fmt.label)
                plan["linears"][name] = {**plan_entry(self.method, None if qw is None else qw.fmt, self.weight(g, n), note),
                                         "errors": errors}
                if qw is None:
                    continue
                replace_with_qlinear(g, n, qw)
                done += 1
        chosen = [e for e in plan["linears"].values() if not e["note"].startswith("skipped")]
        plan["avg_bits"] = round(sum(e["bits"] * e["params"] for e in chosen) / sum(e["params"] for e in chosen), 4)
        g.remove_unused_params()
        return PassResult(g, True, {"quantized": done})
