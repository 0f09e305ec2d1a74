"""JSON form of a graph, for the artifact. Types are stored in their text form."""
from __future__ import annotations

from typing import Any

from llmc.errors import IRError
from llmc.ir.graph import Graph
from llmc.ir.ops import OPS
from llmc.ir.printer import _jsonable, parse_type

GRAPH_FORMAT = 1


def graph_to_dict(g: Graph) -> dict[str, Any]:
    return {
        "format": GRAPH_FORMAT,
        "name": g.name,
        "dims": [{"name": d.name, "min": d.min, "max": d.max} for d in g.dims.values()],
        "inputs": [{"name": v.name, "type": str(v.type)} for v in g.inputs],
        "params": [{"name": v.name, "type": str(v.type)} for v in g.params],
        "nodes": [{"op": n.op, "inputs": [v.name for v in n.inputs],
                   "outputs": [{"name": v.name, "type": str(v.type)} for v in n.outputs],
                   "attrs": _jsonable(n.attrs), "meta": _jsonable(n.meta)} for n in g.nodes],
        "outputs": [v.name for v in g.outputs],
        "meta": _jsonable(g.meta),
    }


def graph_from_dict(d: dict[str, Any]) -> Graph:
    if d.get("format") != GRAPH_FORMAT:
        raise IRError(f"graph JSON format {d.get('format')!r} is not supported (this llmc reads {GRAPH_FORMAT})")
    unknown = sorted({nd["op"] for nd in d["nodes"]} - set(OPS))
    if unknown:
        raise IRError(f"the graph uses op(s) {', '.join(map(repr, unknown))}, which no loaded code registers: a "
                      "user's pass put them there at compile time. Import the Python file that registers them "
                      "(register_op) first: `--plugin FILE.py` on the llmc command line, or `import` it in "
                      "Python (llmc never imports code from an artifact)")
    g = Graph(d["name"])
    for dm in d["dims"]:
        g.add_dim(dm["name"], dm["min"], dm["max"])
    vals = {}
    for v in d["inputs"]:
        vals[v["name"]] = g.add_input(v["name"], parse_type(v["type"]))
    for v in d["params"]:
        vals[v["name"]] = g.add_param(v["name"], type=parse_type(v["type"]))
    for nd in d["nodes"]:
        try:
            args = [vals[n] for n in nd["inputs"]]
        except KeyError as e:
            raise IRError(f"graph JSON: node {nd['op']} uses undefined value %{e.args[0]}") from None
        node = g.add_node(nd["op"], args, nd["attrs"], names=[o["name"] for o in nd["outputs"]],
                          types=[parse_type(o["type"]) for o in nd["outputs"]], meta=nd.get("meta", {}))
        vals.update({v.name: v for v in node.outputs})
    g.outputs = [vals[n] for n in d["outputs"]]
    g.meta = dict(d.get("meta", {}))
    return g
