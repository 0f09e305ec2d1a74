"""The verifier: SSA well-formedness, registered ops, arity, attributes, and re-inferred types."""
from __future__ import annotations

from llmc.errors import IRError
from llmc.ir.graph import Graph, Node
from llmc.ir.ops import get_op


def ir_context(g: Graph, node: Node | None, radius: int = 3) -> str:
    """The IR lines around `node`, with the node marked: for error messages."""
    from llmc.ir.printer import format_attrs
    if node is None or node not in g.nodes:
        return ""
    i = g.nodes.index(node)
    lines = []
    for j in range(max(0, i - radius), min(len(g.nodes), i + radius + 1)):
        n = g.nodes[j]
        outs = ", ".join(f"%{v.name}: {v.type}" for v in n.outputs)
        text = f"{outs} = {n.op}({', '.join('%' + v.name for v in n.inputs)}){format_attrs(n.attrs)}"
        lines.append(("  >> " if j == i else "     ") + text)
    return "\n".join(lines)


def verify(g: Graph, check_weights: bool = False) -> None:
    """Raise IRError naming the first problem and showing the IR around it."""
    defined = set()
    for v in g.inputs + g.params:
        if v.name in defined:
            raise IRError(f"value %{v.name} is defined twice")
        defined.add(v.name)
    for n in g.nodes:
        try:
            opdef = get_op(n.op)
            opdef.check_arity(len(n.inputs))
            for v in n.inputs:
                if v is None or v.name not in defined:
                    raise IRError(f"operand %{getattr(v, 'name', None)} is used before it is defined")
            if set(n.attrs) != set(opdef.attrs):
                raise IRError(f"attributes {sorted(n.attrs)} do not match op {n.op}'s {sorted(opdef.attrs)}")
            types = opdef.infer(n)
            if len(types) != len(n.outputs):
                raise IRError(f"{n.op} produces {len(types)} values, the node names {len(n.outputs)}")
            for v, t in zip(n.outputs, types):
                if v.type.shape != t.shape or v.type.dtype != t.dtype:
                    raise IRError(f"%{v.name} is typed {v.type} but {n.op} gives {t}")
                if v.name in defined:
                    raise IRError(f"value %{v.name} is defined twice")
                defined.add(v.name)
        except IRError as e:
            raise IRError(f"{e}\n{ir_context(g, n)}") from None
    for v in g.outputs:
        if v.name not in defined:
            raise IRError(f"graph output %{v.name} is not defined")
    if check_weights:
        for p in g.params:
            if p.name not in g.weights:
                raise IRError(f"param %{p.name} has no data in the weight store")
            t = g.weights[p.name]
            if tuple(t.shape) != p.type.shape:
                raise IRError(f"param %{p.name} is typed {p.type} but its data has shape {list(t.shape)}")
