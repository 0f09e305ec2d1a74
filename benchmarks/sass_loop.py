"""Static instruction counts of a generated kernel's main loop on Hopper, from a machine without a GPU.

Triton compiles a qlinear kernel for sm_90 here (ptxas ships with triton), cuobjdump disassembles it,
and the instructions of its main loop (the longest span a backward branch closes) are counted by
opcode. Where a kernel is limited by issuing instructions, not by HBM (int4 decode, RESULTS.md),
the instructions a loop iteration issues per weight bound its speed:

    python3 benchmarks/sass_loop.py [--format int4-g128] [--configs 16,64,256,4,1,1 ...] [--tma] [--json OUT]
    python3 benchmarks/sass_loop.py --attention [--code-dots] [--configs 64,4,3 128,8,2 ...]
    python3 benchmarks/sass_loop.py --fp8 [--promote 32|64|128|256] [--configs 128,64,128,4,1,3 ...]
    python3 benchmarks/sass_loop.py --w8a8 [--configs 128,64,128,4,1,3 ...]

A config is BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,M_TILES,SWAP_AB. Each runs twice, with the int4 codes
unpacked by inline PTX (the default) and by fp32 arithmetic (LLMC_INT4_PTX=0), each in a fresh
process (the choice is read when a kernel is rendered).

With --attention: the split-K decode attention kernel of the 8B shape (32 q heads over 8, 128 wide, bf16,
blocks of 16) over a bf16, int8 and fp8 cache; a config is BLOCK_N,num_warps,num_stages, and the counts
are per thread and per key of the main loop (the K/V tile loop).
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
ATTENTION_CONFIGS = ["32,4,2", "64,4,3", "128,8,2"]
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
          "EVEN_K": True, "TMA": {tma}}}
if {tma}:  # W's codes through a TMA descriptor, in boxes of one pack tile's bytes
    sig["w_desc"] = f"tensordesc<u8[{{bn}}, 64]>"
else:
    consts["w_desc"] = None
# what a launch specializes: pointers and every integer but M divisible by 16 (8B shapes are)
attrs = {{(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in sig if k not in ("M", "w_desc")}}
sig.update({{k: "constexpr" for k in consts}})
src = ASTSource(fn, sig, constexprs={{(fn.arg_names.index(k),): v for k, v in consts.items()}}, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": {warps}, "num_stages": 3}})
open({out!r}, "wb").write(k.asm["cubin"])
'''


_COMPILE_W8 = r'''
import sys
sys.path.insert(0, {root!r})
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmc.codegen.kernels import load
from llmc.codegen.qmatmul import QMatmulSpec
kind = {kind!r}
fn = load(QMatmulSpec(kind, 8, 0, False, 0, "bf16", False, "")).qmatmul_kernel
code = "fp8e4nv" if kind == "fp8" else "i8"
bm, bn, bk, sk, swap, stages = {cfg}
consts = {{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "M_TILES": 1, "SWAP_AB": bool(swap),
          "EVEN_K": True, "TMA": {tma}}}
sig = {{"x_ptr": "*" + code, "w_ptr": "*" + code, "s_ptr": "*fp32", "sx_ptr": "*fp32", "y_ptr": "*bf16",
       "ws_ptr": "*fp32" if kind == "fp8" else "*i32", "count_ptr": "*i32", "stride_xm": "i32", "stride_wn": "i32",
       "stride_sn": "i32", "stride_ym": "i32", "M": "i32", "N": "i32", "K": "i32", "KW": "i32"}}
attrs = {{(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in sig if k != "M"}}
if {tma}:  # x's codes and W's through TMA descriptors
    sig.update(x_desc=f"tensordesc<{{code}}[{{bm}}, {{bk}}]>", w_desc=f"tensordesc<{{code}}[{{bn}}, {{bk}}]>")
else:
    consts.update(x_desc=None, w_desc=None)
sig.update({{k: "constexpr" for k in consts}})
src = ASTSource(fn, sig, constexprs={{(fn.arg_names.index(k),): v for k, v in consts.items()}}, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4, "num_stages": stages}})
open({out!r}, "wb").write(k.asm["cubin"])
'''


_COMPILE_ATTENTION = r'''
import sys
sys.path.insert(0, {root!r})
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmc.codegen import kernels
from llmc.codegen.kernels import load
from llmc.codegen.attention import PagedAttentionSpec
if {centre_free}:  # the centres' parts of the quantized caches' decode set to 0 (benchmarks/centre_free_decode.py)
    sys.path.insert(0, {root!r} + "/benchmarks")
    from centre_free_decode import render_without_centres
    kernels.render = render_without_centres
kv, (bn, warps, stages), bs = {kv!r}, {cfg}, {bs}
spec = PagedAttentionSpec(head_dim=128, num_q_heads=32, num_kv_heads=8, block_size=bs, dtype="bfloat16", kv_dtype=kv,
                          mode="decode", split=True, block_n=bn)
fn = load(spec).paged_attention_decode_kernel
cache = {{"bfloat16": "*bf16", "int8": "*i8", "float8_e4m3fn": "*fp8e4nv"}}[kv]
types = {{"out_ptr": "*bf16", "q_ptr": "*bf16", "kv_scale_ptr": "*bf16", "cache_ptr": cache, "m_ptr": "*fp32",
         "l_ptr": "*fp32", "o_ptr": "*fp32", "qk_scale": "fp32"}}
consts = spec.constexprs()
# what a launch specializes: unit strides (the innermost of each tensor) to 1, the rest divisible by 16
consts.update({{k: 1 for k in ("stride_qd", "stride_od", "stride_c4", "stride_s2", "stride_pd", "stride_bt1")
               if k in fn.arg_names}})
sig = {{n: types.get(n, "*i32" if n.endswith("_ptr") else "i32") for n in fn.arg_names if n not in consts}}
attrs = {{(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in sig if k.endswith("_ptr") or k.startswith("stride")}}
sig.update({{k: "constexpr" for k in consts}})
src = ASTSource(fn, sig, constexprs={{(fn.arg_names.index(k),): v for k, v in consts.items()}}, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": warps, "num_stages": stages}})
open({out!r}, "wb").write(k.asm["cubin"])
'''


def cuobjdump() -> Path:
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def loop_opcodes(sass: str, modifiers: bool = False, mma: bool = False) -> collections.Counter:
    """Opcodes (predicates stripped, and modifiers unless `modifiers`) of the longest loop in a SASS listing;
    with `mma`, of the shortest loop that issues a Hopper MMA (a pipelined TMA loop sits inside longer spans
    that other backward branches close)."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    loops = [(int(m.group(1), 16), addr) for addr, text in ins
             if (m := re.search(r"BRA (0x[0-9a-f]+)", text)) and int(m.group(1), 16) < addr]
    if not loops:
        raise RuntimeError("no loop found in the kernel")
    def ops(span):
        body = (re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for addr, text in ins if span[0] <= addr <= span[1])
        return collections.Counter(op if modifiers else op.split(".")[0] for op in body)
    if mma:
        with_mma = [span for span in loops if any(op.split(".")[0].endswith("GMMA") for op in ops(span))]
        if not with_mma:
            raise RuntimeError("no loop of the kernel issues an MMA")
        return ops(min(with_mma, key=lambda span: span[1] - span[0]))
    return ops(max(loops, key=lambda span: span[1] - span[0]))


