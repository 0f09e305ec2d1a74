"""The paged KV cache of one executor: allocation, dtype, block copies and swapping.

Layouts (one entry per attention layer, named like the graph inputs they feed):
    kv_cache.<i>  [2, NB, BS, Hkv, D]   K and V, in the model dtype or int8 / fp8
    kv_scale.<i>  [NB, Hkv, 2D + 2BS]   only for a quantized cache: per-block centres and per-token scales
The block manager decides which blocks hold what; this class only moves bytes.

Every kernel and reference op reads a cache through its strides, so the order its elements sit in memory is
the cache's own choice (`KV_LAYOUTS`): "tokens" stores a block as [BS, Hkv, D] (a token's kv heads side by
side), "heads" as [Hkv, BS, D] (one kv head's keys of a block contiguous: what a decode attention program,
which reads one kv head, streams), both seen as [2, NB, BS, Hkv, D].
"""
from __future__ import annotations

import os

import torch

from llmc.errors import LLMCError, RequestError
from llmc.ir.graph import Graph
from llmc.ir.kv_layout import kv_cache_inputs, set_kv_cache_dtype
from llmc.ir.paged_attention import scale_width
from llmc.ir.types import torch_dtype

DEFAULT_CPU_KV_BYTES = 512 << 20
KV_LAYOUTS = ("tokens", "heads")


def kv_layout(layout: str | None = None) -> str:
    """The cache layout to allocate: `layout`, else $LLMC_KV_LAYOUT, else "tokens"."""
    layout = layout or os.environ.get("LLMC_KV_LAYOUT") or "tokens"
    if layout not in KV_LAYOUTS:
        raise LLMCError(f"unknown KV cache layout {layout!r} (LLMC_KV_LAYOUT): use one of {', '.join(KV_LAYOUTS)}")
    return layout


def empty_cache(shape: tuple[int, ...], dtype: torch.dtype, device, layout: str, pin_memory: bool = False
                ) -> torch.Tensor:
    """A zeroed [2, NB, BS, Hkv, D] cache whose memory follows `layout` ("heads": [2, NB, Hkv, BS, D] underneath)."""
    if layout == "tokens":
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    two, nb, bs, h, d = shape
    return torch.zeros((two, nb, h, bs, d), dtype=dtype, device=device, pin_memory=pin_memory).transpose(2, 3)


def with_kv_cache_dtype(graph: Graph, kv_cache_dtype: str, device: torch.device) -> Graph:
    """The graph with its caches typed for `kv_cache_dtype` (auto / int8 / fp8): a parameter of the plan,
    chosen at load. A quantized cache always gets the current scale layout, whatever the artifact declared."""
    if kv_cache_dtype == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise LLMCError("an fp8 KV cache needs a GPU with fp8 support (compute capability 8.9+); "
                        "use --kv-cache-dtype int8")
    if kv_cache_dtype != "auto" or graph.meta.get("kv_cache_dtype", "auto") != "auto":
        graph = set_kv_cache_dtype(graph.clone(), kv_cache_dtype)
    return graph


