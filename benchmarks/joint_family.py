"""Which of a joint bucket's configs compute the same bits, and what the 1-row bucket would gain from the
fastest of those that do: the generated bf16 matmul and the int4 g128 qlinear on the Llama-3-8B shapes.

Steps of 1 to 64 rows share one GEMM choice (autotune.JOINT_BUCKETS), so that a row's sums do not depend on
how many rows its step holds. But the candidates differ in more than their reduction: the tile's width
(BLOCK_N), its warps and its pipeline stages decide who computes an output, not the order in which its K terms
are summed. Where configs that differ only in those give the same bits, a bucket could take the fastest of
its joint choice's family and stay batch-invariant. Per shape and kind, this prints:

- the families: the candidates (bucket "1") grouped by the bits of Y = f(X) for a random X of 64 rows, each
  config's own invariance checked too (row 0 of Y against f(X[:1]));
- per candidate, microseconds at 1 and 64 rows (`--rows`) (the weight streamed from HBM: CUDA-graph replays over copies
  that overflow L2), and the joint choice as the tuner makes it (least summed time over the two sizes);
- at each row count, the joint choice's time against the fastest member of its family.

    python3 benchmarks/joint_family.py [--shapes qkv,o_proj,gate_up,down] [--kinds bf16,int4] [--rows 1,64] [--out DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.codegen import matmul as mm  # noqa: E402
from llmc.codegen import qmatmul as qm  # noqa: E402
from llmc.ir.quant import QuantFormat, quantize_rtn  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
L2_BYTES = 60 << 20


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:10]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    ap.add_argument("--kinds", default="bf16,int4")
    ap.add_argument("--rows", default="1,64", help="the row counts each config is timed at (the first is the bucket "
                                                    "a family member could serve; the joint choice sums them all)")
    ap.add_argument("--out")
    a = ap.parse_args()
    MS = tuple(int(m) for m in a.rows.split(","))
    torch.manual_seed(0)
    rows = []
    for shape in a.shapes.split(","):
        n, k = SHAPES[shape]
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        for kind in a.kinds.split(","):
            if kind == "bf16":
                nbytes = w.numel() * 2
                weights = [w] + [w.clone() for _ in range(max(0, -(-2 * L2_BYTES // nbytes) - 1))]
                cands = mm.candidates("1")

                def run(cfg, xs, wt, out=None):
                    return mm.matmul(xs, wt, config=cfg, out=out)
            else:
                qw = quantize_rtn(w.float(), QuantFormat("int", 4, 128), torch.bfloat16)
                p0 = qm.prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
                nbytes = sum(t.numel() * t.element_size() for t in (p0.qweight, p0.scales) if t is not None)
                weights = [p0] + [qm.prepare(qw.fmt, qw.qweight.clone(), qw.scales.clone())
                                  for _ in range(max(0, -(-2 * L2_BYTES // nbytes) - 1))]
                cands = qm.candidates("1", n, p0.padded_k, p0.pack)

                def run(cfg, xs, wt, out=None):
                    return qm.qlinear(xs, wt, config=cfg, out=out)
            results = []
            for cfg in cands:
                try:
                    y64 = run(cfg, x, weights[0])
                    y1 = run(cfg, x[:1], weights[0])
                except Exception as e:  # noqa: BLE001 - a config that does not build is reported, not fatal
                    print(f"{shape} {kind} {json.dumps(cfg)}: failed ({type(e).__name__}: {str(e)[:80]})")
                    continue
                times = {}
                for m in MS:
                    ys = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in weights]

                    def calls():
                        for wt, yi in zip(weights, ys):
                            run(cfg, x[:m], wt, yi)
                    times[m] = triton.testing.do_bench_cudagraph(calls, rep=60) * 1e3 / len(weights)
                results.append({"config": cfg, "bits": digest(y64), "invariant": bool(torch.equal(y64[:1], y1)),
                                "us": times})
            joint = min(results, key=lambda r: sum(r["us"].values()))
            family = [r for r in results if r["bits"] == joint["bits"]]
            best = {m: min(family, key=lambda r: r["us"][m]) for m in MS}  # per row count, of the joint's family
            print(f"\n# {shape} {kind} ({n} x {k}), weight {nbytes / 1e6:.1f} MB")
            print(f"{'bits':10s} {'inv':3s} " + " ".join(f"{'us@' + str(m):>7s}" for m in MS) + "  config")
            for r in sorted(results, key=lambda r: (r["bits"], r["us"][MS[0]])):
                mark = " <- joint" if r is joint else ""
                mark += "".join(f" <- best@{m} of its family" for m in MS if r is best[m] and r is not joint)
                print(f"{r['bits']:10s} {'yes' if r['invariant'] else 'NO':3s} "
                      + " ".join(f"{r['us'][m]:7.1f}" for m in MS) + f"  {json.dumps(r['config'])}{mark}")
            for m in MS:
                print(f"joint choice at {m} rows {joint['us'][m]:.1f} us; fastest of its family {best[m]['us'][m]:.1f} "
                      f"us ({joint['us'][m] / best[m]['us'][m]:.2f}x; {len(family)} of {len(results)} configs share "
                      "its bits)")
            rows.append({"shape": shape, "kind": kind, "n": n, "k": k, "results": results, "joint": joint["config"],
                         **{f"best{m}_in_family": best[m]["config"] for m in MS}})
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "joint_family.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
