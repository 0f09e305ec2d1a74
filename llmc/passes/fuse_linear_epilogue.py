"""Vertical fusion: an activation applied to a linear's output runs in the matmul's epilogue.

The activation then costs no extra pass over the [T, N] output (one write instead of a write, a
read and a write).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.passes.manager import Pass, register_pass
from llmc.passes.pattern import P, RewritePass, RewriteRule

_ACTS = {("silu", None): "silu", ("relu", None): "relu", ("gelu", "none"): "gelu", ("gelu", "tanh"): "gelu_tanh"}


def _rule(ctx) -> RewriteRule:
    root = P.op("silu", "relu", "gelu")(P.op("linear", "qlinear").any_args().named("lin"))

    def rewrite(b, m):
        if not b.sole_reader(m["lin"]):
            ctx.explain.append(f"fuse_linear_epilogue: declined %{m['lin'].name}: its output has other users")
            return None
        act = m.root.producer
        kind = _ACTS.get((act.op, act.attrs.get("approximate")))
        lin = m["lin"].producer
        if lin.op == "qlinear":  # a quantized linear carries its epilogue as an attribute
            return None if lin.attrs["act"] else b.call("qlinear", *lin.inputs, **{**lin.attrs, "act": kind})
        return b.call("linear_act", *lin.inputs, act=kind)

    return RewriteRule("linear_act", root, rewrite)


@register_pass
@dataclass
class FuseLinearEpilogue(RewritePass, Pass):
    name: ClassVar[str] = "fuse_linear_epilogue"

    def rules(self, ctx):
        return [_rule(ctx)]
