"""The op registry: every op's operands, attributes, type rule and torch reference implementation.

The reference implementations are the golden model: the interpreter runs any graph with them,
and every pass and kernel is tested against them. Families (ELEMENTWISE, REDUCE, MOVEMENT) let
rules speak of groups of ops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from llmc.errors import IRError
from llmc.ir.types import Dim, TensorType, broadcast_shapes, dim_div, dim_eval, dim_mul, make_dim, torch_dtype
from llmc.plugins import OP_SOURCES, record

UNARY = "unary"
BINARY = "binary"
ELEMENTWISE_FAMILIES = (UNARY, BINARY)


@dataclass
class RefEnv:
    """What a reference implementation may need beyond its operands: the symbol values, state."""

    dims: dict[str, int] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    def dim(self, d: Dim | str) -> int:
        return dim_eval(make_dim(d), self.dims) if not isinstance(d, int) else d


@dataclass(frozen=True)
class OpDef:
    """One op. `operands` names the inputs; a trailing `?` marks an optional one, `*` a variadic tail."""

    name: str
    family: str
    operands: tuple[str, ...]
    attrs: dict[str, Any]
    infer_fn: Callable
    ref: Callable
    doc: str = ""
    # what generic passes may assume: "linear" (a GEMM over param operands whose first dim is the
    # output features: parallel linears fuse by concatenating each along dim 0; an activation
    # epilogue fuses through the `act` attribute where the op has one), "no_fold" (never
    # evaluated at compile time: the model's real work, or a packed format that folding would undo)
    traits: frozenset = frozenset()

    def complete_attrs(self, attrs: dict) -> dict:
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise IRError(f"op {self.name} has no attribute(s) {sorted(unknown)}; it takes {sorted(self.attrs)}")
        out = {}
        for k, default in self.attrs.items():
            if k in attrs:
                out[k] = attrs[k]
            elif default is REQUIRED:
                raise IRError(f"op {self.name} needs attribute {k!r}")
            else:
                out[k] = default
        return out

    def check_arity(self, n: int) -> None:
        req = [o for o in self.operands if not o.endswith(("?", "*"))]
        variadic = any(o.endswith("*") for o in self.operands)
        if n < len(req) or (not variadic and n > len(self.operands)):
            raise IRError(f"op {self.name} takes operands ({', '.join(self.operands)}), got {n}")

    def infer(self, node) -> list[TensorType]:
        self.check_arity(len(node.inputs))
        out = self.infer_fn([v.type if v is not None else None for v in node.inputs], node.attrs)
        return list(out) if isinstance(out, (list, tuple)) else [out]


class _Required:
    def __repr__(self):
        return "REQUIRED"


REQUIRED = _Required()
OPS: dict[str, OpDef] = {}
FAMILIES: dict[str, set[str]] = {}


def register_op(name: str, family: str, operands: tuple[str, ...], infer: Callable, ref: Callable,
                attrs: dict | None = None, doc: str = "", traits: tuple[str, ...] = ()) -> OpDef:
    """Add an op to the registry (user extensions use this too)."""
    opdef = OpDef(name, family, tuple(operands), dict(attrs or {}), infer, ref, doc, frozenset(traits))
    OPS[name] = opdef
    record(OP_SOURCES, name)  # a user's op: where from, for the workers of a parallel run
    FAMILIES.setdefault(family, set()).add(name)
    return opdef


def get_op(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise IRError(f"unknown op {name!r}; registered ops: {', '.join(sorted(OPS))}") from None


def has_trait(op: str, trait: str) -> bool:
    d = OPS.get(op)
    return d is not None and trait in d.traits


def family(name: str) -> set[str]:
    return FAMILIES.get(name, set())


def is_elementwise(op: str) -> bool:
    return op in FAMILIES.get(UNARY, set()) | FAMILIES.get(BINARY, set()) or op == "cast"


# ---------------------------------------------------------------------------------------------
# type rules

def _same(ts, a):
    return ts[0]


def _norm_dim(d: int, rank: int) -> int:
    if not -rank <= d < max(rank, 1):
        raise IRError(f"dim {d} out of range for rank {rank}")
    return d % rank if rank else 0


def _result_dtype(types) -> str:
    # exact torch promotion: rank-0 operands do not promote within a category
    from llmc.ir.types import dtype_name
    out = None
    for t in types:
        p = torch.empty(() if t.rank == 0 else (1,), dtype=torch_dtype(t.dtype))
        out = p if out is None else torch.empty(() if out.dim() == 0 and p.dim() == 0 else (1,),
                                                dtype=torch.result_type(out, p))
    return dtype_name(out.dtype)


def _binary_infer(ts, a):
    return TensorType(broadcast_shapes(ts[0].shape, ts[1].shape), _result_dtype(ts[:2]))


def _resolve_shape(in_t: TensorType, shape: list) -> tuple:
    shape = [make_dim(d) if d != -1 else -1 for d in shape]
    if -1 in shape:
        known = [d for d in shape if d != -1]
        rest = dim_div(in_t.numel(), dim_mul(*known) if known else 1)
        shape = [rest if d == -1 else d for d in shape]
    return tuple(shape)


def _reshape_infer(ts, a):
    out = _resolve_shape(ts[0], a["shape"])
    if dim_mul(*out) != ts[0].numel():
        raise IRError(f"reshape of {ts[0]} to {list(map(str, out))} changes the element count")
    return ts[0].with_shape(out)


def _expand_infer(ts, a):
    shape = list(a["shape"])
    pad = len(shape) - ts[0].rank
    src = [1] * pad + list(ts[0].shape)
    out = [src[i] if d == -1 else make_dim(d) for i, d in enumerate(shape)]
    for s, o in zip(src, out):
        if s != 1 and s != o:
            raise IRError(f"cannot expand dim {s} to {o}")
    return ts[0].with_shape(out)


def _transpose_infer(ts, a):
    s = list(ts[0].shape)
    i, j = _norm_dim(a["dim0"], len(s)), _norm_dim(a["dim1"], len(s))
    s[i], s[j] = s[j], s[i]
    return ts[0].with_shape(s)


def _permute_infer(ts, a):
    return ts[0].with_shape([ts[0].shape[d] for d in a["dims"]])


def _unsqueeze_infer(ts, a):
    s = list(ts[0].shape)
    d = a["dim"] % (len(s) + 1)
    return ts[0].with_shape(s[:d] + [1] + s[d:])


def _squeeze_infer(ts, a):
    s = list(ts[0].shape)
    d = _norm_dim(a["dim"], len(s))
    if s[d] != 1:
        raise IRError(f"squeeze of dim {d} of size {s[d]}")
    return ts[0].with_shape(s[:d] + s[d + 1:])


def _slice_infer(ts, a):
    s = list(ts[0].shape)
    d = _norm_dim(a["dim"], len(s))
    start, end, step = a["start"], a["end"], a["step"]
    size = s[d]
    if isinstance(size, int):
        n = len(range(*slice(start, end, step).indices(size)))
    elif start >= 0 and end is not None and end >= 0 and end < (1 << 62):
        n = len(range(start, end, step))  # a fixed window of a symbolic dim
    elif start >= 0 and (end is None or end >= (1 << 62)):
        n = make_dim(f"({size})-{start}") if step == 1 else make_dim(f"ceiling((({size})-{start})/{step})")
    else:
        raise IRError(f"slice [{start}:{end}:{step}] of symbolic dim {size} is not supported")
    s[d] = n
    return ts[0].with_shape(s)


def _concat_infer(ts, a):
    d = _norm_dim(a["dim"], ts[0].rank)
    total: Dim = 0
    for t in ts:
        total = total + t.shape[d] if isinstance(total, int) and isinstance(t.shape[d], int) else \
            make_dim(f"({total})+({t.shape[d]})")
    s = list(ts[0].shape)
    s[d] = total
    return TensorType(tuple(s), _result_dtype(ts))


def _reduce_infer(ts, a):
    s = list(ts[0].shape)
    dims = sorted(_norm_dim(d, len(s)) for d in a["dims"])
    out = [1 if i in dims else x for i, x in enumerate(s)] if a["keepdim"] else \
        [x for i, x in enumerate(s) if i not in dims]
    return ts[0].with_shape(out)


def _linear_infer(ts, a):
    x, w = ts[0], ts[1]
    if w.rank != 2 or x.shape[-1] != w.shape[1]:
        raise IRError(f"linear: input {x} does not match weight {w} (weight is [out, in])")
    return TensorType(x.shape[:-1] + (w.shape[0],), x.dtype)


def _matmul_infer(ts, a):
    x, y = ts
    if x.shape[-1] != y.shape[-2]:
        raise IRError(f"matmul: {x} @ {y} inner dims differ")
    batch = broadcast_shapes(x.shape[:-2], y.shape[:-2])
    return TensorType(batch + (x.shape[-2], y.shape[-1]), _result_dtype(ts))


def _embedding_infer(ts, a):
    w, ids = ts
    return TensorType(ids.shape + (w.shape[1],), w.dtype)


def _attention_infer(ts, a):
    q, k, v = ts[:3]
    if q.rank != 4 or k.rank != 4 or v.rank != 4:
        raise IRError("attention takes q, k, v of rank 4: [B, H, S, D]")
    if isinstance(q.shape[1], int) and isinstance(k.shape[1], int) and q.shape[1] % k.shape[1]:
        raise IRError(f"attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    return q.with_shape(q.shape[:3] + (v.shape[3],))


# ---------------------------------------------------------------------------------------------
# reference implementations

def _attention_ref(x, a, env):
    q, k, v = x[:3]  # [B, Hq, S, D], [B, Hkv, S, D]
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    S, L = q.shape[2], k.shape[2]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * a["scale"]
    if a["causal"] or a["window"]:
        i = torch.arange(S, device=q.device)[:, None] + (L - S)
        j = torch.arange(L, device=q.device)[None, :]
        allowed = torch.ones(S, L, dtype=torch.bool, device=q.device)
        if a["causal"]:
            allowed &= j <= i
        if a["window"]:
            allowed &= j > i - a["window"]
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def _rms_norm_ref(x, a, env):
    h, w = x
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + a["eps"])
    return w * normed.to(h.dtype) if a["weight_first_cast"] else (normed * w.float()).to(h.dtype)


def _rope_ref(x, a, env):
    t, cos, sin = x
    half = t.shape[-1] // 2
    rot = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rot * sin


def _slice_ref(x, a, env):
    end = a["end"]
    end = None if end is None or end >= (1 << 62) else end
    idx = [slice(None)] * x[0].dim()
    idx[a["dim"]] = slice(a["start"], end, a["step"])
    return x[0][tuple(idx)]


def _shape_arg(shape, env):
    return [d if isinstance(d, int) else env.dim(d) for d in shape]


def _unary(name, fn, attrs=None, doc=""):
    register_op(name, UNARY, ("x",), _same, lambda x, a, env: fn(x[0], a), attrs, doc)


def _binary(name, fn):
    register_op(name, BINARY, ("a", "b"), _binary_infer, lambda x, a, env: fn(x[0], x[1]))


register_op("constant", "constant", (), lambda ts, a: TensorType((), a["dtype"]),
            lambda x, a, env: torch.tensor(a["value"], dtype=torch_dtype(a["dtype"])),
            {"value": REQUIRED, "dtype": "f32"}, "a scalar literal")
register_op("cast", UNARY, ("x",), lambda ts, a: ts[0].with_dtype(a["dtype"]),
            lambda x, a, env: x[0].to(torch_dtype(a["dtype"])), {"dtype": REQUIRED})
_unary("neg", lambda x, a: -x)
_unary("silu", lambda x, a: F.silu(x))
_unary("gelu", lambda x, a: F.gelu(x, approximate=a["approximate"]), {"approximate": "none"})
_unary("relu", lambda x, a: torch.relu(x))
_unary("sigmoid", lambda x, a: torch.sigmoid(x))
_unary("tanh", lambda x, a: torch.tanh(x))
_unary("exp", lambda x, a: torch.exp(x))
_unary("log", lambda x, a: torch.log(x))
_unary("sqrt", lambda x, a: torch.sqrt(x))
_unary("rsqrt", lambda x, a: torch.rsqrt(x))
_unary("reciprocal", lambda x, a: torch.reciprocal(x))
_unary("abs", lambda x, a: torch.abs(x))
_unary("cos", lambda x, a: torch.cos(x))
_unary("sin", lambda x, a: torch.sin(x))
_binary("add", torch.add)
_binary("sub", torch.sub)
_binary("mul", torch.mul)
_binary("div", torch.div)
_binary("pow", torch.pow)
_binary("maximum", torch.maximum)
_binary("minimum", torch.minimum)

register_op("mean", "reduce", ("x",), _reduce_infer,
            lambda x, a, env: x[0].mean(dim=a["dims"], keepdim=a["keepdim"]), {"dims": REQUIRED, "keepdim": False})
register_op("sum", "reduce", ("x",), _reduce_infer,
            lambda x, a, env: x[0].sum(dim=a["dims"], keepdim=a["keepdim"]), {"dims": REQUIRED, "keepdim": False})
register_op("amax", "reduce", ("x",), _reduce_infer,
            lambda x, a, env: x[0].amax(dim=a["dims"], keepdim=a["keepdim"]), {"dims": REQUIRED, "keepdim": False})
register_op("softmax", "reduce", ("x",), _same,
            lambda x, a, env: torch.softmax(x[0].float(), dim=a["dim"]).to(x[0].dtype), {"dim": -1})

register_op("reshape", "movement", ("x",), _reshape_infer,
            lambda x, a, env: x[0].reshape(_shape_arg(a["shape"], env)), {"shape": REQUIRED})
register_op("expand", "movement", ("x",), _expand_infer,
            lambda x, a, env: x[0].expand(_shape_arg(a["shape"], env)), {"shape": REQUIRED})
register_op("transpose", "movement", ("x",), _transpose_infer,
            lambda x, a, env: x[0].transpose(a["dim0"], a["dim1"]), {"dim0": REQUIRED, "dim1": REQUIRED})
register_op("permute", "movement", ("x",), _permute_infer,
            lambda x, a, env: x[0].permute(a["dims"]), {"dims": REQUIRED})
register_op("unsqueeze", "movement", ("x",), _unsqueeze_infer,
            lambda x, a, env: x[0].unsqueeze(a["dim"]), {"dim": REQUIRED})
register_op("squeeze", "movement", ("x",), _squeeze_infer,
            lambda x, a, env: x[0].squeeze(a["dim"]), {"dim": REQUIRED})
register_op("slice", "movement", ("x",), _slice_infer, _slice_ref,
            {"dim": REQUIRED, "start": 0, "end": None, "step": 1})
register_op("concat", "movement", ("xs*",), _concat_infer,
            lambda x, a, env: torch.cat(x, dim=a["dim"]), {"dim": REQUIRED})
register_op("gather", "movement", ("x", "index"),
            lambda ts, a: ts[0].with_shape(ts[0].shape[:a["dim"] % ts[0].rank] + ts[1].shape
                                           + ts[0].shape[a["dim"] % ts[0].rank + 1:]),
            lambda x, a, env: torch.index_select(x[0], a["dim"], x[1].reshape(-1)).reshape(
                x[0].shape[:a["dim"] % x[0].dim()] + x[1].shape + x[0].shape[a["dim"] % x[0].dim() + 1:]),
            {"dim": 0}, "rows of x at index along dim (index_select with an index of any shape)")

register_op("embedding", "nn", ("weight", "ids"), _embedding_infer, lambda x, a, env: F.embedding(x[1], x[0]),
            traits=("no_fold",))
register_op("qembedding", "nn", ("qweight", "scales", "ids"),
            lambda ts, a: TensorType(ts[2].shape + (ts[0].shape[1],), a["dtype"]),
            lambda x, a, env: _qembedding_ref(x, a), {"dtype": "float32"},
            "rows of an int8 table at ids, each times its row's scale (a quantized embedding)", traits=("no_fold",))
register_op("linear", "nn", ("x", "weight", "bias?"), _linear_infer,
            lambda x, a, env: F.linear(x[0], x[1], x[2] if len(x) > 2 else None), doc="x @ weight.T + bias",
            traits=("linear", "no_fold"))
register_op("matmul", "nn", ("a", "b"), _matmul_infer, lambda x, a, env: torch.matmul(x[0], x[1]),
            traits=("no_fold",))
register_op("rms_norm", "nn", ("x", "weight"), lambda ts, a: ts[0].with_dtype(_result_dtype([ts[0], ts[1]])),
            _rms_norm_ref, {"eps": 1e-6, "weight_first_cast": True},
            "RMSNorm in fp32; weight_first_cast: multiply the weight after casting back (Llama's order)")
register_op("layer_norm", "nn", ("x", "weight?", "bias?"), _same,
            lambda x, a, env: F.layer_norm(x[0], x[0].shape[-1:], x[1] if len(x) > 1 else None,
                                           x[2] if len(x) > 2 else None, a["eps"]), {"eps": 1e-5})
register_op("rope", "nn", ("x", "cos", "sin"),
            lambda ts, a: TensorType(broadcast_shapes(ts[0].shape, ts[1].shape), _result_dtype(ts)), _rope_ref,
            doc="rotary embedding, rotate-half convention: x*cos + rotate_half(x)*sin")
register_op("silu_mul", "nn", ("gate", "up"), _binary_infer,
            lambda x, a, env: F.silu(x[0]) * x[1], doc="silu(gate) * up (the SwiGLU MLP body)")
register_op("attention", "attention", ("q", "k", "v"), _attention_infer, _attention_ref,
            {"scale": REQUIRED, "causal": True, "window": 0},
            "softmax(q k^T * scale) v over [B, H, S, D]; grouped-query when k has fewer heads; "
            "window > 0 limits each query to the last `window` keys", traits=("no_fold",))

ELEMENTWISE = family(UNARY) | family(BINARY)
REDUCE = family("reduce")
MOVEMENT = family("movement")


def _paged_attention_infer(ts, a):
    q, k, v, cache = ts[:4]
    if q.rank != 4 or cache.rank != 5:
        raise IRError("paged_attention takes q [1, Hq, T, D] and kv_cache [2, NB, BS, Hkv, D]")
    if (len(ts) > 8) != (cache.dtype in ("i8", "f8e4m3")):
        raise IRError(f"paged_attention: a {cache.dtype} cache {'needs' if len(ts) <= 8 else 'takes no'} kv_scale")
    return q.with_shape(q.shape[:3] + (v.shape[3],))


def _paged_attention_ref(x, a, env):
    from llmc.ir.paged_attention import paged_attention_ref
    return paged_attention_ref(x, a, env)


register_op("paged_attention", "attention",
            ("q", "k", "v", "kv_cache", "query_start_loc", "seq_lens", "block_tables", "slot_mapping", "kv_scale?"),
            _paged_attention_infer, _paged_attention_ref, {"scale": REQUIRED, "causal": True, "window": 0},
            "writes the new k, v into kv_cache (in place) at slot_mapping, then attends each sequence's "
            "new queries over its whole cached context; see llmc/ir/paged_attention.py", traits=("no_fold",))


# ---------------------------------------------------------------------------------------------
# fused forms, produced by the fusion passes (phase 3); each reference composes the primitives'

def _add_rms_norm_ref(x, a, env):
    h = x[0] + x[1]
    return _rms_norm_ref([h, x[2]], a, env), h


register_op("add_rms_norm", "nn", ("a", "b", "weight"),
            lambda ts, a: [ts[0].with_shape(broadcast_shapes(ts[0].shape, ts[1].shape)).with_dtype(
                _result_dtype([_binary_infer(ts[:2], a), ts[2]])), _binary_infer(ts[:2], a)],
            _add_rms_norm_ref, {"eps": 1e-6, "weight_first_cast": True},
            "(rms_norm(a + b, weight), a + b): the residual add and the next norm in one pass")


def _rope_kv_write_ref(x, a, env):
    from llmc.ir.paged_attention import rope_kv_write_ref
    return rope_kv_write_ref(x, a, env)


def _attend_paged_ref(x, a, env):
    from llmc.ir.paged_attention import attend_paged_ref
    return attend_paged_ref(x, a, env)


register_op("rope_kv_write", "attention",
            ("q", "k", "v", "cos", "sin", "kv_cache", "slot_mapping", "kv_scale?"),
            lambda ts, a: ts[0], _rope_kv_write_ref,
            doc="rope on q and k; writes roped k and v into kv_cache at slot_mapping; returns roped q")
register_op("attend_paged", "attention", ("q", "kv_cache", "query_start_loc", "seq_lens", "block_tables", "kv_scale?"),
            lambda ts, a: ts[0].with_shape(ts[0].shape[:3] + (ts[1].shape[4],)), _attend_paged_ref,
            {"scale": REQUIRED, "causal": True, "window": 0},
            "paged attention over a cache that already holds this step's k and v")

LINEAR_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
               "relu": torch.relu}
register_op("linear_act", "nn", ("x", "weight", "bias?"), _linear_infer,
            lambda x, a, env: LINEAR_ACTS[a["act"]](F.linear(x[0], x[1], x[2] if len(x) > 2 else None)),
            {"act": REQUIRED}, "act(x @ weight.T + bias): a matmul with its activation epilogue",
            traits=("linear", "no_fold"))


def _silu_mul_linear_infer(ts, a):
    gate, up = ts[0], ts[1]
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise IRError(f"silu_mul_linear: gate {gate} and up {up} differ")
    return _linear_infer([gate, *ts[2:]], a)


def _silu_mul_linear_ref(x, a, env):
    return F.linear(F.silu(x[0]) * x[1], x[2], x[3] if len(x) > 3 else None)


# not a "linear" by trait: operand 1 is the up projection, not the weight (generic passes that read a linear's
# weight as operand 1 must not take it for one); tensor parallelism unfuses it first (llmc/ir/sharding.py)
register_op("silu_mul_linear", "nn", ("gate", "up", "weight", "bias?"), _silu_mul_linear_infer,
            _silu_mul_linear_ref, doc="(silu(gate) * up) @ weight.T + bias: the SwiGLU product in the down "
            "projection's prologue (rounded to x's dtype first, as the unfused product is stored)",
            traits=("no_fold",))


def _linear_silu_mul_infer(ts, a):
    w = ts[1]
    if w.rank == 2 and isinstance(w.shape[0], int) and w.shape[0] % 2:
        raise IRError(f"linear_silu_mul: weight {w} has an odd number of rows (gate rows, then as many up rows)")
    y = _linear_infer(ts, a)
    return y.with_shape(y.shape[:-1] + (w.shape[0] // 2,))


def _linear_silu_mul_ref(x, a, env):
    y = F.linear(x[0], x[1], x[2] if len(x) > 2 else None)
    half = y.shape[-1] // 2
    return get_op("silu_mul").ref([y[..., :half], y[..., half:]], {}, env)


# not a "linear" by trait: its output is half the weight's rows wide (generic passes take a linear's output
# width for the weight's rows); tensor parallelism unfuses it first (llmc/ir/sharding.py)
register_op("linear_silu_mul", "nn", ("x", "weight", "bias?"), _linear_silu_mul_infer, _linear_silu_mul_ref,
            doc="silu(gate) * up of y = x @ weight.T + bias, gate and up the first and second half of y's columns "
            "(weight: the gate rows, then the up rows): a fused gate/up projection with the SwiGLU product in "
            "its epilogue (gate and up rounded to x's dtype first, as the unfused projection stores them)",
            traits=("no_fold",))


def _moe_infer(ts, a):
    x, router, gate_up, down = ts
    H = x.shape[-1]
    if router.rank != 2 or gate_up.rank != 3 or down.rank != 3 or router.shape[1] != H or gate_up.shape[2] != H \
            or down.shape[1] != H or gate_up.shape[0] != down.shape[0] or gate_up.shape[1] != 2 * down.shape[2]:
        raise IRError(f"moe: x {x}, router {router}, gate_up {gate_up}, down {down} do not fit "
                      "(router [E, H], gate_up [E_local, 2I, H], down [E_local, H, I])")
    E = router.shape[0]
    if not 1 <= a["top_k"] <= E or not 0 <= a["expert_start"] <= E - gate_up.shape[0]:
        raise IRError(f"moe: top_k {a['top_k']} and experts [{a['expert_start']}, "
                      f"{a['expert_start']} + {gate_up.shape[0]}) must lie within the router's {E} experts")
    return x


def _moe_ref(x, a, env):
    from llmc.ir.moe import moe_ref
    return moe_ref(*x, a["top_k"], a["norm_topk_prob"], a["round_weights"], a["expert_start"])


register_op("moe", "nn", ("x", "router", "gate_up", "down"), _moe_infer, _moe_ref,
            {"top_k": REQUIRED, "norm_topk_prob": REQUIRED, "round_weights": False, "expert_start": 0},
            "sparse mixture of SwiGLU experts: softmax routing over router's E experts, top_k of them per token "
            "(renormalised when norm_topk_prob; weights rounded to x's dtype when round_weights), over the "
            "experts [expert_start, expert_start + E_local) of the stacked gate_up/down; see llmc/ir/moe.py",
            traits=("no_fold",))


def _qembedding_ref(x, a):
    from llmc.ir.quant import qembedding_ref
    return qembedding_ref(x[0], x[1], x[2], torch_dtype(a["dtype"]))


def _qlinear_operands(x: list, a: dict) -> tuple:
    """(qweight, scales, zeros or None, bias or None) of a qlinear's operand list after x."""
    rest = list(x[1:])
    qw, sc = rest[0], rest[1]
    zeros = rest[2] if a["has_zeros"] else None
    bias = rest[3 if a["has_zeros"] else 2] if len(rest) > (3 if a["has_zeros"] else 2) else None
    return qw, sc, zeros, bias


