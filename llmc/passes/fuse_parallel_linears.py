"""Horizontal fusion: linears that read the same input become one linear over concatenated weights.

q/k/v projections and gate/up projections each become one GEMM: the input is read once and one
larger GEMM runs closer to peak than three small ones. Weights are concatenated at compile time;
slices hand each consumer its part.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from llmc.passes.manager import Pass, PassResult, register_pass


@register_pass
@dataclass
class FuseParallelLinears(Pass):
    name: ClassVar[str] = "fuse_parallel_linears"
    max_group: int = 4

    def run(self, g, ctx):
        users = g.users()
        fused = 0
        for x, consumers in list(users.items()):
            lins = [n for n in consumers if n.op == "linear" and n.inputs[0] is x and n in g.nodes]
            if len(lins) < 2:
                continue
            lins = [n for n in lins if all(v.kind == "param" for v in n.inputs[1:])]
            if len({len(n.inputs) for n in lins}) > 1:
                ctx.explain.append(f"{self.name}: declined linears on %{x.name}: some have a bias, some not")
                lins = [n for n in lins if len(n.inputs) == 2]
            dtypes = {g.weights[n.inputs[1].name].dtype for n in lins}
            if len(lins) < 2 or len(dtypes) > 1:
                if len(lins) >= 2:
                    ctx.explain.append(f"{self.name}: declined linears on %{x.name}: weight dtypes differ")
                continue
            for i in range(0, len(lins), self.max_group):
                group = lins[i:i + self.max_group]
                if len(group) >= 2:
                    self._fuse(g, x, group)
                    fused += 1
        return PassResult(g, fused > 0, {"groups": fused})

    @staticmethod
    def _fuse(g, x, group):
        ws = [g.weights[n.inputs[1].name] for n in group]
        name = g.fresh(group[0].inputs[1].name.rsplit(".", 2)[0] + ".fused_weight")
        w = g.add_param(name, torch.cat(ws, dim=0).contiguous())
        ins = [x, w]
        if len(group[0].inputs) > 2:
            b = g.add_param(g.fresh(name.replace("weight", "bias")),
                            torch.cat([g.weights[n.inputs[2].name] for n in group]).contiguous())
            ins.append(b)
        first = min(group, key=g.nodes.index)
        big = g.make_node("linear", ins, {}, meta=dict(first.meta))
        g.insert_before(first, big)
        start = 0
        for n, wt in zip(group, ws):
            part = g.make_node("slice", [big.out], {"dim": big.out.type.rank - 1, "start": start,
                                                    "end": start + wt.shape[0], "step": 1}, meta=dict(n.meta))
            g.insert_before(first, part)
            g.replace_uses(n.out, part.out)
            start += wt.shape[0]
        g.remove_nodes(group)
        g.remove_unused_params()
