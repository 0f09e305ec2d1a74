"""The inverse of the `fuse_act_quant` pass, for the runtime (which imports no pass): each op that made
W8A8 / FP8 activation codes for the linears after it (`rms_norm_quant`, `add_rms_norm_quant`,
`silu_mul_quant`) back to its plain op, and their `qlinear_codes` readers back to `qlinear`s that
quantize their own input. Exact: the fused ops are defined as that composition.

Tensor parallelism shards the unfused form (llmc/ir/sharding.py): a row-parallel linear's input is
a slice of the row on each rank, whose codes then take that slice's own per-token scale.
"""
from __future__ import annotations

from llmc.ir.graph import Graph

PLAIN = {"rms_norm_quant": "rms_norm", "add_rms_norm_quant": "add_rms_norm", "silu_mul_quant": "silu_mul"}


def unfuse_act_quant(g: Graph) -> int:
    """Rewrite `g` in place; returns how many producers were unfused."""
    users, count = g.users(), 0
    for q in [n for n in g.nodes if n.op in PLAIN]:
        attrs = {k: v for k, v in q.attrs.items() if k != "kind"}
        plain = g.make_node(PLAIN[q.op], q.inputs, attrs, meta=q.meta)
        g.insert_before(q, plain)
        if q.op == "add_rms_norm_quant":
            g.replace_uses(q.outputs[2], plain.outputs[1])
        for r in users.get(q.outputs[0], []):
            if r.op != "qlinear_codes":
                raise ValueError(f"unfuse_act_quant: %{q.outputs[0].name} is read by {r.op}, not qlinear_codes")
            attrs = {k: v for k, v in r.attrs.items() if k != "dtype"}
            lin = g.make_node("qlinear", [plain.outputs[0], *r.inputs[2:]], attrs, meta=r.meta)
            g.insert_before(r, lin)
            g.replace_uses(r.outputs[0], lin.outputs[0])
            g.remove_nodes([r])
        g.remove_nodes([q])
        count += 1
    return count