# the ops that multiply float activations by a float weight matrix (`linear_weight_inputs` reads their weight)
FLOAT_LINEARS = ("linear", "linear_act", "silu_mul_linear", "linear_silu_mul")


def linear_weight_inputs(n) -> tuple:
    """(weight, bias or None): the weight operands (Values) of a `linear`, `linear_act` or `linear_silu_mul`
    node, or of a `silu_mul_linear` node, whose first two inputs are the SwiGLU product's gate and up."""
    rest = n.inputs[2 if n.op == "silu_mul_linear" else 1:]
    return rest[0], rest[1] if len(rest) > 1 else None


def qlinear_weight_inputs(n) -> tuple:
    """(qweight, scales, zeros or None, bias or None): the weight operands (Values) of a `qlinear` node, or of
    a `qlinear_codes` node, whose first two inputs are the activation codes and their scales."""
    return _qlinear_operands([None, *n.inputs[2 if n.op == "qlinear_codes" else 1:]], n.attrs)


def _qlinear_infer(ts, a):
    from llmc.ir.quant import QuantFormat
    fmt = QuantFormat.from_attrs(a)
    x, qw, sc = ts[0], ts[1], ts[2]
    k = a["in_features"]
    packed = k // 2 if fmt.kind == "int" and fmt.bits == 4 else k
    if x.shape[-1] != k or qw.rank != 2 or qw.shape[1] != packed:
        raise IRError(f"qlinear: input {x} does not match qweight {qw} ({fmt.label}, {k} input features)")
    if sc.rank != 2 or sc.shape != (qw.shape[0], fmt.groups(k)):
        raise IRError(f"qlinear: scales {sc} should be [{qw.shape[0]}, {fmt.groups(k)}] for {fmt.label}")
    if a["has_zeros"] and (len(ts) < 4 or ts[3].shape != sc.shape):
        raise IRError("qlinear: has_zeros needs a zeros operand shaped like the scales")
    return TensorType(x.shape[:-1] + (qw.shape[0],), x.dtype)