def compiled_loop(template: str, env: dict, modifiers: bool = False, mma: bool = False, **fields) -> collections.Counter:
    """Compile `template` (a _COMPILE* text) filled with `fields` in a fresh process, with `env` on top of this
    one's; the opcodes of its main loop (with their modifiers if `modifiers`)."""
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
        env.update(LLMC_CACHE_DIR=str(Path(d) / "cache"), TRITON_CACHE_DIR=str(Path(d) / "triton"))
        code = template.format(root=str(ROOT), out=str(cubin), **fields)
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
        sass = subprocess.run([str(cuobjdump()), "-sass", str(cubin)], check=True, capture_output=True, text=True)
        return loop_opcodes(sass.stdout, modifiers, mma)


def count(cfg: str, ptx: bool, bits: int, group: int, dtype: str, warps: int, zero_points: bool = False,
          tma: bool = False) -> collections.Counter:
    return compiled_loop(_COMPILE, {"LLMC_INT4_PTX": "1" if ptx else "0"}, bits=bits, group=group, dtype=dtype,
                         zp=zero_points, cfg=tuple(map(int, cfg.split(","))), warps=warps, tma=tma)


def count_attention(cfg: str, kv_dtype: str, code_dots: bool = False, modifiers: bool = False,
                    block_size: int = 16, centre_free: bool = False) -> collections.Counter:
    return compiled_loop(_COMPILE_ATTENTION, {"LLMC_KV_CODE_DOTS": "1" if code_dots else "0"}, modifiers,
                         kv=kv_dtype, cfg=tuple(map(int, cfg.split(","))), bs=block_size, centre_free=centre_free)


def attention_main(configs: list[str], json_out: str | None, code_dots: bool = False, block_size: int = 16,
                   centre_free: bool = False) -> None:
    kinds = ("bfloat16", "int8", "float8_e4m3fn")
    print(f"decode attention, 8B shape, bf16 q, blocks of {block_size}: main-loop instructions per thread (per key)"
          + (", quantized caches' codes in fp16 dots (LLMC_KV_CODE_DOTS=1)" if code_dots else "")
          + (", their centres' parts set to 0" if centre_free else ""))
    print(f"{'BLOCK_N,warps,stages':22s}" + "".join(f"{k:>16s}" for k in kinds) + "  top opcodes (fp8)")
    rows = []
    for cfg in configs:
        counts = {k: count_attention(cfg, k, code_dots, block_size=block_size, centre_free=centre_free) for k in kinds}
        bn = int(cfg.split(",")[0])
        rows.append({"config": cfg, **{k: dict(c) for k, c in counts.items()}})
        cells = "".join(f"{sum(c.values()):8d} ({sum(c.values()) / bn:4.1f})" for c in counts.values())
        top = ", ".join(f"{k} {v}" for k, v in counts["float8_e4m3fn"].most_common(6))
        print(f"{cfg:22s}{cells}  {top}")
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=1))


