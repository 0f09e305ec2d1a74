"""Horizontal fusion: linears that read the same input become one linear over concatenated weights.

q/k/v projections and gate/up projections each become one GEMM: the input is read once and one
larger GEMM runs closer to peak than three small ones. Weights are concatenated at compile time;
slices hand each consumer its part.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from llmc.ir.ops import has_trait
from llmc.passes.manager import Pass, PassResult, register_pass


def _signature(g, n) -> tuple:
    """Linears fuse when this agrees: the op, its attributes (a quantized format's bits, group size,
    zero points) and each param operand's dtype and trailing dims (all but the output features)."""
    params = tuple((g.weights[v.name].dtype, tuple(g.weights[v.name].shape[1:])) for v in n.inputs[1:])
    return n.op, tuple(sorted((k, str(v)) for k, v in n.attrs.items())), params


@register_pass
@dataclass
class FuseParallelLinears(Pass):
    """Fuses the ops with the `linear` trait (dense and quantized): every param operand of such an
    op has the output features as its first dim, so the fused op's operands are concatenations."""

    name: ClassVar[str] = "fuse_parallel_linears"
    max_group: int = 4

    def run(self, g, ctx):
        users = g.users()
        fused = 0
        for x, consumers in list(users.items()):
            lins = [n for n in consumers if has_trait(n.op, "linear") and n.inputs[0] is x and n in g.nodes
                    and all(v.kind == "param" for v in n.inputs[1:])]
            if len(lins) < 2:
                continue
            groups: dict[tuple, list] = {}
            for n in lins:
                groups.setdefault(_signature(g, n), []).append(n)
            if len(groups) > 1:
                ctx.explain.append(f"{self.name}: linears on %{x.name} split by op, format or weight dtype into "
                                   f"groups of {sorted(len(v) for v in groups.values())}")
            for lins in groups.values():
                for i in range(0, len(lins), self.max_group):
                    group = lins[i:i + self.max_group]
                    if len(group) >= 2:
                        self._fuse(g, x, group)
                        fused += 1
        return PassResult(g, fused > 0, {"groups": fused})

    @staticmethod
    def _fuse(g, x, group):
        first = min(group, key=g.nodes.index)
        base = first.inputs[1].name.rsplit(".", 2)[0]
        ins = [x]
        for j, v in enumerate(first.inputs[1:], start=1):
            role = v.name.rsplit(".", 1)[-1]
            t = torch.cat([g.weights[n.inputs[j].name] for n in group], dim=0).contiguous()
            ins.append(g.add_param(g.fresh(f"{base}.fused_{role}"), t))
        big = g.make_node(first.op, ins, dict(first.attrs), meta=dict(first.meta))
        g.insert_before(first, big)
        start = 0
        for n in group:
            width = n.out.type.shape[-1]
            part = g.make_node("slice", [big.out], {"dim": big.out.type.rank - 1, "start": start,
                                                    "end": start + width, "step": 1}, meta=dict(n.meta))
            g.insert_before(first, part)
            g.replace_uses(n.out, part.out)
            start += width
        g.remove_nodes(group)
        g.remove_unused_params()
