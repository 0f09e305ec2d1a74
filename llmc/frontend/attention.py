"""Attention as one captured op.

`llmc::attention` is a torch custom op registered as a transformers attention implementation
("llmc"), so `torch.export` records one `attention(q, k, v, scale, causal, window)` node per layer
and the mask construction in the model becomes dead code (the mask function returns None).
"""
from __future__ import annotations

import torch

from llmc.ir.ops import _attention_ref

ATTN_IMPL = "llmc"


@torch.library.custom_op("llmc::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
              window: int) -> torch.Tensor:
    """q: [B, Hq, S, D], k/v: [B, Hkv, S, D] -> [B, Hq, S, D]."""
    return _attention_ref([q, k, v], {"scale": scale, "causal": causal, "window": window}, None)


@attention.register_fake
def _(q, k, v, scale, causal, window):
    return q.new_empty(q.shape[:3] + (v.shape[3],))


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # HF passes sliding_window for sliding layers only (None on full-attention layers)
    window = kwargs.get("sliding_window") or 0
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    out = torch.ops.llmc.attention(query, key, value, scale, bool(getattr(module, "is_causal", True)), int(window))
    return out.transpose(1, 2).contiguous(), None  # HF expects [B, S, H, D]


def _no_mask(*args, **kwargs):
    return None


_registered = False


def register_hf_attention() -> str:
    """Register the "llmc" attention implementation with transformers (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        AttentionInterface.register(ATTN_IMPL, _hf_attention)
        try:
            from transformers.masking_utils import AttentionMaskInterface
            AttentionMaskInterface.register(ATTN_IMPL, _no_mask)
        except ImportError:  # older transformers build masks per implementation name only
            pass
        _registered = True
    return ATTN_IMPL