def _qlinear_ref(x, a, env):
    from llmc.ir.quant import QuantFormat, qlinear_ref
    y = qlinear_ref(x[0], QuantFormat.from_attrs(a), *_qlinear_operands(x, a))
    return LINEAR_ACTS[a["act"]](y) if a["act"] else y


register_op("qlinear", "nn", ("x", "qweight", "scales", "zeros?", "bias?"), _qlinear_infer, _qlinear_ref,
            {"kind": REQUIRED, "bits": 8, "group_size": 0, "has_zeros": False, "in_features": REQUIRED, "act": ""},
            "act(x @ W.T + bias) for a quantized W (formats: llmc/ir/quant.py); zeros only when has_zeros",
            traits=("linear", "no_fold"))


def _act_codes_types(t: TensorType, kind: str) -> list[TensorType]:
    """The (codes, per-token scales) types of x `t` quantized for a `kind` ("w8a8" or "fp8") linear."""
    if kind not in ("w8a8", "fp8"):
        raise IRError(f"activation codes are w8a8 or fp8, not {kind!r}")
    return [t.with_dtype("i8" if kind == "w8a8" else "f8e4m3"), t.with_shape(t.shape[:-1] + (1,)).with_dtype("f32")]


def _rms_norm_quant_ref(x, a, env):
    from llmc.ir.quant import quantize_activations
    return list(quantize_activations(_rms_norm_ref(x, a, env), a["kind"]))


