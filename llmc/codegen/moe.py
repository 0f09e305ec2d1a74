"""Mixture of experts with grouped GEMMs: each expert runs only on the tokens routed to it.

A step's T tokens each choose top_k experts: A = T * top_k assignments. The routing (router logits,
fp32 softmax, top-k, renormalisation: `llmc.ir.moe.route`, the reference's own code) runs in torch;
then `sort_by_expert` groups the assignments by expert, each group padded to a multiple of BLOCK_M,
and three generated kernels (templates/moe_experts.py.jinja) finish the block:

    gate_up  one launch over every expert's row blocks: h = silu(x @ gate.T) * (x @ up.T)   [A, I]
    down     one launch: y = (h @ down.T) * routing weight, fp32, one row per assignment     [A, H]
    combine  out[t] = sum_j y[t * top_k + j], in j order, rounded once to x's dtype          [T, H]

Bytes: each expert's weights are read once per BLOCK_M of its tokens (decode reads exactly the
routed experts' weights, never all E), x rows once per I tile from L2, h written once and read once
(the gate and up outputs never reach memory: 4·A·I bytes saved against an unfused silu*mul), y
written and read once in fp32 (the price of a deterministic top-k sum without atomics).

Nothing here synchronises with the host: the number of row blocks is bounded from T, top_k and the
expert count, and blocks past the last expert's exit at once, so a decode step captures in a CUDA
graph like any other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmc.codegen.elementwise import cast_expr, cast_helpers, compiled, interpreting
from llmc.codegen.kernels import KernelSpec
from llmc.intmath import cdiv, next_pow2
from llmc.ir.moe import route, scale_weights
from llmc.ir.types import dtype_name, torch_dtype


@dataclass(frozen=True)
class MoeExpertsSpec(KernelSpec):
    """The three MoE kernels for activations and expert weights of `dtype`."""

    template = "moe_experts.py.jinja"
    dtype: str

    def context(self) -> dict[str, Any]:
        # the interpreter's tl.dot runs np.matmul on bf16's raw uint16 bits: feed it fp32 there;
        # fp32 on the GPU: "ieee" keeps full precision (tf32 would miss the 1e-4 tolerance)
        def dot(a, b, acc):
            if self.dtype == "bf16" and interpreting():
                return f"tl.dot({a}.to(tl.float32), {b}.to(tl.float32), {acc})"
            if self.dtype == "f32":
                return f'tl.dot({a}, {b}, {acc}, input_precision="ieee")'
            return f"tl.dot({a}, {b}, {acc})"
        e = torch_dtype(self.dtype).itemsize
        return {"dtype": self.dtype, "gate_dot": dot("a", "wg", "acc_g"), "up_dot": dot("a", "wu", "acc_u"),
                "down_dot": dot("a", "b", "acc"), "h_cast": cast_expr("h", self.dtype),
                "out_cast": cast_expr("acc", self.dtype), "helpers": cast_helpers([self.dtype]),
                "gate_up_bytes": f"bytes: each routed expert's gate_up ({2 * e}·2IH) once per row block, x rows "
                                 f"({e}·AH) from L2 per I tile, h written once ({e}·AI); unfused, gate and up "
                                 f"would be written and read back ({4 * e}·AI more)",
                "down_bytes": f"bytes: each routed expert's down ({e}·HI) once per row block, h read once ({e}·AI), "
                              f"y written once (4·AH, fp32)"}


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4


def tiles(assignments: int, num_experts: int, inter: int, hidden: int) -> Tiles:
    """Row blocks as tall as an expert's average share of the assignments (16 at decode: padding
    rows cost compute, not weight bytes), 64-wide N tiles, K tiles up to 64."""
    per_expert = assignments / max(1, min(num_experts, assignments))
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    bk = max(16, min(64, next_pow2(min(inter, hidden))))
    return Tiles(bm, 64, bk, 4 if bm <= 32 else 8)


def sort_by_expert(ids: torch.Tensor, expert_start: int, num_local: int,
                   block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The assignments grouped by expert, for the grouped GEMMs.

    Args:
        ids: [T, k] global expert ids chosen per token.
        expert_start, num_local: the experts held here, [expert_start, expert_start + num_local).
        block_m: the row block height; each expert's group is padded to a multiple of it.

    Returns:
        rows [P] i32: assignment indices t * k + j grouped by local expert (in token order within a
            group), padding slots hold A = T * k; P is a static bound (A + min(E_local, A)·(block_m - 1),
            rounded up to block_m) so that the launch grid does not depend on the routing.
        block_expert [P / block_m] i32: each block's local expert; num_local for blocks past the groups.
    """
    A = ids.numel()
    dev = ids.device
    e = ids.reshape(-1) - expert_start
    e = torch.where((e >= 0) & (e < num_local), e, num_local)  # other ranks' experts: a dropped group
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev).scatter_add_(0, e, torch.ones_like(e))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    P = cdiv(A + min(num_local, A) * (block_m - 1), block_m) * block_m
    order = torch.argsort(e, stable=True)
    se = e[order]
    group_start = counts.cumsum(0) - counts
    slot = (pad_end - padded)[se.clamp(max=num_local - 1)] + torch.arange(A, device=dev) - group_start[se]
    slot = torch.where(se < num_local, slot, P)  # dropped assignments land in a spare slot past P
    rows = torch.full((P + 1,), A, dtype=torch.int32, device=dev).scatter_(0, slot, order.to(torch.int32))[:P]
    block_expert = torch.searchsorted(pad_end, torch.arange(0, P, block_m, device=dev), right=True)
    return rows, block_expert.to(torch.int32)


def moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
        norm_topk_prob: bool, round_weights: bool = False, expert_start: int = 0,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """The `moe` op (llmc/ir/moe.py) with the generated grouped-GEMM kernels.

    Args:
        x: [..., H] tokens.
        router: [E, H]; gate_up: [E_local, 2I, H]; down: [E_local, H, I] (x's dtype).
        top_k, norm_topk_prob, round_weights, expert_start: the op's attributes.
        out: a contiguous tensor of x's shape and dtype to write into; allocated when None.

    Returns:
        [..., H] of x's dtype.

    Example:
        >>> x, r = torch.randn(5, 64), torch.randn(4, 64)
        >>> y = moe(x, r, torch.randn(4, 96, 64), torch.randn(4, 64, 48), 2, True)  # doctest: +SKIP
    """
    H = x.shape[-1]
    E_local, I = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.dtype == down.dtype == x.dtype, "moe: x and the expert weights must share a dtype"
    assert down.shape == (E_local, H, I) and router.shape[1] == H, "moe: weight shapes do not match x"
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    out = out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    weights, ids = route(x2, router, top_k, norm_topk_prob)  # [T, k] fp32, [T, k] i64
    weights = scale_weights(weights, x.dtype, round_weights).contiguous()
    ids = ids.contiguous()
    A = T * top_k
    cfg = tiles(A, E_local, I, H)
    rows, block_expert = sort_by_expert(ids, expert_start, E_local, cfg.block_m)
    gate_up, down = gate_up.contiguous(), down.contiguous()
    h = torch.empty(A, I, dtype=x.dtype, device=x.device)
    y = torch.empty(A, H, dtype=torch.float32, device=x.device)
    mod = compiled(MoeExpertsSpec(dtype_name(x.dtype)))
    blocks = block_expert.numel()
    mod.moe_gate_up_kernel[(blocks, cdiv(I, cfg.block_n))](
        x2, gate_up, h, rows, block_expert, x2.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        A, H, I, E_local, TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps)
    mod.moe_down_kernel[(blocks, cdiv(H, cfg.block_n))](
        h, down, weights, y, rows, block_expert, h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        A, I, H, E_local, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    block_c = min(1024, next_pow2(H))
    out2 = out.view(-1, H)
    mod.moe_combine_kernel[(T, cdiv(H, block_c))](
        y, ids, out2, y.stride(0), out2.stride(0), H, expert_start, E_local, TOP_K=top_k, BLOCK_N=block_c,
        num_warps=4 if block_c <= 1024 else 8)
    return out
