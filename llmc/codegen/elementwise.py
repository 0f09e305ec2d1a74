"""Fused elementwise regions: Python turns an expression DAG into Triton lines, the template loops over them.

A region reads its inputs once, computes every op in registers and writes its outputs once; a chain
of k ops run one kernel each would move every intermediate through HBM twice (write, read back).

Numerics: every float value is computed in fp32 (fp64 for f64) and rounded once, when stored in
its output dtype. torch rounds after every op in the op's dtype (bf16 `silu(x) * y` rounds twice),
so the fused result is at least as accurate and differs from the reference by a few output ulps;
tests compare with dtype-appropriate tolerances. An explicit `cast` to f16/bf16 is kept as a
rounding (it is the model's own choice, e.g. Llama's `normed.to(x.dtype)`). Integer values keep
their own type; ops that only make sense on floats (exp, div, ...) refuse integer operands.

Broadcasting is what LLM graphs need, relative to the region's output shape [..., C] seen as
[R, C] rows: `full` (the output shape, any row stride, unit column stride), `row` (one value per
row: [..., 1]), `col` (one value per column: [C] or [1, ..., C]) and `scalar` (0-d or 1 element).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Sequence

import torch

from llmc.codegen.kernels import KernelSpec, load, pdl_enabled
from llmc.errors import CompileError
from llmc.intmath import cdiv, next_pow2
from llmc.ir.ops import get_op
from llmc.ir.types import FLOAT_DTYPES, TensorType, dtype_name, torch_dtype

KINDS = ("full", "row", "col", "scalar")
UNARY_OPS = ("neg", "silu", "gelu", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "reciprocal",
             "abs", "cos", "sin", "cast")
BINARY_OPS = ("add", "sub", "mul", "div", "pow", "maximum", "minimum", "silu_mul")
SUPPORTED_OPS = UNARY_OPS + BINARY_OPS + ("constant",)
_INT_OK = {"neg", "abs", "relu", "cast", "add", "sub", "mul", "maximum", "minimum", "constant"}
_TL = {"f64": "tl.float64", "f32": "tl.float32", "f16": "tl.float16", "bf16": "tl.bfloat16",
       "f8e4m3": "tl.float8e4nv", "i64": "tl.int64", "i32": "tl.int32", "i16": "tl.int16", "i8": "tl.int8",
       "u8": "tl.uint8", "bool": "tl.int1"}
# a stand-in shape per kind, so the registry's type rules (torch promotion, rank-0 rule) give dtypes
_PROBE_SHAPE = {"full": (2, 3), "row": (2, 1), "col": (3,), "scalar": ()}

# Helpers the expressions call; the interpreter has no libdevice, so tanh and pow use tl primitives.
HELPERS = {
    "tanh": '''@triton.jit
def _tanh(x):
    # odd Taylor series near 0 (1 - exp(-2|x|) cancels there), the exp form elsewhere
    x2 = x * x
    small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    t = tl.exp(-2.0 * tl.abs(x))
    big = (1.0 - t) / (1.0 + t)
    return tl.where(tl.abs(x) < 0.0625, small, tl.where(x < 0, -big, big))''',
    "pow": '''@triton.jit
def _pow(a, b):
    # torch.pow on reals: |a|^b, negated for a < 0 and odd integer b, NaN for a < 0 and fractional b
    mag = tl.exp2(b * tl.log2(tl.abs(a)))
    b_int = b == tl.floor(b)
    odd = b_int & (tl.abs(b - 2.0 * tl.floor(b * 0.5)) == 1.0)
    signed = tl.where(a < 0, tl.where(b_int, tl.where(odd, -mag, mag), float("nan")), mag)
    return tl.where(b == 0, 1.0, signed)''',
}


RNE_BF16 = '''@triton.jit
def _rne_bf16(x):
    # fp32 rounded to the nearest bf16 (ties to even) in integer arithmetic; the interpreter's own
    # fp32 -> bf16 cast truncates (triton 3.9 cast_impl), the cast of this value is exact
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, u.to(tl.float32, bitcast=True))'''


def interpreting() -> bool:
    """Whether @triton.jit builds interpreted kernels now (triton reads TRITON_INTERPRET when it decorates)."""
    try:
        from triton import knobs
        return bool(knobs.runtime.interpret)
    except ImportError:  # triton < 3.4 read the variable directly
        import os
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def cast_expr(expr: str, dtype: str) -> str:
    """`expr` (fp32) cast to IR dtype `dtype`, rounding to nearest even on every backend."""
    if dtype == "bf16" and interpreting():
        return f"_rne_bf16({expr}).to(tl.bfloat16)"
    return f"({expr}).to({_TL[dtype]})"


def cast_helpers(dtypes) -> list[str]:
    """The helper sources `cast_expr` needs for casts to `dtypes`."""
    return [RNE_BF16] if interpreting() and "bf16" in set(dtypes) else []


@functools.lru_cache(maxsize=None)
def _module(spec: KernelSpec, interpret: bool, pdl: bool) -> ModuleType:
    return load(spec, pdl)


def compiled(spec: KernelSpec) -> ModuleType:
    """`kernels.load(spec)` memoized per spec: a launch must not re-render and re-hash its template."""
    interpret = interpreting()
    return _module(spec, interpret, pdl_enabled(interpret))


def _lit(value: Any, dtype: str) -> str:
    if dtype in FLOAT_DTYPES:
        v = float(value)
        if not math.isfinite(v):
            raise CompileError(f"fused elementwise: non-finite constant {v} is not supported; keep it unfused")
        return repr(v)
    return repr(int(value)) if dtype != "bool" else repr(bool(value))


def op_expr(op: str, args: Sequence[str], attrs: dict, helpers: set[str] | None = None,
            const_args: Sequence[float | None] = ()) -> str:
    """The Triton expression of `op` on fp32 (or integer) operand expressions `args`."""
    helpers = helpers if helpers is not None else set()
    a = args[0] if args else None
    b = args[1] if len(args) > 1 else None
    if op == "neg":
        return f"-{a}"
    if op == "silu":
        return f"{a} * tl.sigmoid({a})"
    if op == "gelu":
        if attrs.get("approximate", "none") == "tanh":
            helpers.add("tanh")
            return f"0.5 * {a} * (1.0 + _tanh(0.7978845608028654 * ({a} + 0.044715 * {a} * {a} * {a})))"
        return f"0.5 * {a} * (1.0 + tl.math.erf({a} * 0.7071067811865476))"
    if op == "relu":
        return f"tl.maximum({a}, 0, propagate_nan=tl.PropagateNan.ALL)"  # relu(NaN) is NaN in torch
    if op == "tanh":
        helpers.add("tanh")
        return f"_tanh({a})"
    simple = {"sigmoid": "tl.sigmoid", "exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt_rn", "rsqrt": "tl.rsqrt",
              "abs": "tl.abs", "cos": "tl.cos", "sin": "tl.sin"}
    if op in simple:
        return f"{simple[op]}({a})"
    if op == "reciprocal":
        return f"1.0 / {a}"
    infix = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
    if op in infix:
        return f"{a} {infix[op]} {b}"
    if op in ("maximum", "minimum"):
        return f"tl.{op}({a}, {b}, propagate_nan=tl.PropagateNan.ALL)"
    if op == "silu_mul":
        return f"{a} * tl.sigmoid({a}) * {b}"
    if op == "pow":
        e = const_args[1] if len(const_args) > 1 else None
        exact = {1.0: f"{a}", 2.0: f"{a} * {a}", 3.0: f"{a} * {a} * {a}", 0.5: f"tl.sqrt_rn({a})",
                 -0.5: f"tl.rsqrt({a})", -1.0: f"1.0 / {a}"}
        if e is not None and float(e) in exact:  # the exponents models use, exactly
            return exact[float(e)]
        helpers.add("pow")
        return f"_pow({a}, {b})"
    raise CompileError(f"fused elementwise: op {op!r} has no Triton lowering; supported: {', '.join(SUPPORTED_OPS)}")


def compute_type(dtype: str) -> str:
    """The Triton type a value of IR dtype `dtype` is held in while computing: fp32 for all narrow floats."""
    if dtype in ("f32", "f16", "bf16", "f8e4m3"):
        return "tl.float32"
    return _TL[dtype]


def _freeze_attrs(attrs: Any) -> tuple:
    items = attrs.items() if isinstance(attrs, dict) else (attrs or ())
    return tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in items))


@dataclass(frozen=True)
class ElementwiseSpec(KernelSpec):
    """A fused elementwise region.

    inputs:  ((name, dtype, kind), ...) with kind in KINDS (relative to the region's output shape).
    body:    ((out_name, op, args, attrs), ...) in topological order; args name inputs or earlier
             outputs; attrs is a tuple of (key, value) pairs (a dict is accepted and frozen).
    outputs: ((name, dtype), ...): values written, each as a full tensor of the output shape.
    """

    template = "elementwise.py.jinja"
    inputs: tuple
    body: tuple
    outputs: tuple

    def __post_init__(self):
        object.__setattr__(self, "inputs", tuple((str(n), dtype_name(d), k) for n, d, k in self.inputs))
        object.__setattr__(self, "body", tuple((str(o), op, tuple(args), _freeze_attrs(at))
                                               for o, op, args, at in self.body))
        object.__setattr__(self, "outputs", tuple((str(n), dtype_name(d)) for n, d in self.outputs))
        self._check()

    def _check(self) -> None:
        defined = set()
        for n, _, k in self.inputs:
            if k not in KINDS:
                raise CompileError(f"fused elementwise: input {n!r} has broadcast kind {k!r}; use one of {KINDS}")
            defined.add(n)
        for out, op, args, _ in self.body:
            if op not in SUPPORTED_OPS:
                raise CompileError(f"fused elementwise: op {op!r} cannot be fused; "
                                   f"supported: {', '.join(SUPPORTED_OPS)}")
            missing = [a for a in args if a not in defined]
            if missing or out in defined:
                raise CompileError(f"fused elementwise: {out} = {op}({', '.join(args)}) uses undefined {missing} "
                                   f"or redefines a name; the body must be in topological SSA order")
            defined.add(out)
        if not self.outputs or any(n not in defined for n, _ in self.outputs):
            raise CompileError(f"fused elementwise: outputs {[n for n, _ in self.outputs]} must name defined values")

    def value_dtypes(self) -> dict[str, str]:
        """The IR dtype of every value, by the op registry's type rules (torch's promotion)."""
        types = {n: TensorType(_PROBE_SHAPE[k], d) for n, d, k in self.inputs}
        for out, op, args, attrs in self.body:
            opdef = get_op(op)
            types[out] = opdef.infer_fn([types[a] for a in args], opdef.complete_attrs(dict(attrs)))
        return {n: t.dtype for n, t in types.items()}

    def context(self) -> dict[str, Any]:
        dtypes = self.value_dtypes()
        kinds = {n: k for n, _, k in self.inputs}
        var = {n: f"in{i}" for i, (n, _, _) in enumerate(self.inputs)}
        var.update({out: f"v{j}" for j, (out, _, _, _) in enumerate(self.body)})
        consts = {out: dict(at)["value"] for out, op, _, at in self.body if op == "constant"}
        params, strides, lines, helpers = [], [], [], set()
        for n, d, k in self.inputs:
            v = var[n]
            params.append(f"{v}_ptr")
            if k in ("full", "row"):
                strides.append(f"stride_{v}")
            ptr = {"full": f"{v}_ptr + rows[:, None] * stride_{v} + cols[None, :]",
                   "row": f"{v}_ptr + rows * stride_{v}", "col": f"{v}_ptr + cols", "scalar": f"{v}_ptr"}[k]
            mask = {"full": ", mask=mask, other=0", "row": ", mask=rmask, other=0", "col": ", mask=cmask, other=0",
                    "scalar": ""}[k]
            idx = {"row": "[:, None]", "col": "[None, :]"}.get(k, "")
            lines.append(f"{v} = tl.load({ptr}{mask}){idx}.to({compute_type(d)})")
        for out, op, args, attrs in self.body:
            ct = compute_type(dtypes[out])
            if op == "constant":
                lines.append(f"{var[out]} = {_lit(dict(attrs)['value'], dtypes[out])}")
                continue
            if ct not in ("tl.float32", "tl.float64") and op not in _INT_OK:
                raise CompileError(f"fused elementwise: {op} on integer values ({dtypes[out]}) is not supported; "
                                   f"cast to a float dtype first")
            if op == "cast":
                expr = f"{var[args[0]]}.to({ct})"
                if dtypes[out] in ("f16", "bf16", "f8e4m3"):  # an explicit cast is a rounding the model asked for
                    expr = f"{cast_expr(var[args[0]], dtypes[out])}.to(tl.float32)"
                lines.append(f"{var[out]} = {expr}")
                continue
            operands = [var[a] if compute_type(dtypes[a]) == ct or a in consts else f"{var[a]}.to({ct})"
                        for a in args]
            expr = op_expr(op, operands, dict(attrs), helpers, [consts.get(a) for a in args])
            lines.append(f"{var[out]} = {expr}")
        for i, (n, d) in enumerate(self.outputs):
            params.append(f"out{i}_ptr")
            strides.append(f"stride_out{i}")
        for i, (n, d) in enumerate(self.outputs):
            lines.append(f"tl.store(out{i}_ptr + rows[:, None] * stride_out{i} + cols[None, :], "
                         f"{cast_expr(var[n], d)}, mask=mask)")
        cast_dtypes = [d for _, d in self.outputs] + [dtypes[o] for o, op, _, _ in self.body if op == "cast"]
        return {"params": params + strides, "lines": lines,
                "helpers": [HELPERS[h] for h in sorted(helpers)] + cast_helpers(cast_dtypes),
                "summary": self.summary(), "bytes_comment": self._bytes_comment(dtypes, kinds)}

    def summary(self) -> str:
        return "; ".join(f"{o} = {op}({', '.join(a)})" for o, op, a, _ in self.body)

    def _bytes_comment(self, dtypes: dict[str, str], kinds: dict[str, str]) -> str:
        size = {n: torch_dtype(d).itemsize for n, d in dtypes.items()}
        fused = sum(size[n] for n, _, k in self.inputs if k == "full") + sum(torch_dtype(d).itemsize
                                                                             for _, d in self.outputs)
        consts = {out for out, op, _, _ in self.body if op == "constant"}
        unfused = sum(sum(size[a] for a in args if kinds.get(a, "full") == "full" and a not in consts) + size[out]
                      for out, op, args, _ in self.body if op != "constant")
        return (f"per output element, fused: {fused} B (full inputs read once, outputs written once); "
                f"one kernel per op: {unfused} B")


def broadcast_kind(shape: Sequence, out_shape: Sequence) -> str:
    """The kind of an input of `shape` in a region of output shape `out_shape` (dims: ints or SymDims)."""
    shape, out_shape = tuple(shape), tuple(out_shape)
    if shape == out_shape:
        return "full"
    if all(d == 1 for d in shape):
        return "scalar"
    if len(shape) == len(out_shape) and shape[-1] == 1 and shape[:-1] == out_shape[:-1]:
        return "row"
    if shape and out_shape and shape[-1] == out_shape[-1] and all(d == 1 for d in shape[:-1]):
        return "col"
    raise CompileError(f"fused elementwise: an input of shape {list(map(str, shape))} broadcasts to "
                       f"{list(map(str, out_shape))} in a way the kernel does not support (full, [..., 1] rows, "
                       f"[C] columns, scalars); materialize it with expand first or leave it unfused")


def spec_from_ops(inputs: Sequence[tuple[str, str, str]], ops: Sequence[tuple],
                  outputs: Sequence[str] | None = None) -> ElementwiseSpec:
    """Build an ElementwiseSpec from a list of llmc ops (what the fusion pass holds).

    Args:
        inputs: [(name, dtype, kind)]: dtype an IR dtype name ("bf16"), kind one of KINDS relative
            to the region's output shape (`broadcast_kind(shape, out_shape)` computes it).
        ops: [(op, args, attrs)] or [(op, args, attrs, name)] in topological order. `op` is an llmc
            op name (SUPPORTED_OPS); `args` are input names, names of earlier results, or Python
            numbers (a float becomes a 0-d f32 constant, an int a 0-d i64 one: like torch's weak
            scalars they do not promote a bf16 tensor); `attrs` a dict (or None). Op i's result is
            named `name`, or "t{i}" when the tuple has three items.
        outputs: names of the values to write (inputs or results); default: the last op's result.
            Output dtypes follow the registry's type rules.

    Returns:
        The spec; `fused_elementwise(spec, tensors)` runs it.

    Example:
        >>> spec = spec_from_ops([("g", "bf16", "full"), ("u", "bf16", "full")],
        ...                      [("silu", ["g"], {}), ("mul", ["t0", "u"], {}), ("mul", ["t1", 0.5], None)])
        >>> [o for o, *_ in spec.body]
        ['t0', 't1', 't2_c1', 't2']
    """
    body = []
    for i, item in enumerate(ops):
        op, args, attrs = item[:3]
        out = item[3] if len(item) > 3 else f"t{i}"
        names = []
        for j, a in enumerate(args):
            if isinstance(a, (bool, int, float)):
                cdt = "bool" if isinstance(a, bool) else "i64" if isinstance(a, int) else "f32"
                cname = f"{out}_c{j}"
                body.append((cname, "constant", (), {"value": a, "dtype": cdt}))
                names.append(cname)
            else:
                names.append(str(a))
        body.append((out, op, tuple(names), dict(attrs or {})))
    probe = ElementwiseSpec(tuple(inputs), tuple(body), ((body[-1][0] if body else inputs[-1][0], "f32"),))
    dtypes = probe.value_dtypes()
    outs = list(outputs) if outputs is not None else [body[-1][0]]
    return ElementwiseSpec(tuple(inputs), tuple(body), tuple((o, dtypes[o]) for o in outs))


def _rows_view(t: torch.Tensor, cols: int) -> torch.Tensor:
    """t as [rows, cols] with unit column stride, without a copy when the layout allows it."""
    if t.dim() == 0 or t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, cols)
    except RuntimeError:
        return t.reshape(-1, cols).contiguous()


def fused_elementwise(spec: ElementwiseSpec, tensors: Sequence[torch.Tensor] | dict,
                      outs: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """Run a fused elementwise region.

    Args:
        spec: the region (see `spec_from_ops`).
        tensors: the inputs in `spec.inputs` order (or a dict by name), on one device, of the spec's dtypes.
        outs: contiguous tensors of the broadcast shape to write the outputs into; allocated when None.

    Returns:
        A tuple with one tensor per `spec.outputs`, each of the broadcast shape of the inputs.

    Example:
        >>> spec = spec_from_ops([("x", "f32", "full"), ("b", "f32", "col")],
        ...                      [("add", ["x", "b"], {}), ("silu", ["t0"], {})])
        >>> (y,) = fused_elementwise(spec, [torch.randn(3, 5), torch.randn(5)])
    """
    if isinstance(tensors, dict):
        tensors = [tensors[n] for n, _, _ in spec.inputs]
    assert len(tensors) == len(spec.inputs), f"{spec.name}: {len(spec.inputs)} inputs expected, got {len(tensors)}"
    for t, (n, d, _) in zip(tensors, spec.inputs):
        assert dtype_name(t.dtype) == d, f"input {n}: dtype {t.dtype} but the spec says {d}"
        assert t.device == tensors[0].device, "all inputs must be on one device"
    full = next((t for t, (_, _, k) in zip(tensors, spec.inputs) if k == "full"), None)
    # a full input has the broadcast shape already (checked below); torch's general rule is slow
    if full is not None and all(t.dim() <= full.dim() for t in tensors):
        out_shape = full.shape
    else:
        out_shape = torch.broadcast_shapes(*[t.shape for t in tensors]) if tensors else torch.Size([])
    cols = out_shape[-1] if len(out_shape) else 1
    numel = math.prod(out_shape)
    rows = numel // cols if cols else 0
    device = tensors[0].device if tensors else torch.device("cpu")
    if outs is None:
        outs = [torch.empty(out_shape, dtype=torch_dtype(d), device=device) for _, d in spec.outputs]
    outs = list(outs)
    if numel == 0:
        return tuple(outs)
    args, strides = [], []
    for t, (n, _, k) in zip(tensors, spec.inputs):
        if k == "full":
            assert tuple(t.shape) == tuple(out_shape), \
                f"input {n} of kind full has shape {list(t.shape)}, not {list(out_shape)}"
            v = _rows_view(t, cols)
            strides.append(v.stride(0))
        elif k == "row":
            assert t.numel() == rows and (t.dim() == 0 or t.shape[-1] == 1), \
                f"input {n} of kind row: shape {list(t.shape)}"
            v = _rows_view(t, 1)[:, 0]
            strides.append(v.stride(0))
        elif k == "col":
            assert t.numel() == cols and t.shape[-1] == cols, f"input {n} of kind col: shape {list(t.shape)}"
            v = t.reshape(-1).contiguous()
        else:
            assert t.numel() == 1, f"input {n} of kind scalar has {t.numel()} elements"
            v = t.reshape(1)
        args.append(v)
    views = [o.view(rows, cols) for o in outs]
    # tiles of 2,048 elements whatever the row count, so one compiled kernel serves every step size (a
    # row count's own tile compiled a kernel per batch bucket); the rows past the end are masked. A single row
    # (which Triton compiles apart anyway: it specializes an argument equal to 1) takes the widest tile, so a
    # region whose last dim is the token count (a [1, 1, T] cast of the positions) compiles once, not once per
    # power of two
    block_c = 1024 if rows == 1 else min(next_pow2(cols), 1024)
    block_r = max(1, 2048 // block_c)
    grid = (cdiv(rows, block_r), cdiv(cols, block_c))
    compiled(spec).fused_elementwise_kernel[grid](*args, *views, *strides, *[v.stride(0) for v in views], rows, cols,
                                               BLOCK_R=block_r, BLOCK_C=block_c)
    return tuple(outs)
