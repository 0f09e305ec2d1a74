"""ONNX ops -> llmc IR: one mapping rule per op type.

A rule `rule(imp, node, ins, attrs) -> [outputs]` sees the node's operands as llmc `Value`s (runtime
tensors), `torch.Tensor`s (constants) or `Lazy` values (functions of the symbolic dims only: shape
vectors, ranges, masks; see llmc/frontend/onnx.py) and returns one entry per ONNX output. A node whose
operands are all compile-time values is evaluated instead (llmc/frontend/onnx_eval.py), so the shape
and mask arithmetic of an export never becomes IR.

To support a new op, add a rule with `@onnx_op("OpType")` (and, if it can appear in shape or mask
arithmetic, a torch evaluator with `@const_eval("OpType")` in onnx_eval.py).
"""
from __future__ import annotations

import math
import sys
from typing import Callable

import torch

from llmc.frontend.onnx_eval import BIG, ints, onnx_dtype, reshape_target
from llmc.ir.graph import Value
from llmc.ir.types import broadcast_shapes, dim_div, dim_mul, make_dim

ONNX_OPS: dict[str, Callable] = {}
# op types whose rule a user's file registered (a --plugin): taken in any domain, a custom one too, where
# llmc's own rules are only for the default and com.microsoft domains
USER_OPS: set[str] = set()


def onnx_op(*names: str):
    """Register a mapping rule for ONNX op types (contrib ops by their bare name)."""
    caller = sys._getframe(1).f_globals.get("__name__", "")

    def deco(fn):
        for n in names:
            ONNX_OPS[n] = fn
            if caller != "llmc" and not caller.startswith("llmc."):
                USER_OPS.add(n)
        return fn
    return deco


def _attr_dim(d):
    """A dim as an IR attribute entry: ints stay, symbolic dims become their names."""
    d = make_dim(d)
    return d if isinstance(d, int) else d.name


def _axes(imp, node, ins, attrs, pos: int = 1) -> list[int] | None:
    """Axes from the attribute (older opsets) or the operand at `pos` (newer ones)."""
    if "axes" in attrs:
        return [int(a) for a in attrs["axes"]]
    if len(ins) > pos and ins[pos] is not None:
        return ints(imp.const(ins[pos], node, "axes"))
    return None


# ---------------------------------------------------------------------------------------------
# mapping rules: runtime operands become llmc IR

def _binary(op):
    def rule(imp, node, ins, attrs):
        a, b = imp.binary_operands(ins[0], ins[1], node)
        return [imp.emit(op, [a, b])]
    return rule


for _n, _op in {"Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow"}.items():
    ONNX_OPS[_n] = _binary(_op)


@onnx_op("Add")
def _add(imp, node, ins, attrs):
    for i, j in ((0, 1), (1, 0)):
        if isinstance(ins[i], Value) and imp.is_mask_candidate(ins[j]):
            mask = imp.classify_mask(ins[j], ins[i], "additive", node)
            return [imp.apply_mask(ins[i], mask)]
    a, b = imp.binary_operands(ins[0], ins[1], node)
    return [imp.emit("add", [a, b])]


@onnx_op("Max", "Min")
def _maxmin(imp, node, ins, attrs):
    op = "maximum" if node.op_type == "Max" else "minimum"
    out = imp.ir(ins[0], node)
    for x in ins[1:]:
        a, b = imp.binary_operands(out, x, node)
        out = imp.emit(op, [a, b])
    return [out]


@onnx_op("Where")
def _where(imp, node, ins, attrs):
    cond, x, y = ins
    if isinstance(cond, tuple) and cond[0] == "isnan":
        # Where(IsNaN(p), 0, p): the guard sdpa exports put after a softmax against fully masked rows,
        # which a causal mask never produces
        if y is cond[1] and imp.is_zero(x):
            return [y]
        raise imp.unsupported(node, "IsNaN is only supported as the softmax guard Where(IsNaN(p), 0, p)")
    if imp.is_mask_candidate(cond):
        for keep, fill, allowed_when in ((x, y, True), (y, x, False)):
            if isinstance(keep, Value) and imp.is_large_negative(fill):
                mask = imp.classify_mask(cond, keep, "keep" if allowed_when else "drop", node)
                return [imp.apply_mask(keep, mask)]
    raise imp.unsupported(node, "Where on runtime values is supported only as an attention mask "
                                "(Where(mask, scores, -inf))")


