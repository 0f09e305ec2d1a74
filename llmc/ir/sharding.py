"""Tensor parallelism: one rank's share of a paged graph (Megatron-style column / row parallel linears).

It runs at load, on the artifact's graph as compiled (fused, paged), so one artifact runs at every
tensor-parallel size (docs/distributed.md says why). The rules read the graph's structure, not its
parameter names:

- attention: q, k and v are traced back from each layer's cache-writing op through per-head ops
  (reshape, transpose, rope, a per-head norm) to a linear, or to a slice of a fused linear; those
  rows are column-parallel by head. Rank r keeps query heads [r H/N, (r+1) H/N) and the KV heads
  they read: its own share where N divides the KV heads, one head replicated on several ranks where
  there are fewer KV heads than ranks, and a head held by both neighbours where a group of query
  heads straddles two ranks (6 query / 3 KV heads on 2 ranks: 3 KV slots each, one duplicated).
  Each rank's cache holds its own KV heads. The attention output's linear (o_proj) is row-parallel.
- MLP: a linear whose input is computed, through per-feature ops only (elementwise, silu_mul,
  slices), from other linears' outputs is row-parallel and those linears column-parallel in
  contiguous chunks (gate/up → down; fused gate_up splits per part).
- a row-parallel linear's output is summed by an `all_reduce` (its bias counted on rank 0 only).
  Where one elementwise op (or fused region) reads several such sums and is linear in them (sums,
  differences, products with replicated factors: Qwen2-MoE's experts plus its gated shared expert),
  it runs on the ranks' partial sums and one `all_reduce` follows it (`merge_reductions`).
- mixture of experts (`moe` ops): the router stays whole, so every rank routes every token (the
  activations are replicated); with expert parallelism rank r keeps a contiguous range of experts
  (sizes that differ by one; `expert_start` says where it begins), without it each expert's
  intermediate size is split in chunks (gate and up rows alike, down's columns). Either way the
  op's result is a partial sum that an `all_reduce` completes (docs/distributed.md says why this
  and not an all-to-all).
- the LM head is vocabulary-parallel: rank r computes its ceil(V / N) rows (zero-padded), an
  `all_gather` assembles the logits. The embedding table stays whole on every rank (a tied head
  gets its own sharded copy).
- every other linear stays replicated (correct, listed in `graph.meta["tensor_parallel"]`), and so do
  the columns of a split fused linear that no rule claims (Qwen2-MoE's one-column shared-expert
  gate, fused with the shared expert's gate/up).

Only the query heads must divide by N (equal attention work per rank); chunks of other widths may
differ by one between ranks.

Example:
    >>> g1 = shard_graph(art.graph.clone(), tp_size=2, rank=1)              # doctest: +SKIP
    >>> g1 = shard_graph(art.graph.clone(), 2, 1, expert_parallel=True)     # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from llmc.errors import LLMCError
from llmc.ir.graph import Graph, Node, Value
from llmc.ir.kv_layout import kv_cache_inputs
from llmc.ir.ops import ELEMENTWISE, get_op, has_trait
from llmc.ir.types import torch_dtype
from llmc.ir.verify import verify

GROUP = "tp"
WRITERS = ("rope_kv_write", "paged_attention")  # ops that take q, k, v and write a layer's cache
READERS = ("attend_paged", "paged_attention")  # ops whose output is the layer's attention output
HEAD_OPS = {"reshape", "transpose", "permute", "unsqueeze", "squeeze", "cast", "rope"}  # per head, operand 0
FEATURE_OPS = ELEMENTWISE | {"cast", "silu_mul", "fused"}  # per feature of the last dim


class ShardError(LLMCError):
    """A graph that cannot be split for the asked tensor-parallel size."""


@dataclass
class _Part:
    """Output columns [start, end) of a column-parallel linear, taken by `slice` (None: the whole output);
    `rows(rank)` are the columns rank keeps, relative to start (a row past `end - start` is zero padding);
    `replicated`: every rank keeps them all."""

    start: int
    end: int
    slice: Node | None
    rows: Callable[[int], list[int]]
    replicated: bool = False


@dataclass
class ShardPlan:
    """How a graph splits over `tp` ranks; `apply(rank)` rewrites the graph for one of them."""

    graph: Graph
    tp: int
    column: dict[int, tuple[Node, list[_Part]]] = field(default_factory=dict)  # id(linear) -> parts
    row: list[tuple[Node, Callable[[int], tuple[int, int]]]] = field(default_factory=list)  # input columns kept
    caches: list[tuple[Value, Callable[[int], int]]] = field(default_factory=list)  # KV heads per rank
    reshapes: list[Node] = field(default_factory=list)  # head-count reshapes made shape-agnostic
    head: tuple[Node, int] | None = None  # (LM head linear, vocabulary)
    expert_parallel: bool = False  # moe ops split by expert (else by each expert's intermediate size)
    experts: list[tuple[Node, Callable[[int], tuple[int, int]]]] = field(default_factory=list)  # moe -> [lo, hi)

    def apply(self, rank: int) -> Graph:
        g, n = self.graph, self.tp
        if not 0 <= rank < n:
            raise ShardError(f"rank {rank} is outside a tensor-parallel group of {n}")
        replicated = self.replicated()  # named before the split params replace them
        for lin, parts in self.column.values():
            parts.sort(key=lambda p: p.start)
            rows = [p.start + i if i < p.end - p.start else -1 for p in parts for i in p.rows(rank)]
            _replace_params(g, lin, lambda t: _take_rows(t, rows))
            at = 0
            for p in parts:
                if p.slice is not None:
                    p.slice.attrs = {**p.slice.attrs, "start": at, "end": at + len(p.rows(rank))}
                at += len(p.rows(rank))
        for lin, cols in self.row:
            lo, hi = cols(rank)
            _split_inputs(g, lin, lo, hi, keep_bias=rank == 0)
            _reduce_after(g, lin)
        for op, keep in self.experts:
            _split_experts(g, op, *keep(rank), by_expert=self.expert_parallel)
            _reduce_after(g, op)
        for cache, heads in self.caches:
            s = cache.type.shape
            cache.type = cache.type.with_shape((*s[:3], heads(rank), *s[4:]))
            scale = next((v for v in g.inputs if v.name == "kv_scale." + cache.name.split(".", 1)[1]), None)
            if scale is not None:
                scale.type = scale.type.with_shape((scale.type.shape[0], heads(rank), *scale.type.shape[2:]))
        for r in self.reshapes:
            r.attrs = {**r.attrs, "shape": _agnostic(r)}
        if self.head is not None:
            lin, vocab = self.head
            gathered = g.make_node("all_gather", [lin.out], {"group": GROUP, "dim": -1, "size": n},
                                   meta=dict(lin.meta))
            new = [gathered]
            if -(-vocab // n) * n != vocab:  # drop the padding rows' logits
                new.append(g.make_node("slice", [gathered.out], {"dim": -1, "start": 0, "end": vocab, "step": 1}))
            g.replace_uses(lin.out, new[-1].out)
            at = g.nodes.index(lin) + 1
            g.nodes[at:at] = new
        merged = merge_reductions(g)
        _retype(g)
        g.remove_unused_params()
        g.meta["tensor_parallel"] = {"size": n, "rank": rank, "column": len(self.column), "row": len(self.row),
                                     "merged_reductions": merged,
                                     "vocab_parallel": self.head is not None, "moe": len(self.experts),
                                     "expert_parallel": self.expert_parallel, "replicated": replicated}
        verify(g)
        return g

    def replicated(self) -> list[str]:
        """The linears every rank computes whole (their first param's name), and the columns `name[start:end]`
        of split linears that every rank computes whole."""
        split = set(self.column) | {id(lin) for lin, _ in self.row}
        whole = [n.inputs[1].name for n in self.graph.nodes
                 if has_trait(n.op, "linear") and id(n) not in split and n.inputs[1].kind == "param"]
        return whole + [f"{lin.inputs[1].name}[{p.start}:{p.end}]" for lin, parts in self.column.values()
                        for p in parts if p.replicated]


def shard_graph(g: Graph, tp_size: int, rank: int, expert_parallel: bool = False) -> Graph:
    """Rewrite `g` in place into rank `rank`'s share of `tp_size` (see the module docstring); returns it.

    `expert_parallel`: split the `moe` ops' experts by expert over the ranks (each rank holds whole
    experts) rather than each expert's intermediate size.

    Raises ShardError (one line) where the sizes do not fit: query heads not divisible by tp_size, fewer
    experts than ranks under expert parallelism, expert parallelism on a model without `moe` ops, or
    an attention layer whose projections cannot be traced to linears.
    """
    if tp_size == 1:
        return g
    from llmc.ir.act_quant import unfuse_act_quant
    unfuse_act_quant(g)  # W8A8 / FP8 linears quantize their own (on a row-parallel linear: sliced) input
    unfuse_silu_mul_linear(g)  # the MLP rule reads linear -> slices -> silu_mul -> linear (a shard keeps the
    unfuse_linear_silu_mul(g)  # product kernel, and its gate/up projection takes its rows of both halves)
    return plan_sharding(g, tp_size, expert_parallel).apply(rank)


def unfuse_silu_mul_linear(g: Graph) -> int:
    """Each `silu_mul_linear` (fuse_linear_prologue) back to `silu_mul` then `linear`, in place (exact: the
    fused op is defined as that composition); returns how many were unfused."""
    fused = [n for n in g.nodes if n.op == "silu_mul_linear"]
    for n in fused:
        act = g.make_node("silu_mul", n.inputs[:2], {}, meta=n.meta)
        g.insert_before(n, act)
        lin = g.make_node("linear", [act.outputs[0], *n.inputs[2:]], {}, meta=n.meta)
        g.insert_before(n, lin)
        g.replace_uses(n.outputs[0], lin.outputs[0])
        g.remove_nodes([n])
    return len(fused)


def unfuse_linear_silu_mul(g: Graph) -> int:
    """Each `linear_silu_mul` (fuse_linear_epilogue) back to the gate/up `linear`, its two halves and `silu_mul`,
    in place (exact: the fused op is defined as that composition); returns how many were unfused."""
    fused = [n for n in g.nodes if n.op == "linear_silu_mul"]
    for n in fused:
        lin = g.make_node("linear", list(n.inputs), {}, meta=n.meta)
        g.insert_before(n, lin)
        y = lin.outputs[0]
        dim, width = y.type.rank - 1, int(y.type.shape[-1])
        halves = []
        for start, end in ((0, width // 2), (width // 2, width)):
            half = g.make_node("slice", [y], {"dim": dim, "start": start, "end": end, "step": 1}, meta=n.meta)
            g.insert_before(n, half)
            halves.append(half.outputs[0])
        act = g.make_node("silu_mul", halves, {}, meta=n.meta)
        g.insert_before(n, act)
        g.replace_uses(n.outputs[0], act.outputs[0])
        g.remove_nodes([n])
    return len(fused)


def plan_sharding(g: Graph, tp_size: int, expert_parallel: bool = False) -> ShardPlan:
    """Analyse `g` for `tp_size` ranks without changing it (raises ShardError where it cannot split)."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ShardError(f"the tensor parallel size must be an integer >= 1, not {tp_size!r}")
    if not g.meta.get("paged"):
        raise ShardError("tensor parallelism needs a paged graph (compile with the default pipeline)")
    if "tensor_parallel" in g.meta:
        raise ShardError("this graph is already one rank's shard (the shard pass ran at compile time); shard the "
                         "unsharded artifact at load instead (--tensor-parallel-size N)")
    plan = ShardPlan(g, tp_size, expert_parallel=expert_parallel)
    users = g.users()
    for i, cache in enumerate(kv_cache_inputs(g)):
        _plan_attention(plan, users, cache, i)
    _plan_mlps(plan, users)
    _plan_moe(plan)
    _plan_head(plan, users)
    for lin, parts in plan.column.values():
        taken = {id(p.slice) for p in parts}
        whole = any(p.slice is None for p in parts)
        stray = [u for u in users.get(lin.out, []) if id(u) not in taken]
        if not whole:  # columns of a fused linear that no rule claims: every rank computes them whole
            for u in [u for u in stray if _last_dim_slice(u)]:
                w = u.attrs["end"] - u.attrs["start"]
                _add_part(plan, (lin, u.attrs["start"], u.attrs["end"], u), lambda r, w=w: list(range(w)),
                          replicated=True)
            stray = [u for u in stray if not _last_dim_slice(u)]
        if (whole and len(parts) > 1) or (not whole and stray):
            raise ShardError(f"tensor parallelism: the output of the linear over %{lin.inputs[1].name} is also "
                             f"read by {stray[0].op if stray else 'another part'}, which no sharding rule covers")
    return plan


