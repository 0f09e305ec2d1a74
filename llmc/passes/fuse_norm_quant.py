"""Vertical fusion: the per-token activation quantization of W8A8 and FP8 linears moves into the norm
that feeds them.

Unfused, the norm writes its bf16 output, and each w8a8 / fp8 `qlinear` reading it runs a
quantization kernel first (read the row, write int8 / e4m3 codes and a scale) before its GEMM. Fused,
the norm's kernel quantizes the row it already holds (`rms_norm_quant`, or `add_rms_norm_quant`
after the residual add) and the linears run their GEMM alone on the codes (`qlinear_codes`): per
layer two launches fewer at decode (the fused qkv and gate/up linears), and per token a write and a
read of the hidden vector less. The codes are the unfused path's bit for bit: the norm rounds its
row to its output dtype first, as the stored output would be.

A norm is fused only when every reader of its output is a w8a8 / fp8 qlinear of one kind (a reader
that needs the float row keeps the norm as it is).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.ir.graph import Graph
from llmc.passes.manager import Pass, PassContext, PassResult, register_pass

CODE_KINDS = ("w8a8", "fp8")


@register_pass
@dataclass
class FuseNormQuant(Pass):
    name: ClassVar[str] = "fuse_norm_quant"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        users, fused = graph.users(), 0
        for norm in [n for n in graph.nodes if n.op in ("rms_norm", "add_rms_norm")]:
            normed = norm.outputs[0]
            readers = users.get(normed, [])
            kinds = {r.attrs.get("kind") if r.op == "qlinear" else None for r in readers}
            if not readers or normed in graph.outputs or len(kinds) != 1 or kinds.pop() not in CODE_KINDS \
                    or any(r.inputs[0] is not normed or normed in r.inputs[1:] for r in readers):
                if readers and any(r.op == "qlinear" and r.attrs["kind"] in CODE_KINDS for r in readers):
                    ctx.explain.append(f"fuse_norm_quant: declined %{normed.name}: not every reader is a "
                                       f"{'/'.join(CODE_KINDS)} qlinear of one kind")
                continue
            kind = readers[0].attrs["kind"]
            q = graph.make_node(norm.op + "_quant", norm.inputs, {**norm.attrs, "kind": kind}, meta=norm.meta)
            graph.insert_before(norm, q)
            if norm.op == "add_rms_norm":
                graph.replace_uses(norm.outputs[1], q.outputs[2])
            for r in readers:
                attrs = {**r.attrs, "dtype": r.outputs[0].type.dtype}
                lin = graph.make_node("qlinear_codes", [q.outputs[0], q.outputs[1], *r.inputs[1:]], attrs, meta=r.meta)
                graph.insert_before(r, lin)
                graph.replace_uses(r.outputs[0], lin.outputs[0])
            graph.remove_nodes([norm, *readers])
            fused += 1
        return PassResult(graph, changed=bool(fused), stats={"fused": fused})