class KVCache:
    """Device (and optional host) tensors of every layer's paged cache.

    Args:
        graph: a paged graph, already typed for the cache dtype (`with_kv_cache_dtype`).
        device: where the cache lives.
        block_size: token slots per block.
        num_blocks: blocks per layer; None sizes the cache from `memory_fraction` of free device memory
            (CUDA) or `DEFAULT_CPU_KV_BYTES` (CPU), at least 16.
        num_cpu_blocks: host blocks for swap preemption (0: no swapping).
        layout: the caches' memory order (`KV_LAYOUTS`); None: $LLMC_KV_LAYOUT, else "tokens".

    Example:
        >>> cache = KVCache(graph, torch.device("cpu"), block_size=16, num_blocks=64)   # doctest: +SKIP
        >>> cache.copy_blocks([(3, 7)])                                                 # doctest: +SKIP
    """

    def __init__(self, graph: Graph, device: torch.device, block_size: int, num_blocks: int | None = None,
                 memory_fraction: float = 0.5, num_cpu_blocks: int = 0, layout: str | None = None):
        if block_size < 1 or (num_blocks is not None and num_blocks < 1) or num_cpu_blocks < 0:
            raise LLMCError("block_size and num_blocks must be >= 1 and num_cpu_blocks >= 0")
        self.device, self.block_size, self.layout = device, block_size, kv_layout(layout)
        caches = kv_cache_inputs(graph)
        # cache name -> (shape without the block dim, dtype); blocks are dim 1 of caches, dim 0 of scales
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {}
        for c in caches:
            _, _, _, heads, dim = c.type.shape
            shapes[c.name] = ((2, block_size, heads, dim), torch_dtype(c.type.dtype), 1)
        for v in graph.inputs:
            if v.name.startswith("kv_scale."):
                cache = next(c for c in caches if c.name.split(".", 1)[1] == v.name.split(".", 1)[1])
                width = scale_width(cache.type.shape[4], block_size)
                shapes[v.name] = ((v.type.shape[1], width), torch_dtype(v.type.dtype), 0)
        per_block = sum(_numel(shape) * dt.itemsize for shape, dt, _ in shapes.values())
        if num_blocks is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                budget = int(free * memory_fraction)
            else:
                budget = DEFAULT_CPU_KV_BYTES
            num_blocks = max(16, budget // per_block)
        self.num_blocks, self.num_cpu_blocks = int(num_blocks), num_cpu_blocks
        self.bytes = per_block * self.num_blocks
        _check_fits(self.bytes, device, f"a KV cache of {self.num_blocks:,} blocks of {block_size} tokens",
                    "lower --num-blocks or --block-size, or leave --num-blocks out to size it from free memory")
        _check_fits(per_block * num_cpu_blocks, torch.device("cpu"), f"{num_cpu_blocks:,} host blocks for swapping",
                    "lower num_cpu_blocks")
        self.tensors = {name: self._zeros(_with_blocks(shape, dim, self.num_blocks), dt, device)
                        for name, (shape, dt, dim) in shapes.items()}
        self.host = {name: self._zeros(_with_blocks(shape, dim, num_cpu_blocks), dt, torch.device("cpu"),
                                       pin_memory=device.type == "cuda")
                     for name, (shape, dt, dim) in shapes.items()} if num_cpu_blocks else {}

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device, pin_memory: bool = False) -> torch.Tensor:
        if len(shape) == 5:  # a K/V cache (scales are [NB, Hkv, W] either way)
            return empty_cache(shape, dtype, device, self.layout, pin_memory)
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate each src block into dst (all layers, K and V, scales)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for t in map(_by_block, self.tensors.values()):
            t[:, dst] = t[:, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block, host block) pairs to host memory (swap preemption)."""
        self._swap(pairs, to_host=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (host block, device block) pairs back to the device."""
        self._swap([(d, h) for h, d in pairs], to_host=False)

    def _swap(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        if not pairs:
            return
        if not self.host:
            raise LLMCError("swap preemption needs host blocks: set num_cpu_blocks > 0")
        dev_idx = torch.tensor([p[0] for p in pairs], device=self.device)
        host_idx = torch.tensor([p[1] for p in pairs])
        for name, t in self.tensors.items():
            t, h = _by_block(t), _by_block(self.host[name])
            if to_host:
                h[:, host_idx] = t[:, dev_idx].cpu()
            else:
                t[:, dev_idx] = h[:, host_idx].to(self.device)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _with_blocks(shape: tuple[int, ...], dim: int, n: int) -> tuple[int, ...]:
    return (*shape[:dim], n, *shape[dim:])


def _by_block(t: torch.Tensor) -> torch.Tensor:
    """A view with blocks on dim 1: caches [2, NB, ...] as they are, scales [NB, ...] as [1, NB, ...]."""
    return t if t.dim() == 5 else t.unsqueeze(0)


def _check_fits(nbytes: int, device: torch.device, what: str, fix: str) -> None:
    """RequestError where `nbytes` are more than `device` has free (the CPU: the memory the OS reports available),
    before anything is allocated: an allocation past it fails deep in torch, or the OS kills the process."""
    if not nbytes:
        return
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _available_host_bytes()
    if free is not None and nbytes > free:
        raise RequestError(f"{what} takes {nbytes / 2 ** 30:,.1f} GiB and the {device.type.upper()} has "
                           f"{free / 2 ** 30:,.1f} GiB free; {fix}")


def _available_host_bytes() -> int | None:
    """The memory Linux reports available (MemAvailable: free plus what it can reclaim), else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
