"""Check llmc's attention kernels on a CUDA GPU at realistic sizes: errors and times vs torch.

    python scripts/gpu_check_attention.py [--quick]

For each case it prints the largest error of the Triton kernels and of a torch baseline (gather
K/V through the block tables, then `scaled_dot_product_attention`), both against an fp32 SDPA on the
same cached K/V, and the time of each (triton.testing.do_bench, ms). Small cases are also checked
against the golden model `paged_attention_ref` (float and int8 caches). Needs only torch + triton.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from llmc.codegen.attention import mixed_rows, paged_attention, rope_kv_write  # noqa: E402
from llmc.ir.ops import _rope_ref  # noqa: E402
from llmc.ir.paged_attention import QMAX, _to_q, _write, paged_attention_ref, scale_width  # noqa: E402

DEV = "cuda"


def make_batch(ctx, new, Hq, Hkv, D, BS, dtype, seed=0):
    """Ragged batch with shuffled block tables; the cache already holds every sequence's context."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    per_seq = [-(-c // BS) for c in ctx]
    NB = sum(per_seq) + 8
    perm = torch.randperm(NB, device=DEV, generator=g).to(torch.int32)
    bt = torch.zeros(len(ctx), max(per_seq), dtype=torch.int32, device=DEV)
    i0 = 0
    for i, nb in enumerate(per_seq):
        bt[i, :nb] = perm[i0:i0 + nb]
        i0 += nb
    T = sum(new)
    cache = torch.randn(2, NB, BS, Hkv, D, device=DEV, generator=g).to(dtype)
    return dict(q=torch.randn(T, Hq, D, device=DEV, generator=g).to(dtype), cache=cache,
                qsl=torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=DEV),
                seq_lens=torch.tensor(ctx, dtype=torch.int32, device=DEV), bt=bt, ctx=ctx, new=new)


