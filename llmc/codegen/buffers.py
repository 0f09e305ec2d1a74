"""Static buffer planning: the intermediates of a lowered plan packed into one arena by lifetime.

Every value that a kernel writes (and that is not a graph output) gets a *slot*; values whose
lifetimes do not overlap share a slot. A value's lifetime runs from the step that defines it to
the last step that reads it or any view of it (reshape, transpose, slice, ... alias their source).
Sizes are symbolic in the graph's dims (T tokens, N sequences, ...), so the assignment is made
once, at load, and serves every step: per binding of the dims only the slot sizes (the largest
member of each slot) and their offsets are evaluated, a few microseconds, cached per binding.

Slot choice (greedy, in definition order): a free slot whose members have the same size
expression (the repeated decoder layers hit this case), else the smallest free slot that is large
enough at the reference binding, else the largest free slot (it grows), else a new slot. The
reference binding takes every dim at `reference_size` (the scale at which memory matters).

Example:
    >>> bp = BufferPlan.build(graph, planned=lambda node: True)       # doctest: +SKIP
    >>> layout = bp.layout({"T": 128, "N": 4})                        # doctest: +SKIP
    >>> layout.total_bytes, layout.offsets["h3"]                      # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from llmc.ir.graph import Graph, Node
from llmc.ir.types import dim_eval, dim_mul, make_dim, torch_dtype

ALIAS_OPS = frozenset({"reshape", "expand", "transpose", "permute", "unsqueeze", "squeeze", "slice"})
ALIGN = 256  # bytes: every buffer starts on a boundary the kernels' vector loads like


@dataclass
class Buffer:
    value: str
    nbytes: object  # a Dim (int or SymDim) in bytes
    first: int  # index of the defining step
    last: int  # index of the last step that reads the value or a view of it
    slot: int = -1


@dataclass
class Layout:
    """Byte offsets of every planned value in an arena of `total_bytes`, for one binding of the dims."""
    offsets: dict[str, int]
    sizes: dict[str, int]
    total_bytes: int


@dataclass
class BufferPlan:
    buffers: dict[str, Buffer]
    slots: list[list[str]]  # members of each slot, in definition order
    symbols: tuple[str, ...]  # the dims that the sizes depend on
    _cache: dict[tuple, Layout] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, graph: Graph, planned: Callable[[Node], bool], reference_size: int = 4096) -> "BufferPlan":
        """Plan the outputs of every node for which `planned(node)` holds (its kernel can write into
        a given buffer); graph outputs, and values that a graph output is a view of, stay unplanned."""
        nodes = graph.nodes
        producer = {v.name: i for i, n in enumerate(nodes) for v in n.outputs}
        root: dict[str, str] = {}  # view -> the value whose storage it shares
        for n in nodes:
            if n.op in ALIAS_OPS and n.inputs and n.inputs[0].kind == "node":
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
                if not isinstance(nbytes, int):
                    symbols |= _free_symbols(nbytes)
                buffers[v.name] = Buffer(v.name, nbytes, i, max(last.get(v.name, i), i))
        ref_env = {s: reference_size for s in symbols}
        slots: list[list[str]] = []
        slot_last: list[int] = []
        slot_size: list[int] = []  # at the reference binding
        for b in sorted(buffers.values(), key=lambda b: b.first):
            size = _eval(b.nbytes, ref_env)
            free = [s for s in range(len(slots)) if slot_last[s] < b.first]
            same = [s for s in free if any(buffers[m].nbytes == b.nbytes for m in slots[s])]
            fits = sorted((slot_size[s], s) for s in free if slot_size[s] >= size)
            if same:
                s = same[0]
            elif fits:
                s = fits[0][1]
            elif free:
                s = max(free, key=lambda s: slot_size[s])
            else:
                slots.append([])
                slot_last.append(-1)
                slot_size.append(0)
                s = len(slots) - 1
            slots[s].append(b.value)
            slot_last[s] = b.last
            slot_size[s] = max(slot_size[s], size)
            b.slot = s
        return cls(buffers, slots, tuple(sorted(symbols)))

    def layout(self, env: dict[str, int]) -> Layout:
        """Offsets for the dims in `env` (extra keys are ignored)."""
        key = tuple(env[s] for s in self.symbols)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        sizes = {name: _eval(b.nbytes, env) for name, b in self.buffers.items()}
        offsets, total = {}, 0
        for members in self.slots:
            for m in members:
                offsets[m] = total
            total += -(-max(sizes[m] for m in members) // ALIGN) * ALIGN
        if len(self._cache) > 256:
            self._cache.clear()
        lay = self._cache[key] = Layout(offsets, sizes, total)
        return lay

    def stats(self, env: dict[str, int]) -> dict[str, int]:
        """Arena bytes against the bytes of every planned value held at once (no reuse)."""
        lay = self.layout(env)
        return {"values": len(self.buffers), "slots": len(self.slots), "arena_bytes": lay.total_bytes,
                "unshared_bytes": sum(lay.sizes.values())}


def _eval(nbytes, env: dict[str, int]) -> int:
    return nbytes if isinstance(nbytes, int) else dim_eval(nbytes, env)


def _free_symbols(d) -> set[str]:
    from llmc.ir.types import _compiled
    return set(_compiled(d.name)[1])
