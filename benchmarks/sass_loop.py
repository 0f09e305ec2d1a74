"""Static instruction counts of a generated kernel's main loop on Hopper, from a machine without a GPU.

Triton compiles a qlinear kernel for sm_90 here (ptxas ships with triton), cuobjdump disassembles it,
and the instructions of its main loop (the longest span a backward branch closes) are counted by
opcode. Where a kernel is limited by issuing instructions, not by HBM (int4 decode, RESULTS.md),
the instructions a loop iteration issues per weight bound its speed:

    python3 benchmarks/sass_loop.py [--format int4-g128] [--configs 16,64,256,4,1,1 ...] [--json OUT]

A config is BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,M_TILES,SWAP_AB. Each runs twice, with the int4 codes
unpacked by inline PTX (the default) and by fp32 arithmetic (LLMC_INT4_PTX=0), each in a fresh
process (the choice is read when a kernel is rendered).
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

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = ["16,64,256,4,1,1", "16,64,256,4,1,0", "16,64,256,4,4,1", "128,64,128,4,1,1", "64,128,128,1,1,0"]

_COMPILE = r'''
import sys
sys.path.insert(0, {root!r})
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmc.codegen.kernels import load
from llmc.codegen.qmatmul import QMatmulSpec
bits, group, dtype, zp = {bits}, {group}, {dtype!r}, {zp}
spec = QMatmulSpec("int", bits, group, zp, 64, dtype, False, "")
fn = load(spec).qmatmul_kernel
t = {{"bf16": "*bf16", "f16": "*fp16"}}[dtype]
sig = {{"x_ptr": t, "w_ptr": "*u8", "s_ptr": t, **({{"z_ptr": "*u8"}} if zp else {{}}), "y_ptr": t, "ws_ptr": "*fp32",
       "count_ptr": "*i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
       **({{"stride_zn": "i32"}} if zp else {{}}), "stride_ym": "i32", "M": "i32", "N": "i32", "K": "i32", "KW": "i32"}}
bm, bn, bk, sk, mt, swap = {cfg}
consts = {{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "M_TILES": mt, "SWAP_AB": bool(swap),
          "EVEN_K": True}}
# what a launch specializes: pointers and every integer but M divisible by 16 (8B shapes are)
attrs = {{(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in sig if k != "M"}}
sig.update({{k: "constexpr" for k in consts}})
src = ASTSource(fn, sig, constexprs={{(fn.arg_names.index(k),): v for k, v in consts.items()}}, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": {warps}, "num_stages": 3}})
open({out!r}, "wb").write(k.asm["cubin"])
'''


def cuobjdump() -> Path:
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes (predicates and modifiers stripped) of the longest loop in a SASS listing."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    loops = [(int(m.group(1), 16), addr) for addr, text in ins
             if (m := re.search(r"BRA (0x[0-9a-f]+)", text)) and int(m.group(1), 16) < addr]
    if not loops:
        raise RuntimeError("no loop found in the kernel")
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
                               for addr, text in ins if start <= addr <= end)


def count(cfg: str, ptx: bool, bits: int, group: int, dtype: str, warps: int, zero_points: bool = False
          ) -> collections.Counter:
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(LLMC_INT4_PTX="1" if ptx else "0", LLMC_CACHE_DIR=str(Path(d) / "cache"),
                   TRITON_CACHE_DIR=str(Path(d) / "triton"))
        code = _COMPILE.format(root=str(ROOT), bits=bits, group=group, dtype=dtype, zp=zero_points,
                               cfg=tuple(map(int, cfg.split(","))), warps=warps, out=str(cubin))
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
        sass = subprocess.run([str(cuobjdump()), "-sass", str(cubin)], check=True, capture_output=True, text=True)
        return loop_opcodes(sass.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--zero-points", action="store_true", help="asymmetric int4 (a zero point per group)")
    ap.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS)
    ap.add_argument("--json", help="also write the counts here")
    a = ap.parse_args()
    rows = []
    print(f"int4 g{a.group}{' with zero points' if a.zero_points else ''} {a.dtype}, {a.warps} warps: main-loop "
          "instructions per thread and per code")
    print(f"{'BLOCK_M,N,K,SPLIT_K,M_TILES,SWAP':34s} {'fp32 unpack':>12s} {'PTX unpack':>11s} {'ratio':>6s}  "
          "top opcodes (PTX)")
    for cfg in a.configs:
        base, ptx = (count(cfg, p, 4, a.group, a.dtype, a.warps, a.zero_points) for p in (False, True))
        bm, bn, bk = map(int, cfg.split(",")[:3])
        codes = bn * bk / (32 * a.warps)  # codes a thread unpacks per iteration (one row tile's worth)
        n0, n1 = sum(base.values()), sum(ptx.values())
        rows.append({"config": cfg, "fp32": dict(base), "ptx": dict(ptx), "codes_per_thread": codes})
        top = ", ".join(f"{k} {v}" for k, v in ptx.most_common(5))
        print(f"{cfg:34s} {n0:5d} ({n0 / codes:4.2f}) {n1:5d} ({n1 / codes:4.2f}) {n1 / n0:6.2f}  {top}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