# -- attention ---------------------------------------------------------------------------------

def _plan_attention(plan: ShardPlan, users: dict, cache: Value, layer: int) -> None:
    n = plan.tp
    ops = users.get(cache, [])
    writer = next((u for u in ops if u.op in WRITERS), None)
    reader = next((u for u in ops if u.op in READERS), None)
    if writer is None or reader is None:
        raise ShardError(f"tensor parallelism: the cache %{cache.name} has no attention op that writes and reads it")
    q, k, v = writer.inputs[:3]  # [1, H, T, D]
    hq, hkv, dq, dv = q.type.shape[1], k.type.shape[1], q.type.shape[3], v.type.shape[3]
    if hq % n:
        raise ShardError(f"tensor parallel size {n} does not divide the {hq} attention heads (layer {layer}); use "
                         f"a size that divides {hq}")
    per = hq // n
    kv_of = lambda r: _kv_heads(r, n, hq, hkv)  # noqa: E731
    q_heads = lambda r: range(r * per, (r + 1) * per)  # noqa: E731
    for which, val, rows in (("queries", q, lambda r: _head_rows(q_heads(r), dq)),
                             ("keys", k, lambda r: _head_rows(kv_of(r), dq)),
                             ("values", v, lambda r: _head_rows(kv_of(r), dv))):
        width = val.type.shape[1] * val.type.shape[3]
        _add_part(plan, _trace_projection(plan, users, val, writer, which, layer, width), rows)
    o_proj = _trace_output(plan, users, reader.out, layer)
    plan.row.append((o_proj, lambda r: (r * per * dv, (r + 1) * per * dv)))
    plan.caches.append((cache, lambda r: len(kv_of(r))))


