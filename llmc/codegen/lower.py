"""Lowering: the fused, token-flattened graph becomes a plan of kernel launches.

Each node maps to one step: a generated Triton kernel (norms, rope + KV write, paged attention,
elementwise regions, small-M matmuls where tuning.json says they beat cuBLAS), cuBLAS through
torch for the other GEMMs, a view for movement ops, and the op's torch reference for the rare
rest (named "torch:<op>" in `llmc inspect --kernels`). Intermediates are released after their last
use. The intermediates that a kernel writes go into one arena laid out by the static buffer plan
(llmc/codegen/buffers.py): values alive at different times share bytes, sizes are symbolic in the
dims, and a placement is made once per bucket of the dims; a CUDA graph captures its own arena,
the eager path keeps one that grows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from llmc.codegen.buffers import BufferPlan
from llmc.errors import LLMCError
from llmc.ir.graph import Graph, Node
from llmc.ir.ops import RefEnv, get_op, is_elementwise
from llmc.ir.interpreter import bind_dims
from llmc.ir.types import dim_eval, make_dim, torch_dtype
from llmc.plugins import LOWERING_SOURCES, record
from llmc.runtime.transfer import upload

ACT_EPILOGUE = {"silu": ("silu",), "relu": ("relu",), "gelu": ("gelu",),
                "gelu_tanh": (("gelu", {"approximate": "tanh"}),)}


# user lowerings: op name -> fn(node) returning run(inputs, hints) -> output(s)
LOWERINGS: dict[str, Callable[[Node], Callable[[list, dict], Any]]] = {}


def register_lowering(op: str):
    """Decorator: run `op` on the kernel backends with a user's kernel.

    Example:
        >>> @register_lowering("my_swiglu")                    # doctest: +SKIP
        ... def lower(node):
        ...     return lambda inputs, hints: my_kernel(*inputs)
    """
    record(LOWERING_SOURCES, op)  # a user's lowering: where from, for the workers of a parallel run

    def deco(fn):
        LOWERINGS[op] = fn
        return fn
    return deco


@dataclass
class Step:
    node: Node
    fn: Callable[[list, dict], Any]
    kernel: str  # what runs: "triton:rms_norm", "cublas", "view", "torch:gather", ...
    spec: str = ""
    # the same computation writing into given tensors, one per output, contiguous and of the
    # output's dtype and shape (views of the static buffer plan's arena); None where the kernel
    # allocates its own result
    into: Callable[[list, dict, list], Any] | None = None


class Plan:
    """A graph lowered for the `cuda` or `triton-interpret` backend.

    Args:
        graph: the fused paged graph (weights attached).
        device: where it runs.
        tuner: tuning choices from the artifact (matmul tiles, cuBLAS preference); never retunes.
        triton_matmul: use the generated matmul for every linear (the triton-interpret backend
            does, to test it); otherwise only where the tuner recorded that it wins.
        static_buffers: lay intermediates out in one arena by the static buffer plan; otherwise
            every kernel allocates its result from the caching allocator.
    """

    def __init__(self, graph: Graph, device: torch.device, tuner=None, triton_matmul: bool = False,
                 static_buffers: bool = True):
        self.graph, self.device, self.tuner, self.triton_matmul = graph, torch.device(device), tuner, triton_matmul
        self.state: dict = {}  # what ops run by their torch reference may need: the process groups of collectives
        self.params = upload({p.name: graph.weights[p.name] for p in graph.params}, self.device)
        self.steps = [self._lower(n) for n in graph.nodes]
        self.buffers = None
        self.planned = [False] * len(self.steps)  # whether a step's outputs live in the arena
        self._arena: torch.Tensor | None = None
        self._views: dict[tuple, list] = {}  # (dims, arena) -> each step's output views
        self._ins = [tuple(v.name for v in st.node.inputs) for st in self.steps]
        self._outs = [tuple(v.name for v in st.node.outputs) for st in self.steps]
        if static_buffers:
            kind = {id(st.node): st for st in self.steps}
            self.buffers = BufferPlan.build(graph, lambda n: kind[id(n)].into is not None,
                                            lambda n: kind[id(n)].kernel == "view")
            self.planned = [all(v.name in self.buffers.buffers for v in st.node.outputs) for st in self.steps]
        last = {}
        for i, n in enumerate(graph.nodes):
            for v in n.inputs:
                last[v.name] = i
        keep = {v.name for v in graph.outputs}
        self.free_after = [[v.name for v in n.inputs if last.get(v.name) == i and v.kind == "node"
                            and v.name not in keep] for i, n in enumerate(graph.nodes)]

    # -- execution --------------------------------------------------------------------------------
    def run(self, inputs: dict[str, torch.Tensor], hints: dict | None = None,
            arena: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Run every step. `arena`: the bytes for the planned intermediates (see `new_arena`); by
        default the plan's own, grown as needed. A CUDA graph must be given one that outlives it."""
        g = self.graph
        hints = {**bind_dims(g, inputs), **(hints or {})}
        vals = dict(self.params)
        vals.update({v.name: inputs[v.name] for v in g.inputs})
        views = None
        if self.buffers is not None and self.buffers.buffers:
            views = self._output_views(hints, arena)
        free_after, ins, outs = self.free_after, self._ins, self._outs
        for i, st in enumerate(self.steps):
            xs = [vals[name] for name in ins[i]]
            planned = views[i] if views is not None else None
            out = st.fn(xs, hints) if planned is None else st.into(xs, hints, planned)
            names = outs[i]
            if len(names) == 1:
                vals[names[0]] = out
            else:
                for name, t in zip(names, out):
                    vals[name] = t
            for name in free_after[i]:
                vals.pop(name, None)
        return [vals[v.name] for v in g.outputs]

    def _output_views(self, hints: dict, arena: torch.Tensor | None) -> list[list[torch.Tensor] | None]:
        """Each planned step's outputs as views of the arena, for these dims (cached per dims and arena)."""
        lay = self.buffers.layout(hints)
        if arena is None:
            if self._arena is None or self._arena.numel() < lay.total_bytes:
                self._views.clear()  # the cached views would keep the old arena alive
                self._arena = None  # release the old arena before allocating the larger one
                self._arena = torch.empty(lay.total_bytes, dtype=torch.uint8, device=self.device)
            arena = self._arena
        assert arena.numel() >= lay.total_bytes, "arena smaller than the buffer plan needs"
        key = (tuple(hints[s] for s in self.buffers.symbols), arena.data_ptr(), arena.numel())
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 16:
                self._views.clear()
            views = self._views[key] = [
                [arena[lay.offsets[v.name]: lay.offsets[v.name] + lay.sizes[v.name]]
                 .view(torch_dtype(v.type.dtype)).view(self._shape(v.type.shape)(hints)) for v in st.node.outputs]
                if planned else None
                for st, planned in zip(self.steps, self.planned)]
        return views

    def new_arena(self, inputs: dict[str, torch.Tensor], hints: dict | None = None) -> torch.Tensor | None:
        """A fresh arena sized for these inputs (a CUDA graph keeps its own for its lifetime)."""
        if self.buffers is None or not self.buffers.buffers:
            return None
        lay = self.buffers.layout({**bind_dims(self.graph, inputs), **(hints or {})})
        return torch.empty(lay.total_bytes, dtype=torch.uint8, device=self.device)

    def kernels(self) -> list[dict]:
        """What each node runs, for `llmc inspect --kernels`."""
        return [{"node": ", ".join("%" + v.name for v in s.node.outputs), "op": s.node.op, "kernel": s.kernel,
                 "spec": s.spec} for s in self.steps]

    def specs(self, block_size: int = 16) -> list[tuple[Step, Any]]:
        """(step, KernelSpec) for every generated kernel; attention specs as rendered for `block_size`."""
        out = []
        for st in self.steps:
            spec = getattr(st.fn, "spec", None) or _static_spec(st.node, block_size)
            for sp in (spec if isinstance(spec, list) else [spec]):
                if sp is not None:
                    out.append((st, sp))
        return out

    def sources(self, block_size: int = 16) -> list[tuple[Step, str, str]]:
        """(step, file name, rendered source) of each generated kernel (for the artifact's kernels/)."""
        from llmc.codegen.kernels import render
        out = []
        for st, sp in self.specs(block_size):
            src = render(sp)
            out.append((st, f"{sp.name}_{_digest(src)}.py: {sp.describe()}", src))
        return out

    # -- lowering rules ---------------------------------------------------------------------------
    def _lower(self, n: Node) -> Step:
        if n.op in LOWERINGS:
            run = LOWERINGS[n.op](n)
            return Step(n, run, f"user:{LOWERINGS[n.op].__name__}", getattr(run, "spec", ""))
        rule = getattr(self, f"_op_{n.op}", None)
        if rule is not None:
            step = rule(n)
            if step is not None:
                return step
        if is_elementwise(n.op):
            step = self._elementwise(n, [(n.outputs[0].name, n.op, [f"in{i}" for i in range(len(n.inputs))],
                                          dict(n.attrs))], [n.outputs[0].name])
            if step is not None:
                return step
        ref, attrs, state = get_op(n.op).ref, n.attrs, self.state
        return Step(n, lambda x, h: ref(x, attrs, RefEnv(dict(h), state)), f"torch:{n.op}")

    def _op_constant(self, n):
        t = get_op("constant").ref([], n.attrs, RefEnv()).to(self.device)
        return Step(n, lambda x, h: t, "constant")

    def _op_embedding(self, n):
        def into(x, h, outs):
            torch.index_select(x[0], 0, x[1].reshape(-1), out=outs[0].view(-1, x[0].shape[1]))
            return outs[0]
        return Step(n, lambda x, h: F.embedding(x[1], x[0]), "torch:embedding", into=into)

    def _op_qembedding(self, n):
        from llmc.ir.quant import qembedding_ref
        dtype = torch_dtype(n.attrs["dtype"])

        def into(x, h, outs):
            flat = x[2].reshape(-1)
            out = outs[0].view(-1, x[0].shape[1])
            torch.mul(x[0].index_select(0, flat), x[1].index_select(0, flat)[:, None], out=out)
            return outs[0]
        return Step(n, lambda x, h: qembedding_ref(x[0], x[1], x[2], dtype), "torch:qembedding", into=into)

    def _linear(self, n, epilogue):
        from llmc.codegen import matmul as mm
        tuner, use_triton = self.tuner, self.triton_matmul

        def fn(x, h, out=None):
            b = x[2] if len(x) > 2 else None
            if use_triton:
                return mm.matmul(x[0], x[1], b, epilogue, tuner=tuner, out=out)
            if tuner is not None:
                return mm.linear(x[0], x[1], b, epilogue, tuner=tuner, out=out)
            return mm.reference(x[0], x[1], b, epilogue, out)
        kernel, spec = "triton:matmul" if use_triton else "cublas" + ("+epilogue" if epilogue else ""), f"epilogue={epilogue}"
        tuned = self._tuned_buckets(n, epilogue) if not use_triton else None
        if tuned:
            kernel, spec = "triton:matmul|cublas", f"epilogue={epilogue} triton for M<={tuned}, cublas above"
        return Step(n, fn, kernel, spec, into=lambda x, h, outs: fn(x, h, outs[0]))

    def _tuned_buckets(self, n, epilogue) -> str | None:
        """The largest token bucket below which tuning.json prefers the generated matmul (None: never)."""
        from llmc.codegen import matmul as mm
        from llmc.codegen.autotune import M_BUCKETS
        from llmc.ir.ops import linear_weight_inputs
        if self.tuner is None:
            return None
        wv, bv = linear_weight_inputs(n)
        w = wv.type
        spec = mm.MatmulSpec(w.dtype, bv is not None, tuple(epilogue), "silu_mul" if n.op == "silu_mul_linear" else "",
                             n.op == "linear_silu_mul")
        key = spec.key(int(w.shape[0]), int(w.shape[1]))
        best = None
        for b in M_BUCKETS[:-1]:
            rec = self.tuner.lookup(key, str(b))
            if rec is None or rec.prefer_cublas:
                break
            best = b
        return None if best is None else str(best)

    def _op_linear(self, n):
        return self._linear(n, ())

    def _op_linear_act(self, n):
        return self._linear(n, ACT_EPILOGUE[n.attrs["act"]])

    def _op_silu_mul_linear(self, n):
        """The down projection with the SwiGLU product in its prologue (fuse_linear_prologue): the generated
        matmul forms silu(gate) * up as it loads each tile; where cuBLAS runs the shape (tuning.json, or no
        tuning), the product kernel runs first, as unfused. LLMC_SILU_PROLOGUE=0 (read when a plan is built)
        runs the product kernel first everywhere, with the same tiles: the unfused form, to compare with."""
        from llmc.codegen import matmul as mm
        tuner, use_triton = self.tuner, self.triton_matmul
        prologue = os.environ.get("LLMC_SILU_PROLOGUE", "1") != "0"

        def fn(x, h, out=None):
            g, u, w = x[:3]
            b = x[3] if len(x) > 3 else None
            if use_triton:
                return mm.matmul(g, w, b, up=u, out=out) if prologue else mm.matmul(mm.silu_mul_product(g, u), w, b,
                                                                                    out=out)
            if tuner is not None:
                return mm.linear(g, w, b, tuner=tuner, out=out, up=u, prologue=prologue)
            return mm.reference(mm.silu_mul_product(g, u), w, b, out=out)
        return self._swiglu_step(n, fn, "prologue" if prologue else "kernel first", ("fused_elementwise", "cublas"))

    def _op_linear_silu_mul(self, n):
        """A gate/up projection with the SwiGLU product in its epilogue (fuse_linear_epilogue): the generated
        matmul keeps a gate and an up accumulator per tile and writes silu(gate) * up; where cuBLAS runs the
        shape (tuning.json, or no tuning), the product kernel runs after it, as unfused. LLMC_SILU_EPILOGUE=0
        (read when a plan is built) runs the product kernel after the matmul everywhere, with the same tiles:
        the unfused form, to compare with."""
        from llmc.codegen import matmul as mm
        tuner, use_triton = self.tuner, self.triton_matmul
        fused = os.environ.get("LLMC_SILU_EPILOGUE", "1") != "0"

        def fn(x, h, out=None):
            b = x[2] if len(x) > 2 else None
            if use_triton:
                return mm.matmul(x[0], x[1], b, out=out, gated=True) if fused else mm.swiglu_of(
                    mm.matmul(x[0], x[1], b), out)
            if tuner is not None:
                return mm.linear(x[0], x[1], b, tuner=tuner, out=out, gated=True, fused=fused)
            return mm.reference(x[0], x[1], b, out=out, gated=True)
        return self._swiglu_step(n, fn, "epilogue" if fused else "kernel after", ("cublas", "fused_elementwise"))

    def _swiglu_step(self, n, fn, where: str, unfused: tuple[str, str]) -> Step:
        """The step of a linear with the SwiGLU product fused into it (`where`: its place, as `inspect
        --kernels` says), listed as the generated matmul where it runs, else as the `unfused` pair of kernels."""
        library = "+".join(unfused)
        kernel, spec = library.replace("fused_elementwise", "triton:fused_elementwise"), ""
        tuned = self._tuned_buckets(n, ()) if not self.triton_matmul else None
        if self.triton_matmul:
            kernel, spec = "triton:matmul", f"silu_mul {where}"
        elif tuned:
            kernel, spec = f"triton:matmul|{library}", f"silu_mul {where}: triton for M<={tuned}, cublas above"
        return Step(n, fn, kernel, spec, into=lambda x, h, outs: fn(x, h, outs[0]))

    def _op_qlinear(self, n):
        """A quantized linear: the weight is repacked once into the kernel's layout (`qmatmul.prepare`),
        then every step runs the generated kernel (dequantization in its main loop; for W8A8 and FP8 a
        per-token activation quantization kernel first). `qlinear_codes` is the same GEMM over the codes
        and scales its producer made (fuse_act_quant), so no quantization kernel runs."""
        from llmc.codegen import qmatmul as qmm
        from llmc.ir.ops import qlinear_weight_inputs
        from llmc.ir.quant import QuantFormat
        from llmc.ir.types import torch_dtype
        fmt, act, tuner = QuantFormat.from_attrs(n.attrs), n.attrs["act"], self.tuner
        codes = n.op == "qlinear_codes"
        qw, sc, zeros, bias = (v.name if v is not None else None for v in qlinear_weight_inputs(n))
        dtype = torch_dtype(n.attrs["dtype"]) if codes else None
        label = f"{fmt.label}" + (f"+{act}" if act else "") + (", codes given" if codes else "")
        if self.device.type == "meta":  # a listing only (`llmc inspect --kernels`)
            return Step(n, lambda x, h: None, "triton:qlinear", label)
        self._check_fp8(fmt)
        prepared = qmm.prepare(fmt, self.params[qw], self.params[sc], self.params[zeros] if zeros else None)
        if not codes:
            qmm.ready_layouts(prepared, tuner, torch_dtype(n.inputs[0].type.dtype), bias is not None, act)

        def fn(x, h, out=None):
            return qmm.qlinear(x[0], prepared, self.params[bias] if bias else None, act, tuner=tuner, out=out,
                               x_scales=x[1] if codes else None, dtype=dtype)
        return Step(n, fn, "triton:qlinear", label, into=lambda x, h, outs: fn(x, h, outs[0]))

    _op_qlinear_codes = _op_qlinear

    def _op_rms_norm(self, n):
        from llmc.codegen.norm import rms_norm
        eps, wfc = n.attrs["eps"], n.attrs["weight_first_cast"]
        return Step(n, lambda x, h: rms_norm(x[0], x[1], eps, weight_first_cast=wfc), "triton:rms_norm",
                    into=lambda x, h, o: rms_norm(x[0], x[1], eps, weight_first_cast=wfc, out=o[0]))

    def _op_add_rms_norm(self, n):
        from llmc.codegen.norm import rms_norm
        eps, wfc = n.attrs["eps"], n.attrs["weight_first_cast"]
        return Step(n, lambda x, h: rms_norm(x[0], x[2], eps, residual=x[1], weight_first_cast=wfc),
                    "triton:rms_norm+residual",
                    into=lambda x, h, o: rms_norm(x[0], x[2], eps, residual=x[1], weight_first_cast=wfc,
                                                  out=o[0], h_out=o[1]))

    def _check_fp8(self, fmt):
        if fmt.kind == "fp8" and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise LLMCError(f"this artifact has FP8 weights, and {torch.cuda.get_device_name(self.device)} has no FP8 "
                            "matrix units (compute capability 8.9+: Ada, Hopper); compile with --quant smoothquant "
                            "(int8) or rtn instead, or run with --backend reference")

    def _op_rms_norm_quant(self, n):
        """The norm and the per-token activation codes of the w8a8 / fp8 linears reading it, one kernel."""
        from llmc.codegen.norm import rms_norm_quant
        eps, wfc, kind = n.attrs["eps"], n.attrs["weight_first_cast"], n.attrs["kind"]
        res = n.op == "add_rms_norm_quant"

        def fn(x, h, outs=None):
            return rms_norm_quant(x[0], x[-1], kind, eps, residual=x[1] if res else None, weight_first_cast=wfc,
                                  outs=outs)
        return Step(n, fn, "triton:rms_norm" + ("+residual" if res else "") + "+quant", kind, into=fn)

    _op_add_rms_norm_quant = _op_rms_norm_quant

    def _op_silu_mul_quant(self, n):
        """The SwiGLU product and the per-token activation codes of the w8a8 / fp8 linear reading it, one kernel."""
        from llmc.codegen.act_quant import quantize_act
        kind = n.attrs["kind"]
        return Step(n, lambda x, h: list(quantize_act(x[0], kind, up=x[1])), "triton:quantize_act+silu_mul", kind)

    def _op_rope_kv_write(self, n):
        from llmc.codegen.attention import rope_kv_write

        def fn(x, h, outs=None):
            q, k, v, cos, sin, cache, slots = x[:7]  # q/k/v: [1, H, T, D], cos/sin: [1, 1, T, D]
            T, H, D = q.shape[2], q.shape[1], q.shape[3]
            q_out = outs[0].view(T, H, D) if outs else None  # the kernel's [T, H, D] layout in its memory
            qr = rope_kv_write(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                               cos.reshape(T, D), sin.reshape(T, D), cache, slots, x[7] if len(x) > 7 else None,
                               q_out=q_out)
            return qr.transpose(0, 1).unsqueeze(0)
        return Step(n, fn, "triton:rope_kv_write", into=fn)

    def _attend(self, q, cache, qsl, lens, tables, kv_scale, attrs, h, out=None, tiles=None):
        from llmc.codegen.attention import paged_attention
        _, H, T, D = q.shape
        decode, prefill = tiles or (None, None)
        out = paged_attention(q[0].transpose(0, 1), cache, qsl, lens, tables, attrs["scale"], attrs["causal"],
                              attrs["window"], kv_scale, max_seqlen_q=h.get("max_seqlen_q"),
                              max_seqlen_k=h.get("max_seqlen_k"), partition_size=h.get("partition_size"),
                              out=None if out is None else out.view(T, H, D), decode_tiles=decode,
                              prefill_tiles=prefill, decode_rows=h.get("decode_rows", 0),
                              context_limit=h.get("context_limit"), rows=h.get("mixed_rows"))
        return out.transpose(0, 1).unsqueeze(0)

    def _attention_tiles(self, n) -> tuple[dict | None, dict | None]:
        """The decode and prefill attention launches tuning.json chose for this node's shape
        (compiler._tune_attention); None for either: the kernel's defaults."""
        if self.tuner is None:
            return None, None
        prefill = os.environ.get("LLMC_PREFILL_TILES", "1") != "0"  # 0: the prefill kernel's default launch
        recs = (self.tuner.lookup(attention_tiles_key_of(n, "decode"), "decode"),
                self.tuner.lookup(attention_tiles_key_of(n, "prefill"), "prefill") if prefill else None)
        return tuple(dict(rec.config) if rec is not None else None for rec in recs)

    def _op_attend_paged(self, n):
        attrs, tiles = n.attrs, self._attention_tiles(n)

        def fn(x, h, outs=None):
            return self._attend(x[0], x[1], x[2], x[3], x[4], x[5] if len(x) > 5 else None, attrs, h,
                                outs[0] if outs else None, tiles)
        return Step(n, fn, "triton:paged_attention", into=fn)

    def _op_paged_attention(self, n):
        from llmc.codegen.attention import rope_kv_write
        attrs, tiles = n.attrs, self._attention_tiles(n)

        def fn(x, h, outs=None):
            # the unfused form: the write kernel with an identity rotation (cos 1, sin 0) puts k and v
            # into the cache with no host sync (capturable), then the attention kernel reads it
            q, k, v = (t[0].transpose(0, 1) for t in x[:3])
            scale = x[8] if len(x) > 8 else None
            ones = torch.ones(k.shape[0], k.shape[2], dtype=k.dtype, device=k.device)
            rope_kv_write(k, k, v, ones, torch.zeros_like(ones), x[3], x[7], scale)
            return self._attend(x[0], x[3], x[4], x[5], x[6], scale, attrs, h, outs[0] if outs else None, tiles)
        return Step(n, fn, "triton:kv_write+triton:paged_attention", into=fn)

    def _op_moe(self, n):
        """Routing in torch, then the grouped-GEMM expert kernels (llmc/codegen/moe.py)."""
        from llmc.codegen import moe as moe_kernels
        a = n.attrs

        def fn(x, h, outs=None):
            return moe_kernels.moe(*x, a["top_k"], a["norm_topk_prob"], a["round_weights"], a["expert_start"],
                                   out=outs[0] if outs else None)
        fn.spec = moe_kernels.MoeExpertsSpec(n.inputs[0].type.dtype)
        return Step(n, fn, "triton:moe_experts", f"top_k={a['top_k']}", into=fn)

    def _op_silu_mul(self, n):
        return self._elementwise(n, [(n.outputs[0].name, "silu_mul", ["in0", "in1"], {})], [n.outputs[0].name])

    def _op_fused(self, n):
        return self._elementwise(n, [tuple(b) for b in n.attrs["body"]], list(n.attrs["outputs"]))

    def _elementwise(self, n, body, outputs):
        from llmc.codegen.elementwise import SUPPORTED_OPS, broadcast_kind, fused_elementwise, spec_from_ops
        if any(op not in SUPPORTED_OPS for _, op, _, _ in body):
            return None
        out_shape = max((v.type.shape for v in n.outputs), key=len)
        try:
            inputs = [(f"in{i}", v.type.dtype, broadcast_kind(v.type.shape, out_shape)) for i, v in enumerate(n.inputs)]
            spec = spec_from_ops(inputs, [(op, args, attrs, name) for name, op, args, attrs in body], outputs)
        except Exception:
            return None  # a broadcast the kernel does not cover: the torch reference runs it
        if not inputs:
            return None

        same_shape = all(v.type.shape == out_shape for v in n.outputs)

        def fn(x, h, outs=None):
            outs = fused_elementwise(spec, x, outs)
            return outs[0] if len(outs) == 1 else outs
        fn.spec = spec
        return Step(n, fn, "triton:fused_elementwise", spec.summary(), into=fn if same_shape else None)

    # movement: views (a copy only where torch needs one)
    @staticmethod
    def _shape(shape):
        dims = [d if isinstance(d, int) else make_dim(d) for d in shape]
        return lambda h: [dim_eval(d, h) for d in dims]

    def _op_reshape(self, n):
        shape = self._shape(n.attrs["shape"])
        return Step(n, lambda x, h: x[0].reshape(shape(h)), "view")

    def _op_expand(self, n):
        shape = self._shape(n.attrs["shape"])
        return Step(n, lambda x, h: x[0].expand(shape(h)), "view")

    def _op_transpose(self, n):
        a, b = n.attrs["dim0"], n.attrs["dim1"]
        return Step(n, lambda x, h: x[0].transpose(a, b), "view")

    def _op_permute(self, n):
        d = n.attrs["dims"]
        return Step(n, lambda x, h: x[0].permute(d), "view")

    def _op_unsqueeze(self, n):
        d = n.attrs["dim"]
        return Step(n, lambda x, h: x[0].unsqueeze(d), "view")

    def _op_squeeze(self, n):
        d = n.attrs["dim"]
        return Step(n, lambda x, h: x[0].squeeze(d), "view")

    def _op_slice(self, n):
        ref, attrs = get_op("slice").ref, n.attrs
        return Step(n, lambda x, h: ref(x, attrs, None), "view")


