"""Lift primitive subgraphs to llmc's LLM ops: rms_norm, rope (rotate-half), silu_mul; and the rotary
angles' concat(f, f) folded into their frequency vector."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

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


def rope_angles_rule() -> RewriteRule:
    """concat(f, f) along the last dim of the rotary angles f = a * inv_freq (a: positions, last dim 1;
    inv_freq: a weight vector) becomes a * concat(inv_freq, inv_freq), the doubled vector made at compile
    time. Each angle is the same product, so the values are the same bits; the concat kernel goes, and
    cos and sin of the angles then fuse with the product into one elementwise kernel (fuse_elementwise)."""
    f = P.op("mul")(P.any("a"), P.param("p").rank(1)).named("f")
    root = P.op("concat")(f, f)

    def rewrite(b, m):
        a, p, cat = m["a"], m["p"], m.root.producer
        rank = m["f"].type.rank
        if cat.attrs["dim"] % rank != rank - 1 or a.type.shape[-1] != 1 or m["f"].type.dtype != p.type.dtype:
            return None
        w = b.graph.weights[p.name]
        return b.call("mul", a, b.param(p.name + ".doubled", torch.cat([w, w])))

    return RewriteRule("rope_angles", root, rewrite)


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
    rope_angles: bool = True

    def rules(self, ctx):
        return [r() for flag, r in ((self.rms_norm, rms_norm_rule), (self.rope, rope_rule),
                                    (self.silu_mul, silu_mul_rule), (self.rope_angles, rope_angles_rule)) if flag]
