"""Vertical fusion: the per-token activation quantization of W8A8 and FP8 linears moves into the op
that makes their input: the norm before q/k/v and gate/up, the SwiGLU product before down.

Unfused, the producer writes its bf16 output and each w8a8 / fp8 `qlinear` reading it runs a
quantization kernel first (read the row, write int8 / e4m3 codes and a scale) before its GEMM. Fused,
the producer's kernel quantizes the row it already holds (`rms_norm_quant`, `add_rms_norm_quant`
after the residual add, `silu_mul_quant`) and the linears run their GEMM alone on the codes
(`qlinear_codes`): per layer three launches fewer at decode, and per token a write and a read of
the row less. The codes are the unfused path's bit for bit: the producer rounds its row to its
output dtype first, as the stored output would be.

A producer is fused only when every reader of its output is a w8a8 / fp8 qlinear of one kind (a
reader that needs the float row keeps the producer as it is).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.ir.graph import Graph
from llmc.passes.manager import Pass, PassContext, PassResult, register_pass

CODE_KINDS = ("w8a8", "fp8")
PRODUCERS = {"rms_norm": "rms_norm_quant", "add_rms_norm": "add_rms_norm_quant", "silu_mul": "silu_mul_quant"}


@register_pass
@dataclass
class FuseActQuant(Pass):
    name: ClassVar[str] = "fuse_act_quant"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        users, fused = graph.users(), 0
        for prod in [n for n in graph.nodes if n.op in PRODUCERS]:
            out = prod.outputs[0]
            readers = users.get(out, [])
            kinds = {r.attrs.get("kind") if r.op == "qlinear" else None for r in readers}
            if not readers or out in graph.outputs or len(kinds) != 1 or kinds.pop() not in CODE_KINDS \
                    or any(r.inputs[0] is not out or out in r.inputs[1:] for r in readers):
                if any(r.op == "qlinear" and r.attrs["kind"] in CODE_KINDS for r in readers):
                    ctx.explain.append(f"fuse_act_quant: declined %{out.name}: not every reader is a "
                                       f"{'/'.join(CODE_KINDS)} qlinear of one kind")
                continue
            kind = readers[0].attrs["kind"]
            q = graph.make_node(PRODUCERS[prod.op], prod.inputs, {**prod.attrs, "kind": kind}, meta=prod.meta)
            graph.insert_before(prod, q)
            if prod.op == "add_rms_norm":
                graph.replace_uses(prod.outputs[1], q.outputs[2])
            for r in readers:
                attrs = {**r.attrs, "dtype": r.outputs[0].type.dtype}
                lin = graph.make_node("qlinear_codes", [q.outputs[0], q.outputs[1], *r.inputs[1:]], attrs, meta=r.meta)
                graph.insert_before(r, lin)
                graph.replace_uses(r.outputs[0], lin.outputs[0])
            graph.remove_nodes([prod, *readers])
            fused += 1
        return PassResult(graph, changed=bool(fused), stats={"fused": fused})
