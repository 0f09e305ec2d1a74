"""Static buffer planning: the intermediates of a lowered plan packed into one arena by lifetime.

Every value that a kernel writes (and that is not a graph output) is planned. A value's lifetime
runs from the step that defines it to the last step that reads it or any view of it (the lowered
plan says which steps are views: reshape, transpose, slice, ... alias their source). Two values
may share bytes only if their lifetimes are disjoint.

Placement is greedy by size (as in TFLite's planner): values are taken largest first and each goes
to the lowest offset where it overlaps no already placed value that is alive at the same time.
The result is usually within a few percent of the lower bound, the most bytes alive at any one
step, and it beats a caching allocator's peak because the whole schedule is known in advance.

Sizes are symbolic in the graph's dims (T tokens, N sequences, ...). Lifetimes are found once, at
load; the placement is made per *bucket* of the dims (exact up to 64, then 8 buckets per
doubling, so at most 12.5% over the exact sizes) at a few milliseconds each and cached, so an
engine sees each bucket once. A placement is valid for every binding in its bucket because sizes
only grow with the dims. The exact sizes and offsets of one binding are cached too.

Example:
    >>> bp = BufferPlan.build(graph, planned=lambda n: True, aliases=lambda n: n.op == "reshape")  # doctest: +SKIP
    >>> layout = bp.layout({"T": 128, "N": 4})                        # doctest: +SKIP
    >>> layout.total_bytes, layout.offsets["h3"]                      # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from llmc.ir.graph import Graph, Node
from llmc.ir.types import dim_eval, dim_mul, dim_symbols, make_dim, torch_dtype

ALIGN = 256  # bytes: every buffer starts on a boundary the kernels' vector loads like


@dataclass
class Buffer:
    value: str
    nbytes: object  # a Dim (int or SymDim) in bytes
    first: int  # index of the defining step
    last: int  # index of the last step that reads the value or a view of it


@dataclass
class Layout:
    """Byte offsets and exact sizes of every planned value in an arena of `total_bytes`, for one
    binding of the dims."""
    offsets: dict[str, int]
    sizes: dict[str, int]
    total_bytes: int


@dataclass
class BufferPlan:
    buffers: dict[str, Buffer]
    symbols: tuple[str, ...]  # the dims that the sizes depend on
    _placements: dict[tuple, tuple[dict[str, int], int]] = field(default_factory=dict, repr=False)
    _layouts: dict[tuple, Layout] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, graph: Graph, planned: Callable[[Node], bool], aliases: Callable[[Node], bool]) -> "BufferPlan":
        """Plan the outputs of every node for which `planned(node)` holds (its kernel can write into
        a given buffer); `aliases(node)`: the node's output is a view of its first input. Graph
        outputs, and values that a graph output is a view of, stay unplanned."""
        nodes = graph.nodes
        root: dict[str, str] = {}  # view -> the value whose storage it shares
        for n in nodes:
            if aliases(n) and n.inputs and n.inputs[0].kind == "node":
                src = n.inputs[0].name
                root[n.outputs[0].name] = root.get(src, src)
        last: dict[str, int] = {}
        for i, n in enumerate(nodes):
            for v in n.inputs:
                r = root.get(v.name, v.name)
                last[r] = max(last.get(r, -1), i)
        escaping = {root.get(v.name, v.name) for v in graph.outputs}
        buffers: dict[str, Buffer] = {}
        symbols: set[str] = set()
        for i, n in enumerate(nodes):
            if not planned(n):
                continue
            for v in n.outputs:
                if v.name in escaping or v.name in root:
                    continue
                nbytes = dim_mul(*[make_dim(d) for d in v.type.shape], torch_dtype(v.type.dtype).itemsize)
                symbols |= dim_symbols(nbytes)
                buffers[v.name] = Buffer(v.name, nbytes, i, max(last.get(v.name, i), i))
        return cls(buffers, tuple(sorted(symbols)))

    def layout(self, env: dict[str, int]) -> Layout:
        """Offsets and sizes for the dims in `env` (extra keys are ignored)."""
        key = tuple(env[s] for s in self.symbols)
        lay = self._layouts.get(key)
        if lay is not None:
            return lay
        bucket = tuple(_bucket(v) for v in key)
        placed = self._placements.get(bucket)
        if placed is None:
            benv = dict(zip(self.symbols, bucket))
            placed = self._placements[bucket] = self._place({n: _eval(b.nbytes, benv) for n, b in self.buffers.items()})
        if len(self._layouts) > 1024:
            self._layouts.clear()
        sizes = {n: _eval(b.nbytes, env) for n, b in self.buffers.items()}
        lay = self._layouts[key] = Layout(placed[0], sizes, placed[1])
        return lay

    def _place(self, sizes: dict[str, int]) -> tuple[dict[str, int], int]:
        """Greedy, each value at the lowest offset clear of the live placed values, in each of PLACEMENT_ORDERS;
        the order with the smallest arena wins (no one order packs every graph well: largest first packs a
        plain MLP exactly, largest size x lifetime first the one whose gate/up projection writes the product)."""
        best: tuple[dict[str, int], int] | None = None
        for order in PLACEMENT_ORDERS:
            placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
            offsets, total = {}, 0
            for b in sorted(self.buffers.values(), key=lambda b: order(b, sizes[b.value])):
                size = -(-sizes[b.value] // ALIGN) * ALIGN
                off = 0
                for o, e in sorted((o, e) for o, e, f, l in placed if f <= b.last and b.first <= l):
                    if o - off >= size:
                        break
                    off = max(off, e)
                placed.append((off, off + size, b.first, b.last))
                offsets[b.value] = off
                total = max(total, off + size)
            if best is None or total < best[1]:
                best = (offsets, total)
        return best if best is not None else ({}, 0)

    def stats(self, env: dict[str, int]) -> dict[str, int]:
        """Arena bytes against the lower bound (the most bytes alive at one step) and against one
        buffer per value (no reuse)."""
        lay = self.layout(env)
        steps = max((b.last for b in self.buffers.values()), default=-1) + 1
        alive = [0] * steps
        for n, b in self.buffers.items():
            for i in range(b.first, b.last + 1):
                alive[i] += lay.sizes[n]
        return {"values": len(self.buffers), "arena_bytes": lay.total_bytes,
                "peak_live_bytes": max(alive, default=0), "unshared_bytes": sum(lay.sizes.values())}


# the orders `_place` tries: largest first; largest size x lifetime first; longest-lived first
PLACEMENT_ORDERS = (lambda b, size: (-size, b.first),
                    lambda b, size: (-size * (b.last - b.first + 1), b.first),
                    lambda b, size: (b.first - b.last, -size, b.first))


def _bucket(v: int) -> int:
    """v rounded up to one of 8 steps per doubling (exact up to 64)."""
    if v <= 64:
        return v
    step = 1 << (v.bit_length() - 4)
    return -(-v // step) * step


def _eval(nbytes, env: dict[str, int]) -> int:
    return nbytes if isinstance(nbytes, int) else dim_eval(nbytes, env)
