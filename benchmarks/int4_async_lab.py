"""A lab (not a product kernel): can the int4 g128 decode GEMM keep its wgmma chain in flight?

The shipped qlinear kernel (SWAP_AB, batch 1-64) dots each scale group's two nibble planes into a partial and
adds `partial x scale` to its accumulator. That use of the dot's result inside the loop makes Triton wait for
every wgmma right after issuing it (its pipeliner keeps a dot in flight only where the result feeds nothing
but the next dot's accumulator), so each pack tile runs shared load, unpack, wgmma, wait in sequence (RESULTS.md,
the int4 kernel under Nsight Compute). Folding the scale into the unpacked weight with a separate bf16 multiply
(measured 2026-12-01) added an instruction per pair and was slower.

Here the scale goes into the unpack's own FMA: (MAGIC + q) * s - MAGIC * s rounds q * s once (MAGIC * s is
exact: MAGIC is a power of two), in the instructions the shipped unpack already issues. The zero point 8 comes
back as a rank-1 term, 8 * s[n, g] * sum of x over the group, accumulated beside the dot. The accumulator then
only feeds the next dot, so the dots can stay in flight. The weight enters the dot rounded to bf16 (q * s has
up to 12 significant bits), as in the dequantize-then-cuBLAS path the larger buckets use.

    python3 benchmarks/int4_async_lab.py [--shapes gate_up,down,qkv,o_proj] [--ms 1,16] [--out DIR]
    python3 benchmarks/int4_async_lab.py --ttgir [product,]FOLD,BLOCK_N,PACKS,SPLIT_K,WARPS,STAGES
        # compile only (sm_90, no GPU needed): the loop's dots and waits

Every row: one call streamed from HBM (copies of the weight that overflow L2, CUDA-graph replays), the largest
error against the fp32 reference relative to its largest value. "shipped" rows run llmc's qlinear over its
candidate configs for the bucket, each the best of its kind; with --lab, "lab" rows this file's kernel in both
forms (fold 0: the shipped formulation, fold 1: the scale in the unpack) over a small sweep.

The template once took this as FOLD configs (the scale in the unpack by one more packed multiply per pair, each
weight rounded once, no rank-1 term; each plane and pack tile its own accumulator). With it Triton 3.6 kept the
wgmmas in flight (--ttgir: waits with 7 or 15 pending instead of 0), yet every linear ran 1.2-1.3x slower on an
H100 and the tuned 8B decode did not gain (benchmarks/RESULTS.md, 2026-12-07, FOLD): the loop is bound by the
instructions it issues, not by the waits. `git apply benchmarks/logs/2026-12-07-s14/fold.patch` on 23fc90a brings
it back; this file then also times "fold" rows (the template's FOLD twins of the candidates).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qlinear_probe import SHAPES, streamed_copies  # noqa: E402 - beside this file

# two planes from two bytes: (MAGIC + q) in a bf16 pair each (as llmc.codegen.qmatmul.NIBBLES_ASM), then one
# packed FMA each with $3 = (s, s) and $4 = (-MAGIC s, -MAGIC s): q * s, rounded once
_SCALED = tl.constexpr("""{
.reg .b32 t, h;
cvt.u32.u16 t, $2;
prmt.b32 t, t, 0, 0x4140;
shr.u32 h, t, 4;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xea;
lop3.b32 h, h, 0x000F000F, 0x43004300, 0xea;
fma.rn.bf16x2 $0, t, $3, $4;
fma.rn.bf16x2 $1, h, $3, $4;
}""")
# the shipped unpack: q - 8 exactly
_PLAIN = tl.constexpr("""{
.reg .b32 t, h, one, bias;
mov.b32 one, 0x3F803F80;
mov.b32 bias, 0xC308C308;
cvt.u32.u16 t, $2;
prmt.b32 t, t, 0, 0x4140;
shr.u32 h, t, 4;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xea;
lop3.b32 h, h, 0x000F000F, 0x43004300, 0xea;
fma.rn.bf16x2 $0, t, one, bias;
fma.rn.bf16x2 $1, h, one, bias;
}""")


@triton.jit
def _scaled(codes, s, ms):
    return tl.inline_asm_elementwise(_SCALED, "=r,=r,h,r,r", [codes, s, ms], dtype=(tl.bfloat16, tl.bfloat16),
                                     is_pure=True, pack=2)


@triton.jit
def _plain(codes):
    return tl.inline_asm_elementwise(_PLAIN, "=r,=r,h", [codes], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                     pack=2)


@triton.jit
def lab_kernel(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, stride_wn, stride_sn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACKS: tl.constexpr, SPLIT_K: tl.constexpr,
               FOLD: tl.constexpr):
    # y[M, N] = x[M, K] @ W.T, W int4 g128 in llmc's nibble planes (a pack tile: 128 columns in 64 bytes,
    # byte j = column j | column 64 + j << 4), computed as W x.T ([BLOCK_N, BLOCK_M]); grid (N tiles, K splits)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rr = tl.arange(0, 64)
    m_ok = rm < M
    k_per_split = tl.cdiv(K, SPLIT_K * 128 * PACKS) * 128 * PACKS
    k_start = pid_k * k_per_split
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + rm[:, None] * K
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    corr = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, k_per_split, 128 * PACKS):
        for t in tl.static_range(PACKS):
            k0 = k_start + k + t * 128
            codes = tl.load(w_rows + (k0 // 2 + rr)[None, :])
            x0 = tl.load(x_rows + (k0 + rr)[None, :], mask=m_ok[:, None], other=0.0)
            x1 = tl.load(x_rows + (k0 + 64 + rr)[None, :], mask=m_ok[:, None], other=0.0)
            s = tl.load(s_ptr + rn * stride_sn + k0 // 128)
            if FOLD:
                sb = tl.broadcast_to(s[:, None], (BLOCK_N, 64))
                w0, w1 = _scaled(codes, sb, (sb * -128.0).to(tl.bfloat16))
                if t == 0:  # one accumulator per plane and pack tile: a dot's result feeds only its next
                    acc = tl.dot(w0, tl.trans(x0), acc)
                    acc1 = tl.dot(w1, tl.trans(x1), acc1)
                else:
                    acc2 = tl.dot(w0, tl.trans(x0), acc2)
                    acc3 = tl.dot(w1, tl.trans(x1), acc3)
                xs = tl.sum(x0.to(tl.float32), 1) + tl.sum(x1.to(tl.float32), 1)
                corr += s.to(tl.float32)[:, None] * xs[None, :]
            else:
                w0, w1 = _plain(codes)
                p = tl.dot(w0, tl.trans(x0))
                p = tl.dot(w1, tl.trans(x1), p)
                acc += p * s.to(tl.float32)[:, None]
    if FOLD:
        acc = (acc + acc1) + (acc2 + acc3) - 8.0 * corr
    acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    mask = m_ok[:, None] & (rn[None, :] < N)
    if SPLIT_K > 1:
        tl.store(ws_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in range(SPLIT_K):
                acc += tl.load(ws_ptr + (i * M + rm[:, None]) * N + rn[None, :], mask=mask, other=0.0,
                               cache_modifier=".cg")
            tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=mask)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=mask)


def lab(x, w, s, y, ws, count, cfg):
    m, k = x.shape
    n = w.shape[0]
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"])
    lab_kernel[grid](x, w, s, y, ws, count, m, n, k, w.stride(0), s.stride(0), BLOCK_M=16,
                     BLOCK_N=cfg["BLOCK_N"], PACKS=cfg["PACKS"], SPLIT_K=cfg["SPLIT_K"], FOLD=cfg["FOLD"],
                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def lab_configs(n: int, k: int) -> list[dict]:
    # 64-row tiles on 4 warps, 3 stages; one or two pack tiles a step (fold 1 has accumulators for two)
    return [dict(FOLD=fold, BLOCK_N=64, PACKS=packs, SPLIT_K=split, num_warps=4, num_stages=3)
            for fold in (0, 1) for packs in (1, 2) for split in (1, 2, 4, 8) if k % (split * 128 * packs) == 0]


def ttgir(spec: str) -> None:
    """Compile one config for sm_90 and print the loop's dots and waits: this file's kernel, or with "product," first
    llmc's qlinear kernel (int4 g128, bf16) at BLOCK_N, BLOCK_K = 128 x pack tiles, SPLIT_K, SWAP_AB 1."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    product = spec.startswith("product,")
    fold, bn, packs, split, warps, stages = map(int, spec.removeprefix("product,").split(","))
    if product:
        from llmc.codegen.kernels import load
        from llmc.codegen.qmatmul import QMatmulSpec
        fn = load(QMatmulSpec("int", 4, 128, False, 64, "bf16", False, "")).qmatmul_kernel
        sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
               "count_ptr": "*i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32",
               "M": "i32", "N": "i32", "K": "i32", "KW": "i32"}
        consts = {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": 128 * packs, "SPLIT_K": split, "M_TILES": 1,
                  "SWAP_AB": True, "EVEN_K": True, "TMA": False, "w_desc": None}
        if "FOLD" in fn.arg_names:  # a tree with fold.patch applied
            consts["FOLD"] = bool(fold)
    else:
        fn = lab_kernel
        sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
               "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_wn": "i32", "stride_sn": "i32"}
        consts = {"BLOCK_M": 16, "BLOCK_N": bn, "PACKS": packs, "SPLIT_K": split, "FOLD": fold}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a not in ("M",)}
    sig.update({a: "constexpr" for a in consts})
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()}, attrs=attrs)
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    for line in kern.asm["ttgir"].splitlines():
        if "warp_group_dot" in line or "scf.for" in line:
            print(line.strip()[:160])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="gate_up,down,qkv,o_proj")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--out")
    ap.add_argument("--lab", action="store_true", help="also this file's standalone kernel in both forms")
    ap.add_argument("--ttgir", help="[product,]fold,BLOCK_N,PACKS,SPLIT_K,warps,stages: compile only (sm_90), print "
                                    "the loop's dots and waits (product: llmc's qlinear kernel)")
    a = ap.parse_args()
    if a.ttgir:
        return ttgir(a.ttgir)
    from llmc.codegen import qmatmul as qm
    from llmc.codegen.autotune import m_bucket
    from llmc.ir.quant import QuantFormat, quantize_rtn
    torch.manual_seed(0)
    fmt = QuantFormat("int", 4, 128)
    rows = []
    print(f"{'shape':8s} {'M':>3s} {'kind':8s} {'us':>7s} {'TB/s':>6s} {'rel err':>8s}  config", flush=True)
    for shape in a.shapes.split(","):
        n, k = SHAPES[shape]
        w = torch.randn(n, k, device="cuda") / k ** 0.5
        qw = quantize_rtn(w, fmt, torch.bfloat16)
        copies = streamed_copies(qw)
        p0, nbytes = copies[0], copies[0].nbytes
        for m in map(int, a.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = qm.reference(x.float(), qw.fmt, qw.qweight, qw.scales, qw.zeros)
            ys = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in copies]
            ws = torch.empty(8 * m * n, device="cuda", dtype=torch.float32)
            counts = [torch.zeros(n, device="cuda", dtype=torch.int32) for _ in copies]
            best = {}
            shipped = qm.candidates(m_bucket(m), n, p0.padded_k, p0.pack)
            runs = [("shipped", c) for c in shipped]
            if hasattr(qm, "fold_candidates"):  # a tree with fold.patch applied (see the docstring)
                runs += [("fold", c) for c in qm.fold_candidates(shipped)]
            runs += [(f"lab{c['FOLD']}", c) for c in lab_configs(n, k)] if a.lab else []
            for kind, cfg in runs:
                try:
                    if kind in ("shipped", "fold"):
                        def calls():
                            for p, yi in zip(copies, ys):
                                qm.qlinear(x, p, config=cfg, out=yi)
                    else:
                        def calls():
                            for p, yi, ci in zip(copies, ys, counts):
                                lab(x, p.qweight, p.scales, yi, ws, ci, cfg)
                    calls()
                    torch.cuda.synchronize()
                    err = ((ys[0].float() - ref).abs().max() / ref.abs().max()).item()
                    us = triton.testing.do_bench_cudagraph(calls, rep=50) * 1e3 / len(copies)
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped
                    print(f"{shape:8s} {m:3d} {kind:8s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                row = {"shape": shape, "m": m, "kind": kind, "us": us, "tb_s": nbytes / us / 1e6, "rel_err": err,
                       "config": cfg}
                rows.append(row)
                if kind not in best or us < best[kind]["us"]:
                    best[kind] = row
            for kind, row in sorted(best.items()):
                print(f"{shape:8s} {m:3d} {kind:8s} {row['us']:7.1f} {row['tb_s']:6.2f} {row['rel_err']:8.1e}  "
                      f"{json.dumps(row['config'])}", flush=True)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "int4_async_lab.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
