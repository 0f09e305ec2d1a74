"""A small dataflow pattern language and one rewrite driver.

Patterns read like the math they match:

    x, w = P.any("x"), P.param("w")
    hs = P.cast(x) | x                               # alternatives
    var = P.op("mean", keepdim=True)(P.op("pow")(hs, P.const(2)))
    normed = P.op("mul")(hs, P.op("rsqrt")(P.op("add")(var, P.const().named("eps"))))

`P.op(name, **attrs)(*args)` matches a node by op name (several names: a family), attributes (a
value, or a predicate on the value) and operand patterns; `P.any(name)` matches any value and
captures it; a name used twice must bind the same value. `.named(n)` captures, `|` gives
alternatives, `.dtype(...)`, `.rank(n)` and `.check(fn)` constrain. `RewriteRule` pairs a pattern
with a callback that builds the replacement; `apply_rewrites` drives rules to a fixed point with a
loop guard and counts matches per rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from llmc.errors import CompileError
from llmc.ir.graph import Graph, Node, Value


class Match:
    """Captured values of one match; `m["x"]` is a Value, `m.node("x")` its producer."""

    def __init__(self, root: Value):
        self.root = root
        self.captures: dict[str, Value] = {}
        self.nodes: list[Node] = []

    def __getitem__(self, name: str) -> Value:
        return self.captures[name]

    def __contains__(self, name: str) -> bool:
        return name in self.captures

    def node(self, name: str) -> Node:
        return self.captures[name].producer

    def const(self, name: str) -> Any:
        """The literal value of a captured `constant` node."""
        return self.node(name).attrs["value"]

    def _save(self):
        return dict(self.captures), len(self.nodes)

    def _restore(self, snap):
        self.captures, n = dict(snap[0]), snap[1]
        del self.nodes[n:]


class Pattern:
    def match(self, v: Value, m: Match) -> bool:
        raise NotImplementedError

    def __call__(self, v: Value) -> Match | None:
        """Match at `v`; the Match or None."""
        m = Match(v)
        return m if self.match(v, m) else None

    def __or__(self, other: "Pattern") -> "Pattern":
        return Alt((self, other))

    def named(self, name: str) -> "Pattern":
        return Capture(self, name)

    def check(self, fn: Callable[[Value], bool]) -> "Pattern":
        return Check(self, fn)

    def dtype(self, *dtypes: str) -> "Pattern":
        return Check(self, lambda v: v.type.dtype in dtypes)

    def rank(self, r: int) -> "Pattern":
        return Check(self, lambda v: v.type.rank == r)


@dataclass(frozen=True)
class Wildcard(Pattern):
    kind: str | None = None  # None: any value; "param"/"input": only that kind

    def match(self, v, m):
        return v is not None and (self.kind is None or v.kind == self.kind)


@dataclass(frozen=True)
class Capture(Pattern):
    inner: Pattern
    name: str

    def match(self, v, m):
        if self.name in m.captures:
            return m.captures[self.name] is v
        if not self.inner.match(v, m):
            return False
        m.captures[self.name] = v
        return True


@dataclass(frozen=True)
class Check(Pattern):
    inner: Pattern
    fn: Callable

    def match(self, v, m):
        return self.inner.match(v, m) and bool(self.fn(v))


@dataclass(frozen=True)
class Alt(Pattern):
    options: tuple

    def match(self, v, m):
        for p in self.options:
            snap = m._save()
            if p.match(v, m):
                return True
            m._restore(snap)
        return False

    def __or__(self, other):
        return Alt(self.options + (other,))


@dataclass(frozen=True)
class OpPattern(Pattern):
    ops: frozenset
    args: tuple | None = None  # None: any operands
    attrs: tuple = ()  # ((name, value or predicate), ...)
    commutative: bool = False
    output: int = 0

    def match(self, v, m):
        n = v.producer if v is not None else None
        if n is None or n.op not in self.ops or n.outputs.index(v) != self.output:
            return False
        for k, want in self.attrs:
            have = n.attrs.get(k)
            if callable(want) and not isinstance(want, type) and not want(have):
                return False
            if not callable(want) and _norm(have) != _norm(want):
                return False
        if self.args is not None:
            if len(self.args) != len(n.inputs):
                return False
            orders = [n.inputs]
            if self.commutative and len(n.inputs) == 2:
                orders.append(n.inputs[::-1])
            for ins in orders:
                snap = m._save()
                if all(p.match(x, m) for p, x in zip(self.args, ins)):
                    break
                m._restore(snap)
            else:
                return False
        m.nodes.append(n)
        return True


def _norm(v):
    return list(v) if isinstance(v, tuple) else v


_COMMUTATIVE = {"add", "mul", "maximum", "minimum"}


class _OpBuilder:
    def __init__(self, ops: tuple[str, ...], attrs: dict, commutative: bool | None):
        self.ops, self.attrs, self.comm = frozenset(ops), tuple(attrs.items()), commutative

    def __call__(self, *args: Pattern) -> OpPattern:
        comm = self.comm if self.comm is not None else self.ops <= _COMMUTATIVE
        return OpPattern(self.ops, tuple(args), self.attrs, comm)

    def any_args(self) -> OpPattern:
        return OpPattern(self.ops, None, self.attrs, False)


class P:
    """Pattern constructors."""

    @staticmethod
    def op(*names: str, commutative: bool | None = None, **attrs) -> _OpBuilder:
        """`P.op("add")(a, b)`; `P.op("add", "sub")` for either; attribute values or predicates as kwargs."""
        return _OpBuilder(names, attrs, commutative)

    @staticmethod
    def any(name: str | None = None) -> Pattern:
        return Capture(Wildcard(), name) if name else Wildcard()

    @staticmethod
    def param(name: str | None = None) -> Pattern:
        return Capture(Wildcard("param"), name) if name else Wildcard("param")

    @staticmethod
    def const(value: Any = None, name: str | None = None) -> Pattern:
        """A `constant` node; `value` may be a literal or a predicate on the literal."""
        pred = value if callable(value) else (lambda x: True) if value is None else (lambda x: x == value)
        p = OpPattern(frozenset({"constant"}), (), (("value", pred),))
        return Capture(p, name) if name else p

    @staticmethod
    def cast(x: Pattern, dtype: str | None = None) -> Pattern:
        return P.op("cast", **({"dtype": dtype} if dtype else {}))(x)

    @staticmethod
    def maybe_cast(x: Pattern) -> Pattern:
        """`cast(x)` or `x`: models insert casts that disappear in float32."""
        return P.cast(x) | x


# ---------------------------------------------------------------------------------------------
# rewriting

class Builder:
    """Inserts new nodes before the matched root; the rewrite callback's handle on the graph."""

    def __init__(self, graph: Graph, anchor: Node):
        self.graph, self.anchor = graph, anchor

    def call(self, op: str, *inputs: Value, **attrs) -> Value:
        node = self.graph.make_node(op, list(inputs), attrs, meta=dict(self.anchor.meta))
        self.graph.insert_before(self.anchor, node)
        return node.out

    def node(self, op: str, inputs: list[Value], attrs: dict | None = None) -> Node:
        node = self.graph.make_node(op, inputs, attrs or {}, meta=dict(self.anchor.meta))
        self.graph.insert_before(self.anchor, node)
        return node

    def sole_reader(self, v: Value) -> bool:
        """Whether one node alone reads `v` and it is no graph output: a fusion that folds `v` into that node
        leaves nothing else needing it."""
        return sum(v in n.inputs for n in self.graph.nodes) == 1 and v not in self.graph.outputs

    def param(self, name: str, tensor: torch.Tensor) -> Value:
        """A new weight (e.g. concatenated or folded at compile time)."""
        name = self.graph.fresh(name)
        v = self.graph.add_param(name, tensor)
        return v


