"""The int4 GEMV kernel (`qgemv_int4`) against the tensor-core qlinear kernel at decode sizes on a GPU:
every config of a sweep timed on the Llama-3-8B linear shapes, streaming the weight from HBM as a
decode step does (quant_bench.py's CUDA-graph replay over enough weight copies to overflow L2).

    PYTHONPATH=. python3 benchmarks/gemv_sweep.py --out DIR [--ms 1,4] [--shapes o_proj,gate_up]
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from llmc.codegen import qmatmul as qm
from llmc.ir.quant import QuantFormat, quantize_rtn

from quant_bench import HBM_BYTES_PER_S, SHAPES, copies_for, graph_time_us

SHAPES = dict(SHAPES, lm_head=(128256, 4096))


def sweep_configs(n: int, kw: int) -> list[dict]:
    out = []
    for joined, bn, bw, scale, warps, stages in itertools.product((False, True), (16, 32, 64), (16, 32), (1,),
                                                                  (4,), (3,)):
        out.append({"GEMV": True, "JOINED": joined, "BLOCK_N": bn, "BLOCK_W": bw,
                    "SPLIT_K": qm._split(n, kw, bn, 8 * bw, scale), "num_warps": warps, "num_stages": stages})
    return [dict(c) for c in dict.fromkeys(tuple(c.items()) for c in out)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--shapes", default="o_proj,gate_up,down,qkv,lm_head")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    fmt, rows = QuantFormat("int", 4, 128), []
    for shape in a.shapes.split(","):
        n, k = SHAPES[shape]
        qw = quantize_rtn(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), fmt)
        p = qm.prepare(fmt, *qw.tensors())
        nbytes = p.nbytes
        copies = [p] + [qm.PreparedQWeight(p.fmt, p.qweight.clone(), p.scales.clone(), None, p.in_features, p.run)
                        for _ in range(copies_for(nbytes, False) - 1)]
        for m in map(int, a.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = qm.qlinear(x, p, config=qm.candidates("1", n, p.padded_k, p.pack)[0]).float()
            cands = [("tc", c) for c in qm.candidates("1", n, p.padded_k, p.pack)]
            cands += [("gemv", c) for c in sweep_configs(n, p.padded_k)]
            res = []
            for kind, cfg in cands:
                try:
                    ys = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in copies]
                    y = qm.qlinear(x, p, config=cfg)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    us = graph_time_us([lambda c=c, yy=yy: qm.qlinear(x, c, config=cfg, out=yy)
                                        for c, yy in zip(copies, ys)], a.reps)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
                    print(f"{shape} M={m} {kind} {cfg} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                res.append({"shape": shape, "M": m, "kind": kind, "cfg": cfg, "us": us, "err": err,
                            "hbm_pct": 100 * nbytes / (us * 1e-6) / HBM_BYTES_PER_S})
            rows += res
            for kind in ("tc", "gemv"):
                best = sorted((r for r in res if r["kind"] == kind), key=lambda r: r["us"])[:3]
                for r in best:
                    print(f"{shape:8s} M={m} {kind:4s} {r['us']:7.1f} us {r['hbm_pct']:5.1f}% err {r['err']:.1e} {r['cfg']}",
                          flush=True)
        del copies
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "gemv_sweep.json").write_text(json.dumps(rows, indent=0))


if __name__ == "__main__":
    main()