def _add_rms_norm_quant_ref(x, a, env):
    from llmc.ir.quant import quantize_activations
    normed, h = _add_rms_norm_ref(x, a, env)
    return [*quantize_activations(normed, a["kind"]), h]


register_op("rms_norm_quant", "nn", ("x", "weight"),
            lambda ts, a: _act_codes_types(ts[0].with_dtype(_result_dtype([ts[0], ts[1]])), a["kind"]),
            _rms_norm_quant_ref, {"eps": 1e-6, "weight_first_cast": True, "kind": REQUIRED},
            "(codes, scales) of rms_norm(x, weight) quantized per token for a `kind` (w8a8 / fp8) qlinear: "
            "quant.quantize_activations of the norm's output, which never leaves the kernel")
register_op("add_rms_norm_quant", "nn", ("a", "b", "weight"),
            lambda ts, a: [*_act_codes_types(OPS["add_rms_norm"].infer_fn(ts, a)[0], a["kind"]),
                           _binary_infer(ts[:2], a)],
            _add_rms_norm_quant_ref, {"eps": 1e-6, "weight_first_cast": True, "kind": REQUIRED},
            "(codes, scales, a + b): add_rms_norm with its normed output quantized per token (rms_norm_quant)")


def _silu_mul_quant_ref(x, a, env):
    from llmc.ir.quant import quantize_activations
    return list(quantize_activations(F.silu(x[0]) * x[1], a["kind"]))


