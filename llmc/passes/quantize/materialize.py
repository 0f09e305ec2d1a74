"""What the quantization passes share: which linears a plan covers, replacing a linear by a `qlinear`,
and folding a per-input-channel scale into the op that produces a linear's input.

The plan (`graph.meta["quant_plan"]`, written by assign.py, shown by `llmc inspect`) maps each linear,
by module name (its weight param's name without ``.weight``), to a method and a format (None: kept
in the model dtype). Each method's pass (rtn.py, gptq.py, awq.py, smoothquant.py, fp8.py, mixed.py)
materializes the linears planned for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from llmc.ir.graph import Graph, Node, Value
from llmc.ir.quant import QuantFormat, QuantizedWeight
from llmc.passes.manager import Pass, PassContext, PassResult
from llmc.passes.quantize.config import QuantConfig

PLAN = "quant_plan"


def linear_name(node: Node) -> str:
    return node.inputs[1].name.removesuffix(".weight")


def quantizable_linears(g: Graph) -> list[Node]:
    """Dense linears over a float param weight of an even number of input features."""
    return [n for n in g.nodes if n.op == "linear" and n.inputs[1].kind == "param"
            and all(v.kind == "param" for v in n.inputs[2:])
            and g.weights[n.inputs[1].name].dtype.is_floating_point and g.weights[n.inputs[1].name].dim() == 2]


def planned(g: Graph, method: str | None = None) -> list[tuple[Node, dict]]:
    """(node, plan entry) of the linears the plan quantizes (with `method`, if given), in graph order."""
    plan = g.meta.get(PLAN) or {}
    entries = plan.get("linears", {})
    out = []
    for n in quantizable_linears(g):
        e = entries.get(linear_name(n))
        if e and e.get("format") and (method is None or e["method"] == method):
            out.append((n, e))
    return out


def entry_format(e: dict) -> QuantFormat:
    return QuantFormat(**e["format"])


def weight_bits(fmt: QuantFormat | None, w: torch.Tensor) -> float:
    """Bits per weight of w stored in fmt, scales and zero points included (None: as it is)."""
    return 8 * w.element_size() if fmt is None else fmt.bits_per_weight(w.shape[1], w.element_size())


def plan_entry(method: str, fmt: QuantFormat | None, w: torch.Tensor, note: str) -> dict:
    """One linear's entry in the plan: method, format (None: kept in the model dtype), bits, params, note."""
    return {"method": method, "format": None if fmt is None else fmt.to_json(), "bits": round(weight_bits(fmt, w), 4),
            "params": w.numel(), "note": note}


def _module_name(param: str) -> str:
    """A linear's name from its weight param's: `...q_proj.weight` -> `...q_proj`; a fused projection's
    (`...self_attn.fused_qweight`) -> `...self_attn.fused`."""
    for suffix in (".qweight", ".codes", ".weight"):
        param = param.removesuffix(suffix)
    for fused in ("fused_qweight", "fused_codes", "fused_weight"):
        if param.endswith(fused):
            return param.removesuffix(fused) + "fused"
    return param


def plan_from_graph(g: Graph, method: str) -> dict | None:
    """The plan read back from the graph's linears, for a graph quantized by a pass that wrote none (a
    method of the user's own, docs/passes.md): each qlinear's format and bits from its attributes and
    params, each dense linear kept; None where the graph has no quantized linear."""
    from llmc.ir.ops import OPS

    linears, quantized = {}, False
    for n in g.nodes:
        if "linear" not in n.op:  # linear, linear_act, linear_silu_mul, silu_mul_linear, qlinear, qlinear_codes
            continue
        names = [o.rstrip("?*") for o in OPS[n.op].operands] if n.op in OPS else []
        operand = dict(zip(names, n.inputs))
        w = operand.get("qweight") or operand.get("weight")
        if w is None or w.kind != "param":
            continue
        t = g.weights[w.name]
        if "qweight" in operand:
            fmt, k = QuantFormat.from_attrs(n.attrs), n.attrs["in_features"]
            scales = operand["scales"].name
            bits = fmt.bits_per_weight(k, g.weights[scales].element_size() if scales in g.weights else 2)
            linears[_module_name(w.name)] = {"method": method, "format": fmt.to_json(), "bits": round(bits, 4),
                                                "params": t.shape[0] * k, "note": f"{n.op} in the graph"}
            quantized = True
        elif t.dim() == 2 and t.dtype.is_floating_point:
            linears[_module_name(w.name)] = plan_entry(method, None, t, "kept")
    if not quantized:
        return None
    params = sum(e["params"] for e in linears.values())
    return {"method": method, "avg_bits": round(sum(e["bits"] * e["params"] for e in linears.values()) / params, 3),
            "linears": linears}


