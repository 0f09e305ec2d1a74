"""Fold constant subgraphs into weights or literals, and drop algebraic identities (x*1, x+0, casts to the same dtype)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.ir.ops import RefEnv, get_op, has_trait
from llmc.ir.types import TensorType
from llmc.passes.manager import Pass, PassResult, register_pass
from llmc.passes.pattern import P, RewriteRule, apply_rewrites, dead_code

def _identity_rules() -> list[RewriteRule]:
    x = P.any("x")
    return [
        RewriteRule("mul_one", P.op("mul")(x, P.const(1)), lambda b, m: _same_type(m.root, m["x"])),
        RewriteRule("add_zero", P.op("add")(x, P.const(0)), lambda b, m: _same_type(m.root, m["x"])),
        RewriteRule("cast_noop", P.op("cast")(x), lambda b, m: _same_type(m.root, m["x"])),
    ]


def _same_type(root, x):
    # an identity only when it changes neither the shape (no broadcast) nor the dtype
    return x if root.type.shape == x.type.shape and root.type.dtype == x.type.dtype else None


@register_pass
@dataclass
class FoldConstants(Pass):
    """Evaluate nodes whose operands are all literals or weights, up to `max_elements` per result."""

    name: ClassVar[str] = "fold_constants"
    max_elements: int = 1 << 24

    def run(self, graph, ctx):
        stats = apply_rewrites(graph, _identity_rules())
        folded = 0
        const_vals = {}
        for node in list(graph.nodes):
            # "no_fold" ops are the model's real work (folding would only bloat weights) or packed
            # formats (folding would dequantize them back into dense weights)
            if has_trait(node.op, "no_fold") or not node.inputs and node.op != "constant":
                continue
            if node.op == "constant":
                const_vals[node.out] = get_op("constant").ref([], node.attrs, RefEnv())
                continue
            if not all(v.kind == "param" or v in const_vals for v in node.inputs):
                continue
            if any(not isinstance(d, int) for v in node.outputs for d in v.type.shape):
                continue
            if any(isinstance(v.type.numel(), int) and v.type.numel() > self.max_elements for v in node.outputs):
                continue
            args = [graph.weights[v.name] if v.kind == "param" else const_vals[v] for v in node.inputs]
            out = get_op(node.op).ref(args, node.attrs, RefEnv())
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for v, t in zip(node.outputs, outs):
                p = graph.add_param(graph.fresh("folded."), t.contiguous(), TensorType(tuple(t.shape), v.type.dtype))
                graph.replace_uses(v, p)
            folded += 1
        dead_code(graph)
        graph.remove_unused_params()
        stats["folded"] = folded
        return PassResult(graph, bool(folded or any(stats.values())), stats)
