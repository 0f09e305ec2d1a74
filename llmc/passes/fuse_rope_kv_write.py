"""Vertical fusion: rope on q and k and the KV-cache write become one kernel (`rope_kv_write`),
and the attention reads the cache (`attend_paged`).

Unfused, roped k is written to memory, read back and written again into the cache; fused, k and v
are read once and written once, straight into their cache slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.passes.manager import Pass, register_pass
from llmc.passes.pattern import P, RewritePass, RewriteRule


def _rule(ctx) -> RewriteRule:
    q = P.op("rope")(P.any("q"), P.any("cos"), P.any("sin"))
    k = P.op("rope")(P.any("k"), P.any("cos"), P.any("sin"))
    root = P.op("paged_attention").any_args()

    def rewrite(b, m):
        n = m.root.producer
        mq, mk = q(n.inputs[0]), k(n.inputs[1])
        if mq is None or mk is None or mq["cos"] is not mk["cos"] or mq["sin"] is not mk["sin"]:
            ctx.explain.append(f"fuse_rope_kv_write: declined %{m.root.name}: q and k are not roped "
                               "with one cos/sin pair")
            return None
        cache, qsl, lens, tables, slots = n.inputs[3:8]
        scale = n.inputs[8:]
        qr = b.call("rope_kv_write", mq["q"], mk["k"], n.inputs[2], mq["cos"], mq["sin"], cache, slots, *scale)
        return b.call("attend_paged", qr, cache, qsl, lens, tables, *scale, **n.attrs)

    return RewriteRule("rope_kv_write", root, rewrite)


@register_pass
@dataclass
class FuseRopeKVWrite(RewritePass, Pass):
    name: ClassVar[str] = "fuse_rope_kv_write"

    def rules(self, ctx):
        return [_rule(ctx)]