def _digest(text: str) -> str:
    import hashlib
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _tname(dtype: str) -> str:
    return str(torch_dtype(dtype)).removeprefix("torch.")


def attention_types(n: Node):
    """(q, KV cache) types of an attention node (`attend_paged`, or the unfused `paged_attention`)."""
    return n.inputs[0].type, n.inputs[1 if n.op == "attend_paged" else 3].type


def attention_tiles_key_of(n: Node, mode: str = "decode") -> str:
    """The tuning key of an attention node's decode (or prefill) launch (attention.attention_tiles_key from its
    IR types)."""
    from llmc.codegen.attention import attention_tiles_key
    q, cache = attention_types(n)
    return attention_tiles_key(int(q.shape[3]), int(q.shape[1]), int(cache.shape[3]), _tname(q.dtype),
                               _tname(cache.dtype), bool(n.attrs["window"]), mode)


def _static_spec(n: Node, block_size: int):
    """The KernelSpec a node will launch, where the IR types determine it (block size assumed)."""
    from llmc.codegen.attention import PagedAttentionSpec, RopeKVWriteSpec
    from llmc.codegen.norm import RmsNormSpec
    t = n.inputs[0].type if n.inputs else None
    if n.op in ("rms_norm", "add_rms_norm", "rms_norm_quant", "add_rms_norm_quant"):
        w = n.inputs[-1].type
        return RmsNormSpec(int(t.shape[-1]), t.dtype, n.op.startswith("add_"), n.attrs["weight_first_cast"], w.dtype,
                           n.attrs.get("kind", ""))
    if n.op == "rope_kv_write":
        q, k, cache = n.inputs[0].type, n.inputs[1].type, n.inputs[5].type
        return RopeKVWriteSpec(int(q.shape[3]), int(q.shape[1]), int(k.shape[1]), _tname(q.dtype), _tname(cache.dtype),
                               block_size)
    if n.op in ("attend_paged", "paged_attention"):
        q, cache = attention_types(n)
        return [PagedAttentionSpec(int(q.shape[3]), int(q.shape[1]), int(cache.shape[3]), block_size, _tname(q.dtype),
                                   _tname(cache.dtype), mode, n.attrs["causal"], bool(n.attrs["window"]))
                for mode in ("prefill", "decode")]
    return None


def kernels_per_layer(plan: Plan) -> dict[str, int]:
    """Launches per decoder layer (views and constants excluded): total non-view steps / layers."""
    layers = max(1, sum(1 for s in plan.steps if s.node.op in ("attend_paged", "paged_attention")))
    launches = [s for s in plan.steps if s.kernel not in ("view", "constant")]
    return {"layers": layers, "launches": len(launches), "per_layer": round(len(launches) / layers, 2)}
