"""The 8-bit W8A8 GEMMs (fp8 e4m3 or int8) at decode and mixed-step sizes on a GPU: every config of the
tuner's own candidate list and of a wider grid, the library GEMM, and bf16 cuBLAS on the same shape, each
timed on activation codes made beforehand (as the norm or SwiGLU before a linear makes them), streaming
the weight from HBM (quant_bench.py's CUDA-graph replay over weight copies that overflow L2).

    PYTHONPATH=. python3 benchmarks/w8_sweep.py --out DIR [--kind fp8] [--ms 64,128] [--shapes down,o_proj] [--tma]
        [--promote 32,128]

Prints, per shape and M: bf16 cuBLAS, the library GEMM, and the three fastest configs of the tuner's list
("list") and of the grid outside it ("grid"), with the weight bytes a second as a share of 4.8 TB/s.
`--tma` adds each of those configs with its tiles loaded through TMA descriptors ("tma-list", "tma-grid"),
and a grid of deeper TMA pipelines ("tma-deep"). `--promote 32,128` (fp8) times every generated config once per
interval of K at which the MMA's sums move into the fp32 accumulator (LLMC_FP8_PROMOTE), labelled "@32", "@128";
the error column (against the fp32 reference on the same codes) tells what the fewer promotions cost.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
from pathlib import Path

import torch

from llmc.codegen import elementwise
from llmc.codegen import qmatmul as qm
from llmc.codegen.act_quant import quantize_act
from llmc.codegen.autotune import m_bucket
from llmc.ir.quant import QuantFormat, quantize_rtn

from quant_bench import HBM_BYTES_PER_S, SHAPES, copies_for, graph_time_us, rel_err


def grid(m: int, listed: list[dict]) -> list[dict]:
    """Configs outside the tuner's list: 16-row tiles up to 64 rows (the batch-invariant rule), taller past."""
    rows = (16,) if m <= 64 else (64, 128)
    out = [qm._cfg(bm, bn, bk, split, True, 4, stages)
           for bm, bn, bk, split, stages in itertools.product(rows, (64, 128), (128, 256, 512), (2, 4, 8, 16), (4,))]
    seen = {tuple(sorted(c.items())) for c in listed}
    return [c for c in out if tuple(sorted(c.items())) not in seen]


def tma_grid(m: int) -> list[dict]:
    """TMA configs with deeper pipelines than the pointer grid's (a bulk copy holds no registers)."""
    rows = (16,) if m <= 64 else (64, 128)
    return [dict(qm._cfg(bm, bn, bk, split, True, 4, stages), TMA=True)
            for bm, bn, bk, split, stages in itertools.product(rows, (64, 128), (128,), (2, 4, 8), (4, 6))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kind", default="fp8", choices=("fp8", "w8a8"))
    ap.add_argument("--ms", default="64,128")
    ap.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tma", action="store_true", help="also every config through TMA descriptors, and deeper ones")
    ap.add_argument("--no-grid", action="store_true", help="the tuner's list only, no pointer grid outside it")
    ap.add_argument("--no-deep", action="store_true", help="with --tma: no grid of deeper TMA pipelines")
    ap.add_argument("--promote", default=None,
                    help="fp8: comma-separated intervals of K between promotions of the MMA's sums (32,64,128,256); "
                         "each generated config is timed at each")
    a = ap.parse_args()
    promotes = a.promote.split(",") if a.promote else [None]
    fmt = QuantFormat(a.kind, 8)
    rows: list[dict] = []
    for shape in a.shapes.split(","):
        n, k = SHAPES[shape]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        qw = quantize_rtn(w, fmt, torch.bfloat16)
        p = qm.prepare(fmt, qw.qweight, qw.scales, qw.zeros)
        copies = [p] + [dataclasses.replace(p, qweight=p.qweight.clone(), scales=p.scales.clone())
                        for _ in range(copies_for(p.nbytes, False) - 1)]
        ws = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2, False) - 1)]
        for m in map(int, a.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            codes, scales = quantize_act(x, a.kind)
            ref = qm.reference(x, fmt, qw.qweight, qw.scales)
            bucket = qm.qlinear_bucket(m)
            listed = qm.candidates(bucket, n, p.padded_k, p.pack, m <= 64)
            cands = [("list", c) for c in listed] + [("grid", c) for c in ([] if a.no_grid else grid(m, listed))]
            if a.tma:
                cands += [(f"tma-{kind}", dict(c, TMA=True)) for kind, c in cands if c["BLOCK_K"] <= 256]
                cands += [] if a.no_deep else [("tma-deep", c) for c in tma_grid(m)]
            # up to 64 rows the tuner offers no library GEMM (batch invariance); timed there all the same, as at 128+
            cands += [("library", c) for c in qm.library_candidates(bucket if m > 64 else "128+", p, torch.bfloat16)]
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            res = [{"kind": "bf16", "us": graph_time_us([lambda wi=wi: torch.mm(x, wi.t(), out=y) for wi in ws],
                                                        a.reps), "nbytes": w.numel() * 2, "cfg": "cuBLAS", "err": 0.0}]
            xs = [x.clone() for _ in range(16)]  # one graph of 16 calls: a lone short kernel times the replay's start
            res.append({"kind": "quantize", "us": graph_time_us([lambda xi=xi: quantize_act(xi, a.kind) for xi in xs],
                                                                a.reps),
                        "nbytes": x.numel() * 3, "cfg": "quantize_act", "err": 0.0})
            for promote in promotes:
                if promote is not None:  # read when a kernel renders: render afresh for this interval
                    os.environ["LLMC_FP8_PROMOTE"] = promote
                    elementwise._module.cache_clear()
                for kind, cfg in cands:
                    if kind == "library" and promote != promotes[0]:
                        continue  # the library GEMM once
                    if promote is not None and kind != "library":
                        kind = f"{kind}@{promote}"
                    try:
                        qm.qlinear(codes, p, config=cfg, out=y, x_scales=scales, dtype=torch.bfloat16)
                        err = rel_err(y, ref)
                        us = graph_time_us([lambda c=c: qm.qlinear(codes, c, config=cfg, out=y, x_scales=scales,
                                                                   dtype=torch.bfloat16) for c in copies], a.reps)
                    except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is reported
                        print(f"{shape} M={m} {cfg} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        continue
                    res.append({"kind": kind, "us": us, "nbytes": p.nbytes, "cfg": cfg, "err": err})
            for r in res:
                r.update(shape=shape, M=m, hbm_pct=100 * r["nbytes"] / (r["us"] * 1e-6) / HBM_BYTES_PER_S)
            rows += res
            for kind in dict.fromkeys(r["kind"] for r in res):  # in the order first timed
                top = 1 if kind in ("bf16", "quantize", "library") else 3
                for r in sorted((r for r in res if r["kind"] == kind), key=lambda r: r["us"])[:top]:
                    print(f"{shape:8s} M={m:<4d} {kind:8s} {r['us']:7.1f} us {r['hbm_pct']:5.1f}% err {r['err']:.1e} "
                          f"{r['cfg']}", flush=True)
        del copies, ws
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, f"w8_sweep_{a.kind}.json").write_text(json.dumps(rows, indent=0))
    print(f"# bucket of each M: {[(m, qm.qlinear_bucket(int(m)), m_bucket(int(m))) for m in a.ms.split(',')]}")


if __name__ == "__main__":
    main()
