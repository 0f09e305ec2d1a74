"""Vertical fusion: the residual add and the following rms_norm become one `add_rms_norm`.

Unfused, the sum h = a + b is written, then read back by the norm: per token 3 reads + 2 writes of
the hidden vector. Fused: 2 reads + 2 writes (h for the residual stream, and the normed output).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.passes.manager import Pass, register_pass
from llmc.passes.pattern import P, RewritePass, RewriteRule


def _rule(ctx) -> RewriteRule:
    root = P.op("rms_norm")(P.op("add")(P.any("a"), P.any("b")).named("h"), P.any("w"))

    def rewrite(b, m):
        a, bb = m["a"], m["b"]
        if a.type.shape != bb.type.shape or a.type.dtype != bb.type.dtype:
            ctx.explain.append(f"fuse_add_rmsnorm: declined %{m['h'].name}: the add broadcasts or mixes dtypes")
            return None
        node = b.node("add_rms_norm", [a, bb, m["w"]], dict(m.root.producer.attrs))
        b.graph.replace_uses(m["h"], node.outputs[1])
        return node.outputs[0]

    return RewriteRule("add_rms_norm", root, rewrite)


@register_pass
@dataclass
class FuseAddRmsNorm(RewritePass, Pass):
    name: ClassVar[str] = "fuse_add_rmsnorm"

    def rules(self, ctx):
        return [_rule(ctx)]
