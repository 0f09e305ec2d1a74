"""Lift primitive subgraphs to llmc's LLM ops: rms_norm, rope (rotate-half), silu_mul."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.passes.manager import Pass, register_pass
from llmc.passes.pattern import P, RewritePass, RewriteRule


def _last_dim(v_rank):
    return lambda dims: list(dims) in ([-1], [v_rank - 1]) if v_rank else False


def rms_norm_rule() -> RewriteRule:
    hs = P.maybe_cast(P.any("x")).named("hs")
    var = P.op("mean", keepdim=True)(P.op("pow")(hs, P.const(2)))
    normed = P.op("mul")(hs, P.op("rsqrt")(P.op("add")(var, P.const(name="eps"))))
    root = P.op("mul")(P.any("w").rank(1), P.maybe_cast(normed.named("normed")).named("back"))

    def rewrite(b, m):
        x, hs_v = m["x"], m["hs"]
        mean = m["normed"].producer.inputs[1].producer.inputs[0].producer.inputs[0].producer
        if hs_v.type.dtype != "f32" or list(mean.attrs["dims"]) not in ([-1], [hs_v.type.rank - 1]):
            return None
        if m["back"].type.dtype != x.type.dtype:  # Llama casts back to the input dtype before the weight
            return None
        return b.call("rms_norm", x, m["w"], eps=float(m.const("eps")), weight_first_cast=True)

    return RewriteRule("rms_norm", root, rewrite)


def rope_rule() -> RewriteRule:
    x = P.any("x")
    hi = P.op("slice")(x).named("hi")
    lo = P.op("slice", start=0)(x).named("lo")
    rot = P.op("concat")(P.op("neg")(hi), lo)
    root = P.op("add")(P.op("mul")(x, P.any("cos")), P.op("mul")(rot, P.any("sin")))

    def rewrite(b, m):
        xv = m["x"]
        d, half = xv.type.rank - 1, xv.type.shape[-1]
        if not isinstance(half, int) or half % 2:
            return None
        half //= 2
        ha, la = m.node("hi").attrs, m.node("lo").attrs
        cat = m.node("hi")  # the concat must be along the last dim and split exactly in half
        ok = (ha["dim"] == d and ha["start"] == half and ha["end"] in (None, 2 * half) and ha["step"] == 1
              and la["dim"] == d and la["end"] == half and la["step"] == 1)
        if not ok or m.root.type.shape != xv.type.shape:
            return None
        return b.call("rope", xv, m["cos"], m["sin"])

    return RewriteRule("rope", root, rewrite)


def silu_mul_rule() -> RewriteRule:
    root = P.op("mul")(P.op("silu")(P.any("gate")), P.any("up"))

    def rewrite(b, m):
        if m["gate"].type.shape != m["up"].type.shape:
            return None
        return b.call("silu_mul", m["gate"], m["up"])

    return RewriteRule("silu_mul", root, rewrite)


@register_pass
@dataclass
class LiftPatterns(RewritePass, Pass):
    """Recognise the LLM building blocks so that later passes and codegen see one op for each."""

    name: ClassVar[str] = "lift_patterns"
    rms_norm: bool = True
    rope: bool = True
    silu_mul: bool = True

    def rules(self, ctx):
        return [r() for flag, r in ((self.rms_norm, rms_norm_rule), (self.rope, rope_rule),
                                    (self.silu_mul, silu_mul_rule)) if flag]