def by_input(nodes: list[tuple[Node, Any]]) -> dict[Value, list[tuple[Node, Any]]]:
    """Group linears by the value they read (q/k/v, gate/up): they share input statistics and scales."""
    groups: dict[Value, list] = {}
    for item in nodes:
        groups.setdefault(item[0].inputs[0], []).append(item)
    return groups


def replace_with_qlinear(g: Graph, node: Node, qw: QuantizedWeight) -> Node:
    """Put a qlinear over `qw`'s tensors (and the node's bias) in place of the dense linear `node`."""
    base = linear_name(node)
    ins = [node.inputs[0]] + [g.add_param(g.fresh(f"{base}.{role}"), t.contiguous())
                              for role, t in zip(("qweight", "scales", "zeros"), qw.tensors())]
    ins += node.inputs[2:]  # the bias stays as it is
    q = g.make_node("qlinear", ins, {**qw.fmt.attrs(qw.in_features), "act": ""}, meta=dict(node.meta))
    g.insert_before(node, q)
    g.replace_uses(node.out, q.out)
    g.remove_nodes([node])
    return q


def attention_v_linear(g: Graph, x: Value) -> tuple[Node, int, int, int] | None:
    """(v_proj, query heads, KV heads, head dim) when x is the attention output flattened over heads,
    ``reshape(transpose(attention(q, k, v)))`` with ``v = transpose(reshape(v_proj(h)))``, every link
    used once; else None. Attention is linear in v: scaling v_proj's rows scales the output's."""
    users = g.users()

    def only(v: Value, op: str | tuple) -> Node | None:
        n = v.producer
        ok = n is not None and n.op in ((op,) if isinstance(op, str) else op) and v not in g.outputs
        return n if ok and len(users.get(v, [])) == 1 else None
    r = x.producer
    t = only(r.inputs[0], "transpose") if r is not None and r.op == "reshape" else None
    att = only(t.inputs[0], ("paged_attention", "attention")) if t is not None else None
    vt = only(att.inputs[2], "transpose") if att is not None else None
    vr = only(vt.inputs[0], "reshape") if vt is not None else None
    lin = only(vr.inputs[0], "linear") if vr is not None else None
    if lin is None or not all(v.kind == "param" and len(users.get(v, [])) == 1 for v in lin.inputs[1:]):
        return None
    hq, hkv, d = att.inputs[0].type.shape[1], att.inputs[2].type.shape[1], att.inputs[2].type.shape[3]
    if not all(isinstance(n, int) for n in (hq, hkv, d)) or hq % hkv or x.type.shape[-1] != hq * d:
        return None
    return lin, hq, hkv, d


def head_tie(g: Graph, x: Value):
    """For an attention output x (see `attention_v_linear`): the projection of a per-channel scale onto
    the scales v_proj's rows can give, one per (KV head, dim), shared by the query heads of a group.
    None for any other x."""
    info = attention_v_linear(g, x)
    if info is None:
        return None
    _, hq, hkv, d = info
    rep = hq // hkv
    return lambda s: s.reshape(hkv, rep, d).mean(1, keepdim=True).expand(hkv, rep, d).reshape(-1)


