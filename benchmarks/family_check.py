"""The batch-1 bucket's family choice (`autotune.FAMILY_BUCKETS`) on the Llama-3-8B linears, bf16 matmul
(the gate/up projection with its SwiGLU epilogue, as the 8B graph runs it) and int4 g128 qlinear.

Per linear: a fresh tuner times the joint choice of buckets 1-64 and then bucket 1's family choice, as a
compile does; printed are both configs and their times at one row (`triton_ms` of each record: the
joint one summed over the seven buckets, bucket 1's at one row, and the joint config at one row timed
here the same way). Then batch invariance, the point of the joint choice: over `--trials` random inputs
of 64 rows, row i's output alone (one row: bucket 1's config), among the first 5 rows (bucket 8: the
joint config) and among all 64 must be bitwise equal. Needs a GPU.

    python3 benchmarks/family_check.py [--trials 8] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    from llmc.codegen import autotune
    from llmc.codegen import matmul as mm
    from llmc.codegen import qmatmul as qm
    from llmc.ir.quant import QuantFormat, quantize_rtn

    torch.manual_seed(0)
    rows, bad = [], 0
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
        qw = quantize_rtn(w.float(), QuantFormat("int", 4, 128), torch.bfloat16)
        p = qm.prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
        gated = name == "gate_up"
        for kind in ("bf16", "int4"):
            t = autotune.Tuner(device=autotune._device_name())
            if kind == "bf16":
                f = lambda x: mm.matmul(x, w, tuner=t, gated=gated)  # noqa: E731
            else:
                f = lambda x: qm.qlinear(x, p, tuner=t)  # noqa: E731
            f(torch.randn(3, k, device="cuda", dtype=torch.bfloat16))  # tunes the joint group, then bucket 1
            (key,) = t.records
            joint, one = t.lookup(key, "2"), t.lookup(key, "1")
            x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            joint_at_1 = autotune.gpu_time_ms(lambda: (mm.matmul(x1, w, config=joint.config, gated=gated)
                                                       if kind == "bf16" else qm.qlinear(x1, p, config=joint.config)))
            mismatches = 0
            for _ in range(a.trials):
                x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
                full, five = f(x).clone(), f(x[:5]).clone()
                alone = torch.cat([f(x[i:i + 1]) for i in range(5)])
                mismatches += int(not torch.equal(alone, five)) + int(not torch.equal(five, full[:5]))
            bad += mismatches
            row = {"linear": name, "kind": kind, "joint": joint.config, "bucket_1": one.config,
                   "family_choice": one.family_of is not None, "joint_us_at_1": 1000 * joint_at_1,
                   "bucket_1_us": 1000 * (one.triton_ms if one.family_of is not None else joint_at_1),
                   "invariance_mismatches": mismatches, "trials": a.trials}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "family_check.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"# {torch.cuda.get_device_name()}: bucket 1 against the joint choice at one row, us")
    print(f"{'linear':9s} {'kind':5s} {'joint':>8s} {'bucket 1':>9s} {'x':>6s}  invariance")
    for r in rows:
        print(f"{r['linear']:9s} {r['kind']:5s} {r['joint_us_at_1']:8.1f} {r['bucket_1_us']:9.1f} "
              f"{r['joint_us_at_1'] / r['bucket_1_us']:6.2f}  {'ok' if not r['invariance_mismatches'] else 'DIFFERS'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