@onnx_op("IsNaN")
def _isnan(imp, node, ins, attrs):
    return [("isnan", ins[0])]


_UNARY = {"Sqrt": "sqrt", "Reciprocal": "reciprocal", "Sigmoid": "sigmoid", "Neg": "neg", "Exp": "exp",
          "Log": "log", "Tanh": "tanh", "Relu": "relu", "Cos": "cos", "Sin": "sin", "Abs": "abs"}
for _n, _op in _UNARY.items():
    ONNX_OPS[_n] = (lambda op: lambda imp, node, ins, attrs: [imp.emit(op, [imp.ir(ins[0], node)])])(_op)


@onnx_op("Gelu")
def _gelu(imp, node, ins, attrs):
    approx = attrs.get("approximate", "none")
    return [imp.emit("gelu", [imp.ir(ins[0], node)], approximate=approx if isinstance(approx, str) else "none")]


@onnx_op("FastGelu")
def _fast_gelu(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    if len(ins) > 1 and ins[1] is not None:
        x = imp.emit("add", [x, imp.ir(ins[1], node)])
    return [imp.emit("gelu", [x], approximate="tanh")]


@onnx_op("Identity")
def _identity(imp, node, ins, attrs):
    return [ins[0]]


@onnx_op("Cast", "CastLike")
def _cast(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    dtype = onnx_dtype(attrs["to"]) if node.op_type == "Cast" else imp.dtype_of(ins[1], node)
    name = imp.ir_dtype(dtype)
    return [x if name == x.type.dtype else imp.emit("cast", [x], dtype=name)]


@onnx_op("Softmax")
def _softmax(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    return [imp.emit("softmax", [x], dim=attrs.get("axis", -1) % x.type.rank)]


@onnx_op("MatMul")
def _matmul(imp, node, ins, attrs):
    a, b = ins
    if isinstance(b, torch.Tensor) and b.dim() == 2:  # x @ W with a weight: llmc's linear takes W as [out, in]
        return [imp.emit("linear", [imp.ir(a, node), imp.weight(b.t().contiguous(), node, ins_name=node.input[1])])]
    return [imp.emit("matmul", [imp.ir(a, node), imp.ir(b, node)])]


@onnx_op("Gemm")
def _gemm(imp, node, ins, attrs):
    a, b = ins[0], ins[1]
    c = ins[2] if len(ins) > 2 else None
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if attrs.get("transA", 0) or not isinstance(b, torch.Tensor):
        raise imp.unsupported(node, "Gemm is supported as a linear layer: Gemm(x, W, bias) with W a weight "
                                    "and transA=0")
    w = (b if attrs.get("transB", 0) else b.t()).contiguous() * alpha
    args = [imp.ir(a, node), imp.weight(w, node, ins_name=node.input[1])]
    if c is not None:
        if not isinstance(c, torch.Tensor) or c.numel() != w.shape[0]:
            raise imp.unsupported(node, "Gemm's C must be a bias vector of the output size")
        args.append(imp.weight((c.reshape(-1) * beta).contiguous(), node, ins_name=node.input[2], suffix="bias"))
    return [imp.emit("linear", args)]


def _reduce(op):
    def rule(imp, node, ins, attrs):
        x = imp.ir(ins[0], node)
        axes = _axes(imp, node, ins, attrs)
        if not axes:
            if attrs.get("noop_with_empty_axes"):
                return [x]
            axes = list(range(x.type.rank))
        return [imp.emit(op, [x], dims=[a % x.type.rank for a in axes], keepdim=bool(attrs.get("keepdims", 1)))]
    return rule


ONNX_OPS["ReduceMean"] = _reduce("mean")
ONNX_OPS["ReduceSum"] = _reduce("sum")
ONNX_OPS["ReduceMax"] = _reduce("amax")


@onnx_op("Reshape")
def _reshape(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    shape = imp.dims(ins[1], node)
    shape = reshape_target(list(x.type.shape), shape, attrs.get("allowzero", 0))
    if -1 in shape:  # resolved here so that a reshape to the same shape is seen as the no-op it is
        known = [make_dim(d) for d in shape if d != -1]
        shape = [dim_div(x.type.numel(), dim_mul(*known) if known else 1) if d == -1 else d for d in shape]
    if list(x.type.shape) == [make_dim(d) for d in shape]:
        return [x]
    return [imp.emit("reshape", [x], shape=[_attr_dim(d) for d in shape])]


@onnx_op("Flatten")
def _flatten(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    ax = attrs.get("axis", 1)
    ax = ax + x.type.rank if ax < 0 else ax
    lead = dim_mul(*x.type.shape[:ax]) if ax else 1
    rest = dim_mul(*x.type.shape[ax:]) if ax < x.type.rank else 1
    return [imp.emit("reshape", [x], shape=[_attr_dim(lead), _attr_dim(rest)])]


@onnx_op("Expand")
def _expand(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    shape = broadcast_shapes(tuple(x.type.shape), tuple(make_dim(d) for d in imp.dims(ins[1], node)))
    if shape == tuple(x.type.shape):
        return [x]
    return [imp.emit("expand", [x], shape=[_attr_dim(d) for d in shape])]


@onnx_op("Transpose")
def _transpose(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    perm = list(attrs.get("perm") or reversed(range(x.type.rank)))
    moved = [i for i, p in enumerate(perm) if p != i]
    if not moved:
        return [x]
    if len(moved) == 2:
        return [imp.emit("transpose", [x], dim0=moved[0], dim1=moved[1])]
    return [imp.emit("permute", [x], dims=perm)]


@onnx_op("Unsqueeze")
def _unsqueeze(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    axes = _axes(imp, node, ins, attrs)
    rank = x.type.rank + len(axes)
    for ax in sorted(a % rank for a in axes):
        x = imp.emit("unsqueeze", [x], dim=ax)
    return [x]


@onnx_op("Squeeze")
def _squeeze(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    axes = _axes(imp, node, ins, attrs)
    if axes is None:
        axes = [i for i, d in enumerate(x.type.shape) if d == 1]
    for ax in sorted((a % x.type.rank for a in axes), reverse=True):
        x = imp.emit("squeeze", [x], dim=ax)
    return [x]


@onnx_op("Concat")
def _concat(imp, node, ins, attrs):
    parts = [x for x in ins if not imp.is_empty_along(x, attrs["axis"], node)]
    vals = [imp.ir(x, node) for x in parts]
    if len(vals) == 1:
        return [vals[0]]
    return [imp.emit("concat", vals, dim=attrs["axis"] % vals[0].type.rank)]


@onnx_op("Split")
def _split(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    ax = attrs.get("axis", 0) % x.type.rank
    size = x.type.shape[ax]
    sizes = attrs.get("split") or (ints(imp.const(ins[1], node, "split")) if len(ins) > 1 and ins[1] is not None
                                   else None)
    if sizes is None:
        if not isinstance(size, int):
            raise imp.unsupported(node, f"splitting the symbolic dim {size} into equal parts")
        n = attrs.get("num_outputs", len(node.output))
        step = -(-size // n)
        sizes = [min(step, size - i) for i in range(0, size, step)]
    outs, start = [], 0
    for n in sizes:
        outs.append(imp.emit("slice", [x], dim=ax, start=start, end=start + n, step=1))
        start += n
    return outs


@onnx_op("Slice")
def _slice(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    starts, ends = imp.dims(ins[1], node), imp.dims(ins[2], node)
    axes = ints(imp.const(ins[3], node, "axes")) if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
    steps = ints(imp.const(ins[4], node, "steps")) if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    for s, e, ax, st in zip(starts, ends, axes, steps):
        ax %= x.type.rank
        size = x.type.shape[ax]
        if isinstance(e, int) and e >= BIG or make_dim(e) == size:
            e = None
        if not isinstance(s, int) or (e is not None and not isinstance(e, int)) or st < 1:
            raise imp.unsupported(node, f"a slice [{s}:{e}:{st}] of dim {size} (symbolic bounds or a negative step)")
        if isinstance(size, int):
            s, e, _ = slice(s, e, st).indices(size)
        elif s < 0 or (e is not None and e < 0):
            raise imp.unsupported(node, f"a slice from the end [{s}:{e}] of the symbolic dim {size}")
        if s == 0 and st == 1 and (e is None or e == size):
            continue
        x = imp.emit("slice", [x], dim=ax, start=s, end=e, step=st)
    return [x]


@onnx_op("Gather")
def _gather(imp, node, ins, attrs):
    data, idx = ins
    ax = attrs.get("axis", 0)
    if isinstance(data, torch.Tensor) and data.dim() == 2 and ax == 0 and isinstance(idx, Value):
        return [imp.emit("embedding", [imp.weight(data, node, ins_name=node.input[0]), idx])]
    x = imp.ir(data, node)
    ax %= x.type.rank
    if isinstance(idx, torch.Tensor) and idx.dim() == 0:
        i = int(idx)
        if i < 0:
            if not isinstance(x.type.shape[ax], int):
                raise imp.unsupported(node, "a negative index into a symbolic dim")
            i += x.type.shape[ax]
        s = imp.emit("slice", [x], dim=ax, start=i, end=i + 1, step=1)
        return [imp.emit("squeeze", [s], dim=ax)]
    return [imp.emit("gather", [x, imp.ir(idx, node)], dim=ax)]


@onnx_op("ConstantOfShape")
def _constant_of_shape(imp, node, ins, attrs):
    v = attrs.get("value")
    v = v if v is not None else torch.zeros(1)
    c = imp.emit("constant", [], value=v.reshape(-1)[0].item(), dtype=imp.ir_dtype(v.dtype))
    return [imp.emit("expand", [c], shape=[_attr_dim(d) for d in imp.dims(ins[0], node)])]


@onnx_op("Range")
def _range(imp, node, ins, attrs):
    # under llmc's contract (each sequence's tokens at positions 0..S-1) arange(0, S) is the positions row
    start, limit, delta = (imp.dims(x, node) for x in ins)
    if start == [0] and delta == [1] and [make_dim(d) for d in limit] == [imp.seq_dim]:
        return [imp.positions_row()]
    raise imp.unsupported(node, "a Range other than arange(0, sequence length) on the runtime path")


@onnx_op("LayerNormalization")
def _layer_norm(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    if attrs.get("axis", -1) % x.type.rank != x.type.rank - 1:
        raise imp.unsupported(node, "LayerNormalization over other than the last axis")
    args = [x] + [imp.ir(t, node) for t in ins[1:3] if t is not None]
    return [imp.emit("layer_norm", args, eps=float(attrs.get("epsilon", 1e-5))), None, None]


@onnx_op("RMSNormalization", "SimplifiedLayerNormalization")
def _rms_norm(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    if attrs.get("axis", -1) % x.type.rank != x.type.rank - 1:
        raise imp.unsupported(node, f"{node.op_type} over other than the last axis")
    w = imp.ir(ins[1], node)
    return [imp.emit("rms_norm", [x, w], eps=float(attrs.get("epsilon", 1e-5)), weight_first_cast=True), None]


@onnx_op("SkipSimplifiedLayerNormalization")
def _skip_rms_norm(imp, node, ins, attrs):
    h = imp.emit("add", [imp.ir(ins[0], node), imp.ir(ins[1], node)])
    if len(ins) > 3 and ins[3] is not None:
        h = imp.emit("add", [h, imp.ir(ins[3], node)])
    out = imp.emit("rms_norm", [h, imp.ir(ins[2], node)], eps=float(attrs.get("epsilon", 1e-5)),
                   weight_first_cast=True)
    return [out, None, None, h]


# ---------------------------------------------------------------------------------------------
# rotary embedding and attention: the fused forms of opset 23 and of onnxruntime's contrib ops

def _to_heads(imp, x: Value, heads: int) -> Value:
    """[B, S, H*D] -> [B, H, S, D] (the [B, H, S, D] value itself when x was made from it by _from_heads, as
    between a 3-D RotaryEmbedding and an attention op: rope must feed attention directly to fuse)."""
    y = imp.split_heads.get(id(x))
    if y is not None and y.type.shape[1] == heads:
        return y
    b, s, hd = x.type.shape
    r = imp.emit("reshape", [x], shape=[_attr_dim(b), _attr_dim(s), heads, -1])
    return imp.emit("transpose", [r], dim0=1, dim1=2)


def _from_heads(imp, x: Value) -> Value:
    """[B, H, S, D] -> [B, S, H*D]."""
    t = imp.emit("transpose", [x], dim0=1, dim1=2)
    b, s = t.type.shape[:2]
    out = imp.emit("reshape", [t], shape=[_attr_dim(b), _attr_dim(s), -1])
    imp.split_heads[id(out)] = x
    return out


def _cos_sin(imp, node, cos_cache, sin_cache, positions) -> tuple[Value, Value]:
    """cos/sin of rotate-half rope as [B, 1, S, D] from half-width caches ([max_pos, D/2] looked up at the
    positions, or already [B, S, D/2])."""
    out = []
    for cache in (cos_cache, sin_cache):
        if positions is not None:
            c = imp.emit("embedding", [imp.weight(imp.const(cache, node, "cos/sin cache"), node,
                                                  ins_name=None, suffix="rope_cache"), positions])
        else:
            c = imp.ir(cache, node)
        full = imp.emit("concat", [c, c], dim=c.type.rank - 1)
        out.append(imp.emit("unsqueeze", [full], dim=1))
    return out[0], out[1]


def _rope_positions(imp, node, pos):
    """The positions operand of a rotary op as IR [B, S] (an offset scalar means positions from 0)."""
    if pos is None:
        return None
    if isinstance(pos, Value) or (hasattr(pos, "ir") and pos.ir is not None):
        v = imp.ir(pos, node)
        if v.type.rank == 2:
            return v
    t = imp.try_const(pos, node)
    if t is not None and t.numel() == 1 and int(t.reshape(-1)[0]) == 0:
        return imp.positions()
    raise imp.unsupported(node, "rotary position ids other than [batch, sequence] (or a zero offset)")


def _apply_rope(imp, node, x: Value, cos: Value, sin: Value, heads: int | None, interleaved, rot_dim) -> Value:
    if interleaved:
        raise imp.unsupported(node, "interleaved rotary embeddings (llmc's rope is rotate-half)")
    three_d = x.type.rank == 3
    if three_d:
        if not heads:
            raise imp.unsupported(node, "a 3-D rotary input without num_heads")
        x = _to_heads(imp, x, heads)
    if rot_dim and rot_dim != x.type.shape[-1]:
        raise imp.unsupported(node, f"partial rotary embeddings ({rot_dim} of {x.type.shape[-1]} dims)")
    y = imp.emit("rope", [x, cos, sin])
    return _from_heads(imp, y) if three_d else y


@onnx_op("RotaryEmbedding")
def _rotary(imp, node, ins, attrs):
    x = imp.ir(ins[0], node)
    if node.domain in ("com.microsoft",):  # (input, position_ids, cos_cache, sin_cache)
        pos, cos_c, sin_c = ins[1], ins[2], ins[3]
    else:  # opset 23: (X, cos_cache, sin_cache, position_ids?)
        cos_c, sin_c, pos = ins[1], ins[2], ins[3] if len(ins) > 3 else None
    cos, sin = _cos_sin(imp, node, cos_c, sin_c, _rope_positions(imp, node, pos))
    return [_apply_rope(imp, node, x, cos, sin, attrs.get("num_heads"), attrs.get("interleaved", 0),
                        attrs.get("rotary_embedding_dim", 0))]


def _attention_mask(imp, node, mask, scores_like: Value, causal: bool):
    """(causal, window) from an attention's mask operand (absent, boolean or additive)."""
    if mask is None:
        return causal, 0
    kind = "keep" if imp.dtype_of(mask, node) == torch.bool else "additive"
    c, w = imp.classify_mask(mask, scores_like, kind, node)
    return (c or causal), w


def _empty_past(imp, node, ins, positions: list[int]):
    for i in positions:
        if i < len(ins) and ins[i] is not None and not imp.is_empty_along(ins[i], 2, node):
            raise imp.unsupported(node, "a past key/value cache that is not empty: export without a cache, or "
                                        "with the past inputs llmc removes (past_key_values.*)")


@onnx_op("Attention")
def _attention(imp, node, ins, attrs):
    if node.domain == "com.microsoft":
        raise imp.unsupported(node, "the com.microsoft Attention op (packed QKV weights); export with opset 23's "
                                    "Attention, MultiHeadAttention or GroupQueryAttention")
    q, k, v = (imp.ir(t, node) for t in ins[:3])
    if attrs.get("softcap", 0.0):
        raise imp.unsupported(node, "attention with softcap")
    three_d = q.type.rank == 3
    if three_d:
        q = _to_heads(imp, q, attrs["q_num_heads"])
        k, v = _to_heads(imp, k, attrs["kv_num_heads"]), _to_heads(imp, v, attrs["kv_num_heads"])
    _empty_past(imp, node, ins, [4, 5])
    causal, window = _attention_mask(imp, node, ins[3] if len(ins) > 3 else None, q, bool(attrs.get("is_causal")))
    scale = attrs.get("scale") or 1.0 / math.sqrt(int(q.type.shape[-1]))
    y = imp.emit("attention", [q, k, v], scale=float(scale), causal=causal, window=window)
    return [_from_heads(imp, y) if three_d else y, None, None, None]


@onnx_op("MultiHeadAttention")
def _mha(imp, node, ins, attrs):
    heads = attrs["num_heads"]
    q, k, v = (imp.ir(t, node) for t in ins[:3])
    if len(ins) > 3 and ins[3] is not None:
        raise imp.unsupported(node, "MultiHeadAttention with a packed bias")
    if len(ins) > 4 and ins[4] is not None and not imp.is_all_ones(ins[4]):
        raise imp.unsupported(node, "a key padding mask (llmc keeps sequences apart with its own metadata)")
    _empty_past(imp, node, ins, [6, 7])
    q = _to_heads(imp, q, heads)
    k = k if k.type.rank == 4 else _to_heads(imp, k, heads)
    v = v if v.type.rank == 4 else _to_heads(imp, v, heads)
    causal, window = _attention_mask(imp, node, ins[5] if len(ins) > 5 else None, q,
                                     bool(attrs.get("unidirectional", 0)))
    scale = attrs.get("scale") or 1.0 / math.sqrt(int(q.type.shape[-1]))
    y = imp.emit("attention", [q, k, v], scale=float(scale), causal=causal, window=window)
    return [_from_heads(imp, y), None, None]


@onnx_op("GroupQueryAttention")
def _gqa(imp, node, ins, attrs):
    heads, kv_heads = attrs["num_heads"], attrs["kv_num_heads"]
    if attrs.get("softcap", 0.0) or attrs.get("smooth_softmax", 0):
        raise imp.unsupported(node, "GroupQueryAttention with softcap or smooth_softmax")
    q = imp.ir(ins[0], node)
    if len(ins) < 2 or ins[1] is None:  # packed QKV: [B, S, (H + 2 Hkv) D]
        d = int(q.type.shape[-1]) // (heads + 2 * kv_heads)
        qkv = q
        q = imp.emit("slice", [qkv], dim=2, start=0, end=heads * d, step=1)
        k = imp.emit("slice", [qkv], dim=2, start=heads * d, end=(heads + kv_heads) * d, step=1)
        v = imp.emit("slice", [qkv], dim=2, start=(heads + kv_heads) * d, end=None, step=1)
    else:
        k, v = imp.ir(ins[1], node), imp.ir(ins[2], node)
    _empty_past(imp, node, ins, [3, 4])
    if len(ins) > 10 and ins[10] is not None:
        raise imp.unsupported(node, "GroupQueryAttention with an attention_bias")
    q, k, v = _to_heads(imp, q, heads), _to_heads(imp, k, kv_heads), _to_heads(imp, v, kv_heads)
    if attrs.get("do_rotary", 0):
        pos = ins[9] if len(ins) > 9 and ins[9] is not None else None
        cos, sin = _cos_sin(imp, node, ins[7], ins[8], _rope_positions(imp, node, pos) if pos is not None
                            else imp.positions())
        q = _apply_rope(imp, node, q, cos, sin, None, attrs.get("rotary_interleaved", 0), 0)
        k = _apply_rope(imp, node, k, cos, sin, None, attrs.get("rotary_interleaved", 0), 0)
    local = int(attrs.get("local_window_size", -1))
    scale = attrs.get("scale") or 1.0 / math.sqrt(int(q.type.shape[-1]))
    # onnxruntime's local window counts the query's own position (checked against it in the tests)
    y = imp.emit("attention", [q, k, v], scale=float(scale), causal=True, window=local if local > 0 else 0)
    return [_from_heads(imp, y), None, None]
