"""Reference implementation of `moe`: top-k routing over SwiGLU experts, the golden model for the kernels.

Layouts (E experts in the router, E_local of them held here, hidden H, expert width I):
    x: [..., H]                       tokens (any leading dims)
    router: [E, H]                    router logits = x @ router.T
    gate_up: [E_local, 2I, H]         each expert's gate rows, then its up rows (HF's fused layout)
    down: [E_local, H, I]
The routing is the same for Mixtral, Qwen2-MoE and Qwen3-MoE: logits in x's dtype, softmax over all E
experts in fp32, the top-k probabilities, renormalised to sum 1 when `norm_topk_prob` (Mixtral always;
Qwen by its config flag). `round_weights`: Qwen rounds those weights to x's dtype before they scale the
expert outputs; Mixtral keeps them fp32. Each token's output is the weighted sum of its top-k experts'
`down(silu(gate(x)) * up(x))`, accumulated in fp32 and rounded once.

Expert parallelism: `gate_up[i]` is global expert `expert_start + i`. Routing always sees all E experts
(the router is whole on every rank); tokens routed to an expert outside
[expert_start, expert_start + E_local) contribute nothing here, so a rank's result is a partial sum
that an all_reduce over the ranks completes. Tensor-parallel experts need nothing of the op either: a
rank holding intermediate columns [lo, hi) of every expert (gate rows, up rows and down columns alike)
computes a partial sum over I that the same all_reduce completes (llmc/ir/sharding.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route(x2: torch.Tensor, router: torch.Tensor, top_k: int,
          norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids i64 [T, k]) of tokens x2 [T, H], as HF's routers compute them."""
    logits = F.linear(x2, router)  # [T, E] rounded to x's dtype before the fp32 softmax, as in HF
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def scale_weights(weights: torch.Tensor, dtype: torch.dtype, round_weights: bool) -> torch.Tensor:
    """The fp32 factors that scale the expert outputs: the weights, or their `dtype` rounding (Qwen)."""
    return weights.to(dtype).float() if round_weights else weights


def moe_ref(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
            norm_topk_prob: bool, round_weights: bool = False, expert_start: int = 0) -> torch.Tensor:
    """The `moe` op: see the module docstring. Returns x's shape and dtype."""
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    weights, ids = route(x2, router, top_k, norm_topk_prob)
    weights = scale_weights(weights, x.dtype, round_weights)
    local = ids - expert_start
    out = torch.zeros(x2.shape, dtype=torch.float32, device=x.device)
    for e in range(gate_up.shape[0]):
        tok, j = torch.where(local == e)
        if tok.numel() == 0:
            continue
        gate, up = F.linear(x2[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])  # [n, H] in x's dtype, as HF computes each expert
        out.index_add_(0, tok, y.float() * weights[tok, j, None])
    return out.to(x.dtype).reshape(x.shape)
