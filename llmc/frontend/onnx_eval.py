"""Compile-time evaluation of ONNX ops: torch evaluators for constants and masks, and the symbolic
arithmetic of shape vectors (each entry a dim: an int or an expression over B and S).

The ONNX frontend evaluates a node here when none of its operands is a runtime tensor; see
llmc/frontend/onnx.py.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from llmc.errors import CompileError
from llmc.ir.types import broadcast_shapes, dim_add, dim_mul, make_dim

CONST_EVAL: dict[str, Callable] = {}
BIG = 1 << 62  # slice bounds at or past this mean "to the end"

# ONNX TensorProto element types <-> torch dtypes (the ones a decoder uses)
DTYPES = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16, 11: torch.float64, 7: torch.int64,
          6: torch.int32, 5: torch.int16, 3: torch.int8, 2: torch.uint8, 9: torch.bool}


def onnx_dtype(code: int) -> torch.dtype:
    if code not in DTYPES:
        raise CompileError(f"ONNX element type {code} is not supported (llmc reads float, int and bool tensors)")
    return DTYPES[code]


def const_eval(*names: str):
    """Register a torch evaluator `fn(tensors, attrs) -> [tensors]` for compile-time operands."""
    def deco(fn):
        for n in names:
            CONST_EVAL[n] = fn
        return fn
    return deco


def ints(t) -> list[int]:
    return [int(x) for x in torch.as_tensor(t).reshape(-1).tolist()]


def _ev(fn):
    return lambda x, a: [fn(*x)]


for _n, _f in {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Pow": torch.pow,
               "Equal": torch.eq, "Less": torch.lt, "Greater": torch.gt, "LessOrEqual": torch.le,
               "GreaterOrEqual": torch.ge, "And": torch.logical_and, "Or": torch.logical_or,
               "Xor": torch.logical_xor, "Not": torch.logical_not, "Neg": torch.neg, "Abs": torch.abs,
               "Sqrt": torch.sqrt, "Reciprocal": torch.reciprocal, "Exp": torch.exp, "Log": torch.log,
               "Cos": torch.cos, "Sin": torch.sin, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh,
               "Floor": torch.floor, "Ceil": torch.ceil, "IsNaN": torch.isnan, "Identity": lambda x: x,
               "MatMul": torch.matmul, "Where": torch.where, "Relu": torch.relu}.items():
    CONST_EVAL[_n] = _ev(_f)


@const_eval("Div")
def _c_div(x, a):
    if x[0].is_floating_point() or x[1].is_floating_point():
        return [x[0] / x[1]]
    return [torch.div(x[0], x[1], rounding_mode="trunc")]


@const_eval("Mod")
def _c_mod(x, a):
    return [torch.fmod(x[0], x[1]) if a.get("fmod") else torch.remainder(x[0], x[1])]


CONST_EVAL["Max"] = lambda x, a: [_fold(torch.maximum, x)]
CONST_EVAL["Min"] = lambda x, a: [_fold(torch.minimum, x)]
CONST_EVAL["Sum"] = lambda x, a: [_fold(torch.add, x)]


def _fold(fn, xs):
    out = xs[0]
    for y in xs[1:]:
        out = fn(out, y)
    return out


@const_eval("IsInf")
def _c_isinf(x, a):
    t = x[0]
    pos, neg = a.get("detect_positive", 1), a.get("detect_negative", 1)
    return [(torch.isposinf(t) & bool(pos)) | (torch.isneginf(t) & bool(neg))]


@const_eval("Cast")
def _c_cast(x, a):
    return [x[0].to(onnx_dtype(a["to"]))]


@const_eval("CastLike")
def _c_castlike(x, a):
    return [x[0].to(x[1].dtype)]


@const_eval("Shape")
def _c_shape(x, a):
    s = list(x[0].shape)
    return [torch.tensor(s[slice(a.get("start", 0), a.get("end"))], dtype=torch.int64)]


@const_eval("Size")
def _c_size(x, a):
    return [torch.tensor(x[0].numel(), dtype=torch.int64)]


@const_eval("ConstantOfShape")
def _c_cos(x, a):
    v = a.get("value")
    v = v if v is not None else torch.zeros(1, dtype=torch.float32)
    return [torch.full(ints(x[0]), v.reshape(-1)[0].item(), dtype=v.dtype)]


@const_eval("Range")
def _c_range(x, a):
    start, limit, delta = x
    return [torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)]


def reshape_target(in_shape, shape, allowzero):
    return [in_shape[i] if s == 0 and not allowzero else s for i, s in enumerate(shape)]


@const_eval("Reshape")
def _c_reshape(x, a):
    return [x[0].reshape(reshape_target(list(x[0].shape), ints(x[1]), a.get("allowzero", 0)))]


@const_eval("Flatten")
def _c_flatten(x, a):
    ax = a.get("axis", 1)
    ax = ax + x[0].dim() if ax < 0 else ax
    return [x[0].reshape(math.prod(x[0].shape[:ax]), math.prod(x[0].shape[ax:]))]


@const_eval("Expand")
def _c_expand(x, a):
    shape = broadcast_shapes(tuple(x[0].shape), tuple(ints(x[1])))
    return [x[0].expand(shape)]


@const_eval("Unsqueeze")
def _c_unsqueeze(x, a):
    axes = a["axes"] if "axes" in a else ints(x[1])
    t = x[0]
    rank = t.dim() + len(axes)
    for ax in sorted(d % rank for d in axes):
        t = t.unsqueeze(ax)
    return [t]


@const_eval("Squeeze")
def _c_squeeze(x, a):
    axes = a["axes"] if "axes" in a else (ints(x[1]) if len(x) > 1 and x[1] is not None else None)
    t = x[0]
    if axes is None:
        return [t.squeeze()]
    for ax in sorted((d % t.dim() for d in axes), reverse=True):
        t = t.squeeze(ax)
    return [t]


@const_eval("Concat")
def _c_concat(x, a):
    return [torch.cat([t for t in x], dim=a["axis"])]


@const_eval("Gather")
def _c_gather(x, a):
    data, idx = x
    ax = a.get("axis", 0) % data.dim()
    idx = torch.where(idx < 0, idx + data.shape[ax], idx)
    out = torch.index_select(data, ax, idx.reshape(-1).long())
    return [out.reshape(data.shape[:ax] + idx.shape + data.shape[ax + 1:])]


@const_eval("GatherND")
def _c_gathernd(x, a):
    data, idx = x
    if a.get("batch_dims", 0):
        raise CompileError("GatherND with batch_dims is not supported in shape arithmetic")
    k = idx.shape[-1]
    flat = idx.reshape(-1, k).long()
    out = data[tuple(flat[:, i] for i in range(k))]
    return [out.reshape(idx.shape[:-1] + data.shape[k:])]


@const_eval("Slice")
def _c_slice(x, a):
    data = x[0]
    starts, ends = ints(x[1]), ints(x[2])
    axes = ints(x[3]) if len(x) > 3 and x[3] is not None else list(range(len(starts)))
    steps = ints(x[4]) if len(x) > 4 and x[4] is not None else [1] * len(starts)
    idx = [slice(None)] * data.dim()
    for s, e, ax, st in zip(starts, ends, axes, steps):
        if st < 0:
            raise CompileError("Slice with a negative step is not supported")
        idx[ax % data.dim()] = slice(s, None if e >= BIG else e, st)
    return [data[tuple(idx)]]


@const_eval("Transpose")
def _c_transpose(x, a):
    perm = a.get("perm") or list(reversed(range(x[0].dim())))
    return [x[0].permute(*perm)]


@const_eval("CumSum")
def _c_cumsum(x, a):
    t, ax = x[0], int(x[1].item())
    if a.get("reverse"):
        t = t.flip(ax)
    out = torch.cumsum(t, ax)
    if a.get("exclusive"):
        out = out - t
    return [out.flip(ax) if a.get("reverse") else out]


@const_eval("Trilu")
def _c_trilu(x, a):
    k = int(x[1].item()) if len(x) > 1 and x[1] is not None else 0
    return [torch.triu(x[0], k) if a.get("upper", 1) else torch.tril(x[0], k)]


def _c_reduce(fn):
    def ev(x, a):
        t = x[0]
        axes = a["axes"] if "axes" in a else (ints(x[1]) if len(x) > 1 and x[1] is not None else None)
        if axes is None or not axes:
            axes = list(range(t.dim())) if not a.get("noop_with_empty_axes") else []
        if not axes:
            return [t]
        return [fn(t, axes, bool(a.get("keepdims", 1)))]
    return ev


CONST_EVAL["ReduceSum"] = _c_reduce(lambda t, d, k: t.sum(dim=d, keepdim=k))
CONST_EVAL["ReduceMean"] = _c_reduce(lambda t, d, k: t.float().mean(dim=d, keepdim=k).to(t.dtype))
CONST_EVAL["ReduceMax"] = _c_reduce(lambda t, d, k: t.amax(dim=d, keepdim=k))
CONST_EVAL["ReduceMin"] = _c_reduce(lambda t, d, k: t.amin(dim=d, keepdim=k))


@const_eval("Tile")
def _c_tile(x, a):
    return [x[0].repeat(*ints(x[1]))]


@const_eval("Softmax")
def _c_softmax(x, a):
    return [torch.softmax(x[0], dim=a.get("axis", -1))]


@const_eval("Split")
def _c_split(x, a):
    t, ax = x[0], a.get("axis", 0)
    sizes = a.get("split") or (ints(x[1]) if len(x) > 1 and x[1] is not None else None)
    if sizes is None:
        n = a["num_outputs"]
        step = -(-t.shape[ax] // n)
        sizes = [min(step, t.shape[ax] - i) for i in range(0, t.shape[ax], step)]
    return list(torch.split(t, sizes, dim=ax))


def dim_sub(a, b):
    return a - b if isinstance(a, int) and isinstance(b, int) else make_dim(f"({a})-({b})")


def dim_floordiv(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    return make_dim(f"floor(({a})/({b}))")


# symbolic evaluation of shape vectors: each entry a dim (int or symbolic); None where undecidable
SYM_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "Add": dim_add, "Sub": dim_sub, "Mul": dim_mul, "Div": dim_floordiv,
    "Max": lambda a, b: max(a, b) if isinstance(a, int) and isinstance(b, int) else (a if a == b else None),
    "Min": lambda a, b: min(a, b) if isinstance(a, int) and isinstance(b, int) else (a if a == b else None),
    "Equal": lambda a, b: (a == b) if isinstance(a, int) and isinstance(b, int) or a == b else
    (False if (isinstance(a, int) and a <= 0) or (isinstance(b, int) and b <= 0) else None),
}
