"""Variants of the paged prefill attention kernel (bf16 cache, causal, no window) timed against the shipped
kernel and torch's SDPA on the cases of attention_bench.py, each variant one switch on a copy of the
rendered kernel, so that what a switch is worth is measured before the template takes it:

- FOLD: the scores stay unscaled; the row max is scaled once and exp2 takes `s * qk_scale - m` (one FMA).
- KROW: K loaded [BLOCK_N, D] (rows contiguous in the cache, as V) and transposed for the dot.
- NOSAFE: key tiles every row sees skip the guard for rows with no key yet (none there can have none).
- PAGES: the block table read once per cache block of the key tile, not once per key.

    PYTHONPATH=. python3 benchmarks/prefill_attention_lab.py --out DIR [--shape 8b]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.append(str(Path(__file__).resolve().parent.parent))


@triton.jit
def _tile(q, m_i, l_i, acc, cache_ptr, bt_row, start, hi, qpos, kvh, d,
          stride_c0, stride_c1, stride_c2, stride_c3, stride_c4, stride_bt1, qk_scale,
          MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
          FOLD: tl.constexpr, KROW: tl.constexpr, NOSAFE: tl.constexpr, PAGES: tl.constexpr):
    kpos = start + tl.arange(0, BLOCK_N)
    k_ok = kpos < hi
    if PAGES:
        pg = start // BLOCK_SIZE + tl.arange(0, BLOCK_N // BLOCK_SIZE)
        blk = tl.load(bt_row + pg * stride_bt1, mask=pg * BLOCK_SIZE < hi, other=0).to(tl.int64)
        slot2 = blk[:, None] * stride_c1 + tl.arange(0, BLOCK_SIZE)[None, :] * stride_c2 + kvh * stride_c3
        slot = tl.reshape(slot2, (BLOCK_N,))
    else:
        if MASKED:
            block = tl.load(bt_row + (kpos // BLOCK_SIZE) * stride_bt1, mask=k_ok, other=0).to(tl.int64)
        else:
            block = tl.load(bt_row + (kpos // BLOCK_SIZE) * stride_bt1).to(tl.int64)
        slot = block * stride_c1 + (kpos % BLOCK_SIZE) * stride_c2 + kvh * stride_c3
    if MASKED:
        if KROW:
            k = tl.trans(tl.load(cache_ptr + slot[:, None] + d[None, :] * stride_c4, mask=k_ok[:, None], other=0.0))
        else:
            k = tl.load(cache_ptr + slot[None, :] + d[:, None] * stride_c4, mask=k_ok[None, :], other=0.0)
        v = tl.load(cache_ptr + stride_c0 + slot[:, None] + d[None, :] * stride_c4, mask=k_ok[:, None], other=0.0)
    else:
        if KROW:
            k = tl.trans(tl.load(cache_ptr + slot[:, None] + d[None, :] * stride_c4))
        else:
            k = tl.load(cache_ptr + slot[None, :] + d[:, None] * stride_c4)
        v = tl.load(cache_ptr + stride_c0 + slot[:, None] + d[None, :] * stride_c4)
    s = tl.dot(q, k)
    if not FOLD:
        s = s * qk_scale
    if MASKED:
        s = tl.where(k_ok[None, :] & (kpos[None, :] <= qpos[:, None]), s, float("-inf"))
    if FOLD:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    if NOSAFE and not MASKED:
        m_safe = m_new
    else:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if FOLD:
        p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    else:
        p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def prefill_lab(out_ptr, q_ptr, cache_ptr, qsl_ptr, seq_lens_ptr, block_tables_ptr,
                stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
                stride_c0, stride_c1, stride_c2, stride_c3, stride_c4, stride_bt0, stride_bt1, qk_scale,
                HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
                FOLD: tl.constexpr, KROW: tl.constexpr, NOSAFE: tl.constexpr, PAGES: tl.constexpr):
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    tile = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= n:
        return
    L = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < n
    qpos = L - n + tok
    d = tl.arange(0, HEAD_DIM)
    t = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    first_pos = L - n + tile * BLOCK_Q
    hi = tl.minimum(first_pos + BLOCK_Q, L)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt0
    seen_by_all = tl.minimum(first_pos + 1, hi) // BLOCK_N * BLOCK_N
    for start in range(0, seen_by_all, BLOCK_N):
        m_i, l_i, acc = _tile(q, m_i, l_i, acc, cache_ptr, bt_row, start, hi, qpos, kvh, d,
                              stride_c0, stride_c1, stride_c2, stride_c3, stride_c4, stride_bt1, qk_scale,
                              False, BLOCK_N, BLOCK_SIZE, FOLD, KROW, NOSAFE, PAGES)
    for start in range(seen_by_all, hi, BLOCK_N):
        m_i, l_i, acc = _tile(q, m_i, l_i, acc, cache_ptr, bt_row, start, hi, qpos, kvh, d,
                              stride_c0, stride_c1, stride_c2, stride_c3, stride_c4, stride_bt1, qk_scale,
                              True, BLOCK_N, BLOCK_SIZE, FOLD, KROW, NOSAFE, PAGES)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def launch(q, kv, qsl, lens, tables, out, scale, max_q, tiles, flags):
    T, Hq, D = q.shape
    Hkv, BS = kv.shape[3], kv.shape[2]
    group = Hq // Hkv
    bq = tiles["BLOCK_M"] // group
    grid = (Hkv, lens.shape[0], triton.cdiv(max_q, bq))
    prefill_lab[grid](out, q, kv, qsl, lens, tables, *q.stride(), *out.stride(), *kv.stride(), *tables.stride(),
                      scale * 1.4426950408889634, HEAD_DIM=D, GROUP=group, BLOCK_M=tiles["BLOCK_M"],
                      BLOCK_N=tiles["BLOCK_N"], BLOCK_SIZE=BS, BLOCK_Q=bq, **flags,
                      num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--check", action="store_true", help="tiny shapes against the shipped kernel (interpreter too)")
    a = ap.parse_args()
    from llmc.codegen.attention import paged_attention
    from llmc.compiler import _attention_step
    names = ("FOLD", "KROW", "NOSAFE", "PAGES")
    variants = [dict(zip(names, bits)) for bits in itertools.product((0, 1), repeat=4)]
    if a.check:
        torch.manual_seed(0)
        for new, ctx in (([40], [40]), ([17, 1, 33], [50, 20, 33])):
            Hq, Hkv, D = 8, 2, 32
            per = max(-(-c // 16) for c in ctx)
            kv = torch.randn(2, len(new) * per + 1, 16, Hkv, D).to(torch.bfloat16)
            tables = torch.randperm(len(new) * per).to(torch.int32).view(len(new), per)
            qsl = torch.tensor([0, *itertools.accumulate(new)], dtype=torch.int32)
            lens = torch.tensor(ctx, dtype=torch.int32)
            q = torch.randn(sum(new), Hq, D).to(torch.bfloat16)
            want = paged_attention(q, kv, qsl, lens, tables, D ** -0.5, max_seqlen_q=max(new), max_seqlen_k=max(ctx))
            for flags in variants:  # fp32 operands: the interpreter's dot of bf16 is not the GPU's
                out = torch.empty(q.shape)
                launch(q.float(), kv.float(), qsl, lens, tables, out, D ** -0.5, max(new),
                       dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1), flags)
                err = (out - want.float()).abs().max().item()
                assert err < 2e-2, (new, flags, err)
        print("check: ok")
        return
    Hq, Hkv, D = {"8b": (32, 8, 128), "1b": (32, 8, 64)}[a.shape]
    cases = {"fresh 2048": ([2048], [2048]), "4 chunks of 512 over 1024": ([512] * 4, [1024] * 4),
             "mixed: 32 decodes + 2 x 512 over 1024": ([1] * 32 + [512, 512], [1024] * 34)}
    tiles_list = [dict(BLOCK_M=64, BLOCK_N=64, num_stages=2, num_warps=4),
                  dict(BLOCK_M=128, BLOCK_N=64, num_stages=3, num_warps=8),
                  dict(BLOCK_M=128, BLOCK_N=128, num_stages=2, num_warps=8)]
    from llmc.codegen.autotune import gpu_time_ms
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (new, ctx) in cases.items():
        q, kv, _, qsl, lens, tables, out = _attention_step(g, new, ctx, Hq, Hkv, D, torch.bfloat16)
        flops = 4 * D * Hq * sum(sum(c - n + i + 1 for i in range(n)) for n, c in zip(new, ctx))
        for tiles in tiles_list:
            paged_attention(q, kv, qsl, lens, tables, D ** -0.5, max_seqlen_q=max(new), max_seqlen_k=max(ctx),
                            out=out, prefill_tiles=tiles)
            want = out.clone()
            us = gpu_time_ms(lambda: paged_attention(q, kv, qsl, lens, tables, D ** -0.5, max_seqlen_q=max(new),
                                                     max_seqlen_k=max(ctx), out=out, prefill_tiles=tiles)) * 1e3
            rows.append(dict(case=name, tiles=tiles, variant="shipped", us=us, tflops=flops / us / 1e6, err=0.0))
            for flags in variants:
                try:
                    run = lambda: launch(q, kv, qsl, lens, tables, out, D ** -0.5, max(new), tiles, flags)  # noqa
                    run()
                    err = float((out.float() - want.float()).abs().max())
                    us = gpu_time_ms(run) * 1e3
                    rows.append(dict(case=name, tiles=tiles, variant=flags, us=us, tflops=flops / us / 1e6, err=err))
                except Exception as e:  # noqa: BLE001 (a variant that does not compile is a result too)
                    rows.append(dict(case=name, tiles=tiles, variant=flags, error=str(e)[:300]))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"prefill_lab_{a.shape}.json").write_text(json.dumps(rows, indent=1))
    for name in cases:
        for tiles in tiles_list:
            sub = sorted((r for r in rows if r["case"] == name and r["tiles"] == tiles and "us" in r),
                         key=lambda r: r["us"])
            ship = next(r for r in sub if r["variant"] == "shipped")
            tl_ = f"m{tiles['BLOCK_M']}/n{tiles['BLOCK_N']}/s{tiles['num_stages']}/w{tiles['num_warps']}"
            print(f"{name:40s} {tl_:16s} shipped {ship['us']:7.1f} us ({ship['tflops']:.0f} TFLOP/s)")
            for r in sub[:4] + [r for r in sub if r["variant"] == dict.fromkeys(names, 0)]:
                if r["variant"] != "shipped":
                    on = "+".join(k for k, v in r["variant"].items() if v) or "none"
                    print(f"{'':57s} {on:24s} {r['us']:7.1f} us x{ship['us'] / r['us']:.3f} err {r['err']:.4f}")
        errs = [r for r in rows if r["case"] == name and "error" in r]
        if errs:
            print(f"{name}: {len(errs)} variants failed, e.g. {errs[0]['variant']}: {errs[0]['error'][:120]}")


if __name__ == "__main__":
    main()
