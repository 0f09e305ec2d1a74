"""Vertical fusion: what is applied to a linear's output runs in the matmul's epilogue.

Two rules:
  * an activation (silu, relu, gelu) of a linear's output: `linear_act` (a qlinear carries it as an
    attribute). The activation then costs no extra pass over the [T, N] output (one write instead of a
    write, a read and a write).
  * the SwiGLU product of a fused gate/up projection, silu_mul(y[..., :I], y[..., I:]) of y = linear(x, w):
    `linear_silu_mul`. The matmul loads a gate row tile and the matching up row tile of w at each step,
    keeps two accumulators and writes silu(gate) * up, [T, I]: the [T, 2I] projection is never stored or
    read back and a layer launches one kernel fewer. Gate and up are rounded to x's dtype before the
    product, as the unfused projection stores them, so the result is the unfused one's. Where the tuner
    hands a step to cuBLAS, the lowering runs cuBLAS and the product kernel, as unfused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.passes.fuse_act_quant import CODE_KINDS
from llmc.passes.fuse_linear_prologue import FLOAT_DTYPES  # the dtypes the generated matmul takes
from llmc.passes.manager import Pass, PassContext, register_pass
from llmc.passes.pattern import P, RewritePass, RewriteRule, apply_rewrites

_ACTS = {("silu", None): "silu", ("relu", None): "relu", ("gelu", "none"): "gelu", ("gelu", "tanh"): "gelu_tanh"}


def _act_rule(ctx) -> RewriteRule:
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


def _half(node, lo: bool) -> bool:
    """Whether a slice node takes the low (or high) half of its input's last dim, step 1."""
    a, t = node.attrs, node.inputs[0].type
    width = t.shape[-1]
    if a.get("dim") % t.rank != t.rank - 1 or a.get("step", 1) != 1 or not isinstance(width, int) or width % 2:
        return False
    return (a.get("start"), a.get("end")) == ((0, width // 2) if lo else (width // 2, width))


def _swiglu_rule(ctx) -> RewriteRule:
    lin = (P.op("linear")(P.any("x"), P.param("w")) | P.op("linear")(P.any("x"), P.param("w"), P.param("b"))).named("y")
    root = P.op("silu_mul")(P.op("slice")(lin).named("gate"), P.op("slice")(lin).named("up"))

    def rewrite(b, m):
        y, gate, up = m["y"], m.node("gate"), m.node("up")
        if y.type.dtype not in FLOAT_DTYPES or not (_half(gate, True) and _half(up, False)):
            return None
        readers = [n for n in b.graph.nodes if y in n.inputs]
        if set(readers) != {gate, up} or y in b.graph.outputs or not b.sole_reader(m["gate"]) \
                or not b.sole_reader(m["up"]):
            ctx.explain.append(f"fuse_linear_epilogue: declined %{y.name}: the gate/up projection or a half of it "
                               "has other users")
            return None
        if any(m.root in n.inputs and n.op == "qlinear" and n.attrs["kind"] in CODE_KINDS for n in b.graph.nodes):
            # a W8A8 / FP8 linear reads the product: fuse_act_quant makes its codes in the product's kernel
            ctx.explain.append(f"fuse_linear_epilogue: declined %{y.name}: a {'/'.join(CODE_KINDS)} linear reads "
                               "the product")
            return None
        return b.call("linear_silu_mul", *y.producer.inputs)

    return RewriteRule("linear_silu_mul", root, rewrite)


def fuse_swiglu_epilogues(graph) -> int:
    """The SwiGLU rule alone, on `graph` in place: how many products moved into their projection's epilogue.
    A tensor-parallel shard runs it after the sharding, which unfolds them to split the MLP
    (llmc/ir/sharding.py): each rank's gate/up projection holds its rows of both halves, so its product
    moves back into its epilogue."""
    return apply_rewrites(graph, [_swiglu_rule(PassContext())])["linear_silu_mul"]


@register_pass
@dataclass
class FuseLinearEpilogue(RewritePass, Pass):
    name: ClassVar[str] = "fuse_linear_epilogue"

    def rules(self, ctx):
        return [_act_rule(ctx), _swiglu_rule(ctx)]
