"""The reference executor: runs any graph with the ops' torch reference implementations, on CPU or CUDA."""
from __future__ import annotations

from typing import Mapping

import torch

from llmc.errors import IRError
from llmc.ir.graph import Graph
from llmc.ir.ops import RefEnv, get_op
from llmc.ir.types import SymDim, torch_dtype
from llmc.ir.verify import ir_context


def bind_dims(g: Graph, inputs: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Symbol values from the actual input shapes, checked against each symbol's range."""
    env: dict[str, int] = {}
    for v in g.inputs:
        t = inputs[v.name]
        if t.dim() != v.type.rank:
            raise IRError(f"input %{v.name} has rank {t.dim()}, the graph expects {v.type}")
        for d, n in zip(v.type.shape, t.shape):
            if isinstance(d, int):
                if d != n:
                    raise IRError(f"input %{v.name} has shape {list(t.shape)}, the graph expects {v.type}")
            elif d.name in g.dims or d.name.isidentifier():
                if env.setdefault(d.name, n) != n:
                    raise IRError(f"dim {d.name} is {env[d.name]} in one input and {n} in %{v.name}")
                sd = g.dims.get(d.name)
                if sd and (n < sd.min or (sd.max is not None and n > sd.max)):
                    raise IRError(f"dim {d.name}={n} of input %{v.name} is outside its range "
                                  f"[{sd.min}, {sd.max}]")
    return env


class Interpreter:
    """Runs a graph; weights are moved to `device` once and reused across calls."""

    def __init__(self, graph: Graph, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
        self.graph = graph
        self.device = torch.device(device)
        self.params = {p.name: graph.weights[p.name].to(self.device) for p in graph.params}
        self.state: dict = {}

    def run(self, inputs: Mapping[str, torch.Tensor] | None = None, observe=None,
            **kw: torch.Tensor) -> list[torch.Tensor]:
        """Run the graph. `observe(node, operands)`, when given, sees every node's operand tensors before
        the node runs (calibration collects activation statistics this way)."""
        g = self.graph
        inputs = {**(inputs or {}), **kw}
        missing = [v.name for v in g.inputs if v.name not in inputs]
        if missing:
            raise IRError(f"graph {g.name} needs inputs {missing}")
        env = RefEnv(bind_dims(g, inputs), self.state)
        vals: dict[str, torch.Tensor] = {v.name: inputs[v.name].to(self.device) for v in g.inputs}
        vals.update(self.params)
        last_use = {}
        for i, n in enumerate(g.nodes):
            for v in n.inputs:
                last_use[v.name] = i
        keep = {v.name for v in g.outputs} | set(self.params)
        for i, n in enumerate(g.nodes):
            args = [vals[v.name] for v in n.inputs]
            if observe is not None:
                observe(n, args)
            try:
                out = get_op(n.op).ref(args, n.attrs, env)
            except Exception as e:
                raise IRError(f"{n.op} failed in the interpreter: {e}\n{ir_context(g, n)}") from e
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for v, t in zip(n.outputs, outs):
                vals[v.name] = t.to(self.device) if t.device != self.device else t
            for v in n.inputs:  # free intermediates after their last use
                if last_use.get(v.name) == i and v.name not in keep and v.name in vals and v.kind == "node":
                    del vals[v.name]
        return [vals[v.name] for v in g.outputs]


def run_graph(g: Graph, inputs: Mapping[str, torch.Tensor], device="cpu") -> list[torch.Tensor]:
    return Interpreter(g, device).run(inputs)