@dataclass
class RewriteRule:
    """A pattern and the callback that replaces the root's value; the callback may return None to decline."""

    name: str
    pattern: Pattern
    rewrite: Callable[[Builder, Match], Value | None]


def dead_code(graph: Graph) -> int:
    """Remove nodes whose outputs nothing uses; returns how many were removed."""
    live = set(graph.outputs)
    keep = []
    for n in reversed(graph.nodes):
        if any(v in live for v in n.outputs) or n.meta.get("side_effect"):
            keep.append(n)
            live.update(n.inputs)
    kept = set(keep)
    removed = [n for n in graph.nodes if n not in kept] if len(keep) != len(graph.nodes) else []
    if removed:
        graph.remove_nodes(removed)
    return len(removed)


def apply_rewrites(graph: Graph, rules: Iterable[RewriteRule], max_iterations: int = 32) -> dict[str, int]:
    """Apply rules to a fixed point. Returns matches per rule; raises if the rules never settle."""
    rules = list(rules)
    stats = {r.name: 0 for r in rules}
    for _ in range(max_iterations):
        changed = False
        for node in list(graph.nodes):
            if node not in graph.nodes or len(node.outputs) != 1:
                continue
            for rule in rules:
                try:
                    m = rule.pattern(node.out)
                    new = None if m is None else rule.rewrite(Builder(graph, node), m)
                except Exception as e:  # let the pass manager show the IR around the failing node
                    if getattr(e, "node", None) is None:
                        e.node = node
                    raise
                if m is None:
                    continue
                if new is None or new is node.out:
                    continue
                graph.replace_uses(node.out, new)
                stats[rule.name] += 1
                changed = True
                break
        if not changed:
            dead_code(graph)
            return stats
        dead_code(graph)
    raise CompileError(f"rewrite rules {[r.name for r in rules]} did not settle after {max_iterations} "
                       "iterations: a rule's replacement matches again (a rewrite loop)")


class RewritePass:
    """Mixin for a Pass that is a set of rewrite rules: define `rules(ctx)`, get `run` for free.

    Example:
        >>> @dataclass
        ... class NoSilu(RewritePass, Pass):
        ...     name: ClassVar[str] = "no_silu"
        ...     def rules(self, ctx):
        ...         return [RewriteRule("silu", P.op("silu")(P.any("x")),
        ...                             lambda b, m: b.call("mul", m["x"], b.call("sigmoid", m["x"])))]
    """

    def rules(self, ctx) -> list[RewriteRule]:  # pragma: no cover - interface
        raise NotImplementedError

    def run(self, graph, ctx):
        from llmc.passes.manager import PassResult
        stats = apply_rewrites(graph, self.rules(ctx))
        return PassResult(graph, any(stats.values()), stats)
