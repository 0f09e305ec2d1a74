"""Quantized linears on a GPU: llmc's qlinear kernels against bf16 cuBLAS and llmc's dense matmul.

For the Llama-3-8B linear shapes (fused qkv, o_proj, fused gate/up, down) at M = 1, 16, 128 and 2048
tokens, times bf16 cuBLAS (torch.mm, as F.linear runs it), llmc's dense `matmul.linear` and `qlinear` for int4 g128
(symmetric), int8 per channel (weight-only), w8a8 and fp8, each tuned by its own `Tuner` first
(as a compile does: candidates timed with the weight hot in L2). The measurement then streams the
weight from HBM, as a decode step does: one CUDA graph calls the op on enough copies of the weight
to overflow L2 three times, and a call's time is a replay's over the copies (median of `--reps`
replays, CUDA events). Reported per call: microseconds, the weight's bytes (codes, scales and
zero points) per second, that as a share of the H200's 4.8 TB/s, and the speedup over bf16
cuBLAS; each result is checked against the op's reference on the GPU (max |y - ref| / max |ref|
over the first 128 rows). The last table is the summary; everything goes to OUT/quant_bench.json.

    PYTHONPATH=. python benchmarks/quant_bench.py --out benchmarks/logs/quant
    PYTHONPATH=. python benchmarks/quant_bench.py --out /tmp/q --shapes o_proj --ms 1 --methods bf16,int4-g128
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import time
from pathlib import Path

import torch
import triton

from llmc.codegen import matmul as mm
from llmc.codegen import qmatmul as qm
from llmc.codegen.act_quant import quantize_act
from llmc.codegen.autotune import DECODE_JOINT_BUCKETS, JOINT_BUCKETS, Tuner, m_bucket
from llmc.ir.quant import QuantFormat, quantize_activations, quantize_rtn

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (1, 16, 128, 2048)
HBM_BYTES_PER_S = 4.8e12  # H200
CHECK_ROWS = 128
OK_ERR = 2e-2  # a bf16 output's rounding, with margin
FORMATS = {"int4-g128": QuantFormat("int", 4, 128), "int8-ch": QuantFormat("int", 8),
           "w8a8": QuantFormat("w8a8", 8), "fp8": QuantFormat("fp8", 8)}
METHODS = ("bf16", "llmc-bf16") + tuple(FORMATS)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for quant_bench.json")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="token counts M, comma-separated")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--reps", type=int, default=30, help="graph replays timed per measurement (median)")
    ap.add_argument("--no-tune", action="store_true", help="the kernels' default configs, untimed")
    ap.add_argument("--hot", action="store_true", help="time one weight copy (hot in L2 when it fits)")
    ap.add_argument("--no-batch-invariant", action="store_true",
                    help="tune as `llmc compile --no-batch-invariant` does: 1 to 4 tokens share one choice (where "
                         "int4 can take the GEMV kernel), larger buckets their own")
    return ap.parse_args()


def graph_time_us(calls: list, reps: int) -> float:
    """Median microseconds per call of `calls` (one per weight copy), replayed as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as CUDA graphs want
        for _ in range(2):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def copies_for(nbytes: int, hot: bool) -> int:
    """Weight copies whose total overflows L2 three times (a decode step reads every weight from HBM)."""
    if hot:
        return 1
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(1, min(64, math.ceil(3 * l2 / nbytes)))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def bench_dense(method: str, w: torch.Tensor, xs: dict, tuner, args) -> list[dict]:
    """bf16 cuBLAS (torch.mm) or llmc's dense matmul.linear, checked against an fp32 product."""
    n, k = w.shape
    ws = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2, args.hot) - 1)]
    out = []
    for m, x in xs.items():
        y = torch.empty(m, n, dtype=w.dtype, device=w.device)
        if method == "bf16":
            torch.mm(x, w.t(), out=y)
            calls, choice = [lambda wi=wi: torch.mm(x, wi.t(), out=y) for wi in ws], "cuBLAS"
        else:
            mm.linear(x, w, tuner=tuner, out=y)  # tunes now, eagerly
            calls = [lambda wi=wi: mm.linear(x, wi, tuner=tuner, out=y) for wi in ws]
            rec = tuner.lookup(mm.MatmulSpec("bf16", False).key(n, k), m_bucket(m)) if tuner else None
            choice = "default" if rec is None else ("cuBLAS" if rec.prefer_cublas else rec.config)
        err = rel_err(y[:CHECK_ROWS], x[:CHECK_ROWS].float() @ w.float().t())
        out.append(_record(method, n, k, m, graph_time_us(calls, args.reps), w.numel() * 2, len(ws), err, choice))
    return out


