"""Vertical fusion: the SwiGLU product silu(gate) * up runs in the prologue of the linear that reads it.

Unfused, the product is a kernel of its own between the gate/up projection and the down projection: it
reads gate and up and writes the product, which the down projection then reads back. Fused
(`silu_mul_linear`), the down projection's generated matmul loads gate and up tiles where it loaded
its input and forms the product in registers, rounded to the activation dtype exactly as the unfused
kernel stores it, so the result is the same bit for bit, a layer launches one kernel fewer and no [T, I]
product is stored (a quarter less activation memory at Llama's MLP width). Where the tuner hands a step
to cuBLAS, the lowering runs the product kernel and cuBLAS as unfused.

Opt-in (`--pass fuse_linear_prologue`), not in the default pipeline: on the H200 the prologue kernel, which
recomputes the product for every output tile and cannot stream its x tiles asynchronously, was timed 3.8-4.3x
slower than the product kernel plus cuBLAS at every decode bucket (8B and 1B down projections), so the tuner
chose cuBLAS there, where the unfused graph runs the faster generated GEMV (benchmarks/RESULTS.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.passes.manager import Pass, register_pass
from llmc.passes.pattern import P, RewritePass, RewriteRule

FLOAT_DTYPES = ("bf16", "f16", "f32")


def _rule(ctx) -> RewriteRule:
    act = P.op("silu_mul")(P.any("gate"), P.any("up")).named("act")
    root = P.op("linear")(act, P.param("w")) | P.op("linear")(act, P.param("w"), P.param("b"))

    def rewrite(b, m):
        g, u = m["gate"], m["up"]
        if g.type.shape != u.type.shape or g.type.dtype != u.type.dtype or g.type.dtype not in FLOAT_DTYPES:
            ctx.explain.append(f"fuse_linear_prologue: declined %{m['act'].name}: gate and up differ in shape or dtype")
            return None
        if not b.sole_reader(m["act"]):
            ctx.explain.append(f"fuse_linear_prologue: declined %{m['act'].name}: the product has other users")
            return None
        return b.call("silu_mul_linear", g, u, m["w"], *([m["b"]] if "b" in m else []))

    return RewriteRule("silu_mul_linear", root, rewrite)


@register_pass
@dataclass
class FuseLinearPrologue(RewritePass, Pass):
    name: ClassVar[str] = "fuse_linear_prologue"

    def rules(self, ctx):
        return [_rule(ctx)]
