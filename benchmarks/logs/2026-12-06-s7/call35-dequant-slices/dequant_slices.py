"""An int4 linear at prefill sizes through cuBLAS over a dequantized weight, three ways (GPU).

The 1024+ bucket of an int4 qlinear usually takes `LIBRARY: dequant`: W dequantized to bf16 by a
generated kernel, then one cuBLAS GEMM. That pass writes the whole bf16 W to HBM and the GEMM reads it
back: 4.5 bytes a weight more than bf16's own GEMM reads. This compares, on the 8B shape's linears:

- `bf16`: cuBLAS on a bf16 W made beforehand (the floor: what bf16 pays);
- `whole`: dequantize all of W, then one GEMM (the tuner's plain "dequant" candidate);
- `slices R`: W dequantized R rows at a time (R from `--slice-mib`: as many rows as that many MiB of bf16
  hold, `qmatmul.dequant_slice_rows`) into one buffer, each slice's GEMM writing its columns of y
  (the buffer can stay in L2 between its write and its read);
- `overlap R`: the same with two buffers, slice i+1 dequantized on a second stream while slice i's GEMM
  runs (the dequantization is memory-bound, the GEMM compute-bound).

The last three are `qmatmul._dequant_mm`, as the tuner's "dequant" candidates run it ("SLICE", "OVERLAP").

Each timed with triton's do_bench (L2 flushed before each call), median of its repetitions; the error
is the largest difference from `whole` relative to its largest value.

    python3 benchmarks/dequant_slices.py [--m 512,1024,2048] [--slice-mib 4,8,16,32] [--out DIR]
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
    ap.add_argument("--m", default="512,1024,2048")
    ap.add_argument("--slice-mib", default="4,8,16,32")
    ap.add_argument("--linears", default=",".join(SHAPES))
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("this times cuBLAS and generated kernels on the GPU: it needs one")
    from triton.testing import do_bench
    from llmc.codegen.qmatmul import _dequant_mm, dequant_slice_rows, dequantize_prepared, prepare
    from llmc.ir import quant
    from llmc.ir.quant import QuantFormat
    torch.manual_seed(0)
    results = []
    for name in a.linears.split(","):
        n, k = SHAPES[name]
        qw = quant.quantize_rtn(torch.randn(n, k, device="cuda") * 0.02, QuantFormat("int", 4, 128))
        p = prepare(qw.fmt, *qw.tensors())
        wb = dequantize_prepared(p, torch.bfloat16)
        for m in map(int, a.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = torch.empty_like(y)
            torch.mm(x, dequantize_prepared(p, torch.bfloat16).t(), out=ref)
            scale = ref.abs().max().item()
            row = {"linear": name, "m": m, "n": n, "k": k}
            row["bf16_us"] = 1e3 * do_bench(lambda: torch.mm(x, wb.t(), out=y), return_mode="median")
            row["whole_us"] = 1e3 * do_bench(lambda: torch.mm(x, dequantize_prepared(p, torch.bfloat16).t(), out=y),
                                             return_mode="median")
            for r in dict.fromkeys(dequant_slice_rows(k, int(mib)) for mib in a.slice_mib.split(",")):
                if r >= n:
                    continue
                for way, over in (("slices", 0), ("overlap", 1)):
                    y.zero_()
                    _dequant_mm(x, p, None, y, r, over)
                    torch.cuda.synchronize()
                    row[f"{way}{r}_err"] = (y.float() - ref.float()).abs().max().item() / scale
                    row[f"{way}{r}_us"] = 1e3 * do_bench(lambda: _dequant_mm(x, p, None, y, r, over),
                                                         return_mode="median")
                try:  # as the engine runs it: captured in a CUDA graph (a second stream forks and joins in it)
                    eager = y.clone()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        _dequant_mm(x, p, None, y, r, 1)
                    y.zero_()
                    graph.replay()
                    torch.cuda.synchronize()
                    row[f"graph{r}_same"] = torch.equal(y, eager)
                    row[f"graph{r}_us"] = 1e3 * do_bench(graph.replay, return_mode="median")
                except Exception as e:  # reported, the other figures go on
                    row[f"graph{r}_error"] = f"{type(e).__name__}: {e}"[:200]
            results.append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "dequant_slices.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                              "rows": results}, indent=1))
    print(f"# {torch.cuda.get_device_name()}: us per call (median), x = whole / this")
    for row in results:
        parts = [f"{row['linear']:8s} M={row['m']:5d} bf16 {row['bf16_us']:7.1f} whole {row['whole_us']:7.1f}"]
        for key in row:
            if key.endswith("_us") and key not in ("bf16_us", "whole_us"):
                parts.append(f"{key[:-3]} {row[key]:7.1f} ({row['whole_us'] / row[key]:.2f}x)")
        print(" | ".join(parts))


if __name__ == "__main__":
    main()