def torch_attention(b, scale, window=0, dtype=None):
    """Baseline: per sequence, gather K/V from the blocks and run SDPA (GQA) with an explicit mask."""
    q, cache, bt = b["q"], b["cache"], b["bt"]
    dtype = dtype or q.dtype
    BS, Hkv = cache.shape[2], cache.shape[3]
    out = torch.empty(q.shape, dtype=dtype, device=DEV)
    s = 0
    for i, (L, n) in enumerate(zip(b["ctx"], b["new"])):
        blocks = bt[i, : -(-L // BS)].long()
        K = cache[0, blocks].reshape(-1, Hkv, cache.shape[-1])[:L].to(dtype).transpose(0, 1)[None]  # [1, Hkv, L, D]
        V = cache[1, blocks].reshape(-1, Hkv, cache.shape[-1])[:L].to(dtype).transpose(0, 1)[None]
        qpos = torch.arange(L - n, L, device=DEV)[:, None]
        kpos = torch.arange(L, device=DEV)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(q[s:s + n].to(dtype).transpose(0, 1)[None], K, V, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[s:s + n] = o[0].transpose(0, 1)
        s += n
    return out


def bench(fn):
    """ms per call, host launch overhead included (what an eager runtime pays)."""
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def bench_graph(fn):
    """ms per call replayed from a CUDA graph: the GPU time alone (how the runtime runs decode)."""
    with torch.cuda.stream(torch.cuda.Stream()):
        return triton.testing.do_bench_cudagraph(fn, rep=50)


def attention_case(name, ctx, new, Hq, Hkv, D, BS, dtype, window=0, timing=True, decode_rows=0):
    b = make_batch(ctx, new, Hq, Hkv, D, BS, dtype)
    scale = D ** -0.5
    kw = dict(window=window, max_seqlen_q=max(new), max_seqlen_k=max(ctx), decode_rows=decode_rows, context_limit=4096)
    run = lambda: paged_attention(b["q"], b["cache"], b["qsl"], b["seq_lens"], b["bt"], scale, **kw)  # noqa: E731
    out = run()
    truth = torch_attention(b, scale, window, torch.float32)
    base = torch_attention(b, scale, window)
    err = (out.float() - truth).abs().max().item()
    err_base = (base.float() - truth).abs().max().item()
    t_k = bench(run) if timing else float("nan")
    t_g = bench_graph(run) if timing else float("nan")
    t_t = bench(lambda: torch_attention(b, scale, window)) if timing else float("nan")
    kv_bytes = sum(2 * L * Hkv * D * b["cache"].element_size() for L in ctx)
    gbs = kv_bytes / (t_g * 1e-3) / 1e9
    tol = 2e-2 if dtype != torch.float32 else 1e-3
    ok = err <= max(tol, 2 * err_base)
    print(f"{name:<34} {str(dtype)[6:]:>8} D={D:<4} {err:9.2e} {err_base:9.2e} {t_k:9.3f} {t_g:9.3f} {t_t:9.3f} {gbs:8.0f}  "
          f"{'ok' if ok else 'FAIL'}")
    return ok


def packed_case(name, ctx, new, Hq, Hkv, D, BS, dtype, decode_rows, tokens, seqs):
    """A mixed step launched as a whole-step graph launches it (`rows`: padded to `tokens` tokens and `seqs`
    sequences, the prefill kernel on its packed grid) against the eager step's two launches: the same bits; ms
    per call of each in a CUDA graph."""
    b = make_batch(ctx, new, Hq, Hkv, D, BS, dtype)
    scale, T, N = D ** -0.5, b["q"].shape[0], len(ctx)
    kw = dict(max_seqlen_k=max(ctx), context_limit=4096)
    eager = lambda: paged_attention(b["q"], b["cache"], b["qsl"], b["seq_lens"], b["bt"], scale,  # noqa: E731
                                    max_seqlen_q=max(new), decode_rows=decode_rows, **kw)
    qsl = torch.cat([b["qsl"], torch.full((seqs - N,), T, dtype=torch.int32, device=DEV)])
    rows = tuple(torch.from_numpy(a.copy()).to(DEV) for a in mixed_rows(qsl.cpu().numpy(), decode_rows))
    bt = torch.cat([b["bt"], torch.zeros(seqs - N, b["bt"].shape[1], dtype=torch.int32, device=DEV)])
    lens = torch.cat([b["seq_lens"], torch.ones(seqs - N, dtype=torch.int32, device=DEV)])
    q = torch.cat([b["q"], torch.zeros(tokens - T, Hq, D, dtype=dtype, device=DEV)])
    packed = lambda: paged_attention(q, b["cache"], qsl, lens, bt, scale, max_seqlen_q=tokens, rows=rows,  # noqa: E731
                                     **kw)
    same = torch.equal(packed()[:T], eager())
    t_e, t_p = bench_graph(eager), bench_graph(packed)
    print(f"{name:<34} {str(dtype)[6:]:>8} D={D:<4} same bits: {same}  two launches {t_e:8.4f} ms, packed "
          f"{t_p:8.4f} ms  {'ok' if same else 'FAIL'}")
    return same


def golden_case(name, ctx, new, Hq, Hkv, D, BS, dtype, kv_dtype, window=0, decode_rows=0, decode_tiles=None):
    """Kernels vs paged_attention_ref, including the write (rope_kv_write) and int8 caches."""
    b = make_batch(ctx, new, Hq, Hkv, D, BS, dtype)
    T = b["q"].shape[0]
    k = torch.randn(T, Hkv, D, device=DEV).to(dtype)
    v = torch.randn(T, Hkv, D, device=DEV).to(dtype)
    ang = torch.rand(T, D // 2, device=DEV) * 100
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    slots = torch.cat([b["bt"][i, torch.arange(L - n, L, device=DEV) // BS].long() * BS
                       + torch.arange(L - n, L, device=DEV) % BS for i, (L, n) in enumerate(zip(ctx, new))])
    quant = kv_dtype in QMAX
    scale_t = None
    if quant:  # an earlier state: random centres, positive per-token scales, garbage codes
        scale_t = torch.randn(b["cache"].shape[1], Hkv, scale_width(D, BS), device=DEV)
        scale_t[..., 2 * D:] = scale_t[..., 2 * D:].abs() * 0.02 + 0.01
        scale_t = scale_t.to(dtype)  # kv_scale holds the model's dtype
    cache0 = _to_q(b["cache"].float() / 0.02, kv_dtype, QMAX[kv_dtype]) if quant else b["cache"]
    ref_cache, ref_scale = cache0.clone(), scale_t.clone() if quant else None
    # rope in fp32 like the kernel: in bf16 the reference's own three roundings dominate the comparison
    rope = lambda x: _rope_ref((x.float(), cos[:, None].float(), sin[:, None].float()), {}, None).to(dtype)  # noqa: E731
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    x = [t(rope(b["q"])), t(rope(k)), t(v), ref_cache, b["qsl"], b["seq_lens"], b["bt"], slots]
    ref = paged_attention_ref(x + ([ref_scale] if quant else []), dict(scale=D ** -0.5, causal=True, window=window),
                              None)[0].transpose(0, 1)
    cache, sc = cache0.clone(), scale_t.clone() if quant else None
    q_roped = rope_kv_write(b["q"], k, v, cos, sin, cache, slots, kv_scale=sc)
    out = paged_attention(q_roped, cache, b["qsl"], b["seq_lens"], b["bt"], D ** -0.5, window=window, kv_scale=sc,
                          max_seqlen_q=max(new), max_seqlen_k=max(ctx), decode_rows=decode_rows,
                          decode_tiles=decode_tiles)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()  # relative to the largest
    cache_err = (cache.float() - ref_cache.float()).abs().max().item()
    # quantized: K/V are dequantized into q's dtype for the tensor-core dot, one more bf16 rounding
    tol = 1e-4 if dtype == torch.float32 else 2e-2 if quant and dtype == torch.bfloat16 else 1e-2
    cache_tol = 1.0 if kv_dtype == torch.int8 else 32.0 if quant else tol * 8  # quantized: one step, in q units
    ok = err <= tol and cache_err <= cache_tol
    print(f"{name:<34} {str(dtype)[6:]:>8} {str(kv_dtype)[6:]:>8} D={D:<4} out(rel) {err:9.2e} cache {cache_err:9.2e}  "
          f"{'ok' if ok else 'FAIL'}")
    return ok


def rope_case(T, Hq, Hkv, D, BS, dtype):
    NB = -(-T // BS) + 4
    qkv = torch.randn(T, Hq + 2 * Hkv, D, device=DEV).to(dtype)
    q, k, v = qkv.split([Hq, Hkv, Hkv], dim=1)
    pos = torch.arange(T, device=DEV).float()
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, device=DEV).float() / D)
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    cache = torch.zeros(2, NB, BS, Hkv, D, device=DEV, dtype=dtype)
    slots = torch.randperm(NB * BS, device=DEV)[:T]
    ref_cache = cache.clone()
    rope = lambda x: _rope_ref((x, cos[:, None], sin[:, None]), {}, None)  # noqa: E731

    def torch_version():
        qr = rope(q)
        _write(ref_cache, None, 0, rope(k), slots)
        _write(ref_cache, None, 1, v, slots)
        return qr

    q_ref = torch_version()
    run = lambda: rope_kv_write(q, k, v, cos, sin, cache, slots)  # noqa: E731
    # relative to the largest value: the torch reference ropes in bf16/fp16 (three roundings), the kernel in fp32
    rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()  # noqa: E731
    err = max(rel(run(), q_ref), rel(cache, ref_cache))
    t_k, t_g, t_t = bench(run), bench_graph(run), bench(torch_version)
    nbytes = T * ((2 * Hq + 4 * Hkv) * D + 2 * D) * q.element_size()  # q, k, v, cos, sin in; q, cache out
    print(f"{'rope_kv_write T=' + str(T):<34} {str(dtype)[6:]:>8} D={D:<4} {err:9.2e} {'':>9} {t_k:9.3f} {t_g:9.3f} "
          f"{t_t:9.3f} {nbytes / (t_g * 1e-3) / 1e9:8.0f}  {'ok' if err < 1e-2 else 'FAIL'}")
    return err < 1e-2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    ap.add_argument("--golden-only", action="store_true", help="only the cases against the golden model (no timings)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    g = torch.Generator().manual_seed(0)
    rand = lambda lo, hi, n: torch.randint(lo, hi + 1, (n,), generator=g).tolist()  # noqa: E731
    oks = []
    print("\n-- golden model (paged_attention_ref), rope_kv_write + paged_attention")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        oks.append(golden_case("prefill+prefix, GQA 4", [37, 1, 130], [5, 1, 130], 8, 2, 80, 16, dtype, dtype))
        oks.append(golden_case("decode, window 64", [300, 7, 1000], [1, 1, 1], 8, 2, 64, 16, dtype, dtype, window=64))
    for kv_dtype in (torch.int8, torch.float8_e4m3fn):
        for new in ([5, 1, 130], [1, 1, 1]):
            oks.append(golden_case(f"{str(kv_dtype)[6:]} cache n={new}", [37, 1, 130], new, 8, 2, 128, 16,
                                   torch.bfloat16, kv_dtype))
        # decode over the quantized cache in an fp16 model (its codes in fp16 dots, a centre read per key) and
        # through a window that starts inside a block (bf16: the key tiles aligned down, keys before it masked)
        for dtype in (torch.float16, torch.bfloat16):
            oks.append(golden_case(f"{str(kv_dtype)[6:]} decode, window 64", [300, 7, 1000], [1, 1, 1], 8, 2, 64, 16,
                                   dtype, kv_dtype, window=64))
        # key tiles inside one block (the tile divides the block): the centres as rank-1 terms
        for dtype in (torch.float16, torch.bfloat16):
            for BS, n in ((16, 16), (64, 32)):
                oks.append(golden_case(f"{str(kv_dtype)[6:]} decode, {n}-key tiles in {BS}", [300, 7, 1000], [1, 1, 1],
                                       32, 8, 128, BS, dtype, kv_dtype, window=64 if BS == 16 else 0,
                                       decode_tiles=dict(BLOCK_N=n, num_stages=3, num_warps=4)))
    # a mixed step's leading decodes on the decode kernel, the prompt rows on the prefill kernel
    for dtype, kv_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                            (torch.bfloat16, torch.int8), (torch.bfloat16, torch.float8_e4m3fn)):
        oks.append(golden_case(f"mixed, decodes split, {str(kv_dtype)[6:]}", [300, 1, 37, 130], [1, 1, 5, 130], 8, 2,
                               128, 16, dtype, kv_dtype, decode_rows=2))

    Hq, Hkv, BS = 32, 8, 16
    heads = () if args.golden_only else ("64", "128") if not args.quick else ("128",)
    if heads:
        print(f"\n-- Hq={Hq} Hkv={Hkv} block={BS}; max abs errors vs fp32 SDPA (rope: relative); ms per call: triton "
              f"eager (host launch included), triton in a CUDA graph, torch eager; GB/s = KV (rope: all) bytes / graph "
              f"time")
        print(f"{'case':<34} {'dtype':>8} {'':6} {'err':>9} {'err_sdpa':>9} {'triton':>9} {'graph':>9} {'torch':>9} "
              f"{'GB/s':>8}")
    for D in map(int, heads):
        for dtype in (torch.float16, torch.bfloat16):
            oks.append(rope_case(4096, Hq, Hkv, D, BS, dtype))
            for B, ctx in ((1, [4096]), (8, rand(1, 4096, 8)), (64, rand(256, 2048, 64))):
                oks.append(attention_case(f"decode B={B} ctx<={max(ctx)}", ctx, [1] * B, Hq, Hkv, D, BS, dtype))
            oks.append(attention_case("decode B=16 window 1024", rand(512, 4096, 16), [1] * 16, Hq, Hkv, D, BS,
                                      dtype, window=1024))
            oks.append(attention_case("prefill 1 x 2048", [2048], [2048], Hq, Hkv, D, BS, dtype))
            ctx = rand(256, 4096, 4)
            new = [min(c, n) for c, n in zip(ctx, rand(64, 1024, 4))]
            oks.append(attention_case("prefill 4 ragged, cached prefix", ctx, new, Hq, Hkv, D, BS, dtype))
            oks.append(attention_case("prefill 2 x 2048 window 512", [2048, 2048], [2048, 1024], Hq, Hkv, D, BS,
                                      dtype, window=512))
            ctx = rand(128, 1536, 32) + [1024, 1024]
            for split in (0, 32):
                oks.append(attention_case(f"mixed 32 + 2 x 512{', decodes split' if split else ''}", ctx,
                                          [1] * 32 + [512, 512], Hq, Hkv, D, BS, dtype, decode_rows=split))
            # as a whole-step mixed graph launches them: 128 decodes beside one chunk, beside five
            ctx = rand(128, 1536, 128)
            oks.append(packed_case("packed: 128 + 1 x 300 in 512 / 160", ctx + [700], [1] * 128 + [300], Hq, Hkv, D,
                                   BS, dtype, 128, 512, 160))
            oks.append(packed_case("packed: 120 + 5 chunks in 1024 / 128", ctx[:120] + [900, 64, 300, 200, 513],
                                   [1] * 120 + [200, 64, 100, 150, 300], Hq, Hkv, D, BS, dtype, 120, 1024, 128))
        if not args.quick:
            oks.append(attention_case("prefill fp32 1 x 512", [512], [512], Hq, Hkv, D, BS, torch.float32))
            oks.append(attention_case("decode fp32 B=4", rand(1, 2048, 4), [1] * 4, Hq, Hkv, D, BS, torch.float32))
    print(f"\n{sum(oks)}/{len(oks)} ok")
    sys.exit(0 if all(oks) else 1)


if __name__ == "__main__":
    main()