def bench_quant(method: str, w: torch.Tensor, xs: dict, tuner, args) -> list[dict]:
    """qlinear in format `method`, checked against the qlinear op's reference."""
    fmt = FORMATS[method]
    qw = quantize_rtn(w, fmt, torch.bfloat16)
    p = qm.prepare(fmt, qw.qweight, qw.scales, qw.zeros)
    n, k = w.shape
    ps = [p] + [dataclasses.replace(p, qweight=p.qweight.clone(), scales=p.scales.clone(),
                                    zeros=None if p.zeros is None else p.zeros.clone())
                for _ in range(copies_for(p.nbytes, args.hot) - 1)]
    out = []
    for m, x in xs.items():
        y = torch.empty(m, n, dtype=w.dtype, device=w.device)
        qm.qlinear(x, p, tuner=tuner, out=y)  # tunes now, eagerly
        err = rel_err(y[:CHECK_ROWS], qm.reference(x[:CHECK_ROWS], fmt, qw.qweight, qw.scales, qw.zeros))
        calls = [lambda pi=pi: qm.qlinear(x, pi, tuner=tuner, out=y) for pi in ps]
        rec = tuner.lookup(qm.QMatmulSpec.of(p, x.dtype, False, "").key(n, k), m_bucket(m)) if tuner else None
        choice = rec.config if rec is not None else qm.candidates(m_bucket(m), n, p.padded_k, p.pack)[0]
        out.append(_record(method, n, k, m, graph_time_us(calls, args.reps), p.nbytes, len(ps), err, choice))
        if fmt.kind != "int":  # the activation codes against torch's: the kernel should match every one
            codes, _ = quantize_act(x, fmt.kind)
            out[-1]["act_code_mismatches"] = int((codes.float() != quantize_activations(x, fmt.kind)[0].float()).sum())
    return out


def _record(method, n, k, m, us, nbytes, copies, err, choice) -> dict:
    gbps = nbytes / (us * 1e-6) / 1e9
    return {"method": method, "N": n, "K": k, "M": m, "us": us, "weight_bytes": nbytes, "weight_GBps": gbps,
            "roofline_pct": 100 * gbps * 1e9 / HBM_BYTES_PER_S, "copies": copies, "max_rel_err": err,
            "ok": err < OK_ERR, "choice": choice}


def table(records: list[dict], shapes: dict, ms: list[int], methods: list[str]) -> str:
    """us per call (speedup over bf16 cuBLAS, % of the HBM roofline) per shape and M, then batch-1
    decode's four linears of one layer summed."""
    by = {(r["N"], r["K"], r["M"], r["method"]): r for r in records}
    lines = [f"{'shape':8} {'M':>5} " + " ".join(f"{m:>19}" for m in methods)]
    for name, (n, k) in shapes.items():
        for m in ms:
            base = by.get((n, k, m, "bf16"))
            cells = []
            for meth in methods:
                r = by.get((n, k, m, meth))
                if r is None:
                    cells.append(f"{'-':>19}")
                    continue
                sp = f"{base['us'] / r['us']:.2f}x" if base else "-"
                bad = "" if r["ok"] and not r.get("act_code_mismatches") else "!"
                cells.append(f"{r['us']:7.1f} {sp:>6} {r['roofline_pct']:3.0f}%{bad:1}")
            lines.append(f"{name:8} {m:>5} " + " ".join(cells))
    layer = {meth: sum(by[(n, k, 1, meth)]["us"] for n, k in shapes.values()) for meth in methods
             if all((n, k, 1, meth) in by for n, k in shapes.values())}
    if "bf16" in layer:
        lines.append(f"batch-1 decode, the {len(shapes)} linears of a layer: " + ", ".join(
            f"{meth} {us:.1f} us ({layer['bf16'] / us:.2f}x)" for meth, us in layer.items()))
    lines.append("cells: us per call, speedup over bf16 cuBLAS, weight bytes / time as % of 4.8 TB/s; "
                 f"!: max rel err >= {OK_ERR} or activation codes unlike torch's")
    return "\n".join(lines)


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("quant_bench needs a CUDA GPU")
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    ms = [int(m) for m in args.ms.split(",")]
    methods = args.methods.split(",")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    joint = DECODE_JOINT_BUCKETS if args.no_batch_invariant else JOINT_BUCKETS
    tuners = {meth: None if args.no_tune else Tuner(joint=joint) for meth in methods}
    records, errors = [], []
    t0 = time.time()
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms}
        for meth in methods:
            t = time.time()
            bench = bench_dense if meth in ("bf16", "llmc-bf16") else bench_quant
            try:
                recs = bench(meth, w, xs, tuners[meth], args)
            except Exception as e:  # one method failing (a kernel that does not compile) spoils no other
                print(f"{name} {meth}: FAILED {type(e).__name__}: {e}", flush=True)
                errors.append({"shape": name, "method": meth, "error": f"{type(e).__name__}: {e}"})
                continue
            for r in recs:
                r["shape"] = name
            records += recs
            print(f"{name} {meth}: " + ", ".join(f"M={r['M']} {r['us']:.1f} us err {r['max_rel_err']:.1e}"
                                               for r in recs) + f"  ({time.time() - t:.0f} s with tuning)",
                  flush=True)
        del w, xs
        torch.cuda.empty_cache()
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "args": vars(args),
            "seconds": round(time.time() - t0)}
    tuning = {meth: t.to_json() for meth, t in tuners.items() if t is not None}
    (out_dir / "quant_bench.json").write_text(json.dumps({"meta": meta, "records": records, "errors": errors,
                                                          "tuning": tuning},
                                                         indent=1, default=str))
    print(f"\n{meta['device']}, torch {meta['torch']}, triton {meta['triton']}; {out_dir / 'quant_bench.json'}")
    for e in errors:
        print(f"FAILED {e['shape']} {e['method']}: {e['error'][:300]}")
    print(table(records, shapes, ms, methods))


if __name__ == "__main__":
    main()
