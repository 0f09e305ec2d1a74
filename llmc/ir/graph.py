"""The graph: SSA values, nodes, and a weight store kept beside it.

`Graph` = inputs (runtime tensors), params (named weights whose data lives in a `WeightStore`),
an ordered list of `Node`s in topological order, and outputs.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from llmc.errors import IRError
from llmc.ir.types import SymDim, TensorType


class Value:
    """An SSA value: a graph input, a param, or an output of one node."""

    __slots__ = ("name", "type", "producer", "kind")

    def __init__(self, name: str, type: TensorType, producer: "Node | None" = None, kind: str = "node"):
        self.name, self.type, self.producer, self.kind = name, type, producer, kind

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(eq=False)
class Node:
    """One op application. `meta` keeps the source location the node came from."""

    op: str
    inputs: list[Value]
    attrs: dict[str, Any]
    outputs: list[Value] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def out(self) -> Value:
        if len(self.outputs) != 1:
            raise IRError(f"node {self.op} has {len(self.outputs)} outputs, not one")
        return self.outputs[0]

    def __repr__(self) -> str:
        return f"<{self.op} -> {', '.join(v.name for v in self.outputs)}>"


class WeightStore:
    """Named weight tensors, held outside the graph so that graphs stay cheap to copy and print."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None):
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise IRError(f"weight {name!r} is not in the weight store") from None

    def __setitem__(self, name: str, t: torch.Tensor) -> None:
        self.tensors[name] = t

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def pop(self, name: str) -> torch.Tensor:
        return self.tensors.pop(name)

    def bytes_by_dtype(self) -> dict[str, int]:
        from llmc.ir.types import dtype_name
        out: dict[str, int] = {}
        for t in self.tensors.values():
            k = dtype_name(t.dtype)
            out[k] = out.get(k, 0) + t.numel() * t.element_size()
        return out


