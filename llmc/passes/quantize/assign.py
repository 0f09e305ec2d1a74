"""Phase 2, first pass: the precision plan, one entry per linear (method, format, bits per weight).

Uniform methods give every linear the config's format, except the skipped ones (the LM head by
default: its error lands straight on the logits) and layers the format cannot take (a group size
that does not divide the input features falls back to per channel, said in the plan's note). `mixed`
plans candidates here; mixed.py chooses among them once calibration has measured each linear (a layer int4
cannot take is planned at int8, so that mixed still weighs int8 against the model dtype for it).
The plan is JSON in `graph.meta["quant_plan"]`: saved in the artifact and shown by `llmc inspect`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.ir.quant import QuantFormat
from llmc.passes.manager import Pass, PassContext, PassResult, register_pass
from llmc.passes.quantize.config import QuantConfig
from llmc.passes.quantize.materialize import PLAN, linear_name, plan_entry, quantizable_linears


def is_lm_head(g, node) -> bool:
    """The linear that makes the logits: its weight is the (tied) embedding table or it is vocab-wide."""
    w = node.inputs[1]
    vocab = g.meta.get("vocab_size")
    tied = any(n.op == "embedding" and n.inputs[0] is w for n in g.nodes)
    return tied or (vocab is not None and g.weights[w.name].shape[0] == vocab)


MIXED_FALLBACK = QuantFormat("int", 8, 0)  # mixed's candidate for a layer int4 cannot take


def fit_format(fmt: QuantFormat, k: int) -> tuple[QuantFormat | None, str]:
    """`fmt` as a layer with k input features can take it (None: it cannot, and stays dense), and a note
    when it had to change."""
    if fmt.kind == "int" and fmt.bits == 4 and k % 2:
        return None, f"int4 needs an even number of input features, not {k}: kept dense"
    if fmt.kind == "int" and fmt.group_size and k % fmt.group_size:
        per_channel = QuantFormat(fmt.kind, fmt.bits, 0, fmt.has_zeros)
        return per_channel, f"group size {fmt.group_size} does not divide {k} input features: per channel"
    return fmt, ""


@register_pass
@dataclass
class AssignPrecision(Pass):
    name: ClassVar[str] = "assign_precision"
    config: QuantConfig = QuantConfig()

    def run(self, g, ctx: PassContext):
        cfg = self.config
        linears = {}
        for n in quantizable_linears(g):
            name = linear_name(n)
            w = g.weights[n.inputs[1].name]
            skipped = [s for s in cfg.skip if name.endswith(s) or (s == "lm_head" and is_lm_head(g, n))]
            if skipped:
                linears[name] = plan_entry(cfg.method, None, w, f"skipped ({skipped[0]})")
                continue
            fmt, note = fit_format(cfg.format(), w.shape[1])
            if fmt is None and cfg.method == "mixed":
                fmt, note = MIXED_FALLBACK, note.replace("kept dense", "mixed weighs int8 and the model dtype")
            if note:
                ctx.note(f"{self.name}: {name}: {note}")
            linears[name] = plan_entry(cfg.method, fmt, w, note)
        g.meta[PLAN] = {"method": cfg.method, "config": cfg.to_json(), "linears": linears,
                        "avg_bits": average_bits(linears)}
        return PassResult(g, True, {"planned": sum(1 for e in linears.values() if e["format"])})


def average_bits(linears: dict) -> float:
    """Average bits per weight over the quantized linears (scales and zero points included)."""
    q = [e for e in linears.values() if e["format"]]
    total = sum(e["params"] for e in q)
    return round(sum(e["bits"] * e["params"] for e in q) / total, 4) if total else 0.0