def fold_input_scale(g: Graph, x: Value, readers: list[Node], s: torch.Tensor) -> str | None:
    """Make the producer of `x` emit ``x / s`` (per channel of x's last dim), exactly, by scaling its
    own weights, so that `readers` can take ``W * s``. Returns what was scaled, or None when x's
    producer cannot absorb the scale (then nothing changes): an rms_norm's weight, the rows of the
    `up` linear that multiplies into a SwiGLU product (``silu(gate) * up``), or v_proj's rows under an
    attention output (s tied across each KV group's query heads: `head_tie`)."""
    users = g.users()
    if set(users.get(x, [])) - set(readers) or x in g.outputs or x.producer is None:
        return None
    info = attention_v_linear(g, x)
    if info is not None:
        lin, hq, hkv, d = info
        per_head = s.reshape(hkv, hq // hkv, d)
        if not torch.allclose(per_head, per_head[:, :1].expand_as(per_head)):
            return None  # not one scale per (KV head, dim): v_proj's rows cannot carry it
        t = per_head[:, 0].reshape(-1)
        _scale_param(g, lin.inputs[1].name, (1 / t)[:, None])
        if len(lin.inputs) > 2:
            _scale_param(g, lin.inputs[2].name, 1 / t)
        return lin.inputs[1].name
    p = x.producer
    if p.op == "rms_norm" and p.inputs[1].kind == "param" and len(users.get(p.inputs[1], [])) == 1:
        _scale_param(g, p.inputs[1].name, 1 / s)
        return p.inputs[1].name
    if p.op in ("silu_mul", "mul"):
        up = p.inputs[1]
        if p.op == "mul" and up.producer is not None and up.producer.op == "silu":
            up = p.inputs[0]
        lin = up.producer
        if (lin is not None and lin.op == "linear" and all(v.kind == "param" for v in lin.inputs[1:])
                and users.get(up, []) == [p] and all(len(users.get(v, [])) == 1 for v in lin.inputs[1:])):
            _scale_param(g, lin.inputs[1].name, (1 / s)[:, None])
            if len(lin.inputs) > 2:
                _scale_param(g, lin.inputs[2].name, 1 / s)
            return lin.inputs[1].name
    return None


def _scale_param(g: Graph, name: str, factor: torch.Tensor) -> None:
    t = g.weights[name]
    g.weights[name] = (t.float() * factor.to(t.device)).to(t.dtype).contiguous()


def scale_dtype(g: Graph, node: Node) -> torch.dtype:
    """Int scales are stored in the activations' dtype (what the kernels multiply in)."""
    from llmc.ir.types import torch_dtype
    return torch_dtype(node.inputs[0].type.dtype)


@dataclass
class QuantizePass(Pass):
    """Base of the per-method passes: quantizes each linear the plan gives `method`, group by group
    (the linears that read one input are passed together, for the methods that scale them jointly).

    Every group's input scale is chosen and folded (`input_scale`) before any group is quantized: a
    scale for down_proj's input lands in up_proj's rows, which must still be dense then."""

    method: ClassVar[str] = ""
    config: QuantConfig = QuantConfig()

    def run(self, g: Graph, ctx: PassContext) -> PassResult:
        groups = by_input(planned(g, self.method))
        if not groups:
            return PassResult(g, False)
        status = ctx.state.get("status") or (lambda msg: None)
        scales = {}
        for k, (x, items) in enumerate(groups.items()):  # AWQ's scale search: most of its pass's time
            status(f"pass {self.name}: scales of input {k + 1}/{len(groups)}")
            scales[x] = self.input_scale(g, ctx, x, items)
        done = 0
        for k, (x, items) in enumerate(groups.items()):
            status(f"pass {self.name}: input {k + 1}/{len(groups)}")
            for node, qw in self.quantize_group(g, ctx, x, items, scales[x]):
                replace_with_qlinear(g, node, qw)
                done += 1
        g.remove_unused_params()
        return PassResult(g, True, {"quantized": done})

    def input_scale(self, g: Graph, ctx: PassContext, x: Value, items: list[tuple[Node, dict]]) -> torch.Tensor | None:
        """A per-channel scale s for the group's input, already folded into x's producer (x arrives as
        x / s; the group's weights are to be taken as W * s), or None."""
        return None

    def quantize_group(self, g: Graph, ctx: PassContext, x: Value, items: list[tuple[Node, dict]],
                       s: torch.Tensor | None) -> list[tuple[Node, QuantizedWeight]]:
        raise NotImplementedError

    @staticmethod
    def weight(g: Graph, node: Node) -> torch.Tensor:
        return g.weights[node.inputs[1].name]

    @staticmethod
    def stats(ctx: PassContext, x: Value):
        from llmc.passes.quantize.calibrate import STATS
        try:
            return ctx.state[STATS][x.name]
        except KeyError:
            raise RuntimeError(f"no calibration statistics for %{x.name}: the calibrate pass must run before "
                               "this one") from None