register_op("silu_mul_quant", "nn", ("gate", "up"), lambda ts, a: _act_codes_types(_binary_infer(ts, a), a["kind"]),
            _silu_mul_quant_ref, {"kind": REQUIRED},
            "(codes, scales) of silu(gate) * up quantized per token for a `kind` (w8a8 / fp8) qlinear (the down "
            "projection): quant.quantize_activations of the product, which never leaves the kernel")


def _qlinear_codes_infer(ts, a):
    xq, sx, qw, sc = ts[:4]
    k = a["in_features"]
    if a["kind"] not in ("w8a8", "fp8") or xq.shape[-1] != k or qw.rank != 2 or qw.shape[1] != k \
            or sx.shape != xq.shape[:-1] + (1,) or sc.shape != (qw.shape[0], 1):
        raise IRError(f"qlinear_codes: codes {xq}, scales {sx}, qweight {qw}, weight scales {sc} do not fit a "
                      f"{a['kind']} linear of {k} input features")
    return TensorType(xq.shape[:-1] + (qw.shape[0],), a["dtype"])


def _qlinear_codes_ref(x, a, env):
    from llmc.ir.quant import QuantFormat, qlinear_codes_ref
    y = qlinear_codes_ref(x[0], x[1], QuantFormat.from_attrs(a), x[2], x[3], x[4] if len(x) > 4 else None,
                          torch_dtype(a["dtype"]))
    return LINEAR_ACTS[a["act"]](y) if a["act"] else y