def _kv_heads(rank: int, n: int, hq: int, hkv: int) -> list[int]:
    """The KV heads rank keeps, in the order its query heads read them: one per group of its query heads,
    with the largest group size that divides its query heads and never straddles two KV heads."""
    per, group = hq // n, hq // hkv
    kv = [h // group for h in range(rank * per, (rank + 1) * per)]
    for size in range(per, 0, -1):
        if per % size == 0 and all(len(set(kv[b:b + size])) == 1 for b in range(0, per, size)):
            return kv[::size]
    raise AssertionError("unreachable: a group of one query head always fits")


def _head_rows(heads, d: int) -> list[int]:
    return [h * d + j for h in heads for j in range(d)]


def _trace_projection(plan, users, val: Value, consumer: Node, which: str, layer: int, width: int):
    """Back from an attention operand through per-head ops to (linear, start, end, slice node)."""
    while True:
        if [id(u) for u in users.get(val, [])] != [id(consumer)]:
            raise ShardError(f"tensor parallelism: the {which} of attention layer {layer} are also read outside "
                             f"the attention (%{val.name}), which head-wise splitting would change")
        p = val.producer
        if p is None:
            raise ShardError(f"tensor parallelism: the {which} of attention layer {layer} do not come from a linear "
                             f"projection (%{val.name} is a graph {val.kind})")
        if _last_dim_slice(p) and _is_linear(p.inputs[0].producer):
            start, end = p.attrs["start"], p.attrs["end"]
            if end - start != width:
                raise ShardError(f"tensor parallelism: the {which} of attention layer {layer} take {end - start} "
                                 f"columns of a fused linear, not the {width} their heads need")
            return p.inputs[0].producer, start, end, p
        if _is_linear(p):
            if p.out.type.shape[-1] != width:
                raise ShardError(f"tensor parallelism: the {which} projection of attention layer {layer} has "
                                 f"{p.out.type.shape[-1]} outputs, not the {width} its heads need")
            return p, 0, width, None
        per_head_norm = p.op == "rms_norm" and p.inputs[1].type.numel() == p.inputs[0].type.shape[-1] and \
            p.inputs[0].type.rank == 4
        if p.op not in HEAD_OPS and not per_head_norm:
            raise ShardError(f"tensor parallelism: cannot trace the {which} of attention layer {layer} back to a "
                             f"linear projection: they pass through {p.op}")
        if p.op == "reshape":
            plan.reshapes.append(p)
        consumer, val = p, p.inputs[0]


def _trace_output(plan, users, val: Value, layer: int) -> Node:
    """Forward from an attention output ([1, H, T, D]) through movement to its output projection."""
    while True:
        us = users.get(val, [])
        if len(us) != 1:
            raise ShardError(f"tensor parallelism: the output of attention layer {layer} is read by {len(us)} ops, "
                             "not by one output projection")
        u = us[0]
        if _is_linear(u) and u.inputs[0] is val:
            if val.producer is None or val.producer.op != "reshape":
                raise ShardError(f"tensor parallelism: attention layer {layer}'s output reaches its projection "
                                 "without merging heads into features")
            return u
        if u.op not in HEAD_OPS - {"rope"}:
            raise ShardError(f"tensor parallelism: the output of attention layer {layer} passes through {u.op} "
                             "before its output projection")
        if u.op == "reshape":
            plan.reshapes.append(u)
        val = u.out


# -- MLPs and the LM head ----------------------------------------------------------------------

def _plan_mlps(plan: ShardPlan, users: dict) -> None:
    """Row-parallel every linear whose input is a per-feature function of other linears' outputs."""
    claimed = set(plan.column) | {id(lin) for lin, _ in plan.row}
    for d in list(plan.graph.nodes):
        if not _is_linear(d) or id(d) in claimed:
            continue
        found = _feature_region(users, d, claimed)
        if found is None or d.op not in ("linear", "qlinear") or d.attrs.get("act"):
            continue  # an activation fused into it would have to follow the sum over ranks: stays replicated
        leaves, width = found
        n = plan.tp
        chunk = lambda r, w=width: (r * w // n, (r + 1) * w // n)  # noqa: E731
        for lin, start, end, sl in leaves:
            _add_part(plan, (lin, start, end, sl), lambda r, c=chunk: list(range(*c(r))))
            claimed.add(id(lin))
        plan.row.append((d, chunk))
        claimed.add(id(d))


def _feature_region(users, d: Node, claimed: set):
    """([(linear, start, end, slice)], width) if d's input is computed per feature from linears alone."""
    leaves, region, stack, seen = [], {id(d)}, [d.inputs[0]], set()
    inner = []
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        p = v.producer
        if p is None:
            return None
        if _last_dim_slice(p) and _is_linear(p.inputs[0].producer):
            if id(p.inputs[0].producer) in claimed:
                return None
            leaves.append((p.inputs[0].producer, p.attrs["start"], p.attrs["end"], p))
            region.add(id(p))
            inner.append(v)
            continue
        if _is_linear(p):
            if id(p) in claimed:
                return None
            leaves.append((p, 0, p.out.type.shape[-1], None))
            inner.append(v)
            continue
        if p.op not in FEATURE_OPS or (p.op == "fused" and p.attrs.get("kind") != "elementwise"):
            return None
        region.add(id(p))
        inner.append(v)
        for x in p.inputs:
            if x.producer is None or x.producer.op == "constant":
                if x.type.numel() != 1:  # a per-feature param would have to be split too
                    return None
            else:
                stack.append(x)
    widths = {end - start for _, start, end, _ in leaves}
    if not leaves or len(widths) != 1:
        return None
    width = widths.pop()
    for v in inner:  # every value of the region is read only inside it, and is as wide as the parts
        if v.type.shape[-1] != width or any(id(u) not in region for u in users.get(v, [])):
            return None
    return leaves, width


def _plan_moe(plan: ShardPlan) -> None:
    """Each `moe` op keeps experts [lo, hi) (expert parallel) or columns [lo, hi) of every expert's intermediate
    size (tensor parallel). The router stays whole: every rank routes every token (activations are replicated)."""
    g, n = plan.graph, plan.tp
    ops = [op for op in g.nodes if op.op == "moe"]
    if plan.expert_parallel and not ops:
        raise ShardError("expert parallelism: this model has no mixture-of-experts layers (moe ops) to split by "
                         "expert; leave --expert-parallel out")
    for i, op in enumerate(ops):
        router, gate_up, down = op.inputs[1:]
        experts, held, inter = router.type.shape[0], gate_up.type.shape[0], down.type.shape[2]
        if any(v.kind != "param" for v in op.inputs[1:]) or held != experts or op.attrs["expert_start"]:
            raise ShardError(f"tensor parallelism: MoE layer {i} does not hold all {experts} experts as weights, "
                             "which the expert split needs")
        if plan.expert_parallel and experts < n:
            raise ShardError(f"expert parallel size {n} is larger than the {experts} experts of MoE layer {i}; use "
                             f"at most {experts} ranks, or leave --expert-parallel out (each expert split instead)")
        if not plan.expert_parallel and inter < n:
            raise ShardError(f"tensor parallel size {n} is larger than the experts' intermediate size {inter} (MoE "
                             f"layer {i}); use at most {inter} ranks")
        size = experts if plan.expert_parallel else inter
        plan.experts.append((op, lambda r, s=size: (r * s // n, (r + 1) * s // n)))


def _plan_head(plan: ShardPlan, users: dict) -> None:
    """Vocabulary-parallel the linear that produces the logits (through casts and reshapes)."""
    g = plan.graph
    if len(g.outputs) != 1:
        return
    v = g.outputs[0]
    while v.producer is not None and v.producer.op in ("cast", "reshape") and \
            len(users.get(v.producer.inputs[0], [])) == 1:
        v = v.producer.inputs[0]
    lin = v.producer
    claimed = set(plan.column) | {id(x) for x, _ in plan.row}
    if not _is_linear(lin) or id(lin) in claimed or lin.attrs.get("act"):
        return
    vocab, n = lin.out.type.shape[-1], plan.tp
    chunk = -(-vocab // n)
    _add_part(plan, (lin, 0, vocab, None), lambda r: list(range(r * chunk, (r + 1) * chunk)))
    plan.head = (lin, vocab)


# -- rewriting ---------------------------------------------------------------------------------

def _is_linear(n: Node | None) -> bool:
    return n is not None and has_trait(n.op, "linear") and all(v.kind == "param" for v in n.inputs[1:])


def _last_dim_slice(n: Node | None) -> bool:
    return n is not None and n.op == "slice" and n.attrs["step"] == 1 and \
        n.attrs["dim"] % n.inputs[0].type.rank == n.inputs[0].type.rank - 1


def _reduce_after(g: Graph, node: Node) -> None:
    """An `all_reduce` of node's output, which every reader of that output reads instead."""
    ar = g.make_node("all_reduce", [node.out], {"group": GROUP}, meta=dict(node.meta))
    g.replace_uses(node.out, ar.out)
    g.nodes.insert(g.nodes.index(node) + 1, ar)


def _linearity(op: str, attrs: dict, kinds: list[str]) -> str:
    """How an elementwise op's result depends on the ranks' partial sums, from its operands': "R" (replicated:
    the same on every rank), "L" (linear in the partials: summing the results over the ranks gives the op of
    the sums) or "N" (neither)."""
    if all(k == "R" for k in kinds):
        return "R"
    if "N" in kinds:
        return "N"
    if op in ("add", "sub"):  # a replicated term would be counted once per rank
        return "L" if all(k == "L" for k in kinds) else "N"
    if op == "mul":
        return "L" if sorted(kinds) == ["L", "R"] else "N"
    if op == "div":
        return "L" if kinds == ["L", "R"] else "N"
    if op == "neg" or (op == "cast" and torch_dtype(attrs["dtype"]).is_floating_point):
        return "L"
    return "N"


def _linear_in(node: Node, partial: set[int]) -> bool:
    """Whether `node` (an elementwise op or fused region, one output) is linear in its operands at the
    positions `partial` and reads the others only as replicated factors (`_linearity`)."""
    kinds = ["L" if i in partial else "R" for i in range(len(node.inputs))]
    if node.op in ELEMENTWISE:
        return _linearity(node.op, node.attrs, kinds) == "L"
    if node.op != "fused" or node.attrs.get("kind") != "elementwise" or len(node.attrs["outputs"]) != 1:
        return False
    env = {f"in{i}": k for i, k in enumerate(kinds)}
    for name, op, operands, attrs in node.attrs["body"]:
        env[name] = _linearity(op, attrs, [env[o] for o in operands])
    return env[node.attrs["outputs"][0]] == "L"


def merge_reductions(g: Graph) -> int:
    """One `all_reduce` after an elementwise op that reads several and is linear in them, in place of theirs:
    f(all_reduce(a), all_reduce(b)) = all_reduce(f(a, b)) for f linear in a and b (any replicated factor is
    the same on every rank). Each all_reduce must have no other reader. Returns the all_reduces saved."""
    users, saved = g.users(), 0
    for node in list(g.nodes):
        if len(node.outputs) != 1:
            continue
        sums = {i: v.producer for i, v in enumerate(node.inputs)
                if v.producer is not None and v.producer.op == "all_reduce" and len(users.get(v, [])) == 1}
        groups = {ar.attrs["group"] for ar in sums.values()}
        if len(sums) < 2 or len(groups) != 1 or len(set(map(id, sums.values()))) != len(sums) or \
                not _linear_in(node, set(sums)):
            continue
        node.inputs = [sums[i].inputs[0] if i in sums else v for i, v in enumerate(node.inputs)]
        ar = g.make_node("all_reduce", [node.out], {"group": groups.pop()}, meta=dict(node.meta))
        g.replace_uses(node.out, ar.out)
        g.nodes.insert(g.nodes.index(node) + 1, ar)
        g.remove_nodes(list(sums.values()))
        saved += len(sums) - 1
    return saved


def _add_part(plan: ShardPlan, found, rows, replicated: bool = False) -> None:
    lin, start, end, sl = found
    _, parts = plan.column.setdefault(id(lin), (lin, []))
    if any(p.slice is sl for p in parts) or any(p.start < end and start < p.end for p in parts):
        raise ShardError(f"tensor parallelism: the columns [{start}, {end}) of the linear over %{lin.inputs[1].name} "
                         "are claimed twice")
    parts.append(_Part(start, end, sl, rows, replicated))


def _split_experts(g: Graph, op: Node, lo: int, hi: int, by_expert: bool) -> None:
    """A `moe` op keeps experts [lo, hi) (by_expert) or intermediate columns [lo, hi) of each expert:
    gate_up [E, 2I, H] keeps gate rows lo:hi and up rows I+lo:I+hi (so its halves stay gate | up), down
    [E, H, I] the same columns. The op's output is then this rank's share of the sum."""
    x, router, gate_up, down = op.inputs
    gu, dn = g.weights[gate_up.name], g.weights[down.name]
    if by_expert:
        gu, dn = gu[lo:hi], dn[lo:hi]
        op.attrs = {**op.attrs, "expert_start": lo}
    else:
        inter = dn.shape[2]
        gu, dn = torch.cat([gu[:, lo:hi], gu[:, inter + lo:inter + hi]], dim=1), dn[:, :, lo:hi]
    op.inputs = [x, router, g.add_param(g.fresh(f"{gate_up.name}.tp"), gu.contiguous()),
                 g.add_param(g.fresh(f"{down.name}.tp"), dn.contiguous())]


def _take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows of t in order; -1 gives a row of zeros (vocabulary padding)."""
    idx = torch.tensor([max(r, 0) for r in rows], dtype=torch.long)
    out = t.index_select(0, idx)
    pad = torch.tensor([r < 0 for r in rows])
    if pad.any():
        out[pad] = 0
    return out.contiguous()


def _replace_params(g: Graph, lin: Node, fn) -> None:
    ins = [lin.inputs[0]]
    for p in lin.inputs[1:]:
        t = fn(g.weights[p.name])
        ins.append(g.add_param(g.fresh(f"{p.name}.tp"), t))
    lin.inputs = ins


def _split_inputs(g: Graph, lin: Node, lo: int, hi: int, keep_bias: bool) -> None:
    """A row-parallel linear keeps input columns [lo, hi); its bias counts on one rank only."""
    if lin.op == "qlinear":
        return _split_qlinear_inputs(g, lin, lo, hi, keep_bias)
    w = g.weights[lin.inputs[1].name]
    ins = [lin.inputs[0], g.add_param(g.fresh(f"{lin.inputs[1].name}.tp"), w[:, lo:hi].contiguous())]
    if len(lin.inputs) > 2:
        b = g.weights[lin.inputs[2].name]
        ins.append(g.add_param(g.fresh(f"{lin.inputs[2].name}.tp"), b.clone() if keep_bias else torch.zeros_like(b)))
    lin.inputs = ins


def _split_qlinear_inputs(g: Graph, lin: Node, lo: int, hi: int, keep_bias: bool) -> None:
    """Quantized weights split on input columns at whole groups (and whole bytes of packed int4)."""
    from llmc.ir.ops import qlinear_weight_inputs
    from llmc.ir.quant import QuantFormat
    fmt = QuantFormat.from_attrs(lin.attrs)
    qw, sc, zeros, bias = qlinear_weight_inputs(lin)
    gs = fmt.group_size if fmt.kind == "int" else 0
    pack = 2 if fmt.kind == "int" and fmt.bits == 4 else 1
    if (gs and (lo % gs or hi % gs)) or lo % pack or hi % pack:
        raise ShardError(f"tensor parallelism: the quantized linear over %{qw.name} ({fmt.label}) cannot split its "
                         f"input at columns {lo}-{hi}: splits must fall on whole quantization groups")
    take = lambda v, t: g.add_param(g.fresh(f"{v.name}.tp"), t.contiguous())  # noqa: E731
    ins = [lin.inputs[0], take(qw, g.weights[qw.name][:, lo // pack:hi // pack])]
    grp = (lambda t: t[:, lo // gs:hi // gs]) if gs else (lambda t: t)
    ins.append(take(sc, grp(g.weights[sc.name])))
    if zeros is not None:
        ins.append(take(zeros, grp(g.weights[zeros.name])))
    if bias is not None:
        b = g.weights[bias.name]
        ins.append(take(bias, b.clone() if keep_bias else torch.zeros_like(b)))
    lin.inputs = ins
    lin.attrs = {**lin.attrs, "in_features": hi - lo}


def _agnostic(r: Node) -> list:
    """A reshape's target with its head (or heads x head_dim) entry as -1, so it fits any head count."""
    shape = list(r.attrs["shape"])
    if -1 in shape:
        return shape
    src, out = r.inputs[0].type.shape, r.out.type.shape
    if len(out) > len(src):  # [.., H*D] -> [.., H, D]: the heads are the second last
        shape[-2] = -1
    else:  # [.., H, D] -> [.., H*D]
        shape[-1] = -1
    return shape


def _retype(g: Graph) -> None:
    for n in g.nodes:
        for v, t in zip(n.outputs, get_op(n.op).infer(n)):
            v.type = t
