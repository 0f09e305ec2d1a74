"""Decode attention over an fp8 (e4m3) cache with fp8 tensor-core dots: a lab, not a product kernel.

The shipped decode kernel over an 8-bit cache widens the codes to fp16 before its dots (RESULTS 2026-12-06,
morning): it reads half a bf16 cache's bytes and still takes 1.08-1.13x its time, bound by the instructions
that bring the codes to the tensor cores. Hopper's tensor cores take e4m3 operands as they are. Here q is
quantized to e4m3 per head (a scale per row) and the scores are an fp8 dot of q with the K codes, which then
need no conversion at all; the values take either the fp16 route or an fp8 dot of p x scale (scaled by a power
of two per tile into e4m3's range) with the V codes.

Simplified kernels, the same structure and tiles in every mode (grid: sequence x kv head, every key of a
sequence in one program, a paged cache of 16-token blocks (`--block-size`), per-token scales, no block centres;
a key tile inside one block reads its block number once):

    bf16      a bf16 cache, bf16 dots (the reference speed)
    fp16dots  an fp8 cache, codes widened to fp16 for both dots (the shipped approach, plain conversions)
    fp8k      an fp8 cache, scores by an fp8 dot, values widened to fp16
    fp8kv     an fp8 cache, both dots in fp8
    fp16dots+centres   fp16dots with each entry its block's centre + code x scale (the shipped cache's form),
              a centre row per key in two more bf16 dots
    fp16dots-rows      fp16dots with the group's q heads as the dots' rows (16, padded), as the shipped kernel
    fp8k2     fp8k with q in two e4m3 halves (hi, and the rest x 16; two dots): about fp16's precision for q
    fp8kvt    both dots in fp8, the V codes stored transposed per block ([block, head, D, BS]), so that the
              value dot's operand is K-major as Hopper's fp8 dots need it (one e4m3 half of q and of p x scale)
    fp8kvt2   fp8kvt with q and p x scale each in two e4m3 halves (four dots)
    i8kvt2    an int8 cache (code x scale, scale max / 127), V transposed per block, q and p x scale as 16-bit
              integers in two int8 halves: four int8 dots, exact in int32
    fp8kvt2-rows, i8kvt2-rows   fp8kvt2 and i8kvt2 with the group's q heads as the dots' rows (16, padded)

    python3 benchmarks/fp8_decode_lab.py [--cases 128x1024,64x4096] [--modes bf16,fp8k2] [--block-size 64] [--out DIR]

Prints microseconds per call (CUDA-graph replays) per mode, configs BLOCK_N x num_warps x num_stages, and each
mode's largest error against an fp32 reference over the same (dequantized) cache, relative to the output's
largest value. Needs a GPU with fp8 (sm_89+).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("bf16", "fp16dots", "fp8k", "fp8kv", "fp16dots+centres", "fp16dots-rows")
SPLIT_MODES = ("fp8k2", "fp8kvt", "fp8kvt2", "i8kvt2")  # decode_split_kernel's
ROW_MODES = ("fp8kvt2-rows", "i8kvt2-rows")  # decode_rows_kernel's
HQ, HKV, D, BS = 32, 8, 128, 16
E4M3_MAX = 448.0


@triton.jit
def _pow2(e):
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _log2_floor(x):
    return ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _tile_blocks(bt_row, start, kpos, k_ok, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    # each key's cache block; a tile inside one block (start is a multiple of BLOCK_N) reads its block once,
    # and the keys' addresses are then known to run contiguously within it
    if BLOCK_N <= BS:
        return tl.load(bt_row + start // BS).to(tl.int64) + tl.zeros([BLOCK_N], tl.int64)
    return tl.load(bt_row + kpos // BS, mask=k_ok, other=0).to(tl.int64)


@triton.jit
def decode_lab_kernel(out_ptr, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kc_ptr, vc_ptr, seq_lens_ptr, bt_ptr, stride_bt, qk_scale,
                      MODE: tl.constexpr, GROUP: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                      D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, WIDEN: tl.constexpr):
    # MODE 0 bf16, 1 fp16dots, 2 fp8k, 3 fp8kv, 4 fp16dots+centres, 5 fp16dots-rows. Cache [NB, BS, HKV, D]; scales [NB, BS, HKV] fp32. Keys are the
    # dots' tall side (scores [BLOCK_N, 16], output [D, 16], the group's q heads the narrow one), so that Hopper's
    # wgmma (64+ rows) takes them, with the K codes straight from shared memory
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    L = tl.load(seq_lens_ptr + seq)
    row_ok, head, d, q = _group_q(q_ptr, seq, kvh, GROUP, HQ, D)
    if MODE == 2 or MODE == 3:
        # q in e4m3, a scale per row (its largest entry at 448)
        q_scale = tl.maximum(tl.max(tl.abs(q), 1), 1e-30) / 448.0
        qd = (q / q_scale[:, None]).to(tl.float8e4nv)
    elif MODE == 1 or MODE >= 4:
        q_scale = tl.full([16], 1.0, tl.float32)
        qd = q.to(tl.float16)
    else:
        q_scale = tl.full([16], 1.0, tl.float32)
        qd = q.to(tl.bfloat16)
    qt = tl.trans(qd)  # [D, 16]
    qbt = tl.trans(q.to(tl.bfloat16))
    m_i = tl.full([16], float("-inf"), tl.float32)
    l_i = tl.zeros([16], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if MODE == 5:
        acc_r = tl.zeros([16, D], tl.float32)
        for start in range(0, L, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            k_ok = kpos < L
            block = _tile_blocks(bt_row, start, kpos, k_ok, BS, BLOCK_N)
            slot = (block * BS + kpos % BS) * HKV + kvh
            kt = tl.load(k_ptr + slot[None, :] * D + d[:, None], mask=k_ok[None, :], other=0.0)  # [D, BLOCK_N]
            v = tl.load(v_ptr + slot[:, None] * D + d[None, :], mask=k_ok[:, None], other=0.0)  # [BLOCK_N, D]
            ks = tl.load(ks_ptr + slot, mask=k_ok, other=0.0)
            sr = tl.dot(qd, kt.to(tl.float16)) * ks[None, :] * qk_scale
            sr = tl.where(k_ok[None, :], sr, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sr, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            pr = tl.math.exp2(sr - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(pr, 1)
            vs = tl.load(vs_ptr + slot, mask=k_ok, other=0.0)
            v_shift = 7 - _log2_floor(tl.maximum(tl.max(vs, 0), 1e-30))
            pvr = pr * vs[None, :] * _pow2(v_shift)
            acc_r = acc_r * alpha[:, None] + tl.dot(pvr.to(tl.float16), v.to(tl.float16)) * _pow2(-v_shift)
            m_i = m_new
        acc = tl.trans(acc_r)
    else:
        acc = tl.zeros([D, 16], tl.float32)
    for start in range(0, L if MODE != 5 else 0, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < L
        block = _tile_blocks(bt_row, start, kpos, k_ok, BS, BLOCK_N)
        slot = (block * BS + kpos % BS) * HKV + kvh  # token-head index
        k = tl.load(k_ptr + slot[:, None] * D + d[None, :], mask=k_ok[:, None], other=0.0)  # [BLOCK_N, D]
        vt = tl.load(v_ptr + slot[None, :] * D + d[:, None], mask=k_ok[None, :], other=0.0)  # [D, BLOCK_N]
        if MODE == 0:
            s = tl.dot(k, qt)
        else:
            ks = tl.load(ks_ptr + slot, mask=k_ok, other=0.0)
            if MODE == 1 or MODE >= 4:  # (mode 5 runs the loop above; this one runs no key for it)
                s = tl.dot(k.to(tl.float16), qt) * ks[:, None]
                if MODE == 4:  # each key's block centre, a row per key
                    crow = (block * HKV + kvh) * D
                    kc = tl.load(kc_ptr + crow[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)  # [BLOCK_N, D]
                    if WIDEN:  # the interpreter's bf16 dot multiplies raw bits: fp32 there
                        s += tl.dot(kc.to(tl.float32), qbt.to(tl.float32))
                    else:
                        s += tl.dot(kc, qbt)
            else:
                s = tl.dot(k, qt) * ks[:, None] * q_scale[None, :]
        s = s * qk_scale  # [BLOCK_N, 16]
        s = tl.where(k_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[None, :])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 0)
        if MODE == 0:
            acc = acc * alpha[None, :] + tl.dot(vt, p.to(tl.bfloat16))
        else:
            vs = tl.load(vs_ptr + slot, mask=k_ok, other=0.0)
            # p x scale by a power of two per tile: the tile's largest value scale in [2^7, 2^8) (e4m3 tops at 448)
            v_shift = 7 - _log2_floor(tl.maximum(tl.max(vs, 0), 1e-30))
            pv = p * vs[:, None] * _pow2(v_shift)
            if MODE == 3:
                part = tl.dot(vt, pv.to(tl.float8e4nv))
            else:
                part = tl.dot(vt.to(tl.float16), pv.to(tl.float16))
            part = part * _pow2(-v_shift)
            if MODE == 4:
                crow = (block * HKV + kvh) * D
                vct = tl.load(vc_ptr + crow[None, :] + d[:, None], mask=k_ok[None, :], other=0.0)  # [D, BLOCK_N]
                if WIDEN:
                    part += tl.dot(vct.to(tl.float32), p)
                else:
                    part += tl.dot(vct, p.to(tl.bfloat16))
            acc = acc * alpha[None, :] + part
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[None, :]
    tl.store(out_ptr + seq * HQ * D + head[None, :] * D + d[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[None, :])


@triton.jit
def _rint(v):
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _i8_halves(x):
    # an integer-valued fp32 in [-32512, 32512] as hi * 256 + lo, both in [-128, 127]
    xi = x.to(tl.int32)
    hi = (xi + 128) >> 8
    return hi.to(tl.int8), (xi - hi * 256).to(tl.int8)


@triton.jit
def _group_q(q_ptr, seq, kvh, GROUP: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr):
    # the group's q heads as 16 rows (padded), fp32: (row_ok, head, d, q)
    rows = tl.arange(0, 16)
    row_ok = rows < GROUP
    head = kvh * GROUP + rows
    d = tl.arange(0, D)
    q = tl.load(q_ptr + seq * HQ * D + head[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    return row_ok, head, d, q.to(tl.float32)


@triton.jit
def _q_halves(q, INT8: tl.constexpr):
    # q [16, D] as (a scale per row, hi, lo): int8 halves of 16-bit integers, or e4m3 hi and the rest x 16 (clear
    # of e4m3's subnormals: q = scale x (hi + lo / 16))
    if INT8:
        q_scale = tl.maximum(tl.max(tl.abs(q), 1), 1e-30) / 32512.0
        q_hi, q_lo = _i8_halves(_rint(q / q_scale[:, None]))
    else:
        q_scale = tl.maximum(tl.max(tl.abs(q), 1), 1e-30) / 448.0
        qs = q / q_scale[:, None]
        q_hi = qs.to(tl.float8e4nv)
        q_lo = ((qs - q_hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
    return q_scale, q_hi, q_lo


@triton.jit
def decode_split_kernel(out_ptr, q_ptr, k_ptr, v_ptr, vt_ptr, ks_ptr, vs_ptr, seq_lens_ptr, bt_ptr, stride_bt, qk_scale,
                        MODE: tl.constexpr, GROUP: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                        D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    # MODE 0 fp8k2, 1 fp8kvt, 2 fp8kvt2, 3 i8kvt2; keys the dots' tall side as decode_lab_kernel. K codes [NB, BS,
    # HKV, D]; V codes [NB, BS, HKV, D] (mode 0) or transposed per block [NB, HKV, D, BS] (modes 1-3)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    L = tl.load(seq_lens_ptr + seq)
    row_ok, head, d, q = _group_q(q_ptr, seq, kvh, GROUP, HQ, D)
    q_scale, q_hi, q_lo = _q_halves(q, MODE == 3)
    q_hi_t = tl.trans(q_hi)  # [D, 16]
    q_lo_t = tl.trans(q_lo)
    m_i = tl.full([16], float("-inf"), tl.float32)
    l_i = tl.zeros([16], tl.float32)
    acc = tl.zeros([D, 16], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, L, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < L
        block = _tile_blocks(bt_row, start, kpos, k_ok, BS, BLOCK_N)
        slot = (block * BS + kpos % BS) * HKV + kvh  # token-head index
        k = tl.load(k_ptr + slot[:, None] * D + d[None, :], mask=k_ok[:, None], other=0.0)  # [BLOCK_N, D]
        ks = tl.load(ks_ptr + slot, mask=k_ok, other=0.0)
        if MODE == 3:
            si = tl.dot(k, q_hi_t, out_dtype=tl.int32) * 256 + tl.dot(k, q_lo_t, out_dtype=tl.int32)
            s = si.to(tl.float32)
        elif MODE == 1:
            s = tl.dot(k, q_hi_t)
        else:
            s = tl.dot(k, q_hi_t, acc=tl.dot(k, q_lo_t) * 0.0625)
        s = s * ks[:, None] * q_scale[None, :] * qk_scale  # [BLOCK_N, 16]
        s = tl.where(k_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[None, :])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 0)
        vs = tl.load(vs_ptr + slot, mask=k_ok, other=0.0)
        if MODE == 0:
            vt = tl.load(v_ptr + slot[None, :] * D + d[:, None], mask=k_ok[None, :], other=0.0)  # [D, BLOCK_N]
            v_shift = 7 - _log2_floor(tl.maximum(tl.max(vs, 0), 1e-30))
            pv = p * vs[:, None] * _pow2(v_shift)
            part = tl.dot(vt.to(tl.float16), pv.to(tl.float16))
        else:
            vrow = (block * HKV + kvh) * (D * BS) + kpos % BS
            vt = tl.load(vt_ptr + vrow[None, :] + d[:, None] * BS, mask=k_ok[None, :], other=0.0)  # [D, BLOCK_N]
            if MODE == 3:
                v_shift = 13 - _log2_floor(tl.maximum(tl.max(vs, 0), 1e-30))  # p x scale below 2^14
                p_hi, p_lo = _i8_halves(_rint(p * vs[:, None] * _pow2(v_shift)))
                part = (tl.dot(vt, p_hi, out_dtype=tl.int32) * 256 + tl.dot(vt, p_lo, out_dtype=tl.int32)).to(tl.float32)
            else:
                v_shift = 7 - _log2_floor(tl.maximum(tl.max(vs, 0), 1e-30))
                pv = p * vs[:, None] * _pow2(v_shift)
                p_hi = pv.to(tl.float8e4nv)
                if MODE == 1:
                    part = tl.dot(vt, p_hi)
                else:
                    part = tl.dot(vt, p_hi, acc=tl.dot(vt, ((pv - p_hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)) * 0.0625)
        acc = acc * alpha[None, :] + part * _pow2(-v_shift)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[None, :]
    tl.store(out_ptr + seq * HQ * D + head[None, :] * D + d[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[None, :])


@triton.jit
def decode_rows_kernel(out_ptr, q_ptr, k_ptr, vt_ptr, ks_ptr, vs_ptr, seq_lens_ptr, bt_ptr, stride_bt, qk_scale,
                       INT8: tl.constexpr, GROUP: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                       D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    # fp8kvt2 / i8kvt2 with the group's q heads as the rows: scores [16, BLOCK_N], output [16, D]
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    L = tl.load(seq_lens_ptr + seq)
    row_ok, head, d, q = _group_q(q_ptr, seq, kvh, GROUP, HQ, D)
    q_scale, q_hi, q_lo = _q_halves(q, INT8)
    m_i = tl.full([16], float("-inf"), tl.float32)
    l_i = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, L, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < L
        block = _tile_blocks(bt_row, start, kpos, k_ok, BS, BLOCK_N)
        slot = (block * BS + kpos % BS) * HKV + kvh
        kt = tl.load(k_ptr + slot[None, :] * D + d[:, None], mask=k_ok[None, :], other=0.0)  # [D, BLOCK_N]
        ks = tl.load(ks_ptr + slot, mask=k_ok, other=0.0)
        if INT8:
            s = (tl.dot(q_hi, kt, out_dtype=tl.int32) * 256 + tl.dot(q_lo, kt, out_dtype=tl.int32)).to(tl.float32)
        else:
            s = tl.dot(q_hi, kt, acc=tl.dot(q_lo, kt) * 0.0625)
        s = s * ks[None, :] * q_scale[:, None] * qk_scale
        s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        vs = tl.load(vs_ptr + slot, mask=k_ok, other=0.0)
        vrow = (block * HKV + kvh) * (D * BS) + kpos % BS
        v = tl.load(vt_ptr + vrow[:, None] + d[None, :] * BS, mask=k_ok[:, None], other=0.0)  # [BLOCK_N, D]
        if INT8:
            v_shift = 13 - _log2_floor(tl.maximum(tl.max(vs, 0), 1e-30))
            p_hi, p_lo = _i8_halves(_rint(p * vs[None, :] * _pow2(v_shift)))
            part = (tl.dot(p_hi, v, out_dtype=tl.int32) * 256 + tl.dot(p_lo, v, out_dtype=tl.int32)).to(tl.float32)
        else:
            v_shift = 7 - _log2_floor(tl.maximum(tl.max(vs, 0), 1e-30))
            pv = p * vs[None, :] * _pow2(v_shift)
            p_hi = pv.to(tl.float8e4nv)
            part = tl.dot(p_hi, v, acc=tl.dot(((pv - p_hi.to(tl.float32)) * 16.0).to(tl.float8e4nv), v) * 0.0625)
        acc = acc * alpha[:, None] + part * _pow2(-v_shift)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + seq * HQ * D + head[:, None] * D + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def make_case(n_seqs: int, keys: int, device: str = "cuda", seed: int = 0) -> dict:
    """A paged cache holding `keys` tokens for each of `n_seqs` sequences (blocks shuffled), bf16 and fp8 forms."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nb_seq = -(-keys // BS)
    nb = n_seqs * nb_seq
    k = torch.randn(nb, BS, HKV, D, generator=g) * 1.5
    v = torch.randn(nb, BS, HKV, D, generator=g)
    kc = (torch.randn(nb, HKV, D, generator=g) * 0.5).to(torch.bfloat16)  # block centres (fp16dots+centres)
    vc = (torch.randn(nb, HKV, D, generator=g) * 0.5).to(torch.bfloat16)
    ks = k.abs().amax(-1) / E4M3_MAX
    vs = v.abs().amax(-1) / E4M3_MAX
    k8 = (k / ks[..., None]).to(torch.float8_e4m3fn)
    v8 = (v / vs[..., None]).to(torch.float8_e4m3fn)
    ksi = k.abs().amax(-1) / 127.0
    vsi = v.abs().amax(-1) / 127.0
    ki8 = torch.round(k / ksi[..., None]).clamp(-127, 127).to(torch.int8)
    vi8 = torch.round(v / vsi[..., None]).clamp(-127, 127).to(torch.int8)
    bt = torch.randperm(nb, generator=g).reshape(n_seqs, nb_seq).to(torch.int32)
    q = torch.randn(n_seqs, HQ, D, generator=g)
    to = lambda t: t.to(device)  # noqa: E731
    return {"q": to(q.to(torch.bfloat16)), "k": to(k.to(torch.bfloat16)), "v": to(v.to(torch.bfloat16)),
            "k8": to(k8), "v8": to(v8), "ks": to(ks.float()), "vs": to(vs.float()), "bt": to(bt),
            "lens": to(torch.full((n_seqs,), keys, dtype=torch.int32)), "keys": keys, "kc": to(kc), "vc": to(vc),
            "v8t": to(v8.permute(0, 2, 3, 1).contiguous()), "ki8": to(ki8), "vi8t": to(vi8.permute(0, 2, 3, 1).contiguous()),
            "ksi": to(ksi.float()), "vsi": to(vsi.float())}


