"""Collective ops of a sharded graph (`all_reduce`, `all_gather`) and the process groups they run over.

A graph names its groups (`group="tp"`); the executor that runs it binds each name to a `Collectives`
object in the interpreter's (or plan's) state, `state["process_groups"][name]`. The real one wraps a
`torch.distributed` group (NCCL on GPUs, gloo on the CPU); tests bind a threaded stand-in, so that
the same graphs run N ranks inside one process.
"""
from __future__ import annotations

from typing import Protocol

import torch

from llmc.errors import IRError


class Collectives(Protocol):
    """What a sharded graph needs of its process group."""

    size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...  # sum over the group, in place

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor: ...  # ranks' tensors concatenated on dim


class TorchCollectives:
    """A `torch.distributed` process group (None: the default group)."""

    def __init__(self, group=None):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.size = dist.get_world_size(group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)


def group_of(env, name: str) -> Collectives:
    groups = env.state.get("process_groups", {}) if env is not None else {}
    if name not in groups:
        raise IRError(f"this graph is sharded: its collective ops run over process group {name!r}, which only the "
                      "distributed executor binds; run it with tensor_parallel_size > 1 "
                      "(`--tensor-parallel-size N`)")
    return groups[name]


def all_reduce_ref(x, a, env):
    # a copy: references never write their operands (the kernel plan may have placed x in its arena)
    return group_of(env, a["group"]).all_reduce(x[0].clone(memory_format=torch.contiguous_format))


def all_gather_ref(x, a, env):
    g = group_of(env, a["group"])
    if g.size != a["size"]:
        raise IRError(f"all_gather over {a['size']} ranks runs in a group of {g.size}")
    return g.all_gather(x[0], a["dim"])
