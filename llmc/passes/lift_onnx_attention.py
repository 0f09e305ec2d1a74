"""Lift an exported decoder's attention, matmul-scale-mask-softmax-matmul, to one `attention` op.

ONNX exporters decompose attention (and a few other blocks) in their own spellings; this pass
canonicalises those first, so that `lift_patterns` then finds rms_norm, rope and silu_mul as it does
in a captured Hugging Face model:

    reciprocal(sqrt(x)), div(1, sqrt(x))        -> rsqrt(x)
    mul(x, sigmoid(x))                          -> silu(x)
    add(linear(x, w), b)                        -> linear(x, w, b)
    reshape(transpose(reshape(k)))  (k^T of sdpa's export)          -> transpose(k)
    matmul(softmax(q @ k^T * s [+ causal_mask]), v)                 -> attention(q, k, v)
    attention(q, repeat_kv(k), repeat_kv(v))                        -> attention(q, k, v)

`causal_mask` is the op the ONNX frontend puts where an export built its mask (recognised at
compile time as causal or sliding-window); after lifting, nothing uses it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from llmc.ir.graph import Value
from llmc.ir.ops import REQUIRED, register_op
from llmc.ir.types import TensorType, make_dim, torch_dtype
from llmc.passes.manager import Pass, register_pass
from llmc.passes.pattern import P, RewritePass, RewriteRule


def _causal_mask_ref(x, a, env):
    sq, sk = (env.dim(d) for d in a["shape"])
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    allowed = j <= i
    if a["window"]:
        allowed &= j > i - a["window"]
    zero = torch.zeros((), dtype=torch_dtype(a["dtype"]))
    return torch.where(allowed, zero, torch.tensor(float("-inf"), dtype=zero.dtype))


register_op("causal_mask", "attention", (),
            lambda ts, a: TensorType(tuple(make_dim(d) for d in a["shape"]), a["dtype"]), _causal_mask_ref,
            {"shape": REQUIRED, "window": 0, "dtype": "f32"},
            "additive [Sq, Sk] mask: 0 where key j may be seen from query i (j <= i, and j > i - window when "
            "window > 0), -inf elsewhere; made by the ONNX frontend, consumed by lift_onnx_attention",
            traits=("no_fold",))


def scalar(v: Value, g) -> float | None:
    """The value of a literal or a one-element weight, else None."""
    n = v.producer
    if n is not None and n.op == "constant":
        return float(n.attrs["value"])
    if v.kind == "param" and v.name in g.weights and g.weights[v.name].numel() == 1:
        return float(g.weights[v.name].reshape(()))
    return None


def _scaled(v: Value, g) -> tuple[Value, float]:
    """(x, c) for v = x * c or x / c with c a scalar literal; (v, 1.0) otherwise."""
    n = v.producer
    if n is not None and n.op in ("mul", "div"):
        for i in ((0, 1) if n.op == "mul" else (0,)):
            c = scalar(n.inputs[1 - i], g)
            if c is not None and n.inputs[i].type.shape == v.type.shape:
                return n.inputs[i], (c if n.op == "mul" else 1.0 / c)
    return v, 1.0


def _skip_casts(v: Value) -> Value:
    while v.producer is not None and v.producer.op == "cast" and v.producer.inputs[0].type.is_float:
        v = v.producer.inputs[0]
    return v


def _untranspose(v: Value) -> Value | None:
    """k for v = k^T over the last two dims of a rank-4 k."""
    n = v.producer
    if n is None or v.type.rank != 4:
        return None
    if n.op == "transpose" and {n.attrs["dim0"] % 4, n.attrs["dim1"] % 4} == {2, 3}:
        return n.inputs[0]
    if n.op == "permute" and list(n.attrs["dims"]) == [0, 1, 3, 2]:
        return n.inputs[0]
    return None


def _unrepeat(v: Value) -> Value:
    """k for v = repeat_kv(k): reshape(expand(unsqueeze(k, 2), [B, Hkv, n, S, D]), [B, Hkv*n, S, D])."""
    r = v.producer
    if r is None or r.op != "reshape" or v.type.rank != 4:
        return v
    e = r.inputs[0].producer
    if e is None or e.op != "expand" or e.out.type.rank != 5:
        return v
    u = e.inputs[0].producer
    if u is None or u.op != "unsqueeze" or u.attrs["dim"] % 5 != 2:
        return v
    k = u.inputs[0]
    b, hk, s, d = k.type.shape
    eb, ehk, n, es, ed = e.out.type.shape
    if (eb, ehk, es, ed) != (b, hk, s, d) or v.type.shape != (b, make_dim(f"({hk})*({n})"), s, d):
        return v
    return k


def attention_rule() -> RewriteRule:
    def rewrite(b, m):
        g = b.graph
        out = m.root.producer
        p, v = out.inputs
        sm = _skip_casts(p).producer
        if sm is None or sm.op != "softmax" or sm.attrs["dim"] % sm.out.type.rank != sm.out.type.rank - 1:
            return None
        s = _skip_casts(sm.inputs[0])
        causal, window = False, 0
        if s.producer is not None and s.producer.op == "add":
            masks = [i for i, x in enumerate(s.producer.inputs)
                     if x.producer is not None and x.producer.op == "causal_mask"]
            if masks:
                mask = s.producer.inputs[masks[0]].producer
                causal, window = True, int(mask.attrs["window"])
                s = s.producer.inputs[1 - masks[0]]
        s, scale = _scaled(s, g)
        mm = s.producer
        if mm is None or mm.op != "matmul":
            return None
        q, c1 = _scaled(mm.inputs[0], g)
        kt, c2 = _scaled(mm.inputs[1], g)
        k = _untranspose(kt)
        if k is None or q.type.rank != 4:
            return None
        k, v = _unrepeat(k), _unrepeat(v)
        if v.type.rank != 4 or k.type.shape[:3] != v.type.shape[:3] or q.type.shape[3] != k.type.shape[3]:
            return None
        return b.call("attention", q, k, v, scale=float(scale * c1 * c2), causal=causal, window=window)

    return RewriteRule("attention", P.op("matmul").any_args(), rewrite)


def unrepeat_rule() -> RewriteRule:
    def rewrite(b, m):
        n = m.root.producer
        q, k, v = n.inputs
        k2, v2 = _unrepeat(k), _unrepeat(v)
        if k2 is k and v2 is v:
            return None
        return b.call("attention", q, k2, v2, **n.attrs)

    return RewriteRule("unrepeat_kv", P.op("attention").any_args(), rewrite)


def sdpa_transpose_rule() -> RewriteRule:
    """reshape(transpose(reshape(k, [B*H, S, D]), 1, 2), [B, H, D, S]) -> transpose(k, 2, 3)."""
    def rewrite(b, m):
        k = m["k"]
        t = m.node("t")
        if k.type.rank != 3 + 1 or t.out.type.rank != 3 or {t.attrs["dim0"] % 3, t.attrs["dim1"] % 3} != {1, 2}:
            return None
        bb, h, s, d = k.type.shape
        if m.node("flat").out.type.shape[1:] != (s, d) or m.root.type.shape != (bb, h, d, s):
            return None
        return b.call("transpose", k, dim0=2, dim1=3)

    flat = P.op("reshape")(P.any("k")).named("flat")
    return RewriteRule("sdpa_transpose", P.op("reshape")(P.op("transpose")(flat).named("t")), rewrite)


def rsqrt_rule() -> RewriteRule:
    def rewrite(b, m):
        n = m.root.producer
        if n.op == "div" and scalar(n.inputs[0], b.graph) != 1.0:
            return None
        return b.call("rsqrt", m["x"])

    sq = P.op("sqrt")(P.any("x"))
    return RewriteRule("rsqrt", P.op("reciprocal")(sq) | P.op("div", commutative=False)(P.any(), sq), rewrite)


def silu_rule() -> RewriteRule:
    x = P.any("x")
    return RewriteRule("silu", P.op("mul")(x, P.op("sigmoid")(x)), lambda b, m: b.call("silu", m["x"]))


def linear_bias_rule() -> RewriteRule:
    def rewrite(b, m):
        lin = m.node("lin")
        bias = m["b"]
        if len(lin.inputs) != 2 or bias.type.shape != (lin.inputs[1].type.shape[0],):
            return None
        return b.call("linear", lin.inputs[0], lin.inputs[1], bias)

    return RewriteRule("linear_bias", P.op("add")(P.op("linear").any_args().named("lin"), P.param("b").rank(1)),
                       rewrite)


@register_pass
@dataclass
class LiftOnnxAttention(RewritePass, Pass):
    """Canonicalise an ONNX export's spellings and lift its attention (see the module docstring)."""

    name: ClassVar[str] = "lift_onnx_attention"

    def rules(self, ctx):
        return [rsqrt_rule(), silu_rule(), linear_bias_rule(), sdpa_transpose_rule(), attention_rule(),
                unrepeat_rule()]