class Graph:
    """An SSA dataflow graph. Build it with `add_input`, `add_param` and `add_node`."""

    def __init__(self, name: str = "main"):
        self.name = name
        self.inputs: list[Value] = []
        self.params: list[Value] = []
        self.nodes: list[Node] = []
        self.outputs: list[Value] = []
        self.dims: dict[str, SymDim] = {}
        self.meta: dict[str, Any] = {}
        self.weights = WeightStore()
        self._names: set[str] = set()
        self._counter = itertools.count()

    # -- construction -------------------------------------------------------------------------
    def fresh(self, hint: str = "") -> str:
        """A value name not used yet in this graph."""
        if hint and hint not in self._names:
            return hint
        while True:
            n = f"{hint}{next(self._counter)}" if hint else str(next(self._counter))
            if n not in self._names:
                return n

    def _claim(self, name: str) -> str:
        if name in self._names:
            raise IRError(f"value name %{name} is defined twice")
        self._names.add(name)
        return name

    def add_dim(self, name: str, min: int = 1, max: int | None = None) -> SymDim:
        d = SymDim(name, min, max)
        self.dims[name] = d
        return d

    def add_input(self, name: str, type: TensorType) -> Value:
        v = Value(self._claim(name), type, None, "input")
        self.inputs.append(v)
        return v

    def add_param(self, name: str, tensor: torch.Tensor | None = None, type: TensorType | None = None) -> Value:
        """Declare a weight. With `tensor`, its data goes into the weight store under `name`."""
        if tensor is not None:
            self.weights[name] = tensor
            type = type or TensorType.of(tensor)
        if type is None:
            raise IRError(f"param {name} needs a tensor or a type")
        v = Value(self._claim(name), type, None, "param")
        self.params.append(v)
        return v

    def make_node(self, op: str, inputs: Iterable[Value], attrs: dict | None = None,
                  names: list[str] | None = None, meta: dict | None = None,
                  types: list[TensorType] | None = None) -> Node:
        """A node with inferred (or given) output types, not yet placed in the graph."""
        from llmc.ir.ops import get_op
        opdef = get_op(op)
        inputs = list(inputs)
        attrs = opdef.complete_attrs(dict(attrs or {}))
        node = Node(op, inputs, attrs, [], dict(meta or {}))
        types = types or opdef.infer(node)
        if names is None:
            names = [self.fresh() for _ in types]
        node.outputs = [Value(self._claim(n), t, node) for n, t in zip(names, types)]
        return node

    def add_node(self, op: str, inputs: Iterable[Value], attrs: dict | None = None, **kw) -> Node:
        node = self.make_node(op, inputs, attrs, **kw)
        self.nodes.append(node)
        return node

    def call(self, op: str, *inputs: Value, **attrs) -> Value:
        """Append a single-output node and return its value: `g.call("add", a, b)`."""
        return self.add_node(op, inputs, attrs).out

    def insert_before(self, anchor: Node, node: Node) -> Node:
        self.nodes.insert(self.nodes.index(anchor), node)
        return node

    # -- queries ------------------------------------------------------------------------------
    def users(self) -> dict[Value, list[Node]]:
        out: dict[Value, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                if v is not None:
                    out.setdefault(v, []).append(n)
        return out

    def values(self) -> dict[str, Value]:
        vals = {v.name: v for v in self.inputs + self.params}
        for n in self.nodes:
            for v in n.outputs:
                vals[v.name] = v
        return vals

    def param_tensor(self, v: Value) -> torch.Tensor:
        return self.weights[v.name]

    def op_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.op] = out.get(n.op, 0) + 1
        return dict(sorted(out.items()))

    # -- mutation -----------------------------------------------------------------------------
    def rename(self, v: Value, name: str) -> None:
        self._names.discard(v.name)
        v.name = self._claim(name)

    def replace_uses(self, old: Value, new: Value) -> None:
        for n in self.nodes:
            n.inputs = [new if v is old else v for v in n.inputs]
        self.outputs = [new if v is old else v for v in self.outputs]

    def remove_nodes(self, dead: Iterable[Node]) -> None:
        dead = set(map(id, dead))
        for n in self.nodes:
            if id(n) in dead:
                for v in n.outputs:
                    self._names.discard(v.name)
        self.nodes = [n for n in self.nodes if id(n) not in dead]

    def remove_unused_params(self) -> int:
        used = {v for n in self.nodes for v in n.inputs} | set(self.outputs)
        dead = [p for p in self.params if p not in used]
        for p in dead:
            self.params.remove(p)
            self._names.discard(p.name)
            if p.name in self.weights:
                self.weights.pop(p.name)
        return len(dead)

    def toposort(self) -> None:
        """Reorder nodes topologically, keeping the current order where it is already valid."""
        ready = set(self.inputs) | set(self.params)
        pending, order = list(self.nodes), []
        while pending:
            rest = []
            for n in pending:
                if all(v in ready for v in n.inputs if v is not None):
                    order.append(n)
                    ready.update(n.outputs)
                else:
                    rest.append(n)
            if len(rest) == len(pending):
                raise IRError(f"graph has a cycle or a dangling value near {rest[0]!r}")
            pending = rest
        self.nodes = order

    def clone(self) -> "Graph":
        """A structural copy sharing the weight tensors (weights are immutable by convention)."""
        from llmc.ir.serialize import graph_from_dict, graph_to_dict
        g = graph_from_dict(graph_to_dict(self))
        g.weights = WeightStore(self.weights.tensors)
        return g

    def nx(self):
        """A networkx DiGraph: one vertex per node (and per input/param), edges along dataflow."""
        import networkx as nx
        G = nx.DiGraph()
        for v in self.inputs + self.params:
            G.add_node(v.name, kind=v.kind, type=str(v.type))
        keys = {id(n): f"n{i}:{n.op}" for i, n in enumerate(self.nodes)}
        for n in self.nodes:
            G.add_node(keys[id(n)], kind="node", op=n.op, node=n)
            for v in n.inputs:
                if v is not None:
                    src = v.name if v.producer is None else keys[id(v.producer)]
                    G.add_edge(src, keys[id(n)], value=v.name)
        return G

    def __str__(self) -> str:
        from llmc.ir.printer import print_graph
        return print_graph(self)

