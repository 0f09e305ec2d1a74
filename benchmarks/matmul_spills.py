"""Registers and local-memory spills of the generated matmul's decode tiles on Hopper, from a machine without a GPU.

Triton compiles `matmul.py.jinja` for sm_90 here (ptxas ships with triton) in each tile config the tuner
may choose at 1 to 64 tokens (`matmul.candidates`), plain and with the SwiGLU epilogue (`gated`), at one
and four row tiles a program; cuobjdump reports each kernel's registers a thread and stack bytes, and its
SASS is counted for local-memory stores and loads (STL, LDL: spills). Arguments are specialized as a
launch on an 8B or 1B shape specializes them (pointers and every integer but M divisible by 16): without
that, Triton cannot vectorize the loads, and 16 x 64 x 256 tiles on 4 warps compile to 32 registers and
2.5 KB of stack, which no launch of those shapes runs.

    python3 benchmarks/matmul_spills.py [--configs 16,64,256,4,4,3 ...] [--json OUT]

A config is BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,num_warps,num_stages (default: every decode candidate).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret: before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from llmc.codegen.kernels import load  # noqa: E402
from llmc.codegen.matmul import MatmulSpec, candidates  # noqa: E402
from sass_loop import cuobjdump  # noqa: E402  (beside this script)

SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "count_ptr": "*i32",
       "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "M": "i32", "N": "i32", "K": "i32",
       "prefetch_k": "i32"}


def resources(cfg: dict, m_tiles: int, gated: bool) -> dict:
    """Registers a thread, stack bytes, and the SASS's STL and LDL counts of one compiled config."""
    fn = load(MatmulSpec("bf16", False, (), "", gated), pdl=True).matmul_kernel.fn
    consts = {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
              "SPLIT_K": cfg["SPLIT_K"], "M_TILES": m_tiles}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in SIG if k != "M"}
    sig = {**SIG, **{k: "constexpr" for k in consts}}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "launch_pdl": True})
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        usage, sass = (subprocess.run([str(cuobjdump()), flag, str(cubin)], check=True, capture_output=True,
                                      text=True).stdout for flag in ("--dump-resource-usage", "-sass"))
    ops = collections.Counter(m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z]+)",
                                                              sass))
    return {"regs": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1)), "stl": ops["STL"], "ldl": ops["LDL"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="*", help="BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,num_warps,num_stages")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
    cfgs = ([dict(zip(keys, map(int, c.split(",")))) for c in a.configs] if a.configs
            else [{k: c[k] for k in keys} for c in candidates("1")])
    print(f"triton {triton.__version__}, sm_90, bf16: registers a thread, stack bytes, "
          "spill stores + loads (STL + LDL)")
    print("| BLOCK_M, N, K, SPLIT_K, warps, stages | row tiles | plain | SwiGLU epilogue |")
    print("|---|---|---|---|")
    rows = []
    for cfg in cfgs:
        for mt in (1, 4):
            cells = []
            for gated in (False, True):
                r = resources(cfg, mt, gated)
                rows.append({**cfg, "M_TILES": mt, "gated": gated, **r})
                cells.append(f"{r['regs']}, {r['stack']} B, {r['stl'] + r['ldl']}")
            print(f"| {', '.join(str(cfg[k]) for k in keys)} | {mt} | {cells[0]} | {cells[1]} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
