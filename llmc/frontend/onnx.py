"""ONNX decoder files: load, check, and lift to an llmc Graph `(input_ids[B,S], position_ids[B,S]) -> logits[B,S,V]`.

The graph that comes out is the one the Hugging Face frontend produces, so every pass (paged KV,
quantization, fusion) and codegen apply unchanged. How an export becomes that graph:

- Values are of three kinds: llmc `Value`s (runtime tensors: what depends on the token ids),
  `torch.Tensor`s (initializers and folded constants) and `Lazy` values: functions of the symbolic
  batch and sequence dims only (shape vectors, `Range`s, attention masks). A node whose operands are
  all compile-time is evaluated (`CONST_EVAL`) instead of lowered, so an exporter's shape arithmetic
  and mask construction never become IR.
- llmc's contract fixes what the extra inputs of an export hold: `position_ids` rows are 0..S-1
  (llmc passes the real positions at run time), `attention_mask` is all ones (llmc keeps sequences
  apart with its own metadata) and the `past_key_values.*` inputs are empty (llmc adds its own paged
  cache); their `present.*` outputs are dropped. Masks are therefore computable at compile time: one
  added to (or selected into) attention scores is evaluated at a few sequence lengths and recognised
  as causal, sliding-window or none (`causal_mask`), and anything else is an error.
- `lift_onnx_attention` then turns matmul-scale-mask-softmax-matmul into one `attention` op, and the
  default pipeline's `lift_patterns` finds rms_norm, rope and silu_mul as for a captured HF model.

Mapping rules live in llmc/frontend/onnx_ops.py, compile-time evaluation in onnx_eval.py, the
onnxruntime oracle in onnx_check.py.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from llmc.errors import CompileError, IRError
from llmc.frontend.onnx_eval import BIG, CONST_EVAL, SYM_BINARY, onnx_dtype
from llmc.frontend.onnx_ops import ONNX_OPS, USER_OPS
from llmc.ir.graph import Graph, Value
from llmc.ir.types import DTYPE_NAMES, SymDim, TensorType, dim_eval, dim_mul, make_dim, torch_dtype

OPSET_MIN = 17
MAX_BATCH = 1024
PROBES = (3, 8, 21, 40)  # sequence lengths at which masks are evaluated (past every common test window)
WIDE_PROBE = 4100  # and once near the context length: past a 4096-token window, ~17M mask entries
DOMAINS = ("", "ai.onnx", "com.microsoft")
PAST = re.compile(r"^(past_key_values|past)[._]\d+[._](key|value)$|^past_(key|value)[._]?\d+$")


@dataclass(eq=False)
class Lazy:
    """A compile-time value that depends on the symbolic dims only: `node` applied to `inputs`, or a leaf."""

    node: Any = None  # the ONNX node (None for a leaf)
    inputs: list = field(default_factory=list)
    index: int = 0
    leaf: Callable[[dict], torch.Tensor] | None = None  # env -> tensor, for the contract inputs
    elems: list | None = None  # a shape vector's entries as dims, when known symbolically
    rank0: bool = False
    shape: tuple | None = None  # known for leaves (an empty cache's shape feeds Shape ops)
    ir: Value | None = None  # the runtime value, once emitted (or given: position_ids)
    make_ir: Callable[[], Value] | None = None


def load_onnx(path: str | Path):
    """The ModelProto of an ONNX file with its external weights, or a CompileError saying what is wrong."""
    import onnx
    from google.protobuf.message import DecodeError
    path = Path(path)
    if not path.exists():
        raise CompileError(f"{path} does not exist. Pass an ONNX file (model.onnx) or a Hugging Face directory.")
    if not path.is_file():
        raise CompileError(f"{path} is not a file; an ONNX model is one .onnx file (with its external data beside it)")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except DecodeError as e:
        raise CompileError(f"{path} is not a valid ONNX model (it does not parse as an ONNX protobuf: {e}); the file "
                           "may be truncated or not ONNX at all. Re-export it with torch.onnx.export.") from None
    except Exception as e:
        raise CompileError(f"{path} could not be read as ONNX: {type(e).__name__}: {e}") from None
    if not model.graph.node or not model.opset_import or not model.ir_version:
        raise CompileError(f"{path} is not an ONNX model (no graph, nodes or opset); re-export it with "
                           "torch.onnx.export")
    from onnx.external_data_helper import _get_all_tensors, load_external_data_for_model, uses_external_data
    files = sorted({e.value for t in _get_all_tensors(model) if uses_external_data(t)
                    for e in t.external_data if e.key == "location"})
    missing = [f for f in files if not (path.parent / f).is_file()]
    if missing:
        raise CompileError(f"{path}: its weights are stored in the external data file {missing[0]}, which is not "
                           f"beside it in {path.parent}; keep the exporter's data file(s) next to the .onnx file")
    try:
        load_external_data_for_model(model, str(path.parent))
    except Exception as e:
        raise CompileError(f"{path}: its external weights could not be loaded: {type(e).__name__}: {e}") from None
    _check_opset(path, model)
    return model


def _check_opset(path: Path, model) -> None:
    import onnx
    newest = onnx.defs.onnx_opset_version()
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        raise CompileError(f"{path} imports no default ONNX opset; re-export it with torch.onnx.export")
    if opset < OPSET_MIN:
        raise CompileError(f"{path} uses opset {opset}; llmc reads opsets {OPSET_MIN} to {newest}. Re-export with "
                           f"torch.onnx.export(..., opset_version={OPSET_MIN}) or newer.")
    if opset > newest:
        raise CompileError(f"{path} uses opset {opset}, newer than the installed onnx {onnx.__version__} knows "
                           f"({newest}); upgrade onnx or export with opset_version={newest}")


class Importer:
    """Walks an ONNX graph in order and builds the llmc Graph (see the module docstring)."""

    def __init__(self, model, name: str, config: dict):
        self.model, self.onnx_graph = model, model.graph
        self.g = Graph(name)
        self.config = config
        self.values: dict[str, Any] = {}
        self.node = None  # the ONNX node being lowered, for meta and errors
        self.init_names: dict[int, str] = {}  # id(tensor) -> initializer name
        self._params: dict[tuple, Value] = {}
        self._memo: dict[tuple, torch.Tensor] = {}
        self._masks: dict[tuple, tuple[bool, int]] = {}
        self._row: Value | None = None
        self._cse: dict[tuple, Value] = {}
        self.split_heads: dict[int, Value] = {}  # id of a [B, S, H*D] value -> the [B, H, S, D] it was made from
        self.batch_dim: SymDim | int = 1
        self.seq_dim = SymDim("S")

    # -- inputs and outputs -------------------------------------------------------------------
    def bind_inputs(self) -> None:
        inits = {t.name for t in self.onnx_graph.initializer}
        inputs = [i for i in self.onnx_graph.input if i.name not in inits]
        ids = next((i for i in inputs if i.name == "input_ids"), None) or next(
            (i for i in inputs if _rank(i) == 2 and _elem(i) in (6, 7) and "mask" not in i.name
             and "position" not in i.name), None)
        if ids is None:
            raise CompileError(f"the ONNX graph has no decoder shape: no input_ids[batch, sequence] integer input "
                               f"(its inputs: {', '.join(f'{i.name}{_shape_text(i)}' for i in inputs) or 'none'}). "
                               "Export the model with input_ids (and optionally attention_mask, position_ids).")
        if _rank(ids) != 2:
            what = "has no shape" if _rank(ids) is None else f"{_shape_text(ids)} has rank {_rank(ids)}"
            raise CompileError(f"input {ids.name} {what}: llmc needs input_ids[batch, sequence]. Export the model "
                               "with input_ids of that shape (dynamic_axes={'input_ids': {0: 'batch', 1: 'sequence'}} "
                               "or dynamic_shapes)")
        b, s = _dims(ids)
        if not isinstance(s, str):
            raise CompileError(f"input {ids.name} has a fixed sequence length ({s}); export with a dynamic sequence "
                               "axis (dynamic_axes={'input_ids': {0: 'batch', 1: 'sequence'}} or dynamic_shapes)")
        self._logits_output()
        if isinstance(b, str):
            self.batch_dim = self.g.add_dim("B", 1, MAX_BATCH)
        elif b != 1:
            raise CompileError(f"input {ids.name} has a fixed batch size {b}; export with a dynamic batch axis (or "
                               "batch 1)")
        max_len = int(self.config.get("max_position_embeddings") or 4096)
        self.seq_dim = self.g.add_dim("S", 1, max_len)
        bs = (self.batch_dim, self.seq_dim)
        names = {b: self.batch_dim} if isinstance(b, str) else {}
        v_ids = self.g.add_input("input_ids", TensorType(bs, "i64"))
        self.pos = self.g.add_input("position_ids", TensorType(bs, "i64"))
        for i in inputs:
            dt = onnx_dtype(_elem(i))
            if i is ids:
                self.values[i.name] = self._as_dtype(v_ids, dt)
            elif i.name == "position_ids":
                self.values[i.name] = Lazy(leaf=lambda env, dt=dt: self._arange(env, 2).to(dt), shape=bs,
                                           ir=self._as_dtype(self.pos, dt))
            elif i.name == "attention_mask":
                self.values[i.name] = Lazy(leaf=lambda env, dt=dt: torch.ones(self._bs(env), dtype=dt), shape=bs)
            elif i.name == "cache_position":
                self.values[i.name] = Lazy(leaf=lambda env, dt=dt: self._arange(env, 1).to(dt), shape=(self.seq_dim,),
                                           make_ir=lambda dt=dt: self._as_dtype(self.positions_row(), dt))
            elif PAST.match(i.name) or (_rank(i) == 4 and dt.is_floating_point):
                self.values[i.name] = self._empty_cache(i, names, dt)
            else:
                raise CompileError(f"the ONNX graph has an input {i.name}{_shape_text(i)} that llmc does not know "
                                   "how to feed; llmc feeds input_ids, position_ids, attention_mask (all ones), "
                                   "cache_position and empty past_key_values.*. Export without it.")

    def _empty_cache(self, i, names: dict, dt) -> Lazy:
        """A past key/value input as an empty tensor: its symbolic non-batch dim (the past length) is 0."""
        shape, past = [], 0
        for d in _dims(i):
            if isinstance(d, int):
                shape.append(d)
            elif d in names:
                shape.append(names[d])
            else:
                shape.append(0)
                past += 1
        if past != 1:
            raise CompileError(f"the cache input {i.name}{_shape_text(i)} has no single dynamic past-length axis; "
                               "export without past key values (use_cache=False), llmc adds its own paged cache")
        return Lazy(leaf=lambda env: torch.zeros([dim_eval(d, env) for d in shape], dtype=dt), shape=tuple(shape))

    def bind_initializers(self) -> None:
        from onnx import numpy_helper
        for t in self.onnx_graph.initializer:
            self.values[t.name] = x = _to_torch(numpy_helper.to_array(t), t.data_type)
            self.init_names[id(x)] = t.name

    def _logits_output(self):
        """The declared logits output (named logits, else the first), checked before the walk: an export of the
        last position's logits only ([batch, vocab], or a sequence axis of 1) fails on its slice otherwise."""
        outs = list(self.onnx_graph.output)
        logits = next((o for o in outs if o.name == "logits"), outs[0] if outs else None)
        one = logits is not None and _rank(logits) == 3 and _dims(logits)[1] == 1  # while input_ids' is symbolic
        if logits is None or _rank(logits) not in (3, None) or one:
            shape = f" {_shape_text(logits)}" if logits is not None and _rank(logits) is not None else ""
            raise CompileError("the ONNX graph has no decoder shape: its first output "
                               f"{logits.name if logits else '(none)'}{shape} is not logits[batch, sequence, vocab] "
                               "(an export of the last position's logits only?). Export the model's full-sequence "
                               "logits.")
        return logits

    def outputs(self) -> list[Value]:
        logits = self._logits_output()
        v = self.ir(self.values[logits.name], None)
        if v.type.rank != 3:
            raise CompileError(f"the ONNX output {logits.name} is {v.type}, not logits[batch, sequence, vocab]")
        return [v]

    # -- the walk -----------------------------------------------------------------------------
    def run(self) -> None:
        for node in self.onnx_graph.node:
            self.node = node
            if node.domain not in DOMAINS and node.op_type not in USER_OPS:
                raise self.unsupported(node)
            try:
                ins = [self._value(n, node) if n else None for n in node.input]
                outs = self._lower(node, ins, _attrs(node))
            except IRError as e:
                raise CompileError(f"ONNX node {node.name!r} ({node.op_type}) could not be lowered: {e}") from None
            for name, v in zip(node.output, outs):
                if name:
                    self.values[name] = v
                    if isinstance(v, torch.Tensor):
                        self.init_names.setdefault(id(v), name)
        self.node = None

    def _value(self, name: str, node):
        if name not in self.values:
            raise CompileError(f"ONNX node {node.name!r} ({node.op_type}) reads {name!r}, which no node or input "
                               "defines (subgraphs and functions are not supported)")
        return self.values[name]

    def _lower(self, node, ins: list, attrs: dict) -> list:
        op = node.op_type
        if op == "Constant":
            return [_constant_attr(attrs, node)]
        if op in ("Shape", "Size"):
            return [self._shape(ins[0], attrs, op == "Size")]
        if op in CONST_EVAL and not any(isinstance(x, (Value, tuple)) for x in ins) and ins:
            return self._fold(node, ins, attrs)
        rule = ONNX_OPS.get(op)
        if rule is None:
            raise self.unsupported(node)
        return rule(self, node, ins, attrs)

    def _fold(self, node, ins: list, attrs: dict) -> list:
        if all(x is None or isinstance(x, torch.Tensor) for x in ins):
            try:
                return CONST_EVAL[node.op_type](ins, attrs)
            except CompileError:
                raise
            except Exception as e:
                raise CompileError(f"evaluating ONNX node {node.name!r} ({node.op_type}) at compile time failed: "
                                   f"{type(e).__name__}: {e}") from None
        sym = self._sym(node.op_type, ins, attrs)
        if sym is not None:
            elems, rank0 = sym
            return [Lazy(node, ins, elems=elems, rank0=rank0)]
        return [Lazy(node, ins, k) for k in range(len(node.output))]

    # -- compile-time values ------------------------------------------------------------------
    def _bs(self, env) -> tuple[int, int]:
        return dim_eval(self.batch_dim, env), dim_eval(self.seq_dim, env)

    def _arange(self, env, rank: int) -> torch.Tensor:
        b, s = self._bs(env)
        r = torch.arange(s, dtype=torch.int64)
        return r.expand(b, s).contiguous() if rank == 2 else r

    def eval(self, x, env: dict) -> torch.Tensor:
        """The value of a compile-time operand for concrete dims `env`."""
        if isinstance(x, torch.Tensor):
            return x
        if not isinstance(x, Lazy):
            raise CompileError("a runtime value reached the compile-time evaluation of a mask or shape")
        key = (id(x), tuple(sorted(env.items())))
        if key not in self._memo:
            if x.elems is not None:
                t = torch.tensor([int(dim_eval(make_dim(e), env)) if not isinstance(e, bool) else e
                                  for e in x.elems])
                self._memo[key] = t.reshape(()) if x.rank0 else t
            elif x.leaf is not None:
                self._memo[key] = x.leaf(env)
            else:
                args = [None if i is None else self.eval(i, env) for i in x.inputs]
                self._memo[key] = CONST_EVAL[x.node.op_type](args, _attrs(x.node))[x.index]
        return self._memo[key]

    def probe_env(self, s: int) -> dict:
        env = {self.seq_dim.name: s}
        if isinstance(self.batch_dim, SymDim):
            env[self.batch_dim.name] = 2
        return env

    def _shape(self, x, attrs: dict, size: bool):
        shape = None
        if isinstance(x, Value):
            shape = list(x.type.shape)
        elif isinstance(x, torch.Tensor):
            shape = list(x.shape)
        elif isinstance(x, Lazy):
            shape = list(x.ir.type.shape) if x.ir is not None else list(x.shape) if x.shape is not None else \
                ([] if x.rank0 else [len(x.elems)]) if x.elems is not None else None
        if shape is None:
            return Lazy(leaf=lambda env: torch.tensor(
                self.eval(x, env).numel() if size else list(self.eval(x, env).shape)[
                    slice(attrs.get("start", 0), attrs.get("end"))], dtype=torch.int64))
        if size:
            return self._elems([dim_mul(*shape) if shape else 1], True)
        return self._elems(shape[slice(attrs.get("start", 0), attrs.get("end"))], False)

    def _elems(self, elems: list, rank0: bool):
        elems = [make_dim(e) if not isinstance(e, bool) else e for e in elems]
        if all(isinstance(e, int) for e in elems):
            t = torch.tensor(elems, dtype=torch.int64)
            return t.reshape(()) if rank0 else t
        return Lazy(elems=elems, rank0=rank0)

    def _as_elems(self, x):
        """A shape-vector operand as (entries, rank0), or None."""
        if isinstance(x, Lazy) and x.elems is not None:
            return list(x.elems), x.rank0
        if isinstance(x, torch.Tensor) and x.dim() <= 1 and not x.is_floating_point() and x.numel() <= 64:
            vals = [bool(v) if x.dtype == torch.bool else int(v) for v in x.reshape(-1).tolist()]
            return vals, x.dim() == 0
        return None

    def _sym(self, op: str, ins: list, attrs: dict):
        """Shape arithmetic on symbolic entries: (entries, rank0) of the result, or None where undecidable."""
        args = [self._as_elems(x) if x is not None else None for x in ins]
        if not args or args[0] is None:
            return None
        (a, a0) = args[0]
        if op in ("Identity", "Cast"):
            if op == "Cast" and onnx_dtype(attrs["to"]).is_floating_point:
                return None
            return a, a0
        if op == "Gather" and args[1] is not None and attrs.get("axis", 0) == 0 and not a0:
            idx, i0 = args[1]
            out = [a[i] for i in idx]
            return out, i0
        if op == "Concat" and all(x is not None and not x[1] for x in args):
            return [e for x in args for e in x[0]], False
        if op == "Unsqueeze" and a0:
            return a, False
        if op == "Squeeze" and not a0 and len(a) == 1:
            return a, True
        if op == "Reshape" and args[1] is not None:
            target = args[1][0]
            if target == [] and len(a) == 1:
                return a, True
            return (a, False) if target in ([-1], [len(a)]) else None
        if op == "Slice" and not a0 and all(x is not None for x in args[1:3]):
            starts, ends = args[1][0], args[2][0]
            steps = args[4][0] if len(args) > 4 and args[4] is not None else [1]
            if len(starts) != 1 or not all(isinstance(v, int) for v in starts + ends + steps):
                return None
            return a[slice(starts[0], None if ends[0] >= BIG else ends[0], steps[0])], False
        if op in SYM_BINARY and len(args) == 2 and args[1] is not None:
            (b, b0) = args[1]
            n = max(len(a), len(b))
            if len(a) not in (1, n) or len(b) not in (1, n):
                return None
            out = [SYM_BINARY[op](a[i if len(a) > 1 else 0], b[i if len(b) > 1 else 0]) for i in range(n)]
            return (out, a0 and b0) if all(e is not None for e in out) else None
        if op == "Where" and all(x is not None for x in args):
            (b, _), (c, _) = args[1], args[2]
            n = max(len(a), len(b), len(c))
            pick = lambda v, i: v[i if len(v) > 1 else 0]
            return [pick(b, i) if pick(a, i) else pick(c, i) for i in range(n)], a0
        return None

    # -- helpers for the mapping rules ----------------------------------------------------------
    def unsupported(self, node, what: str | None = None) -> CompileError:
        where = f"ONNX node {node.name!r} ({node.domain + '.' if node.domain else ''}{node.op_type})"
        if what is None and any(f.name == node.op_type and f.domain == node.domain for f in self.model.functions):
            return CompileError(f"{where}: a function the model defines itself; llmc reads plain graphs: inline it "
                                "first (onnx.inliner.inline_local_functions(model)) and compile the result")
        if what is None:
            return CompileError(f"{where}: llmc has no mapping for the op type {node.op_type}. Add a rule with "
                                f"@onnx_op({node.op_type!r}) in a file given with --plugin FILE.py (the built-in "
                                "rules are in llmc/frontend/onnx_ops.py; a torch evaluator with @const_eval in "
                                "onnx_eval.py if it appears in shape or mask arithmetic), or export without it.")
        return CompileError(f"{where}: {what} is not supported")

    def emit(self, op: str, inputs: list[Value], **attrs) -> Value:
        """Append an IR node; an identical earlier node (same op, operands, attributes) is reused instead,
        because exporters repeat the cos/sin of rope per layer and fusion needs q and k to share them."""
        key = (op, tuple(id(v) for v in inputs), json.dumps(attrs, sort_keys=True, default=str))
        if key in self._cse:
            return self._cse[key]
        meta = {}
        if self.node is not None:
            meta = {"source": f"ONNX node {self.node.name or '(unnamed)'} ({self.node.op_type})" + _stack(self.node),
                    "onnx": self.node.op_type}
        self._cse[key] = v = self.g.add_node(op, inputs, attrs, meta=meta).out
        return v

    def ir(self, x, node) -> Value:
        """An operand as a runtime Value: constants become literals or params, compile-time values are emitted."""
        if isinstance(x, Value):
            return x
        if isinstance(x, torch.Tensor):
            if x.dim() == 0:
                return self.emit("constant", [], value=x.item(), dtype=self.ir_dtype(x.dtype))
            return self._param(x, _param_name(self.init_names.get(id(x), "const")))
        if isinstance(x, Lazy):
            if x.ir is None and x.make_ir is not None:
                x.ir = x.make_ir()
            if x.ir is not None:
                return x.ir
            if x.elems is not None and all(isinstance(e, int) for e in x.elems):
                return self.ir(self.eval(x, {}), node)
            if x.node is None:
                raise CompileError(f"ONNX node {getattr(node, 'name', '')!r}: an input that llmc feeds itself "
                                   "(attention_mask or a past cache) is used outside the attention mask; export "
                                   "without it")
            rule = ONNX_OPS.get(x.node.op_type)
            if rule is None:
                raise self.unsupported(x.node, f"{x.node.op_type} on the runtime path (it feeds "
                                               f"{getattr(node, 'name', 'the output')!r})")
            saved, self.node = self.node, x.node
            try:
                out = rule(self, x.node, x.inputs, _attrs(x.node))[x.index]
            finally:
                self.node = saved
            x.ir = out if isinstance(out, Value) else self.ir(out, node)
            return x.ir
        if isinstance(x, tuple):
            raise self.unsupported(node, "IsNaN outside the softmax guard Where(IsNaN(p), 0, p)")
        raise CompileError(f"ONNX node {getattr(node, 'name', '')!r}: an operand is missing")

    def binary_operands(self, a, b, node) -> tuple[Value, Value]:
        """Both operands as Values; a one-element constant beside a tensor of at least its rank is a literal
        (so patterns see `mul(x, 2.0)`, not a [1]-shaped weight)."""
        out = []
        for x, other in ((a, b), (b, a)):
            if isinstance(x, torch.Tensor) and x.numel() == 1 and x.dim() <= _rank_of(other):
                out.append(self.emit("constant", [], value=x.reshape(()).item(), dtype=self.ir_dtype(x.dtype)))
            else:
                out.append(self.ir(x, node))
        return out[0], out[1]

    def weight(self, t: torch.Tensor, node, ins_name: str | None, suffix: str = "weight") -> Value:
        """A weight as a param named after the module that uses it (`model.layers.0.mlp.up_proj.weight`)."""
        scope = _scope(node)
        return self._param(t, f"{scope}.{suffix}" if scope else _param_name(ins_name or "const"))

    def _param(self, t: torch.Tensor, name: str) -> Value:
        """One param per tensor storage: a tied LM head (the embedding, transposed twice) stays one weight."""
        t = t.contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in self._params:
            self._params[key] = self.g.add_param(self.g.fresh(name), t)
        return self._params[key]

    def const(self, x, node, what: str) -> torch.Tensor:
        t = self.try_const(x, node)
        if t is None:
            raise self.unsupported(node, f"a {what} operand that is not a compile-time constant")
        return t

    def try_const(self, x, node) -> torch.Tensor | None:
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, Lazy) and x.elems is not None and all(isinstance(e, int) for e in x.elems):
            return self.eval(x, {})
        return None

    def dims(self, x, node) -> list:
        """A shape-vector operand as a list of dims (ints or symbolic)."""
        e = self._as_elems(x) if not isinstance(x, Value) else None
        if e is None:
            raise self.unsupported(node, "a shape that is computed at run time (llmc folds shapes at compile time)")
        return e[0]

    def dtype_of(self, x, node) -> torch.dtype:
        if isinstance(x, Value):
            return torch_dtype(x.type.dtype)
        if isinstance(x, torch.Tensor):
            return x.dtype
        return self.eval(x, self.probe_env(PROBES[0])).dtype

    @staticmethod
    def ir_dtype(dtype: torch.dtype) -> str:
        if dtype not in DTYPE_NAMES:
            raise CompileError(f"llmc has no IR dtype for {dtype}")
        return DTYPE_NAMES[dtype]

    def _as_dtype(self, v: Value, dt: torch.dtype) -> Value:
        name = self.ir_dtype(dt)
        return v if v.type.dtype == name else self.g.add_node("cast", [v], {"dtype": name}).out

    def positions(self) -> Value:
        return self.pos

    def positions_row(self) -> Value:
        """position_ids[0]: arange(S) under llmc's contract, the real positions once tokens are flattened."""
        if self._row is None:
            first = self.g.add_node("slice", [self.pos], {"dim": 0, "start": 0, "end": 1, "step": 1}).out
            self._row = self.g.add_node("squeeze", [first], {"dim": 0}).out
        return self._row

    def is_zero(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x.numel() == 1 and float(x.reshape(())) == 0.0

    def is_large_negative(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x.numel() == 1 and x.is_floating_point() and \
            float(x.reshape(())) <= -1e4

    def is_mask_candidate(self, x) -> bool:
        """A compile-time value that can be an attention mask: its last axis is the sequence's (keys) at every probe
        length. A learned position embedding looked up by position_ids ([.., S, hidden]: GPT-2's) is compile-time
        too, but is emitted at run time with the real positions."""
        if not (isinstance(x, Lazy) and x.ir is None and x.make_ir is None and x.elems is None):
            return False
        try:
            return all(self.eval(x, self.probe_env(s)).shape[-1:] == (s,) for s in PROBES[:2])
        except CompileError:
            raise
        except Exception:  # not evaluable here: left to the mask's own checks, which say what failed
            return True

    def is_all_ones(self, x) -> bool:
        if isinstance(x, Value):
            return False
        return all(bool((self.eval(x, self.probe_env(s)) == 1).all()) for s in PROBES[:2])

    def is_empty_along(self, x, axis: int, node) -> bool:
        if isinstance(x, Value):
            return x.type.rank > 0 and x.type.shape[axis] == 0
        if isinstance(x, torch.Tensor):
            return x.dim() > 0 and x.shape[axis] == 0
        if isinstance(x, Lazy) and x.ir is None and x.elems is None:
            return all(self.eval(x, self.probe_env(s)).shape[axis] == 0 for s in PROBES[:2])
        return False

    # -- masks --------------------------------------------------------------------------------
    def classify_mask(self, mask, scores: Value, kind: str, node) -> tuple[bool, int]:
        """(causal, window) of a compile-time attention mask, checked at several sequence lengths.

        kind: "additive" (0 where allowed, very negative elsewhere), "keep" (True where allowed) or
        "drop" (True where masked)."""
        key = (id(mask), kind)
        if key not in self._masks:
            self._masks[key] = self._classify(mask, kind, node)
        return self._masks[key]

    def _classify(self, mask, kind: str, node) -> tuple[bool, int]:
        where = f"ONNX node {node.name!r} ({node.op_type})"
        probes = list(PROBES)
        declared = self.config.get("sliding_window")
        max_len = self.seq_dim.max or 4096
        if isinstance(declared, int) and PROBES[-1] <= declared < max_len:
            probes.append(declared + 2)  # a window wider than the small probes shows only past its width
        elif max_len > PROBES[-1]:
            probes.append(min(max_len, WIDE_PROBE))  # the common wide windows (4096) show here
        seen = []
        for s in probes:
            env = self.probe_env(s)
            try:
                m = self.eval(mask, env)
            except CompileError:
                raise
            except Exception as e:
                raise CompileError(f"{where}: evaluating its attention mask at sequence length {s} failed: "
                                   f"{type(e).__name__}: {e}") from None
            if kind == "additive":
                if not m.is_floating_point():
                    raise CompileError(f"{where}: an integer attention mask added to the scores")
                allowed = m > -1e4
                if (m[allowed] != 0).any():
                    raise CompileError(f"{where}: the attention mask adds biases (values other than 0 and -inf, "
                                       "e.g. ALiBi); llmc supports causal and sliding-window masks only")
            else:
                allowed = m.bool() if kind == "keep" else ~m.bool()
            try:
                allowed = torch.broadcast_to(allowed, allowed.shape[:-2] + (s, s)) if allowed.dim() >= 2 else None
            except RuntimeError:
                allowed = None
            if allowed is None:
                raise CompileError(f"{where}: the attention mask is not [.., sequence, sequence]")
            rows = allowed.reshape(-1, s, s)
            if not bool((rows == rows[0]).all()):
                raise CompileError(f"{where}: the attention mask differs between batch rows or heads (padding?); "
                                   "llmc keeps sequences apart with its own metadata")
            seen.append((s, _causal_window(rows[0])))
            if seen[-1][1] is None:
                raise CompileError(f"{where}: the attention mask is neither causal nor sliding-window; llmc "
                                   "compiles decoders with causal (optionally sliding-window) attention")
        if all(c == (False, 0) for _, c in seen):
            return False, 0
        if any(not c[0] for _, c in seen):
            raise CompileError(f"{where}: the attention mask is causal at some lengths and not at others")
        windows = {c[1] for _, c in seen if c[1]}
        if len(windows) > 1 or (windows and any(not c[1] and s > next(iter(windows)) for s, c in seen)):
            raise CompileError(f"{where}: the attention mask's window changes with the sequence length")
        return True, windows.pop() if windows else 0

    def apply_mask(self, scores: Value, mask: tuple[bool, int]) -> Value:
        causal, window = mask
        if not causal:
            return scores
        sq, sk = scores.type.shape[-2:]
        m = self.emit("causal_mask", [], shape=[_dim_attr(sq), _dim_attr(sk)], window=window,
                      dtype=scores.type.dtype)
        return self.emit("add", [scores, m])


def _causal_window(a: torch.Tensor) -> tuple[bool, int] | None:
    """(causal, window) of an [S, S] allowed-matrix, or None when it is neither."""
    s = a.shape[0]
    if bool(a.all()):
        return False, 0
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    causal = j <= i
    n = int(a[-1].sum())
    window = n if n < s else 0
    want = causal & (j > i - window) if window else causal
    return (True, window) if bool((a == want).all()) else None


# ---------------------------------------------------------------------------------------------
# small readers of the ONNX protobuf

def _attrs(node) -> dict:
    from onnx import helper, numpy_helper
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if a.type == a.TENSOR:
            v = _to_torch(numpy_helper.to_array(v), v.data_type)
        elif isinstance(v, bytes):
            v = v.decode()
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [x.decode() for x in v]
        out[a.name] = v
    return out


def _constant_attr(attrs: dict, node) -> torch.Tensor:
    if "value" in attrs:
        return attrs["value"]
    for k, dt in (("value_float", torch.float32), ("value_int", torch.int64)):
        if k in attrs:
            return torch.tensor(attrs[k], dtype=dt)
    for k, dt in (("value_floats", torch.float32), ("value_ints", torch.int64)):
        if k in attrs:
            return torch.tensor(list(attrs[k]), dtype=dt)
    raise CompileError(f"ONNX node {node.name!r}: a Constant of kind {sorted(attrs)} is not supported")


def _to_torch(arr, data_type: int) -> torch.Tensor:
    import numpy as np
    if data_type == 16:  # bfloat16 arrives as a 2-byte numpy type
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = np.array(arr)
    return torch.from_numpy(arr.copy() if arr.dtype == object else arr)


def _dims(vi) -> list:
    return [d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value") else "?"
            for d in vi.type.tensor_type.shape.dim]


def _rank(vi) -> int | None:
    t = vi.type.tensor_type
    return len(t.shape.dim) if t.HasField("shape") else None


def _elem(vi) -> int:
    return vi.type.tensor_type.elem_type


def _shape_text(vi) -> str:
    return f"[{', '.join(map(str, _dims(vi)))}]"


def _rank_of(x) -> int:
    if isinstance(x, Value):
        return x.type.rank
    if isinstance(x, torch.Tensor):
        return x.dim()
    return 0


def _dim_attr(d):
    return d if isinstance(d, int) else d.name


def _param_name(name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.]", "_", name).strip("_.")
    return name or "const"


def _scope(node) -> str:
    """The module path of the node that uses a weight: from the dynamo exporter's name scopes, or from the
    legacy exporter's node name (`/model/layers.0/mlp/up_proj/MatMul`)."""
    if node is None:
        return ""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(p.value)
            except (ValueError, SyntaxError):
                break
            return _param_name(scopes[-2]) if len(scopes) >= 2 else ""
    parts = [p for p in node.name.split("/") if p]
    return _param_name(".".join(parts[:-1])) if len(parts) > 1 and node.name.startswith("/") else ""


def _stack(node) -> str:
    """' at file.py:12' for the innermost user frame the dynamo exporter recorded, else ''."""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.stack_trace":
            frames = re.findall(r'File "([^"]+)", line (\d+)', p.value)
            user = [f for f in frames if "/torch/" not in f[0]]
            if user:
                return f" at {user[-1][0]}:{user[-1][1]}"
    return ""


# ---------------------------------------------------------------------------------------------

def model_dir_files(onnx_path: Path, tokenizer: str | Path | None) -> tuple[Path | None, dict]:
    """The directory holding the tokenizer (given, or beside the .onnx file) and its config.json (or {})."""
    from llmc.frontend.hf import TOKENIZER_FILES
    if tokenizer is not None:
        d = Path(tokenizer).expanduser()
        if not d.is_dir():
            raise CompileError(f"--tokenizer {tokenizer}: not a directory; give the directory with tokenizer.json "
                               "(the Hugging Face model directory the ONNX file was exported from)")
        if not any((d / f).is_file() for f in TOKENIZER_FILES):
            raise CompileError(f"--tokenizer {tokenizer}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...)")
    else:
        d = onnx_path.parent
        if not any((d / f).is_file() for f in TOKENIZER_FILES):
            d = None
    cfg = {}
    for where in filter(None, (d, onnx_path.parent)):
        for f in ("config.json", "generation_config.json"):
            p = where / f
            if p.is_file():
                try:
                    cfg = {**json.loads(p.read_text()), **cfg} if f == "config.json" else \
                        {**cfg, **{k: v for k, v in json.loads(p.read_text()).items()
                                   if k in ("eos_token_id", "bos_token_id") and k not in cfg}}
                except (json.JSONDecodeError, UnicodeDecodeError) as e:  # it sets eos ids and the context
                    raise CompileError(f"{p} is not valid JSON ({e}); fix or remove it (without it the eos "
                                       "tokens and context length are not known)") from None
        if cfg:
            break
    return d, cfg


def capture_onnx(path: str | Path, dtype: torch.dtype | None = None,
                 tokenizer: str | Path | None = None) -> tuple[Graph, list[Path]]:
    """Read an ONNX decoder into an llmc Graph `(input_ids[B,S], position_ids[B,S]) -> logits[B,S,V]`.

    Args:
        path: the .onnx file (external data files beside it, as the exporter wrote them).
        dtype: the precision to compile in; it must be the one the file was exported in (None: as exported;
            `graph.meta["dtype"]` records it).
        tokenizer: the directory with the tokenizer files; default: the .onnx file's directory. Its
            config.json (when present) gives eos/bos ids, the context length and a sliding window.
    Returns:
        The graph (attention lifted to `attention` ops) and the tokenizer files to ship.

    Example:
        >>> g, tok = capture_onnx("model.onnx", tokenizer="hf-model-dir")   # doctest: +SKIP
        >>> g.op_counts()["attention"]                                       # doctest: +SKIP
        2
    """
    from llmc.frontend.hf import TOKENIZER_FILES
    from llmc.passes.lift_onnx_attention import LiftOnnxAttention
    from llmc.passes.manager import PassManager
    from llmc.passes.pattern import dead_code
    path = Path(path).expanduser()
    model = load_onnx(path)
    tok_dir, cfg = model_dir_files(path, tokenizer)
    imp = Importer(model, re.sub(r"\W", "_", path.stem) or "onnx", cfg)
    imp.bind_initializers()
    imp.bind_inputs()
    imp.run()
    g = imp.g
    g.outputs = imp.outputs()
    dead_code(g)
    g.remove_unused_params()
    precision = export_precision(g)
    if dtype is not None and imp.ir_dtype(dtype) != precision:
        names = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
        raise CompileError(f"{path.name} was exported in {names.get(precision, precision)} (its weights); llmc "
                           f"compiles an ONNX model in the precision it was exported in: pass --dtype "
                           f"{names.get(precision, precision)} or leave --dtype out, or export the model in "
                           f"{names.get(imp.ir_dtype(dtype))}")
    g = PassManager([LiftOnnxAttention()]).run(g)
    _check_lifted(g, path)
    _check_tokens_apart(g, path, imp.seq_dim)
    attn = [n for n in g.nodes if n.op == "attention"]
    q, k = attn[0].inputs[0].type.shape, attn[0].inputs[1].type.shape
    g.meta.update({
        "architecture": (cfg.get("architectures") or ["onnx"])[0],
        "vocab_size": int(g.outputs[0].type.shape[-1]),
        "max_position_embeddings": imp.seq_dim.max,
        "num_hidden_layers": len(attn),
        "num_attention_heads": int(q[1]),
        "num_key_value_heads": int(k[1]),
        "head_dim": int(q[3]),
        "eos_token_id": cfg.get("eos_token_id"),
        "bos_token_id": cfg.get("bos_token_id"),
        "source_format": "onnx",
        "dtype": precision,
    })
    tok_files = [tok_dir / f for f in TOKENIZER_FILES if (tok_dir / f).is_file()] if tok_dir else []
    return g, tok_files


def export_precision(g: Graph) -> str:
    """The IR dtype an export computes in: the float dtype of most of its weights' elements (an fp16 export
    keeps a few fp32 constants, such as rotary frequencies), or its logits' where it holds no float weight."""
    counts: dict[str, int] = {}
    for v in g.params:
        if v.type.is_float:
            counts[v.type.dtype] = counts.get(v.type.dtype, 0) + g.weights[v.name].numel()
    return max(counts, key=counts.get) if counts else g.outputs[0].type.dtype


def _mixing_axis(n, seq) -> int | None:
    """The axis along which node `n` reads across the sequence (a reduction, softmax, matmul contraction, slice or
    concat over the axis that is `seq`), or None."""
    shape = n.inputs[0].type.shape if n.inputs else ()
    if not shape:
        return None
    if n.op in ("mean", "sum", "amax", "softmax"):
        axes = n.attrs["dims"] if "dims" in n.attrs else [n.attrs.get("dim", -1)]
    elif n.op == "matmul":
        axes = [-1]
    elif n.op in ("slice", "concat"):
        axes = [n.attrs.get("dim", 0)]
    else:
        return None
    return next((a for a in (int(a) % len(shape) for a in axes) if shape[a] == seq), None)


def _check_tokens_apart(g: Graph, path: Path, seq) -> None:
    """llmc runs each token's computation apart from the others' (only attention reads other tokens, through the
    paged cache): an op outside attention that reads across the sequence axis (a norm over the sequence, a token
    shift) would compute something else one token at a time, so it is refused here; onnxruntime
    (--check-ort) would only catch it after the compile."""
    for n in g.nodes:
        axis = _mixing_axis(n, seq)
        if axis is not None:
            where = n.meta.get("source") or n.name
            raise CompileError(f"{path.name}: {where} ({n.op} over axis {axis}, the sequence) mixes tokens outside "
                               "attention; llmc computes each token apart from the others except in causal "
                               "attention, so this graph would give other logits. Export a decoder whose only "
                               "reading across positions is its attention")


def _check_lifted(g: Graph, path: Path) -> None:
    left = [n for n in g.nodes if n.op == "causal_mask"]
    if left:
        raise CompileError(f"{path.name}: an attention of the ONNX graph was not recognised "
                           f"({left[0].meta.get('source')}): llmc lifts matmul(softmax(q @ k^T * scale + causal "
                           "mask), v) and the Attention, MultiHeadAttention and GroupQueryAttention ops; export with attn_implementation "
                           "'eager' or 'sdpa'")
    if not any(n.op == "attention" for n in g.nodes):
        raise CompileError(f"{path.name}: no attention found in the ONNX graph; llmc compiles decoder LMs (causal "
                           "self-attention lifted from matmul-softmax-matmul or the Attention ops)")