register_op("qlinear_codes", "nn", ("x_codes", "x_scales", "qweight", "scales", "bias?"), _qlinear_codes_infer,
            _qlinear_codes_ref,
            {"kind": REQUIRED, "bits": 8, "group_size": 0, "has_zeros": False, "in_features": REQUIRED, "act": "",
             "dtype": REQUIRED},
            "act(x @ W.T + bias) as `dtype` for a w8a8 / fp8 W, from x's per-token codes and scales made by the "
            "op before it (rms_norm_quant, silu_mul_quant)", traits=("linear", "no_fold"))


def _fused_infer(ts, a):
    from llmc.ir.region import region_types
    return region_types(a, ts)


def _fused_ref(x, a, env):
    from llmc.ir.region import run_region
    return run_region(a, x, env)


register_op("fused", "fused", ("xs*",), _fused_infer, _fused_ref, {"kind": "elementwise", "body": REQUIRED,
                                                                 "outputs": REQUIRED},
            "a region: body = [[name, op, [operand names], attrs], ...] over operands named %0.. %n-1; "
            "outputs names the body values it returns")


# ---------------------------------------------------------------------------------------------
# collectives, inserted by tensor parallelism (llmc/ir/sharding.py); groups: llmc/ir/collectives.py

def _all_gather_infer(ts, a):
    d = _norm_dim(a["dim"], ts[0].rank)
    s = list(ts[0].shape)
    s[d] = dim_mul(s[d], a["size"])
    return ts[0].with_shape(s)


def _all_reduce_ref(x, a, env):
    from llmc.ir.collectives import all_reduce_ref
    return all_reduce_ref(x, a, env)


def _all_gather_ref(x, a, env):
    from llmc.ir.collectives import all_gather_ref
    return all_gather_ref(x, a, env)


register_op("all_reduce", "collective", ("x",), _same, _all_reduce_ref, {"group": REQUIRED},
            "the sum of x over the ranks of process group `group` (after a row-parallel linear)",
            traits=("no_fold",))
register_op("all_gather", "collective", ("x",), _all_gather_infer, _all_gather_ref,
            {"group": REQUIRED, "dim": -1, "size": REQUIRED},
            "the `size` ranks' x concatenated along dim, in rank order (the vocabulary-parallel LM head)",
            traits=("no_fold",))
