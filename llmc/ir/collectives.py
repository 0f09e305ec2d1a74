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

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...  # sum over the group; t itself left as it is

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor: ...  # ranks' tensors concatenated on dim


class TorchCollectives:
    """A `torch.distributed` process group (None: the default group).

    On GPUs, an all_reduce of at most `SymmetricAllReduce.MAX_BYTES` (256 KB) goes through PyTorch's symmetric
    memory (one kernel that reads every peer's buffer over NVLink) rather than NCCL, whose latency
    dominates the small all_reduces of a decode step (two per layer). `allreduce` picks: "auto" (symmetric
    memory where it sets up, else NCCL), "nccl" or "symm" (an error where it cannot set up); the
    environment variable LLMC_TP_ALLREDUCE overrides it, for measurements."""

    def __init__(self, group=None, device: torch.device | None = None, allreduce: str = "auto"):
        import os
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.size = dist.get_world_size(group)
        allreduce = os.environ.get("LLMC_TP_ALLREDUCE", allreduce)
        if allreduce not in ("auto", "nccl", "symm"):
            raise IRError(f"all_reduce implementation {allreduce!r}: use auto, nccl or symm")
        self.symm = None
        if allreduce != "nccl" and device is not None and device.type == "cuda" and self.size > 1:
            try:
                self.symm = SymmetricAllReduce(group, device)
            except Exception as e:  # noqa: BLE001 - symmetric memory is optional: NCCL does the same sum
                if allreduce == "symm":
                    raise IRError(f"symmetric-memory all_reduce cannot set up here ({type(e).__name__}: {e}); "
                                  "use LLMC_TP_ALLREDUCE=nccl") from e
        self.allreduce = "symm" if self.symm is not None else "nccl"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.symm is not None and self.symm.fits(t):
            return self.symm(t)
        t = t.clone(memory_format=torch.contiguous_format)
        self.dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)


class SymmetricAllReduce:
    """One-shot all_reduce over symmetric memory (no NVLink multicast): each rank's input is copied into its
    buffer and every rank sums all the buffers, in one kernel (`symm_mem.one_shot_all_reduce_copy`) that
    synchronises the ranks itself, so it is captured in CUDA graphs like any kernel.

    That kernel's barrier comes after its copy, so a rank that runs ahead could overwrite its buffer while
    a peer still reads the last sum's input from it. Calls therefore alternate between two buffers: a
    rank reaching call k + 2 has passed call k + 1's barrier, which its peers reach only after reading
    call k's buffer. (Steps end with the LM head's NCCL all_gather, which orders the ranks the same way
    where one step's last call and the next step's first land on the same buffer.)"""

    # one-shot wins where latency rules (8 KB on two H200s: 6.7 us against NCCL's 22.8); in a TP=2 mixed
    # workload's 128-token decode steps (1 MB) it averaged 28 us a call, waits for the other rank included,
    # where NCCL's ring should do no worse. Until benchmarks/allreduce_bench.py's sweep places the switch,
    # symmetric memory takes up to 32 tokens of a 4096-wide model.
    MAX_BYTES = 1 << 18

    def __init__(self, group, device: torch.device, max_bytes: int | None = None):
        import os

        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        # one-shot reads peers' buffers over plain NVLink mappings: no multicast object is needed (or made)
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.name = (group or dist.group.WORLD).group_name
        self.op = torch.ops.symm_mem.one_shot_all_reduce_copy
        self.max_bytes = max_bytes or self.MAX_BYTES
        self.bufs = []
        for _ in range(2):
            self.bufs.append(symm_mem.empty(self.max_bytes, dtype=torch.uint8, device=device))
            symm_mem.rendezvous(self.bufs[-1], self.name)
        self.calls = 0

    def fits(self, t: torch.Tensor) -> bool:
        return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16, torch.float32) and \
            t.numel() * t.element_size() <= self.max_bytes

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        buf = self.bufs[self.calls % 2].view(t.dtype)[:t.numel()]
        self.calls += 1
        return self.op(buf, t.contiguous().view(-1), "sum", self.name).view(t.shape)


def group_of(env, name: str) -> Collectives:
    groups = env.state.get("process_groups", {}) if env is not None else {}
    if name not in groups:
        raise IRError(f"this graph is sharded: its collective ops run over process group {name!r}, which only the "
                      "distributed executor binds; run it with tensor_parallel_size > 1 "
                      "(`--tensor-parallel-size N`)")
    return groups[name]


def all_reduce_ref(x, a, env):
    # a new tensor (Collectives.all_reduce leaves x alone): the kernel plan may have placed x in its arena
    return group_of(env, a["group"]).all_reduce(x[0])


def all_gather_ref(x, a, env):
    g = group_of(env, a["group"])
    if g.size != a["size"]:
        raise IRError(f"all_gather over {a['size']} ranks runs in a group of {g.size}")
    return g.all_gather(x[0], a["dim"])
