"""Phase 2, last: the input embedding table as int8 rows with one scale each (`qembedding`).

A decode step gathers a handful of the table's rows, so its size hardly matters for speed, but it
is a large share of a quantized artifact (an 8B model's 128k x 4096 table is 1 GiB in bf16, a
quarter of its int4 weights). Per-row absmax int8 keeps every row within half a code of 1/127 of
its largest entry.

A table the LM head also reads (tied embeddings) with the head kept dense stays as it is: the
dense head needs it, and a second, int8 copy would add bytes, not save them. Quantize the head too
(`--quant-lm-head`) and the dense table goes. Where that leaves no table to quantize, the option would
do nothing: the compile stops with an error that says so, before anything is written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.errors import CompileError
from llmc.ir.quant import quantize_rows_int8
from llmc.passes.manager import Pass, PassContext, PassResult, register_pass
from llmc.passes.quantize.config import QuantConfig
from llmc.passes.quantize.materialize import PLAN


@register_pass
@dataclass
class QuantizeEmbeddings(Pass):
    name: ClassVar[str] = "quantize_embeddings"
    config: QuantConfig = QuantConfig()

    def run(self, g, ctx: PassContext):
        users = g.users()
        done, kept = {}, []
        for n in [n for n in g.nodes if n.op == "embedding" and n.inputs[0].kind == "param"]:
            table = n.inputs[0]
            others = [u for u in users.get(table, []) if u is not n]
            if others:
                kept.append(table.name)
                ctx.note(f"{self.name}: {table.name} is also read by {others[0].op} {others[0].out.name} "
                         "(a dense tied LM head): kept; quantize the head too to drop the dense table")
                continue
            w = g.weights[table.name]
            q, s = quantize_rows_int8(w)
            base = table.name.removesuffix(".weight")
            ins = [g.add_param(g.fresh(f"{base}.qrows"), q), g.add_param(g.fresh(f"{base}.row_scales"), s), n.inputs[1]]
            qn = g.make_node("qembedding", ins, {"dtype": n.out.type.dtype}, meta=dict(n.meta))
            g.insert_before(n, qn)
            g.replace_uses(n.out, qn.out)
            g.remove_nodes([n])
            done[base] = {"format": "int8 rows", "params": w.numel(), "bits": round(8 + 32 / w.shape[1], 4)}
        if kept and not done:
            raise CompileError(f"--quant-embeddings int8: the embedding table {kept[0]} is tied to the LM head, which "
                               "stays dense, so no table can be quantized; add --quant-lm-head to quantize the head "
                               "and the table, or leave --quant-embeddings out")
        g.remove_unused_params()
        if done and PLAN in g.meta:
            g.meta[PLAN]["embeddings"] = done
        return PassResult(g, bool(done), {"quantized": len(done)})
