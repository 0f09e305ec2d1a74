"""Vertical fusion: chains and trees of elementwise ops become one `fused` region (one kernel).

A region grows in topological order: a node joins the region of an elementwise producer unless a
value of that region was already consumed outside it (placing the fused node at its last member
would then break that consumer). Every intermediate that stays inside saves one write and one
read of the tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.ir.ops import family, is_elementwise
from llmc.passes.manager import Pass, PassResult, register_pass


def _fusible(n) -> bool:
    return is_elementwise(n.op) or n.op == "constant"


def _sink_movement(g) -> None:
    """Each movement op (unsqueeze, reshape, ...) of an elementwise op's output moved down to just before its
    first reader. A region closes when a node outside it reads one of its values, so a view taken between
    two elementwise ops that share an input (an exporter may order cos, its cast and view, then sin) would
    split what can be one kernel; moved to its reader, it no longer stands between them."""
    movement = family("movement")
    for n in reversed(list(g.nodes)):
        src = n.inputs[0].producer if n.inputs else None
        if n.op not in movement or src is None or not _fusible(src) or n.outputs[0] in g.outputs:
            continue
        readers = [i for i, u in enumerate(g.nodes) if any(v in u.inputs for v in n.outputs)]
        at = g.nodes.index(n)
        if readers and min(readers) > at + 1:
            g.nodes.remove(n)
            g.nodes.insert(min(readers) - 1, n)


@register_pass
@dataclass
class FuseElementwise(Pass):
    name: ClassVar[str] = "fuse_elementwise"
    max_ops: int = 64

    def run(self, g, ctx):
        _sink_movement(g)
        region_of: dict[int, list] = {}
        escaped: set[int] = set()
        regions: list[list] = []
        for n in g.nodes:
            srcs = {id(region_of[id(v.producer)]): region_of[id(v.producer)] for v in n.inputs
                    if v.producer is not None and id(v.producer) in region_of}
            if not _fusible(n):
                escaped.update(srcs)  # consumed outside: those regions are closed
                continue
            target = None
            for rid, r in srcs.items():
                if rid in escaped:
                    ctx.explain.append(f"{self.name}: {n.op} -> %{n.outputs[0].name} not joined to a region "
                                       "whose value is used before it")
                elif len(r) >= self.max_ops:
                    ctx.explain.append(f"{self.name}: region full ({self.max_ops} ops) at %{n.outputs[0].name}")
                elif target is None:
                    target = r
            for rid in srcs:
                if srcs[rid] is not target:
                    escaped.add(rid)
            if target is None:
                target = []
                regions.append(target)
            target.append(n)
            region_of[id(n)] = target
        made = 0
        for r in regions:
            if sum(1 for n in r if n.op != "constant") >= 2:
                self._outline(g, r)
                made += 1
        return PassResult(g, made > 0, {"regions": made})

    @staticmethod
    def _outline(g, region) -> None:
        members = set(map(id, region))
        inside = {v for n in region for v in n.outputs}
        ext, names = [], {}
        body = []
        for n in region:
            for v in n.inputs:
                if v not in inside and v not in names:
                    names[v] = f"in{len(ext)}"
                    ext.append(v)
            for v in n.outputs:
                names[v] = f"v{len(body)}"
            body.append([names[n.outputs[0]], n.op, [names[v] for v in n.inputs], dict(n.attrs)])
        users = g.users()
        outs = [v for n in region for v in n.outputs
                if v in g.outputs or any(id(u) not in members for u in users.get(v, []))]
        last = region[-1]
        node = g.make_node("fused", ext, {"kind": "elementwise", "body": body, "outputs": [names[v] for v in outs]},
                           meta=dict(last.meta))
        g.insert_before(last, node)
        for old, new in zip(outs, node.outputs):
            g.replace_uses(old, new)
        g.remove_nodes(region)
