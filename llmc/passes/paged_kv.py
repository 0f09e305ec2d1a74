"""Rewrite the captured [B, S] graph into the token-flattened graph over a paged KV cache.

The batch dim is specialised to 1 and the sequence dim to T (all new tokens of all sequences of a
step, concatenated): every op but attention works per token, so only the attention nodes need
the metadata that keeps sequences apart. Each `attention` becomes a `paged_attention` over the
layer's KV cache (a graph input the runtime owns), and the LM head runs only on `logits_indices`.

Inputs of the result:
    input_ids[T], positions[T], query_start_loc[N+1], seq_lens[N], block_tables[N,M],
    slot_mapping[T], logits_indices[L], kv_cache.<i>[2,NB,BS,Hkv,D] (+ kv_scale.<i>[NB,Hkv,2D+2BS] in the model dtype)
Output: logits[L, V].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.errors import CompileError
from llmc.ir.graph import Graph, Value
from llmc.ir.kv_layout import set_kv_cache_dtype
from llmc.ir.types import TensorType, dim_subs, subs_dim_attr
from llmc.passes.manager import Pass, PassResult, register_pass
from llmc.passes.pattern import dead_code

METADATA = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")


def _substitute_dims(g: Graph, mapping: dict[str, int | str]) -> None:
    for v in list(g.inputs) + [o for n in g.nodes for o in n.outputs]:
        v.type = v.type.with_shape(dim_subs(d, mapping) for d in v.type.shape)
    for n in g.nodes:
        n.attrs = {k: subs_dim_attr(val, mapping) for k, val in n.attrs.items()}
    for name in mapping:
        g.dims.pop(name, None)


@register_pass
@dataclass
class PagedKV(Pass):
    """Flatten tokens and put attention onto a paged KV cache (see the module docstring)."""

    name: ClassVar[str] = "paged_kv"
    kv_cache_dtype: str = "auto"
    max_tokens: int = 65536

    def run(self, g, ctx):
        names = [v.name for v in g.inputs]
        if names != ["input_ids", "position_ids"] or [v.type.rank for v in g.inputs] != [2, 2]:
            raise CompileError(f"paged_kv expects inputs (input_ids[B,S], position_ids[B,S]), got {names}")
        attn = [n for n in g.nodes if n.op == "attention"]
        if not attn:
            raise CompileError("paged_kv found no attention op in the graph")
        for i, n in enumerate(attn):
            if not n.attrs["causal"]:
                where = n.meta.get("source") or f"attention {i}"
                raise CompileError(
                    f"{where}: the attention is not causal (every token sees the whole sequence, later tokens too). "
                    "Generation with a KV cache needs each token to attend only to the ones before it, so a model "
                    "like this (an encoder, or an export that lost its causal mask) cannot run on the paged cache: "
                    "export the model with its causal mask (is_causal=True); from Python, llmc.compile(..., "
                    "paged_kv=False) compiles the graph as it is, without a KV cache")
        bdim, sdim = g.inputs[0].type.shape
        g.add_dim("T", 1, self.max_tokens)
        for d in ("N", "M", "L", "NB", "BS"):
            g.add_dim(d, 1, None)
        _substitute_dims(g, {str(bdim): 1, str(sdim): "T"})

        old_ids, old_pos = g.inputs
        g.inputs = []
        g.rename(old_ids, "input_ids.2d")
        g.rename(old_pos, "position_ids.2d")
        ids = g.add_input("input_ids", TensorType(("T",), "i64"))
        pos = g.add_input("positions", TensorType(("T",), "i64"))
        meta = [g.add_input("query_start_loc", TensorType(("N+1",), "i32")),
                g.add_input("seq_lens", TensorType(("N",), "i32")),
                g.add_input("block_tables", TensorType(("N", "M"), "i32")),
                g.add_input("slot_mapping", TensorType(("T",), "i64"))]
        logits_idx = g.add_input("logits_indices", TensorType(("L",), "i64"))
        first = g.nodes[0]
        for old, new in ((old_ids, ids), (old_pos, pos)):
            node = g.make_node("unsqueeze", [new], {"dim": 0})
            g.insert_before(first, node)
            g.replace_uses(old, node.out)

        for i, n in enumerate(attn):
            q, k, v = n.inputs
            if k.type.shape[0] != 1:
                raise CompileError(f"attention {i}: unexpected batch dim {k.type.shape[0]} after flattening")
            cache = g.add_input(f"kv_cache.{i}", TensorType((2, "NB", "BS", k.type.shape[1], k.type.shape[3]),
                                                             k.type.dtype))
            new = g.make_node("paged_attention", [q, k, v, cache, *meta],
                              {"scale": n.attrs["scale"], "causal": n.attrs["causal"], "window": n.attrs["window"]},
                              meta=dict(n.meta))
            g.insert_before(n, new)
            g.replace_uses(n.out, new.out)
        self._head_on_indices(g, logits_idx)
        dead_code(g)
        g.remove_unused_params()
        g.meta["paged"] = True
        g.meta["num_layers_kv"] = len(attn)
        set_kv_cache_dtype(g, self.kv_cache_dtype)
        return PassResult(g, True, {"attention_layers": len(attn)})

    @staticmethod
    def _head_on_indices(g: Graph, idx: Value) -> None:
        """Run the LM head only on the rows that are sampled: gather before the last linear."""
        out = g.outputs[0]
        chain = []
        v = out
        while v.producer is not None and v.producer.op == "cast":
            chain.append(v.producer)
            v = v.producer.inputs[0]
        lin = v.producer
        if lin is not None and lin.op == "linear":
            x = g.call("gather", lin.inputs[0], idx, dim=1)  # [1, L, H]
            y = g.call("linear", x, *lin.inputs[1:])
            for c in reversed(chain):
                y = g.call("cast", y, dtype=c.attrs["dtype"])
        else:  # no recognisable head: sample rows of the full logits (correct, just slower)
            y = g.call("gather", out, idx, dim=1)
        y = g.call("reshape", y, shape=["L", y.type.shape[-1]])
        g.outputs = [y]
