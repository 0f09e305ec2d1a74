"""Mixture-of-experts blocks as one captured op.

HF's sparse MoE blocks loop over the experts that received tokens (`nonzero`, `where`, `index_add_`):
data-dependent control flow that torch.export cannot keep dynamic. Before capture, each block of a
supported architecture is replaced by `SparseMoE`, which keeps the block's submodules (so weight names
stay the checkpoint's: `mlp.gate.weight`, `mlp.experts.gate_up_proj`, ...) and calls `llmc::moe`, a
torch custom op, so the export holds one `moe(x, router, gate_up, down)` node per layer.

A shared expert (Qwen2-MoE: `sigmoid(shared_expert_gate(x)) * shared_expert(x)`, added to the routed
experts' output) is left as plain torch around the op: it is an ordinary SwiGLU MLP, so it is captured
as `linear` nodes and gets the gate/up fusion, the silu_mul lift, quantization and (later) tensor
parallelism that every other MLP gets, instead of a second implementation inside the op.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmc.errors import CompileError
from llmc.ir.moe import moe_ref


@dataclass(frozen=True)
class MoEArch:
    """How one HF architecture routes: the block class llmc replaces and the routing choices."""

    block: str  # HF's sparse MoE block class name
    experts_key: str  # the config field with the number of experts
    norm_topk_prob: bool | None  # always (True) / never (False) renormalise, or None: the config's flag
    round_weights: bool  # top-k weights rounded to the model dtype before scaling the expert outputs
    shared_expert: bool


MOE_ARCHS = {
    "MixtralForCausalLM": MoEArch("MixtralSparseMoeBlock", "num_local_experts", True, False, False),
    "Qwen2MoeForCausalLM": MoEArch("Qwen2MoeSparseMoeBlock", "num_experts", None, True, True),
    "Qwen3MoeForCausalLM": MoEArch("Qwen3MoeSparseMoeBlock", "num_experts", None, True, False),
}


@torch.library.custom_op("llmc::moe", mutates_args=())
def moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
        norm_topk_prob: bool, round_weights: bool) -> torch.Tensor:
    """x: [..., H], router: [E, H], gate_up: [E, 2I, H], down: [E, H, I] -> [..., H] (llmc/ir/moe.py)."""
    return moe_ref(x, router, gate_up, down, top_k, norm_topk_prob, round_weights)


@moe.register_fake
def _(x, router, gate_up, down, top_k, norm_topk_prob, round_weights):
    return torch.empty_like(x)


def lower_moe(L, x, router, gate_up, down, top_k, norm_topk_prob, round_weights):
    """The torch_export lowering of `llmc::moe` to the IR's `moe` op."""
    return L.emit("moe", [L.val(x), L.val(router), L.val(gate_up), L.val(down)], top_k=int(top_k),
                  norm_topk_prob=bool(norm_topk_prob), round_weights=bool(round_weights), expert_start=0)


class SparseMoE(torch.nn.Module):
    """An HF sparse MoE block whose routed experts run as `llmc::moe` (shape-static, exportable)."""

    def __init__(self, block: torch.nn.Module, top_k: int, norm_topk_prob: bool, round_weights: bool):
        super().__init__()
        self.gate, self.experts = block.gate, block.experts
        self.shared_expert = getattr(block, "shared_expert", None)
        self.shared_expert_gate = getattr(block, "shared_expert_gate", None)
        self.top_k, self.norm_topk_prob, self.round_weights = top_k, norm_topk_prob, round_weights

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [B, S, H]
        out = torch.ops.llmc.moe(hidden_states, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj,
                                 self.top_k, self.norm_topk_prob, self.round_weights)
        if self.shared_expert is not None:
            out = out + F.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return out


def check_moe_config(cfg: dict) -> None:
    """A CompileError (one line) for an MoE configuration that llmc does not compile; nothing otherwise."""
    arch = MOE_ARCHS.get((cfg.get("architectures") or [""])[0])
    if arch is None:
        return
    name = cfg["architectures"][0]
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CompileError(f"{name} with hidden_act={act!r} is not supported: llmc's MoE kernels compute "
                           "SwiGLU experts (silu(gate) * up); only hidden_act='silu' compiles")
    experts, top_k = int(cfg.get(arch.experts_key) or 0), int(cfg.get("num_experts_per_tok") or 0)
    if experts and not 1 <= top_k <= experts:
        raise CompileError(f"{name} with num_experts_per_tok={top_k} is not supported: it must be 1..{experts} "
                           f"({arch.experts_key}={experts})")


def replace_moe_blocks(model: torch.nn.Module, architecture: str) -> int:
    """Put `SparseMoE` in place of each HF sparse MoE block of `model` (in place); the number replaced."""
    arch = MOE_ARCHS.get(architecture)
    if arch is None:
        return 0
    cfg = model.config
    cfg.output_router_logits = False  # the aux loss would read router outputs that the op no longer records
    norm = arch.norm_topk_prob if arch.norm_topk_prob is not None else bool(getattr(cfg, "norm_topk_prob", False))
    found = [(name, m) for name, m in model.named_modules() if type(m).__name__ == arch.block]
    for name, block in found:
        _check_block(block, name, arch)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, SparseMoE(block, int(cfg.num_experts_per_tok), norm,
                                                             arch.round_weights))
    return len(found)


def _check_block(block: torch.nn.Module, name: str, arch: MoEArch) -> None:
    experts = getattr(block, "experts", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    ok = (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
          and isinstance(getattr(getattr(block, "gate", None), "weight", None), torch.Tensor)
          and not getattr(experts, "is_transposed", False) and getattr(experts, "is_concatenated", True)
          and not getattr(experts, "has_bias", False)
          and (not arch.shared_expert or getattr(block, "shared_expert_gate", None) is not None))
    if not ok:
        import transformers
        raise CompileError(f"{name} ({type(block).__name__}) has an expert layout llmc does not know (transformers "
                           f"{transformers.__version__}): llmc reads stacked experts gate_up_proj [E, 2I, H] and "
                           "down_proj [E, H, I] with a router `gate.weight` (transformers 5.x)")
