"""Greedy sampling on the device: a row-wise argmax over the logits, ties to the lowest index."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from llmc.codegen.elementwise import compiled
from llmc.codegen.kernels import KernelSpec
from llmc.intmath import next_pow2
from llmc.ir.types import dtype_name, torch_dtype

SPLIT_ARGMAX = os.environ.get("LLMC_SPLIT_ARGMAX", "1") != "0"  # 0: one program a row (to compare)
SPLIT_BLOCK = 2048  # logits a split program reads per loop step
MAX_SPLITS = 64  # programs per row at most (the merge kernel's lanes: one compiled merge for every count)
# about eight programs per SM of an H200 (132 SMs): a decode step of 128 rows split each row in two with 264 (two
# a SM), and its argmax read the bf16 logits at about a fifth of the copy rate (34.5 us, 2026-12-05)
SPLIT_PROGRAMS = 1056


@dataclass(frozen=True)
class ArgmaxSpec(KernelSpec):
    """Row-wise argmax over logits of `dtype`."""

    template = "argmax.py.jinja"
    dtype: str

    def context(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "itemsize": torch_dtype(self.dtype).itemsize}


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of the largest logit of each row, as torch.argmax(logits, -1) (first index on ties, NaN largest).

    Args:
        logits: [N, V] or [V] (any row stride, unit column stride).

    Returns:
        [N] (or 0-d for a 1-d input) int64 token ids, on the logits' device.

    Example:
        >>> argmax(torch.tensor([[0.0, 2.0, 2.0], [5.0, 1.0, 0.0]]))
        tensor([1, 0])
    """
    assert logits.dim() in (1, 2) and logits.shape[-1] > 0, f"argmax: logits of shape {list(logits.shape)}"
    squeeze = logits.dim() == 1
    x = logits.unsqueeze(0) if squeeze else logits
    if x.stride(-1) != 1:
        x = x.contiguous()
    N, V = x.shape
    out = torch.empty(N, dtype=torch.int64, device=x.device)
    if not N:
        return out[0] if squeeze else out
    mod = compiled(ArgmaxSpec(dtype_name(x.dtype)))
    splits = argmax_splits(N, V) if SPLIT_ARGMAX else 1
    if splits == 1:
        block = min(4096, next_pow2(V))
        mod.argmax_kernel[(N,)](x, out, x.stride(0), V, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    else:
        chunk = -(-V // (splits * SPLIT_BLOCK)) * SPLIT_BLOCK
        val = torch.empty(N, splits, dtype=torch.float32, device=x.device)
        idx = torch.empty(N, splits, dtype=torch.int32, device=x.device)
        nan = torch.empty_like(idx)
        mod.argmax_split_kernel[(N, splits)](x, val, idx, nan, x.stride(0), V, chunk, splits,
                                             BLOCK=SPLIT_BLOCK, num_warps=4)
        mod.argmax_merge_kernel[(N,)](val, idx, nan, out, splits, BLOCK_S=MAX_SPLITS, num_warps=1)
    return out[0] if squeeze else out


def argmax_splits(rows: int, vocab: int) -> int:
    """Programs per row: one where `rows` alone fill the GPU, else enough for about SPLIT_PROGRAMS in all (a
    batch-1 decode's 128K-vocabulary row on 63 SMs, not one), each over SPLIT_BLOCK logits at least. The
    result does not depend on it (argmax is exact, ties to the lowest index)."""
    return max(1, min(-(-vocab // SPLIT_BLOCK), SPLIT_PROGRAMS // rows, MAX_SPLITS))
