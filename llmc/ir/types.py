"""Tensor types with symbolic dims.

A dim is an `int` or a `SymDim`. Base symbols (`B`, `S`, `T`) carry their range; derived dims
(`B*S`) are `SymDim`s whose name is a sympy expression over the base symbols. Equality of dims is
equality of their (canonical) names, so `S*B` and `B*S` compare equal.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import sympy
import torch

from llmc.errors import IRError

# text name <-> torch dtype; the text names are what the printer writes and the parser reads
DTYPES: dict[str, torch.dtype] = {
    "f64": torch.float64,
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f8e4m3": torch.float8_e4m3fn,
    "i64": torch.int64,
    "i32": torch.int32,
    "i16": torch.int16,
    "i8": torch.int8,
    "u8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = frozenset({"f64", "f32", "f16", "bf16", "f8e4m3"})


def dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        if dtype in DTYPES:
            return dtype
        alias = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
                 "int64": "i64", "int32": "i32", "int8": "i8", "uint8": "u8"}
        if dtype in alias:
            return alias[dtype]
        raise IRError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise IRError(f"llmc has no IR dtype for {dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[dtype_name(name)]


@dataclass(frozen=True)
class SymDim:
    """A symbolic dim: a base symbol with its range, or an expression over base symbols."""

    name: str
    min: int = field(default=1, compare=False)
    max: int | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return self.name


Dim = int | SymDim


@functools.lru_cache(maxsize=4096)
def _canon(expr: str) -> str:
    return str(sympy.sympify(expr, locals=_SYMPY_LOCALS(expr)))


# the functions a dim's expression may call (a symbolic dim divided: `floor(S/2)`); every other name is a dim
_DIM_FUNCTIONS = {"floor": sympy.floor, "ceiling": sympy.ceiling, "Max": sympy.Max, "Min": sympy.Min, "Mod": sympy.Mod}


def _SYMPY_LOCALS(expr: str) -> dict:
    # single-letter names like S, N, E, I, O, Q are sympy objects; force every other name to a Symbol
    import re
    return {n: _DIM_FUNCTIONS.get(n) or sympy.Symbol(n, positive=True, integer=True)
            for n in re.findall(r"[A-Za-z_]\w*", expr)}


def make_dim(d: int | str | SymDim) -> Dim:
    """Canonicalise a dim: ints stay ints, expressions become SymDims with a canonical name."""
    if isinstance(d, SymDim):
        return d
    if isinstance(d, int):
        return d
    s = _canon(str(d))
    try:
        return int(s)
    except ValueError:
        return SymDim(s)


def dim_mul(*dims: Dim) -> Dim:
    if all(isinstance(d, int) for d in dims):
        out = 1
        for d in dims:
            out *= d
        return out
    return make_dim("*".join(f"({d})" for d in dims))


def dim_div(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        if b == 0 or a % b:
            raise IRError(f"dim {a} is not divisible by {b}")
        return a // b
    return make_dim(f"({a})/({b})")


def dim_add(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    return make_dim(f"({a})+({b})")


def dim_eval(d: Dim, env: dict[str, int]) -> int:
    """The concrete value of a dim given the base symbols' values."""
    if isinstance(d, int):
        return d
    if d.name in env:  # a base symbol: the common case on the hot path
        return env[d.name]
    fn, names = _compiled(d.name)
    return int(fn(*[env[n] for n in names]))


def dim_symbols(d: Dim) -> set[str]:
    """The symbols a dim depends on (none for an int)."""
    return set() if isinstance(d, int) else set(_compiled(d.name)[1])


@functools.lru_cache(maxsize=1024)
def _compiled(expr: str):
    """An expression over symbols as a plain Python function (sympy parses once per expression)."""
    e = sympy.sympify(expr, locals=_SYMPY_LOCALS(expr))
    syms = sorted(e.free_symbols, key=str)
    return sympy.lambdify(syms, e, modules="math"), [str(s) for s in syms]


@dataclass(frozen=True)
class TensorType:
    """shape, dtype name, and an optional quantization scheme tag (e.g. `w8_per_channel`)."""

    shape: tuple[Dim, ...]
    dtype: str
    quant: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(make_dim(d) for d in self.shape))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def with_shape(self, shape) -> "TensorType":
        return TensorType(tuple(shape), self.dtype, self.quant)

    def with_dtype(self, dtype: str) -> "TensorType":
        return TensorType(self.shape, dtype, self.quant)

    def numel(self) -> Dim:
        return dim_mul(*self.shape) if self.shape else 1

    def __str__(self) -> str:
        q = f"<{self.quant}>" if self.quant else ""
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]{q}"

    @staticmethod
    def of(t: torch.Tensor) -> "TensorType":
        return TensorType(tuple(t.shape), dtype_name(t.dtype))


def broadcast_shapes(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> tuple[Dim, ...]:
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise IRError(f"shapes {list(map(str, a))} and {list(map(str, b))} do not broadcast")
    return tuple(reversed(out))


def dim_subs(d: Dim, mapping: dict[str, int | str]) -> Dim:
    """Substitute base symbols in a dim (`B*S` with {B: 1, S: "T"} gives `T`)."""
    if isinstance(d, int) or not any(k in d.name for k in mapping):
        return d
    return _subs(d.name, tuple(sorted(mapping.items())))


@functools.lru_cache(maxsize=4096)
def _subs(name: str, mapping: tuple[tuple[str, int | str], ...]) -> Dim:
    """`dim_subs` of one expression: a graph holds the same few thousand times (sympy takes ~0.5 ms each)."""
    expr = sympy.sympify(name, locals=_SYMPY_LOCALS(name))
    subs = {sympy.Symbol(k, positive=True, integer=True):
            (v if isinstance(v, int) else sympy.Symbol(v, positive=True, integer=True)) for k, v in mapping}
    return make_dim(str(expr.subs(subs)))


def subs_dim_attr(value, mapping: dict[str, int | str]):
    """A list attribute (a reshape/expand shape) with its symbolic entries substituted; other values as they are."""
    if not isinstance(value, list) or not any(isinstance(x, str) for x in value):
        return value
    out = []
    for x in value:
        d = dim_subs(make_dim(x), mapping) if isinstance(x, str) else x
        out.append(d if isinstance(d, int) else d.name)
    return out
