"""Shard: rewrite a paged graph into one tensor-parallel rank's share (column/row parallel, collectives).

The runtime shards at load (`--tensor-parallel-size N`, llmc/ir/sharding.py), so the default pipeline
never runs this pass; it is here to look at one rank's graph (`llmc compile --pass shard{tp_size=2}
--dump-ir DIR`) and to test the rewrite as IR before and after.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.ir.sharding import shard_graph
from llmc.passes.fuse_linear_epilogue import fuse_swiglu_epilogues
from llmc.passes.manager import Pass, PassResult, register_pass


@register_pass
@dataclass
class Shard(Pass):
    """Rank `rank` of `tp_size` (see llmc/ir/sharding.py for the rules); `expert_parallel`: MoE experts split
    by expert."""

    name: ClassVar[str] = "shard"
    tp_size: int = 2
    rank: int = 0
    expert_parallel: bool = False

    def run(self, g, ctx):
        if self.tp_size == 1:
            return PassResult(g, False)
        g = shard_graph(g, self.tp_size, self.rank, self.expert_parallel)
        fuse_swiglu_epilogues(g)  # as a worker does after sharding
        return PassResult(g, True, {k: v for k, v in g.meta["tensor_parallel"].items() if k != "replicated"})