def reference(c: dict, quantized: bool, centres: bool = False, int8: bool = False) -> torch.Tensor:
    """fp32 attention of every q head over its sequence's keys, the cache dequantized when `quantized` (each
    entry its block's centre + code x scale with `centres`)."""
    n = c["q"].shape[0]
    if int8:
        k = c["ki8"].float() * c["ksi"][..., None]
        v = c["vi8t"].permute(0, 3, 1, 2).float() * c["vsi"][..., None]
    elif quantized:
        k = c["k8"].float() * c["ks"][..., None]
        v = c["v8"].float() * c["vs"][..., None]
        if centres:
            k, v = k + c["kc"].float()[:, None], v + c["vc"].float()[:, None]
    else:
        k, v = c["k"].float(), c["v"].float()
    out = torch.empty(n, HQ, D, device=c["q"].device)
    for i in range(n):
        ki = k[c["bt"][i].long()].reshape(-1, HKV, D)[:c["keys"]]  # [L, HKV, D]
        vi = v[c["bt"][i].long()].reshape(-1, HKV, D)[:c["keys"]]
        qi = c["q"][i].float().reshape(HKV, HQ // HKV, D)
        s = torch.einsum("hgd,lhd->hgl", qi, ki) / D ** 0.5
        out[i] = torch.einsum("hgl,lhd->hgd", s.softmax(-1), vi).reshape(HQ, D)
    return out


def launch(c: dict, mode: str, out: torch.Tensor, block_n: int, warps: int, stages: int) -> None:
    if mode in ROW_MODES:
        i8 = mode.startswith("i8")
        k, vt, ks, vs = (c["ki8"], c["vi8t"], c["ksi"], c["vsi"]) if i8 else (c["k8"], c["v8t"], c["ks"], c["vs"])
        decode_rows_kernel[(c["q"].shape[0], HKV)](out, c["q"], k, vt, ks, vs, c["lens"], c["bt"], c["bt"].stride(0),
                                                   1.4426950408889634 / D ** 0.5, INT8=i8, GROUP=HQ // HKV, HQ=HQ,
                                                   HKV=HKV, D=D, BS=BS, BLOCK_N=block_n, num_warps=warps,
                                                   num_stages=stages)
        return
    if mode in SPLIT_MODES:
        m = SPLIT_MODES.index(mode)
        n = c["q"].shape[0]
        k, vt, ks, vs = (c["ki8"], c["vi8t"], c["ksi"], c["vsi"]) if mode == "i8kvt2" else (c["k8"], c["v8t"], c["ks"], c["vs"])
        decode_split_kernel[(n, HKV)](out, c["q"], k, c["v8"], vt, ks, vs, c["lens"], c["bt"], c["bt"].stride(0),
                                      1.4426950408889634 / D ** 0.5, MODE=m, GROUP=HQ // HKV, HQ=HQ, HKV=HKV, D=D,
                                      BS=BS, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        return
    m = MODES.index(mode)
    k, v = (c["k"], c["v"]) if m == 0 else (c["k8"], c["v8"])
    n = c["q"].shape[0]
    decode_lab_kernel[(n, HKV)](out, c["q"], k, v, c["ks"], c["vs"], c["kc"], c["vc"], c["lens"], c["bt"], c["bt"].stride(0),
                                1.4426950408889634 / D ** 0.5, MODE=m, GROUP=HQ // HKV, HQ=HQ, HKV=HKV, D=D, BS=BS,
                                BLOCK_N=block_n, WIDEN=os.environ.get("TRITON_INTERPRET") == "1",
                                num_warps=warps, num_stages=stages)


def main() -> None:
    global BS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="128x1024,64x4096")
    ap.add_argument("--configs", default="64x4x2,64x4x3,128x4x2,128x8x2")
    ap.add_argument("--modes", default=",".join(MODES + SPLIT_MODES + ROW_MODES))
    ap.add_argument("--block-size", type=int, default=BS, help="the cache's block size (a power of two)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    BS = a.block_size
    from llmc.codegen.autotune import gpu_time_ms
    rows = []
    for case in a.cases.split(","):
        n, keys = map(int, case.split("x"))
        c = make_case(n, keys)
        # each mode's reference: the bf16 cache, the codes with centres, or the codes alone (every other mode)
        plain, codes = reference(c, False), reference(c, True)
        refs = {m: plain if m == "bf16" else codes for m in MODES}
        refs["fp16dots+centres"] = reference(c, True, centres=True)
        refs.update({m: codes for m in SPLIT_MODES + ROW_MODES})
        refs["i8kvt2"] = refs["i8kvt2-rows"] = reference(c, True, int8=True)
        modes = a.modes.split(",")
        for mode in modes:
            for cfg in a.configs.split(","):
                bn, w, st = map(int, cfg.split("x"))
                out = torch.empty(n, HQ, D, dtype=torch.bfloat16, device="cuda")
                try:
                    launch(c, mode, out, bn, w, st)
                    torch.cuda.synchronize()
                    us = gpu_time_ms(lambda: launch(c, mode, out, bn, w, st)) * 1e3
                except Exception as e:  # a config a mode cannot compile
                    print(f"{case} {mode} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                ref = refs[mode]
                err = float((out.float() - ref).abs().max() / ref.abs().max())
                row = {"case": case, "mode": mode, "config": cfg, "us": round(us, 2), "rel_err": err,
                       "TBps": round(2 * n * keys * HKV * D * (2 if mode == "bf16" else 1) / (us * 1e-6) / 1e12, 3)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\ncase        mode       best config   us      x bf16   TB/s   max rel err")
    for case in a.cases.split(","):
        got = {m: min((r for r in rows if r["case"] == case and r["mode"] == m), key=lambda r: r["us"], default=None)
               for m in a.modes.split(",")}
        base = got["bf16"]["us"] if got.get("bf16") else None
        for m, r in got.items():
            if r:
                x = f"{r['us'] / base:.2f}" if base else "-"
                print(f"{case:11s} {m:10s} {r['config']:12s} {r['us']:7.1f} {x:>7s} {r['TBps']:6.2f}   {r['rel_err']:.2e}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "fp8_decode_lab.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
