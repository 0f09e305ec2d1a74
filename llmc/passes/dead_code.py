"""Remove nodes whose values nothing uses, and params nothing reads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.passes.manager import Pass, PassResult, register_pass
from llmc.passes.pattern import dead_code


@register_pass
@dataclass
class DeadCode(Pass):
    name: ClassVar[str] = "dead_code"

    def run(self, graph, ctx):
        nodes = dead_code(graph)
        params = graph.remove_unused_params()
        return PassResult(graph, bool(nodes or params), {"nodes": nodes, "params": params})
