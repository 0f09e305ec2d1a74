"""Capture a stack of identical decoder layers by exporting two of them.

`torch.export` traces every layer of a model one op at a time: 32 layers of an 8B Llama take most of a
compile's capture. When every layer is the same module with its own weights, llmc exports the model
cut to its first two layers and builds the others in its own IR: layer 1's nodes are copied once per
further layer, each copy reading that layer's weights and the previous copy's output.

Two checks keep this exact, and either one failing means the whole model is exported as before:
- before the export, every layer must have the same submodules, the same plain attributes (all but
  `layer_idx`) and weights of the same names, shapes and dtypes; a config's `layer_types`, where it
  has one, must name one kind;
- after it, layer 1's lowered nodes must match layer 0's one for one (op, attributes, operands), with
  layer 0's output as the only value one layer passes to the next.
"""
from __future__ import annotations

import contextlib
import logging
import re

import torch

from llmc.ir.graph import Graph, Node, Value

log = logging.getLogger(__name__)

EXPORTED_LAYERS = 2
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_of(stack: dict | None) -> int | None:
    """The decoder-layer index of an exported node, from its `nn_module_stack` meta (None outside layers)."""
    for path, _ in (stack or {}).values():
        m = _LAYER.search(path)
        if m:
            return int(m.group(1))
    return None


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """The (dotted name, list) of the model's decoder layers: the ModuleList named `layers` holding
    `num_hidden_layers` modules, or None where there is no single such list."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and name.split(".")[-1] == "layers" and len(m) == n]
    return found[0] if len(found) == 1 else None


def _plain(v) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str, torch.dtype))


def layer_signature(layer: torch.nn.Module) -> tuple:
    """What makes two layers trace alike: each submodule's type and plain attributes, each weight's
    name, shape and dtype. `layer_idx` is left out: HF uses it only to index a KV cache."""
    mods = tuple((name, type(m).__qualname__,
                  tuple(sorted((k, repr(v)) for k, v in vars(m).items()
                               if not k.startswith("_") and k not in ("layer_idx", "training") and _plain(v))))
                 for name, m in layer.named_modules())
    tensors = tuple((name, tuple(t.shape), t.dtype) for name, t in
                    list(layer.named_parameters()) + list(layer.named_buffers()))
    return mods, tensors


def uniform_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """The model's decoder layers where every one traces like the first and there are more than
    EXPORTED_LAYERS of them; None where the whole model must be exported."""
    found = decoder_layers(model)
    if found is None or len(found[1]) <= EXPORTED_LAYERS:
        return None
    kinds = getattr(model.config, "layer_types", None)
    if kinds is not None and len(set(kinds)) > 1:
        return None
    first = layer_signature(found[1][0])
    if any(layer_signature(layer) != first for layer in found[1][1:]):
        return None
    return found


@contextlib.contextmanager
def first_layers(model: torch.nn.Module, layers: torch.nn.ModuleList, keep: int = EXPORTED_LAYERS):
    """The model cut to its first `keep` layers for the duration (layers, config), then restored."""
    parent_name, _, attr = decoder_layers(model)[0].rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    cfg = model.config
    saved = (cfg.num_hidden_layers, getattr(cfg, "layer_types", None))
    setattr(parent, attr, torch.nn.ModuleList(list(layers)[:keep]))
    cfg.num_hidden_layers = keep
    if saved[1] is not None:
        cfg.layer_types = list(saved[1])[:keep]
    try:
        yield
    finally:
        setattr(parent, attr, layers)
        cfg.num_hidden_layers = saved[0]
        if saved[1] is not None:
            cfg.layer_types = saved[1]


class NotRepeatable(Exception):
    """Layer 1's nodes do not repeat layer 0's: the caller exports the whole model."""


def _storage_key(t: torch.Tensor) -> tuple:
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def repeat_layers(g: Graph, prefix: str, num_layers: int, tensors: dict[str, torch.Tensor]) -> None:
    """Grow `g`, captured with layers 0 and 1 of `prefix` (e.g. `model.layers`), to `num_layers` layers.

    Copy k of layer 1 (k = 2 .. num_layers - 1) reads the weights named `{prefix}.k.*` from `tensors`
    and the previous copy's output; what read layer 1's output afterwards reads the last copy's.
    Raises NotRepeatable (leaving `g` as it was) where layer 1 does not repeat layer 0."""
    l0 = [n for n in g.nodes if n.meta.get("layer") == 0]
    l1 = [n for n in g.nodes if n.meta.get("layer") == 1]
    if not l1 or len(l0) != len(l1):
        raise NotRepeatable(f"layer 0 has {len(l0)} nodes, layer 1 {len(l1)}")
    pos = {id(n): (0, j) for j, n in enumerate(l0)} | {id(n): (1, j) for j, n in enumerate(l1)}
    p0, p1 = f"{prefix}.0.", f"{prefix}.1."
    plan = []  # per layer-1 node, per operand: ("inner", j, k) | ("carry", j, k) | ("param", suffix) | ("same", v)
    for a, b in zip(l0, l1):
        if a.op != b.op or a.attrs != b.attrs or len(a.inputs) != len(b.inputs) or len(a.outputs) != len(b.outputs) \
                or [v.type for v in a.outputs] != [v.type for v in b.outputs]:
            raise NotRepeatable(f"{a.op} in layer 0 against {b.op} in layer 1")
        row = []
        for va, vb in zip(a.inputs, b.inputs):
            row.append(_operand(va, vb, pos, p0, p1))
        plan.append(row)
    after = g.nodes.index(l1[-1]) + 1
    if any(pos.get(id(v.producer), (None,))[0] == 0 for n in g.nodes[after:] for v in n.inputs if v is not None) \
            or any(pos.get(id(v.producer), (None,))[0] == 0 for v in g.outputs):
        raise NotRepeatable("a node after the layers reads layer 0")
    if any(n.meta.get("layer") not in (None, 0, 1) for n in g.nodes) or \
            any(id(n) in pos for n in g.nodes[after:]):
        raise NotRepeatable("the layers' nodes are not one run per layer")
    missing = [f"{prefix}.{k}.{arg[0]}" for k in range(EXPORTED_LAYERS, num_layers) for row in plan
               for kind, *arg in row if kind == "param" and f"{prefix}.{k}.{arg[0]}" not in tensors]
    if missing:
        raise NotRepeatable(f"no weight {missing[0]}")

    existing = {_storage_key(g.weights[p.name]): p for p in g.params if p.name in g.weights}
    n_params = len(g.params)
    prev = [n.outputs for n in l1]  # the outputs of the latest layer's nodes, by position
    new_nodes: list[Node] = []
    for k in range(EXPORTED_LAYERS, num_layers):
        outs: list[list[Value]] = []
        for b, row in zip(l1, plan):
            inputs = []
            for kind, *arg in row:
                if kind == "inner":
                    inputs.append(outs[arg[0]][arg[1]])
                elif kind == "carry":
                    inputs.append(prev[arg[0]][arg[1]])
                elif kind == "param":
                    inputs.append(_param(g, f"{prefix}.{k}.{arg[0]}", tensors, existing))
                else:
                    inputs.append(arg[0])
            node = g.make_node(b.op, inputs, dict(b.attrs), meta={**b.meta, "layer": k},
                               types=[v.type for v in b.outputs])
            new_nodes.append(node)
            outs.append(node.outputs)
        prev = outs
    last = {id(v): prev[j][i] for j, n in enumerate(l1) for i, v in enumerate(n.outputs)}
    for n in g.nodes[after:]:
        n.inputs = [last.get(id(v), v) if v is not None else None for v in n.inputs]
    g.outputs = [last.get(id(v), v) for v in g.outputs]
    g.nodes[after:after] = new_nodes
    # the new weights follow layer 1's, in the order a whole export lists them
    added, g.params = g.params[n_params:], g.params[:n_params]
    rank = {p.name[len(p1):]: i for i, p in enumerate(g.params) if p.name.startswith(p1)}

    def place(p: Value) -> tuple[int, int]:
        k, _, suffix = p.name[len(prefix) + 1:].partition(".")
        return int(k), rank[suffix]
    added.sort(key=place)
    at = max((i + 1 for i, p in enumerate(g.params) if p.name.startswith(p1)), default=len(g.params))
    g.params[at:at] = added


def _operand(va: Value | None, vb: Value | None, pos: dict, p0: str, p1: str) -> tuple:
    """How layer 1 gets one operand, checked against layer 0's operand in the same place."""
    if va is None or vb is None:
        if va is not vb:
            raise NotRepeatable("an operand present in one layer only")
        return ("same", None)
    wa, wb = pos.get(id(va.producer)), pos.get(id(vb.producer))
    if wb is not None and wb[0] == 1:  # made inside layer 1: layer 0 makes it in the same place
        if wa != (0, wb[1]) or va.producer.outputs.index(va) != vb.producer.outputs.index(vb):
            raise NotRepeatable("operands made in different places")
        return ("inner", wb[1], vb.producer.outputs.index(vb))
    if wb is not None:  # layer 0's output, passed on: layer 0 reads something from before the layers
        if wa is not None:
            raise NotRepeatable("layer 0 reads a value of its own where layer 1 reads layer 0")
        return ("carry", wb[1], vb.producer.outputs.index(vb))
    if vb.kind == "param" and vb.name.startswith(p1):
        if va.kind != "param" or va.name != p0 + vb.name[len(p1):]:
            raise NotRepeatable(f"{vb.name} against {va.name}")
        return ("param", vb.name[len(p1):])
    if vb.kind == "param" and vb.name.startswith(p0):
        raise NotRepeatable(f"layer 1 reads layer 0's {vb.name}")
    if va is not vb:
        raise NotRepeatable(f"the layers read different values (%{va.name}, %{vb.name})")
    return ("same", vb)


def _param(g: Graph, name: str, tensors: dict[str, torch.Tensor], existing: dict) -> Value:
    t = tensors[name].detach()
    key = _storage_key(t)
    if key not in existing:  # weights shared between layers stay one param, as the export keeps them
        existing[key] = g.add_param(name, t.contiguous())
    return existing[key]
