"""Pattern-by-example: write the pattern and its replacement as plain Python over torch.

    def pattern(x, w):
        return torch.nn.functional.gelu(x @ w.t(), approximate="tanh")

    def replacement(x, w):
        return torch.nn.functional.gelu(x @ w.t())

    rule = rule_from_example(pattern, replacement, (torch.randn(4, 8), torch.randn(16, 8)))

Both functions are traced with torch.export into llmc IR, with every input dim dynamic where the
code allows; the pattern graph becomes a `Pattern` (inputs are named wildcards; constants must be
equal; reshape/expand shapes are free), and the replacement graph is inlined at each match with
its symbolic dims bound to the matched values' dims.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch

from llmc.errors import CompileError
from llmc.ir.graph import Graph, Value
from llmc.ir.types import subs_dim_attr
from llmc.passes.manager import Pass, PassResult, register_pass
from llmc.passes.pattern import (Builder, Capture, Match, OpPattern, P, Pattern, RewriteRule, Wildcard,
                                 apply_rewrites)

# attributes that hold shapes traced from the example sizes: a pattern leaves them unconstrained
_SHAPE_ATTRS = {"shape"}


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def trace_function(fn: Callable, example_inputs: Sequence[torch.Tensor], canonicalize: bool = True) -> Graph:
    """Trace a Python function over tensors into an llmc Graph (inputs named after its parameters)."""
    from llmc.frontend.torch_export import capture
    names = list(inspect.signature(fn).parameters)[: len(example_inputs)]
    g = capture(_Fn(fn), tuple(example_inputs), names, dynamic="auto", name=getattr(fn, "__name__", "fn"))
    if len(g.outputs) != 1:
        raise CompileError(f"{fn.__name__}: a pattern function must return exactly one tensor")
    if canonicalize:
        from llmc.passes.fold_constants import _identity_rules
        apply_rewrites(g, _identity_rules())
    return g


def pattern_from_graph(g: Graph) -> Pattern:
    """The Pattern matching `g`'s output: ops, operand structure, constants and attributes."""
    memo: dict[Value, Pattern] = {}

    def build(v: Value) -> Pattern:
        if v in memo:
            return memo[v]
        if v.kind in ("input", "param"):  # ranks must agree: the replacement indexes dims by position
            r = v.type.rank
            p = Capture(Wildcard(None if v.kind == "input" else "param").check(lambda x, r=r: x.type.rank == r), v.name)
        elif v.producer.op == "constant":
            p = P.const(v.producer.attrs["value"])
        else:
            n = v.producer
            attrs = tuple((k, a) for k, a in n.attrs.items() if k not in _SHAPE_ATTRS)
            p = OpPattern(frozenset({n.op}), tuple(build(x) for x in n.inputs), attrs,
                          commutative=n.op in {"add", "mul", "maximum", "minimum"}, output=n.outputs.index(v))
        memo[v] = p
        return p

    return build(g.outputs[0])


def inline_graph(b: Builder, g: Graph, bindings: dict[str, Value]) -> Value:
    """Insert a copy of `g`'s nodes at the builder's anchor, its inputs bound by name; returns its output."""
    env: dict[Value, Value] = {}
    dims: dict[str, Any] = {}
    for v in g.inputs:
        if v.name not in bindings:
            raise CompileError(f"replacement input {v.name!r} is not captured by the pattern")
        target = bindings[v.name]
        env[v] = target
        for d, t in zip(v.type.shape, target.type.shape):
            if not isinstance(d, int) and d.name not in dims:
                dims[d.name] = t if isinstance(t, int) else t.name
    for p in g.params:
        env[p] = bindings[p.name] if p.name in bindings else b.param(f"example.{p.name}", g.weights[p.name])
    for n in g.nodes:
        attrs = {k: subs_dim_attr(a, dims) for k, a in n.attrs.items()}
        node = b.node(n.op, [env[x] for x in n.inputs], attrs)
        env.update(zip(n.outputs, node.outputs))
    return env[g.outputs[0]]


def rule_from_example(pattern: Callable, replacement: Callable, example_inputs: Sequence[torch.Tensor],
                      name: str | None = None, check: Callable[[Match], bool] | None = None) -> RewriteRule:
    """A RewriteRule from two plain Python functions with the same parameters.

    Args:
        pattern: what to find, written over torch tensors.
        replacement: what to put instead, same parameters, same output shape and dtype.
        example_inputs: tensors to trace both with (sizes only shape the trace; dims stay symbolic).
        check: an optional predicate on the Match to decline some matches.
    Returns:
        A RewriteRule for `apply_rewrites` or `ReplaceByExample`.
    """
    pg = trace_function(pattern, example_inputs)
    rg = trace_function(replacement, example_inputs)
    pat = pattern_from_graph(pg)

    def rewrite(b: Builder, m: Match):
        if check is not None and not check(m):
            return None
        out = inline_graph(b, rg, m.captures)
        if out.type.dtype != m.root.type.dtype or out.type.shape != m.root.type.shape:
            return None  # the replacement would change the value's type here
        return out

    return RewriteRule(name or f"{pattern.__name__}->{replacement.__name__}", pat, rewrite)


@dataclass
class ReplaceByExample(Pass):
    """A pass applying `rule_from_example(pattern, replacement, example_inputs)` everywhere.

    Example:
        >>> p = ReplaceByExample(pattern=gelu_tanh, replacement=gelu_exact,            # doctest: +SKIP
        ...                      example_inputs=(torch.randn(4, 8),))
    """

    name: ClassVar[str] = "replace_by_example"
    pattern: Callable = None
    replacement: Callable = None
    example_inputs: tuple = ()
    rule: RewriteRule | None = field(default=None, repr=False)

    def run(self, graph, ctx):
        rule = self.rule or rule_from_example(self.pattern, self.replacement, self.example_inputs)
        stats = apply_rewrites(graph, [rule])
        return PassResult(graph, any(stats.values()), stats)

    def describe(self) -> str:
        return f"{self.name}{{{getattr(self.pattern, '__name__', '?')}->{getattr(self.replacement, '__name__', '?')}}}"
