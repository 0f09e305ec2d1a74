"""Pipeline parallelism: a paged graph cut into stages of consecutive layers.

Stage s runs layers [s L / S, (s+1) L / S). Each cut lies between the previous layer's attention and
the next layer's q/k/v projection, at the latest point in node order where the fewest values cross
(for a Llama after fusion: the residual stream and the normed hidden state). What crosses becomes
the next stage's inputs, with the same names, and the previous stage's outputs; values that only the step's inputs determine (rotary cos/sin from the
positions) are recomputed by each stage that needs them rather than sent. Every stage keeps the
step's metadata inputs it uses and only its own layers' KV caches.

Example:
    >>> cut = split_stages(art.graph, 2)                                          # doctest: +SKIP
    >>> cut.graphs[1].inputs[0].name, cut.boundaries[0]                            # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass

from llmc.errors import LLMCError
from llmc.ir.graph import Graph, Value, WeightStore
from llmc.ir.kv_layout import kv_cache_inputs
from llmc.ir.ops import get_op, has_trait
from llmc.ir.serialize import graph_from_dict, graph_to_dict
from llmc.ir.verify import verify

NOT_RECOMPUTED = ("attention", "collective")  # op families a recomputed value never passes through


@dataclass
class Stages:
    """`graphs[s]`: stage s; `boundaries[s]`: the names of the values stage s sends to stage s + 1."""

    graphs: list[Graph]
    boundaries: list[list[str]]


def split_stages(g: Graph, num_stages: int) -> Stages:
    """Cut `g` into `num_stages` graphs (see the module docstring); `g` is left as it was.

    Raises LLMCError when there are more stages than layers.
    """
    caches = kv_cache_inputs(g)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise LLMCError(f"the pipeline parallel size must be an integer >= 1, not {num_stages!r}")
    if num_stages > len(caches):
        raise LLMCError(f"pipeline parallel size {num_stages} is larger than the model's {len(caches)} layers; use "
                        f"at most {len(caches)}")
    if num_stages == 1:
        return Stages([g], [])
    index = {id(n): i for i, n in enumerate(g.nodes)}
    users = g.users()
    layers = sorted([sorted(index[id(u)] for u in users.get(c, [])) for c in caches])  # node indices per layer
    starts = [_layer_start(g, index, g.nodes[nodes[0]]) for nodes in layers]
    cheap = _recomputable(g)
    last_use: dict[str, int] = {}
    for i, n in enumerate(g.nodes):
        for v in n.inputs:
            last_use[v.name] = i
    for v in g.outputs:
        last_use[v.name] = len(g.nodes)
    defined = [(i, v) for i, n in enumerate(g.nodes) for v in n.outputs]

    def crossing(k: int) -> list[Value]:
        return [v for i, v in defined if i < k <= last_use.get(v.name, -1) and v.name not in cheap]

    n_layers = len(layers)
    cuts = []
    for s in range(1, num_stages):
        first = s * n_layers // num_stages  # the first layer of stage s
        lo, hi = layers[first - 1][-1] + 1, max(layers[first - 1][-1] + 1, starts[first])  # cut before node k
        best = min(range(lo, hi + 1), key=lambda k: (len(crossing(k)), -k))
        cuts.append(best)
    bounds = [0, *cuts, len(g.nodes)]
    graphs, sent = [], []
    for s in range(num_stages):
        receives = [v.name for v in crossing(bounds[s])] if s else []
        sends = [v.name for v in crossing(bounds[s + 1])] if s < num_stages - 1 else None
        graphs.append(_stage_graph(g, bounds[s], bounds[s + 1], receives, sends, cheap, s, num_stages))
        if sends is not None:
            sent.append(sends)
    return Stages(graphs, sent)


def _layer_start(g: Graph, index: dict, writer) -> int:
    """Where a layer's own work begins: its earliest q/k/v projection (a linear reached back from the op that
    writes its cache), so that a cut leaves the previous layer's output projection and MLP before it."""
    first = index[id(writer)]
    for v in writer.inputs[:3]:
        while v.producer is not None and not has_trait(v.producer.op, "linear") and v.producer.inputs:
            v = v.producer.inputs[0]
        if v.producer is not None:
            first = min(first, index[id(v.producer)])
    return first


def _recomputable(g: Graph) -> dict[str, int]:
    """Values (name -> producer index) that the step's inputs, params and constants alone determine through
    cheap ops (no GEMM, embedding, attention or collective): every stage recomputes what it needs of them."""
    out: dict[str, int] = {}
    ok = {v.name for v in g.inputs if not v.name.startswith(("kv_cache.", "kv_scale."))} | {p.name for p in g.params}
    for i, n in enumerate(g.nodes):
        fam = get_op(n.op).family
        if fam in NOT_RECOMPUTED or has_trait(n.op, "no_fold"):
            continue
        if all(v.name in ok or v.name in out for v in n.inputs):
            for v in n.outputs:
                out[v.name] = i
    return out


def _stage_graph(g: Graph, lo: int, hi: int, receives: list[str], sends: list[str] | None, cheap: dict[str, int],
                 stage: int, num_stages: int) -> Graph:
    """Nodes [lo, hi) of g (and the cheap producers of what they read from before lo) as a graph of its own."""
    s = graph_from_dict(graph_to_dict(g))
    s.weights = WeightStore(g.weights.tensors)
    keep = set(range(lo, hi))
    need = [v.name for n in s.nodes[lo:hi] for v in n.inputs]
    while need:  # the cheap cone of what the stage reads from earlier nodes
        name = need.pop()
        i = cheap.get(name)
        if i is not None and i < lo and i not in keep:
            keep.add(i)
            need += [v.name for v in s.nodes[i].inputs]
    vals = s.values()
    for name in receives:
        v = vals[name]
        v.producer, v.kind = None, "input"
    s.nodes = [n for i, n in enumerate(s.nodes) if i in keep]
    s.outputs = [vals[name] for name in sends] if sends is not None else s.outputs
    used = {v.name for n in s.nodes for v in n.inputs} | {v.name for v in s.outputs}
    s.inputs = [v for v in s.inputs if v.name in used] + [vals[name] for name in receives]
    s.remove_unused_params()
    s.meta["pipeline"] = {"stage": stage, "size": num_stages, "receives": receives, "sends": sends or []}
    verify(s)
    return s
