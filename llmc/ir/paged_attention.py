"""Reference implementation of `paged_attention`: write the new K/V into cache blocks, then attend.

This is the golden model for the Triton kernels. Layouts:
    q: [1, Hq, T, D]   k, v: [1, Hkv, T, D]   (T = all new tokens of all sequences in this step)
    kv_cache: [2, NB, BS, Hkv, D]  (K and V; NB blocks of BS slots)
    kv_scale: [NB, Hkv, 2D + 2BS]  (only for int8 / fp8 caches, in the model dtype: the centres and
                                    scales of each block and head, see `scale_layout`)
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


def tiny(dtype: torch.dtype) -> float:
    """The smallest scale stored: an all-zero difference still divides cleanly."""
    return torch.finfo(dtype).tiny


def scale_width(head_dim, block_size):
    """Floats of kv_scale per (block, kv head), see `scale_layout`; symbolic while the block size is."""
    if isinstance(head_dim, int) and isinstance(block_size, int):
        return 2 * head_dim + 2 * block_size
    from llmc.ir.types import make_dim
    return make_dim(f"2*({head_dim}) + 2*({block_size})")


def scale_layout(head_dim: int, block_size: int) -> dict[str, slice]:
    """Where each part of a quantized cache's kv_scale [NB, Hkv, 2D + 2BS] lives, per (block, kv head).

    v_zero, k_zero [D]: the block's first V and K vectors, exact (kv_scale has the model's dtype),
        which every entry of the block is stored relative to;
    k_token, v_token [BS]: each slot's scale (symmetric, per token and head) of its difference from
        the block's first vector, rounded to that dtype before it is used.
    Centring on the first entry takes out what K and V vectors near each other in a sequence share
    (K's large per-channel offsets above all), so the 8 bits resolve what differs. Every scale is
    fixed when its entry is written: nothing is ever requantized, so nothing is rounded twice, and
    a block's first entry is stored exactly.
    """
    D, BS = head_dim, block_size
    return {"v_zero": slice(0, D), "k_zero": slice(D, 2 * D), "k_token": slice(2 * D, 2 * D + BS),
            "v_token": slice(2 * D + BS, 2 * D + 2 * BS)}


def _to_q(x: torch.Tensor, dtype: torch.dtype, qmax: float) -> torch.Tensor:
    """Round half up (as the kernels do) and saturate; fp8 rounds in the cast."""
    x = x.clamp(-qmax, qmax)
    return torch.floor(x + 0.5).to(dtype) if dtype == torch.int8 else x.to(dtype)


def _write(cache: torch.Tensor, scale: torch.Tensor | None, which: int, new: torch.Tensor,
           slots: torch.Tensor) -> None:
    """Write new [T, Hkv, D] vectors into cache[which] at `slots` (-1 skips a token).

    Quantized caches: a write at a block's offset 0 sets the block's centre (`scale_layout`); each
    vector is stored as its difference from the centre, with its own scale.
    """
    BS, H, D = cache.shape[2:]
    keep = slots >= 0
    slots, new = slots[keep], new[keep]
    if slots.numel() == 0:
        return
    blocks, offs = slots // BS, slots % BS
    at = (which, blocks, offs)  # indexed, not viewed: the cache's memory order is its own (kv_cache.py)
    if not quantized(cache):
        cache[at] = new.to(cache.dtype)
        return
    qmax, lay = QMAX[cache.dtype], scale_layout(D, BS)
    x = new.float()
    centre = lay["v_zero" if which else "k_zero"]
    scale[blocks[offs == 0], :, centre] = x[offs == 0].to(scale.dtype)
    x = x - scale[blocks][..., centre].float()
    s = (x.abs().amax(dim=-1) / qmax).clamp_min(tiny(scale.dtype)).to(scale.dtype)  # [t, H]
    cache[at] = _to_q(x / s[..., None].float(), cache.dtype, qmax)
    col = lay["v_token" if which else "k_token"].start + offs
    scale[blocks[:, None], torch.arange(H, device=x.device)[None, :], col[:, None]] = s


def _read(cache, scale, which, blocks, L, dtype):
    kv = cache[which, blocks]  # [nb, BS, Hkv, D]
    if quantized(cache):
        lay = scale_layout(cache.shape[4], cache.shape[2])
        rows = scale[blocks].float()  # [nb, Hkv, W]
        tok = rows[..., lay["v_token" if which else "k_token"]].transpose(1, 2)[..., None]  # [nb, BS, Hkv, 1]
        kv = kv.float() * tok + rows[:, None, :, lay["v_zero" if which else "k_zero"]]
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
