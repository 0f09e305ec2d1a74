"""Capture a module with torch.export and lift the exported ATen graph to llmc ops.

Each ATen op maps to llmc ops through `LOWERINGS`; an op with no lowering is a CompileError that
names the op and the user's source line. Only nodes that feed the outputs are lowered, so dead
code (mask construction that the llmc attention implementation makes unused) costs nothing.
"""
from __future__ import annotations

import operator
import re
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx

from llmc.errors import CompileError, IRError
from llmc.frontend.repeat import layer_of
from llmc.ir.graph import Graph, Value
from llmc.ir.types import TensorType, dtype_name, make_dim

aten = torch.ops.aten


def source_line(node: torch.fx.Node) -> str:
    """'file.py:123 in fn: code' for the innermost user frame that produced an exported node."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    for f, line, fn, code in reversed(frames):
        if "/torch/" not in f:
            return f"{f}:{line} in {fn}: {code.strip()}"
    return "unknown source location"


class Lowerer:
    """Walks the exported graph and builds an llmc Graph."""

    def __init__(self, ep: torch.export.ExportedProgram, graph: Graph, symbols: dict[str, str]):
        self.ep, self.g, self.symbols = ep, graph, symbols
        self.env: dict[torch.fx.Node, Any] = {}
        self.node: torch.fx.Node | None = None

    # -- helpers used by the lowering rules -------------------------------------------------
    def dim(self, x) -> Any:
        """A Python int or SymInt (or an fx node producing one) as an IR dim."""
        if isinstance(x, torch.fx.Node):
            x = self.env[x] if x in self.env and not isinstance(self.env[x], Value) else x.meta["val"]
        if isinstance(x, torch.SymInt):
            expr = x.node.expr
            expr = expr.subs({s: sympy.Symbol(self.symbols.get(str(s), str(s)), positive=True, integer=True)
                              for s in expr.free_symbols})
            d = make_dim(str(expr))
            return d.name if not isinstance(d, int) else d
        return int(x)

    def val(self, a) -> Value:
        """An operand as a Value: fx nodes map through env, Python scalars become constants."""
        if isinstance(a, torch.fx.Node):
            v = self.env[a]
            if not isinstance(v, Value):
                raise CompileError(f"expected a tensor for {a.name}, got {v!r}")
            return v
        if isinstance(a, bool):
            return self.emit("constant", [], value=a, dtype="bool")
        if isinstance(a, int):
            return self.emit("constant", [], value=a, dtype="i64")
        if isinstance(a, float):
            return self.emit("constant", [], value=a, dtype="f32")
        raise CompileError(f"unsupported operand {a!r} ({type(a).__name__})")

    def emit(self, op: str, inputs: Sequence[Value], **attrs) -> Value:
        meta = {"source": source_line(self.node)} if self.node is not None else {}
        if self.node is not None:
            meta["aten"] = str(self.node.target)
            layer = layer_of(self.node.meta.get("nn_module_stack"))
            if layer is not None:
                meta["layer"] = layer
        return self.g.add_node(op, list(inputs), attrs, meta=meta).out

    def dtype(self, node: torch.fx.Node) -> str:
        return dtype_name(node.meta["val"].dtype)

    # -- the walk -----------------------------------------------------------------------------
    def live_nodes(self) -> set[torch.fx.Node]:
        out_node = next(n for n in self.ep.graph.nodes if n.op == "output")
        live, stack = set(), [out_node]
        while stack:
            n = stack.pop()
            if n in live:
                continue
            live.add(n)
            stack.extend(n.all_input_nodes)
        return live

    def run(self) -> None:
        live = self.live_nodes()
        for node in self.ep.graph.nodes:
            if node not in live or node.op in ("placeholder", "output"):
                continue
            self.node = node
            target = node.target
            if isinstance(node.meta.get("val"), (torch.SymInt, int)) and not isinstance(node.meta.get("val"), bool) \
                    and target not in LOWERINGS:
                self.env[node] = node.meta["val"]  # shape arithmetic (sym_size, mul of sizes): a dim
                continue
            if target is operator.getitem:
                self.env[node] = self.env[node.args[0]][node.args[1]]
                continue
            rule = LOWERINGS.get(target) or LOWERINGS.get(getattr(target, "overloadpacket", None))
            if rule is None:
                raise CompileError(
                    f"llmc cannot lower op `{target}` used at {source_line(node)}. "
                    "Add a lowering for it to LOWERINGS in llmc/frontend/torch_export.py "
                    "(or register an llmc op with llmc.ir.ops.register_op), or rewrite that line "
                    "of the model with supported ops.")
            try:
                self.env[node] = rule(self, *node.args, **node.kwargs)
            except (IRError, CompileError) as e:
                raise CompileError(f"lowering `{target}` at {source_line(node)} failed: {e}") from None
        self.node = None


# ---------------------------------------------------------------------------------------------
# lowering rules: (lowerer, *aten_args, **aten_kwargs) -> Value (or a tuple of Values)

LOWERINGS: dict[Any, Callable] = {}


def lowering(*targets):
    def deco(fn):
        for t in targets:
            LOWERINGS[t] = fn
        return fn
    return deco


def _binary(op):
    def rule(L, a, b, alpha=1, **_):
        x, y = L.val(a), L.val(b)
        if alpha != 1:
            y = L.emit("mul", [y, L.val(alpha)])
        return L.emit(op, [x, y])
    return rule


for _t, _op in [(aten.add, "add"), (aten.sub, "sub"), (aten.mul, "mul"), (aten.pow, "pow"),
                (aten.maximum, "maximum"), (aten.minimum, "minimum")]:
    LOWERINGS[_t] = _binary(_op)


@lowering(aten.div)
def _div(L, a, b, rounding_mode=None):
    if rounding_mode is not None:
        raise CompileError(f"div with rounding_mode={rounding_mode!r} is not supported")
    return L.emit("div", [L.val(a), L.val(b)])


@lowering(aten.rsub)
def _rsub(L, a, b, alpha=1):
    return _binary("sub")(L, b, a, alpha)


for _t, _op in [(aten.neg, "neg"), (aten.silu, "silu"), (aten.relu, "relu"), (aten.sigmoid, "sigmoid"),
                (aten.tanh, "tanh"), (aten.exp, "exp"), (aten.log, "log"), (aten.sqrt, "sqrt"),
                (aten.rsqrt, "rsqrt"), (aten.reciprocal, "reciprocal"), (aten.abs, "abs"),
                (aten.cos, "cos"), (aten.sin, "sin")]:
    LOWERINGS[_t] = (lambda op: lambda L, x, **_: L.emit(op, [L.val(x)]))(_op)


@lowering(aten.gelu)
def _gelu(L, x, approximate="none"):
    return L.emit("gelu", [L.val(x)], approximate=approximate)


@lowering(aten.alias, aten.clone, aten.contiguous, aten.detach, aten.lift_fresh_copy)
def _identity(L, x, *args, **kw):
    return L.val(x)


@lowering(aten.dropout)
def _dropout(L, x, p, train):
    if train and p:
        raise CompileError("dropout in training mode cannot be compiled; call model.eval() first")
    return L.val(x)


def _cast(L, x, dtype):
    v = L.val(x)
    if dtype is None or dtype_name(dtype) == v.type.dtype:
        return v
    return L.emit("cast", [v], dtype=dtype_name(dtype))


@lowering(aten.to.dtype)
def _to_dtype(L, x, dtype, *args, **kw):
    return _cast(L, x, dtype)


@lowering(aten.to.device, aten.to.dtype_layout, aten._to_copy, aten.to.other, aten.type_as)
def _to(L, x, *args, **kw):
    dtype = kw.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        if isinstance(a, torch.fx.Node):  # to.other / type_as: the other tensor's dtype
            dtype = a.meta["val"].dtype
    return _cast(L, x, dtype)


@lowering(aten.embedding)
def _embedding(L, w, ids, *args, **kw):
    return L.emit("embedding", [L.val(w), L.val(ids)])


@lowering(aten.linear)
def _linear(L, x, w, b=None):
    return L.emit("linear", [L.val(x), L.val(w)] + ([L.val(b)] if b is not None else []))


@lowering(aten.matmul, aten.mm, aten.bmm)
def _matmul(L, a, b):
    return L.emit("matmul", [L.val(a), L.val(b)])


@lowering(aten.t)
def _t(L, x):
    return L.emit("transpose", [L.val(x)], dim0=0, dim1=1)


def _reduce(op):
    def rule(L, x, dims=None, keepdim=False, dtype=None):
        v = L.val(x)
        if dtype is not None:
            v = _cast(L, v, dtype)
        dims = list(range(v.type.rank)) if dims is None else list(dims) if isinstance(dims, (list, tuple)) else [dims]
        return L.emit(op, [v], dims=dims, keepdim=bool(keepdim))
    return rule


LOWERINGS[aten.mean.dim] = _reduce("mean")
LOWERINGS[aten.sum.dim_IntList] = _reduce("sum")
LOWERINGS[aten.amax] = _reduce("amax")


@lowering(aten.softmax.int, aten._softmax)
def _softmax(L, x, dim, dtype=None):
    v = L.val(x)
    if isinstance(dtype, torch.dtype):
        v = _cast(L, v, dtype)
    out = L.emit("softmax", [v if dtype is not True else _cast(L, v, torch.float32)], dim=dim)
    return out


@lowering(aten.view, aten.reshape, aten._unsafe_view)
def _reshape(L, x, shape):
    return L.emit("reshape", [L.val(x)], shape=[L.dim(d) for d in shape])


@lowering(aten.expand)
def _expand(L, x, shape, implicit=False):
    return L.emit("expand", [L.val(x)], shape=[L.dim(d) for d in shape])


@lowering(aten.transpose.int)
def _transpose(L, x, d0, d1):
    return L.emit("transpose", [L.val(x)], dim0=d0, dim1=d1)


@lowering(aten.permute)
def _permute(L, x, dims):
    return L.emit("permute", [L.val(x)], dims=list(dims))


@lowering(aten.unsqueeze)
def _unsqueeze(L, x, dim):
    return L.emit("unsqueeze", [L.val(x)], dim=dim)


@lowering(aten.squeeze.dim)
def _squeeze(L, x, dim):
    return L.emit("squeeze", [L.val(x)], dim=dim)


@lowering(aten.slice.Tensor)
def _slice(L, x, dim=0, start=None, end=None, step=1):
    v = L.val(x)
    start = 0 if start is None else L.dim(start)
    end = None if end is None else L.dim(end)
    if not isinstance(start, int) or (end is not None and not isinstance(end, int)):
        raise CompileError("slices with symbolic bounds are not supported")
    if end is not None and end >= (1 << 62):
        end = None
    return L.emit("slice", [v], dim=dim % v.type.rank, start=start, end=end, step=step)


@lowering(aten.select.int)
def _select(L, x, dim, index):
    v = L.val(x)
    d = dim % v.type.rank
    s = L.emit("slice", [v], dim=d, start=index, end=None if index == -1 else index + 1, step=1)
    return L.emit("squeeze", [s], dim=d)


@lowering(aten.cat)
def _cat(L, xs, dim=0):
    vals = [L.val(x) for x in xs]
    return L.emit("concat", vals, dim=dim % vals[0].type.rank)


def _split_at(L, x, sizes, dim):
    v = L.val(x)
    d, start, outs = dim % v.type.rank, 0, []
    for n in sizes:
        outs.append(L.emit("slice", [v], dim=d, start=start, end=start + n, step=1))
        start += n
    return tuple(outs)


def _static_size(L, v, d):
    size = v.type.shape[d]
    if not isinstance(size, int):
        raise CompileError(f"splitting a symbolic dim ({size}) is not supported")
    return size


@lowering(aten.chunk)
def _chunk(L, x, chunks, dim=0):
    v = L.val(x)
    size = _static_size(L, v, dim % v.type.rank)
    step = -(-size // chunks)
    return _split_at(L, x, [min(step, size - i) for i in range(0, size, step)], dim)


@lowering(aten.split.Tensor)
def _split(L, x, split_size, dim=0):
    v = L.val(x)
    size = _static_size(L, v, dim % v.type.rank)
    return _split_at(L, x, [min(split_size, size - i) for i in range(0, size, split_size)], dim)


@lowering(aten.split_with_sizes)
def _split_sizes(L, x, sizes, dim=0):
    return _split_at(L, x, list(sizes), dim)


@lowering(aten.index_select)
def _index_select(L, x, dim, index):
    return L.emit("gather", [L.val(x), L.val(index)], dim=dim)


@lowering(aten.layer_norm)
def _layer_norm(L, x, shape, w=None, b=None, eps=1e-5, *args):
    ins = [L.val(x)] + ([L.val(w)] if w is not None else []) + ([L.val(b)] if b is not None else [])
    if w is None and b is not None:
        raise CompileError("layer_norm with a bias but no weight is not supported")
    return L.emit("layer_norm", ins, eps=eps)


@lowering(aten.rms_norm)
def _rms_norm(L, x, shape, w=None, eps=None):
    if w is None:
        raise CompileError("rms_norm without a weight is not supported")
    return L.emit("rms_norm", [L.val(x), L.val(w)], eps=eps or 1.1920928955078125e-07, weight_first_cast=False)


@lowering(aten.scaled_dot_product_attention)
def _sdpa(L, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None:
        raise CompileError("scaled_dot_product_attention with an explicit mask is not supported: "
                           "use is_causal=True (llmc builds masks from sequence metadata)")
    qv = L.val(q)
    if qv.type.rank != 4:
        raise CompileError("scaled_dot_product_attention must take [B, H, S, D] tensors")
    scale = float(scale if scale is not None else int(qv.type.shape[-1]) ** -0.5)
    return L.emit("attention", [qv, L.val(k), L.val(v)], scale=scale, causal=bool(is_causal), window=0)


def _llmc_attention(L, q, k, v, scale, causal, window):
    return L.emit("attention", [L.val(q), L.val(k), L.val(v)], scale=float(scale), causal=bool(causal),
                  window=int(window))


def _register_custom_lowerings():
    from llmc.frontend import attention  # noqa: F401  (registers torch.ops.llmc.attention)
    from llmc.frontend import moe  # registers torch.ops.llmc.moe
    LOWERINGS[torch.ops.llmc.attention.default] = _llmc_attention
    LOWERINGS[torch.ops.llmc.moe.default] = moe.lower_moe


# ---------------------------------------------------------------------------------------------

def capture(module: torch.nn.Module, example_inputs: Sequence[torch.Tensor], input_names: Sequence[str],
            dynamic: dict[str, dict[int, tuple[str, int, int]]] | str | None = None, name: str = "main") -> Graph:
    """Export `module` and lift it to an llmc Graph.

    Args:
        module: the model, in eval mode.
        example_inputs: one tensor per input.
        input_names: the graph input names, in order.
        dynamic: per input name, {dim index: (symbol name, min, max)}; symbols shared by name.
            "auto": every dim dynamic where the code allows, named `<input>_<dim>` (for patterns).
    Returns:
        A Graph whose params hold the module's weights and buffers.
    """
    _register_custom_lowerings()
    auto = dynamic == "auto"
    dynamic = {} if auto or not dynamic else dynamic
    dims = {}
    spec = [{i: torch.export.Dim.AUTO for i in range(t.dim())} or None for t in example_inputs] if auto else []
    for nm in input_names if not auto else []:
        d = {}
        for i, (sym, lo, hi) in dynamic.get(nm, {}).items():
            if sym not in dims:
                dims[sym] = torch.export.Dim(sym, min=lo, max=hi)
            d[i] = dims[sym]
        spec.append(d or None)
    shapes = tuple(spec)
    import inspect
    if any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(module.forward).parameters.values()):
        shapes = (shapes,)  # forward(*args): the spec of `args` is one nested tuple
    try:
        with torch.no_grad():
            ep = torch.export.export(module, tuple(example_inputs), dynamic_shapes=shapes, strict=False)
    except CompileError:
        raise
    except Exception as e:  # torch's own message is long; keep its first lines
        msg = str(e).strip().splitlines()
        raise CompileError(f"torch.export could not capture the model: {' '.join(msg[:3])[:600]}") from e

    g = Graph(name)
    symbols: dict[str, str] = {}
    user_inputs = [s for s in ep.graph_signature.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for spec_, nm in zip(user_inputs, input_names):
        val = placeholders[spec_.arg.name].meta["val"]
        for i, s in enumerate(val.shape):
            if auto and isinstance(s, torch.SymInt) and str(s.node.expr) not in symbols \
                    and s.node.expr.is_Symbol:
                symbols[str(s.node.expr)] = f"{nm}_{i}"
                g.add_dim(f"{nm}_{i}", 0, None)
            if isinstance(s, torch.SymInt) and i in dynamic.get(nm, {}):
                sym, lo, hi = dynamic[nm][i]
                symbols[str(s.node.expr)] = sym
                if sym not in g.dims:
                    g.add_dim(sym, lo, hi)
    L = Lowerer(ep, g, symbols)
    state = {**ep.state_dict, **getattr(ep, "constants", {})}
    by_storage: dict[tuple, Value] = {}  # tied weights (lm_head = embed_tokens) become one param
    prefix = _common_prefix([s.target for s in ep.graph_signature.input_specs if s.target])
    for s in ep.graph_signature.input_specs:
        node = placeholders[s.arg.name]
        if s.kind == torch.export.graph_signature.InputKind.USER_INPUT:
            nm = input_names[user_inputs.index(s)]
            L.env[node] = g.add_input(nm, TensorType(tuple(L.dim(d) for d in node.meta["val"].shape),
                                                     dtype_name(node.meta["val"].dtype)))
        else:
            t = state[s.target].detach()
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if key not in by_storage:
                by_storage[key] = g.add_param(s.target[len(prefix):], t.contiguous())
            L.env[node] = by_storage[key]
    L.run()
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    g.outputs = [L.env[a] for a in out_node.args[0]]
    g.remove_unused_params()
    return g


def _common_prefix(names: list[str]) -> str:
    """Strip a wrapper module's attribute prefix (`m.`) shared by every weight name."""
    if not names:
        return ""
    first = names[0].split(".")[0] + "."
    return first if all(n.startswith(first) for n in names) and first == "m." else ""
