"""One int4 g128 qlinear call at batch 1 on the 8B gate/up and o_proj shapes, untuned (each shape's
default decode config), timed as a CUDA graph, with its largest error against the reference relative to
the reference's largest value. Run it once with LLMC_INT4_PTX=1 and once with 0 (the choice is read when
a kernel is rendered, so each setting needs its own process):

    for v in 1 0; do LLMC_INT4_PTX=$v python3 benchmarks/ptx_quick.py; done
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.codegen import qmatmul as qm  # noqa: E402
from llmc.ir.quant import QuantFormat, quantize_rtn  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    res = []
    for n, k in ((28672, 4096), (4096, 4096)):
        w = torch.randn(n, k, device="cuda") / k ** 0.5
        qw = quantize_rtn(w, QuantFormat("int", 4, 128), torch.bfloat16)
        p = qm.prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cfg = qm.candidates("1", n, p.padded_k, p.pack)[0]
        y = qm.qlinear(x, p, config=cfg)
        ref = qm.reference(x.float(), qw.fmt, qw.qweight, qw.scales, qw.zeros).to(torch.bfloat16).float()
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        ms = triton.testing.do_bench_cudagraph(lambda: qm.qlinear(x, p, config=cfg), rep=200)
        res.append(f"N{n}K{k} M=1 {cfg['BLOCK_N']}x{cfg['BLOCK_K']} split {cfg['SPLIT_K']}: {ms * 1e3:.1f} us, "
                   f"rel err {err:.2e}")
    print(f"LLMC_INT4_PTX={os.environ.get('LLMC_INT4_PTX', '1')}: " + "; ".join(res))


if __name__ == "__main__":
    main()
