"""A tall-tile int4 GEMV for batch-1 decode, swept on the Llama-3-8B linear shapes against the shipped
int4 kernels and bf16 cuBLAS: the weight streamed from HBM as a decode step does (quant_bench.py's CUDA-graph
replay over weight copies that overflow L2).

The shipped GEMV (`qgemv_int4`) spreads a tile's columns over a warp's threads, so every thread loads
the x values of its own columns for each of the few weight rows it holds: about one x load per code.
Here a tile is one scale group wide (16 words, 128 columns) and BLOCK_N rows tall, so a thread holds one
16-byte vector of each of many rows and loads its 32 x values once for all of them; the scale is one
load per row and group.

    PYTHONPATH=. python3 benchmarks/int4_gemv_lab.py --out DIR [--shapes qkv,o_proj,gate_up,down]
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

sys.path.insert(0, str(Path(__file__).parent))


@triton.jit
def _plane(src, P: tl.constexpr):
    # (code - 8) x 2^P for the nibble at bits P..P+3 (P <= 12): and-or into 2^23's exponent, one subtraction
    f = ((src & (15 << P)) | 0x4B000000).to(tl.float32, bitcast=True)
    return f - (8388608.0 + 8.0 * (1 << P))


@triton.jit
def _x(x_ptr, col, K, P: tl.constexpr):
    return tl.load(x_ptr + col, mask=col < K, other=0.0).to(tl.float32) * (1.0 / (1 << P))


@triton.jit
def _group(w, x_ptr, col, K):
    # the 8 planes of a [BLOCK_N, 16] word tile against x: word j, byte b holds columns c0 + b (low nibble)
    # and c0 + 64 + b (high); col = c0
    w_hi = w >> 16
    p = _plane(w, 0) * _x(x_ptr, col, K, 0)
    p = tl.fma(_plane(w, 4), _x(x_ptr, col + 64, K, 4), p)
    p = tl.fma(_plane(w, 8), _x(x_ptr, col + 1, K, 8), p)
    p = tl.fma(_plane(w, 12), _x(x_ptr, col + 65, K, 12), p)
    p = tl.fma(_plane(w_hi, 0), _x(x_ptr, col + 2, K, 0), p)
    p = tl.fma(_plane(w_hi, 4), _x(x_ptr, col + 66, K, 4), p)
    p = tl.fma(_plane(w_hi, 8), _x(x_ptr, col + 3, K, 8), p)
    p = tl.fma(_plane(w_hi, 12), _x(x_ptr, col + 67, K, 12), p)
    return p


@triton.jit
def gemv_tall(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, count_ptr,
              stride_wn, stride_sn, N, K, NG,
              SPLIT_K, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr):
    # y[N] = x[K] @ W.T, W int4 g128 in the prepared layout (run 64) read as int32 words [N, NG * 16]
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    ri = tl.arange(0, 16)
    per = tl.cdiv(NG, SPLIT_K)
    g_lo = pid_k * per
    g_hi = tl.minimum(g_lo + per, NG)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn + ri[None, :]
    s_rows = s_ptr + rn * stride_sn
    col0 = ri * 4
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    if PREFETCH:
        ok = rn < tl.where(g_lo < g_hi, N, 0)
        w = tl.load(w_rows + g_lo * 16, mask=ok[:, None], other=0)
        s = tl.load(s_rows + g_lo, mask=ok, other=0.0).to(tl.float32)
        for g in range(g_lo, g_hi):
            ok = rn < tl.where(g + 1 < g_hi, N, 0)
            w_next = tl.load(w_rows + (g + 1) * 16, mask=ok[:, None], other=0)
            s_next = tl.load(s_rows + g + 1, mask=ok, other=0.0).to(tl.float32)
            p = _group(w, x_ptr, g * 128 + col0, K)
            acc = tl.fma(p, s[:, None], acc)
            w = w_next
            s = s_next
    else:
        for g in range(g_lo, g_hi):
            w = tl.load(w_rows + g * 16, mask=n_ok[:, None], other=0)
            s = tl.load(s_rows + g, mask=n_ok, other=0.0).to(tl.float32)
            p = _group(w, x_ptr, g * 128 + col0, K)
            acc = tl.fma(p, s[:, None], acc)
    out = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(ws_ptr + pid_k * N + rn, out, mask=n_ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tot = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for sk in range(SPLIT_K):
                tot += tl.load(ws_ptr + sk * N + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + rn, tot.to(y_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def launch(x, p, y, cfg, counts):
    """y [1, N] = x [1, K] @ W.T with the tall-tile GEMV."""
    n, k = p.out_features, p.in_features
    w32 = p.qweight.view(torch.int32)
    ng = w32.shape[1] // 16
    split = cfg["SPLIT_K"]
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), split)
    ws = torch.empty((split, n) if split > 1 else (1,), device=x.device, dtype=torch.float32)
    gemv_tall[grid](x, w32, p.scales, y, ws, counts, w32.stride(0), p.scales.stride(0), n, k, ng, split,
                    BLOCK_N=cfg["BLOCK_N"], PREFETCH=cfg["PREFETCH"],
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def configs(n: int, ng: int) -> list[dict]:
    out = []
    for bn, warps, stages, pre in itertools.product((64, 128, 256), (4, 8), (1, 3), (0, 1)):
        if bn // (8 * warps) < 1:
            continue
        tiles = triton.cdiv(n, bn)
        for target in (264, 528, 1056):
            split = 1
            while tiles * split * 2 <= target and split * 2 <= ng:
                split *= 2
            out.append({"BLOCK_N": bn, "SPLIT_K": split, "PREFETCH": pre, "num_warps": warps, "num_stages": stages})
    return [dict(c) for c in dict.fromkeys(tuple(c.items()) for c in out)]


def check(device: str) -> None:
    """The kernel against the dequantized weight on a few ragged shapes (runs under TRITON_INTERPRET=1)."""
    from llmc.codegen import qmatmul as qm
    from llmc.ir.quant import QuantFormat, quantize_rtn
    fmt = QuantFormat("int", 4, 128)
    torch.manual_seed(0)
    for n, k in ((40, 256), (96, 384), (130, 512)):
        qw = quantize_rtn(torch.randn(n, k, device=device), fmt, torch.bfloat16)
        p = qm.prepare(fmt, qw.qweight, qw.scales, qw.zeros)
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        ref = x.float() @ p.dequantize().float().t()
        counts = torch.zeros(64, dtype=torch.int32, device=device)
        for cfg in ({"BLOCK_N": 32, "SPLIT_K": 1, "PREFETCH": 0, "num_warps": 2, "num_stages": 1},
                    {"BLOCK_N": 64, "SPLIT_K": 2, "PREFETCH": 1, "num_warps": 4, "num_stages": 1}):
            y = torch.empty(1, n, device=device, dtype=torch.bfloat16)
            launch(x, p, y, cfg, counts)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (n, k, cfg, err)
    print("check: ok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--check", action="store_true", help="only the correctness check")
    a = ap.parse_args()
    if a.check:
        check("cpu")
        return
    from llmc.codegen import qmatmul as qm
    from llmc.codegen.kernels import tile_counters
    from llmc.ir.quant import QuantFormat, quantize_rtn
    from quant_bench import HBM_BYTES_PER_S, SHAPES, copies_for, graph_time_us
    check("cuda")
    fmt, rows = QuantFormat("int", 4, 128), []
    counts = tile_counters(torch.device("cuda"), 1 << 16)
    for shape in a.shapes.split(","):
        n, k = SHAPES[shape]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        qw = quantize_rtn(w, fmt, torch.bfloat16)
        p = qm.prepare(fmt, qw.qweight, qw.scales, qw.zeros)
        nc = copies_for(p.nbytes, False)
        ps = [p] + [qm.PreparedQWeight(p.fmt, p.qweight.clone(), p.scales.clone(), None, p.in_features, p.run)
                    for _ in range(nc - 1)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ p.dequantize().float().t()
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)

        def record(kind, cfg, calls, nbytes):
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            us = graph_time_us(calls, a.reps)
            rows.append({"shape": shape, "kind": kind, "cfg": cfg, "us": us, "err": err,
                         "hbm": nbytes / (us * 1e-6) / HBM_BYTES_PER_S})

        ws = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2, False) - 1)]
        torch.mm(x, w.t(), out=y)
        record("bf16-cublas", None, [lambda wi=wi: torch.mm(x, wi.t(), out=y) for wi in ws], w.numel() * 2)
        del ws
        shipped = [("tc", c) for c in qm.candidates("1", n, p.padded_k, p.pack)]
        shipped += [("gemv", c) for c in qm.gemv_candidates(n, p.padded_k)]
        for kind, cfg in shipped:
            qm.qlinear(x, p, config=cfg, out=y)
            record(kind, cfg, [lambda pi=pi, cfg=cfg: qm.qlinear(x, pi, config=cfg, out=y) for pi in ps], p.nbytes)
        for cfg in configs(n, p.padded_k // 128):
            try:
                launch(x, p, y, cfg, counts)
                record("tall", cfg, [lambda pi=pi, cfg=cfg: launch(x, pi, y, cfg, counts) for pi in ps], p.nbytes)
            except Exception as e:  # a config that does not compile (registers, shared memory)
                rows.append({"shape": shape, "kind": "tall", "cfg": cfg, "error": str(e)[:200]})
        del ps
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "int4_gemv_lab.json").write_text(json.dumps(rows, indent=1))
    print(f"{'shape':8} {'kind':12} {'us':>8} {'HBM':>6} {'err':>8}  config")
    for shape in a.shapes.split(","):
        sub = [r for r in rows if r["shape"] == shape and "us" in r]
        best = {}
        for r in sub:
            if r["kind"] not in best or r["us"] < best[r["kind"]]["us"]:
                best[r["kind"]] = r
        for r in sorted(best.values(), key=lambda r: r["us"]):
            print(f"{shape:8} {r['kind']:12} {r['us']:8.1f} {r['hbm']:6.1%} {r['err']:8.1e}  {r['cfg']}")
        tall = sorted((r for r in sub if r["kind"] == "tall"), key=lambda r: r["us"])[:6]
        for r in tall:
            print(f"{'':8} {'  tall':12} {r['us']:8.1f} {r['hbm']:6.1%} {r['err']:8.1e}  {r['cfg']}")


if __name__ == "__main__":
    main()