def w8_main(configs: list[str], json_out: str | None, promote: int = 128, kind: str = "fp8") -> None:
    """The fp8 (or int8, `kind` "w8a8") qlinear's MMA loop with pointer loads and with TMA tiles; a config is
    BLOCK_M,N,K,SPLIT_K,SWAP,stages. `promote`: of K summed in the fp8 MMA's precision before each move into the
    fp32 accumulator (LLMC_FP8_PROMOTE; int8 sums in int32, exact)."""
    print(f"{'fp8' if kind == 'fp8' else 'int8'} W8A8, bf16 out, 4 warps: MMA-loop instructions per thread and per "
          "weight of the tile, pointer loads / TMA" + (f"; sums promoted every {promote} of K" if kind == "fp8" else ""))
    rows = []
    env = {"LLMC_FP8_PROMOTE": str(promote)}
    for cfg in configs:
        c = tuple(map(int, cfg.split(",")))
        ptr, tma = (compiled_loop(_COMPILE_W8, env, mma=True, cfg=c, tma=t, kind=kind) for t in (False, True))
        per = c[1] * c[2] / 128  # weights of a BLOCK_N x BLOCK_K tile per thread
        n0, n1 = sum(ptr.values()), sum(tma.values())
        rows.append({"config": cfg, "kind": kind, "promote": promote if kind == "fp8" else None,  # int8: exact int32
                     "pointer": dict(ptr), "tma": dict(tma)})
        print(f"{cfg:24s} {n0:5d} ({n0 / per:5.2f}) {n1:5d} ({n1 / per:5.2f}) {n1 / n0:5.2f}  pointer: "
              + ", ".join(f"{k} {v}" for k, v in ptr.most_common(4)) + "; TMA: "
              + ", ".join(f"{k} {v}" for k, v in tma.most_common(4)))
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--zero-points", action="store_true", help="asymmetric int4 (a zero point per group)")
    ap.add_argument("--configs", nargs="*")
    ap.add_argument("--attention", action="store_true", help="the decode attention kernel per cache type")
    ap.add_argument("--code-dots", action="store_true", help="with --attention: quantized caches' codes in fp16 dots")
    ap.add_argument("--block-size", type=int, default=16, help="with --attention: the cache's keys per block")
    ap.add_argument("--centre-free", action="store_true",
                    help="with --attention: the quantized caches' centre parts set to 0 (what a centre-free cache costs)")
    ap.add_argument("--tma", action="store_true", help="the int4 codes through a TMA descriptor (`TMA` configs)")
    ap.add_argument("--fp8", action="store_true", help="the fp8 qlinear's MMA loop, pointer loads against TMA tiles "
                                                        "(configs BLOCK_M,N,K,SPLIT_K,SWAP,stages)")
    ap.add_argument("--w8a8", action="store_true", help="the int8 W8A8 qlinear's MMA loop, as --fp8 counts fp8's")
    ap.add_argument("--promote", type=int, default=128, choices=[32, 64, 128, 256],
                    help="with --fp8: of K summed in the MMA's precision before each promotion (LLMC_FP8_PROMOTE; "
                         "default 128, as a compile's)")
    ap.add_argument("--json", help="also write the counts here")
    a = ap.parse_args()
    if a.fp8 or a.w8a8:
        return w8_main(a.configs or ["128,64,128,4,1,3", "64,128,128,4,1,4", "16,64,256,4,1,3"], a.json,
                        a.promote, "w8a8" if a.w8a8 else "fp8")
    if a.attention:
        return attention_main(a.configs or ATTENTION_CONFIGS, a.json, a.code_dots, a.block_size, a.centre_free)
    a.configs = a.configs or DEFAULT_CONFIGS
    rows = []
    print(f"int4 g{a.group}{' with zero points' if a.zero_points else ''} {a.dtype}, {a.warps} warps"
          f"{', codes through TMA' if a.tma else ''}: main-loop instructions per thread and per code")
    print(f"{'BLOCK_M,N,K,SPLIT_K,M_TILES,SWAP':34s} {'fp32 unpack':>12s} {'PTX unpack':>11s} {'ratio':>6s}  "
          "top opcodes (PTX)")
    for cfg in a.configs:
        base, ptx = (count(cfg, p, 4, a.group, a.dtype, a.warps, a.zero_points, a.tma) for p in (False, True))
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
