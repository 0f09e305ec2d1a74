"""Reference implementation of `paged_attention`: write the new K/V into cache blocks, then attend.

This is the golden model for the Triton kernels. Layouts:
    q: [1, Hq, T, D]   k, v: [1, Hkv, T, D]   (T = all new tokens of all sequences in this step)
    kv_cache: [2, NB, BS, Hkv, D]  (K and V; NB blocks of BS slots)
    kv_scale: [2, NB, Hkv] f32     (only for int8 / fp8 caches: one scale per block and head)
    query_start_loc: [N+1] start of each sequence's new tokens in T
    seq_lens: [N] context length of each sequence after this step (cached + new tokens)
    block_tables: [N, M] the blocks of each sequence, in order
    slot_mapping: [T] flat cache slot (block * BS + offset) of each new token; -1 skips the write
The new tokens of a sequence are its last `n_new` positions, so one op serves prefill, chunked
prefill, decode, prefix-cache hits and speculative verification alike.
"""
from __future__ import annotations

import torch

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QMAX


def _write(cache: torch.Tensor, scale: torch.Tensor | None, which: int, new: torch.Tensor,
           slots: torch.Tensor) -> None:
    """Write new [T, Hkv, D] vectors into cache[which] at `slots`, requantizing blocks whose scale grows."""
    NB, BS = cache.shape[1], cache.shape[2]
    keep = slots >= 0
    slots, new = slots[keep], new[keep]
    if slots.numel() == 0:
        return
    flat = cache[which].view(NB * BS, *cache.shape[3:])  # [NB*BS, Hkv, D]
    if not quantized(cache):
        flat[slots] = new.to(cache.dtype)
        return
    qmax = QMAX[cache.dtype]
    blocks = slots // BS
    amax = new.float().abs().amax(dim=-1)  # [t, Hkv]
    need = torch.zeros(NB, new.shape[1], device=new.device).scatter_reduce_(
        0, blocks[:, None].expand_as(amax), amax / qmax, "amax")  # [NB, Hkv]: the scale each block needs
    old = scale[which]  # [NB, Hkv]
    old[blocks[slots % BS == 0]] = 0.0  # a write at offset 0 starts a block afresh: forget a reused block's scale
    grown = need > old
    if grown.any():
        # rescale the blocks' existing entries to the larger scale so that one scale covers them all
        ratio = torch.where(grown, old / need.clamp_min(1e-12), torch.ones_like(old))  # [NB, Hkv]
        view = cache[which]  # [NB, BS, Hkv, D]
        rescaled = view.float() * ratio[:, None, :, None]
        view.copy_(_to_q(rescaled, cache.dtype, qmax))
        old.copy_(torch.maximum(old, need))
    s = old[blocks].clamp_min(1e-12)  # [t, Hkv]
    flat[slots] = _to_q(new.float() / s[..., None], cache.dtype, qmax)


def _to_q(x: torch.Tensor, dtype: torch.dtype, qmax: float) -> torch.Tensor:
    x = x.clamp(-qmax, qmax)
    return x.round().to(dtype) if dtype == torch.int8 else x.to(dtype)


def _read(cache, scale, which, blocks, L, dtype):
    kv = cache[which, blocks]  # [nb, BS, Hkv, D]
    if quantized(cache):
        kv = kv.float() * scale[which, blocks][:, None, :, None]
    return kv.reshape(-1, *cache.shape[3:])[:L].to(dtype)  # [L, Hkv, D]


def write_kv(cache, scale, k, v, slot_mapping) -> None:
    """k, v: [T, Hkv, D] written at slot_mapping (in place)."""
    _write(cache, scale, 0, k, slot_mapping.long())
    _write(cache, scale, 1, v, slot_mapping.long())


def attend(q, cache, scale, qsl, seq_lens, block_tables, a) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]: each sequence's new queries over its cached context."""
    BS = cache.shape[2]
    Hq, Hkv = q.shape[1], cache.shape[3]
    out = torch.zeros(q.shape[0], Hq, cache.shape[-1], dtype=q.dtype, device=q.device)
    qsl, seq_lens, block_tables = qsl.tolist(), seq_lens.tolist(), block_tables.long()
    for i in range(len(seq_lens)):
        s, e, L = qsl[i], qsl[i + 1], seq_lens[i]
        n = e - s
        if n == 0:
            continue
        blocks = block_tables[i, : (L + BS - 1) // BS]
        K = _read(cache, scale, 0, blocks, L, torch.float32).repeat_interleave(Hq // Hkv, dim=1)  # [L, Hq, D]
        V = _read(cache, scale, 1, blocks, L, torch.float32).repeat_interleave(Hq // Hkv, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[s:e].float(), K) * a["scale"]  # [Hq, n, L]
        qpos = torch.arange(L - n, L, device=q.device)[:, None]
        kpos = torch.arange(L, device=q.device)[None, :]
        allowed = kpos <= qpos if a["causal"] else torch.ones_like(kpos <= qpos)
        if a["window"]:
            allowed &= kpos > qpos - a["window"]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[s:e] = torch.einsum("htl,lhd->thd", torch.softmax(scores, dim=-1), V).to(q.dtype)
    return out


def paged_attention_ref(x, a, env) -> torch.Tensor:
    q, k, v, cache, qsl, seq_lens, block_tables, slot_mapping = x[:8]
    scale = x[8] if len(x) > 8 else None
    write_kv(cache, scale, k[0].transpose(0, 1), v[0].transpose(0, 1), slot_mapping)
    out = attend(q[0].transpose(0, 1), cache, scale, qsl, seq_lens, block_tables, a)
    return out.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]


def rope_kv_write_ref(x, a, env) -> torch.Tensor:
    """rope on q and k, then k and v into the cache; returns roped q. q: [1, Hq, T, D], cos/sin [1, 1, T, D]."""
    from llmc.ir.ops import _rope_ref
    q, k, v, cos, sin, cache, slot_mapping = x[:7]
    scale = x[7] if len(x) > 7 else None
    qr, kr = _rope_ref([q, cos, sin], a, env), _rope_ref([k, cos, sin], a, env)
    write_kv(cache, scale, kr[0].transpose(0, 1), v[0].transpose(0, 1), slot_mapping)
    return qr.to(q.dtype)


def attend_paged_ref(x, a, env) -> torch.Tensor:
    q, cache, qsl, seq_lens, block_tables = x[:5]
    scale = x[5] if len(x) > 5 else None
    return attend(q[0].transpose(0, 1), cache, scale, qsl, seq_lens, block_tables, a).transpose(0, 1).unsqueeze(0)
