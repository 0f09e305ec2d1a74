"""An int4 g128 decode GEMV whose codes load straight into the tensor cores' register layout (Gluon, Hopper).

llmc's int4 qlinear (Triton) issues about 3.8 main-loop instructions a code on sm_90 (`sass_loop.py`): beside the
dequantization itself, the codes go through shared memory into the MMA operand's register layout, two bytes a
load, with byte permutes and shifts, and the loop's addressing. On the H200 the decode is bound by those
instructions, not by HBM. This lab asks what a kernel costs whose weight layout, chosen on the host, puts in
each thread's registers exactly the codes its part of the MMA operand needs:

- W is stored in tiles of 64 rows x 128 columns (one scale group), 1,024 int32 words a tile. A word holds the
  8 codes one thread of the warpgroup MMA's A operand needs from a 16 x 16 block: rows r and r + 8, columns
  k, k + 1, k + 8, k + 9 (`pack`). A thread's 4 words of a tile are 16 contiguous bytes (one 128-bit load) and
  a warp's loads are 512 contiguous bytes.
- Each word becomes 4 bf16 pairs by 3 shifts, 4 LOP3s (a nibble pair or-ed into the exponent of 128) and, with
  `SUB`, 4 bf16x2 FMAs (less 136: the zero point 8 and the 128); without `SUB` the MMA takes 128 + code and the
  tile's sum less 136 x the group's sum of x (computed once a tile for all 64 rows).
- The words' tensor goes through joins, a permute and a reshape to the [64, 128] A operand; `convert_layout(...,
  assert_trivial=True)` proves at compile time that no data moves.
- x [M <= 16, 128] through shared memory is the MMA's B operand; the 64 x 16 fp32 product of each group is
  scaled into the accumulator; K splits add into an fp32 y atomically (a lab: llmc's qlinear sums its splits in
  a fixed order).

Variants timed: ``sub`` (as above), ``xsums`` (the subtraction through x's sums), ``2tiles`` (two groups a loop
step), ``xall`` (`int4_gemv_xall_kernel`: the split's whole x in shared memory before the loop), ``xraw`` (`xall`
with 128 + code into the MMA and the groups' sums of x, made before the loop, taken off after it); ``xall-det``
and ``xraw-det`` end as llmc's qlinear does: a bf16 y, K splits summed in a fixed order by the last to arrive. Any
variant takes the suffix ``-det`` (that ending) and ``-a2`` (two tiles' words loaded ahead, not one), and the
one-tile loops ``-wg2`` (two warpgroups, 128 weight rows a program sharing x's tile): ``sub-det-a2``.

    python3 benchmarks/gluon_int4_lab.py --out OUT      # on a Hopper GPU: bits against torch, then timings
    python3 benchmarks/gluon_int4_lab.py --sass         # no GPU: compile for sm_90, main-loop instructions a code
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from llmc.codegen.qwgmma import TILE_N, pack  # the layout's tiles and packing: llmc's kernel's

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


KERNEL_SOURCE = r'''
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, fence_async_shared

# shared with llmc's kernel (`load_kernel` names its rendered module): the layouts of one or two warpgroups,
# `_at`, the barrier, and the dequantizing PTX (bf16 x, codes less 8)
from gluon_int4_lab_product import DEQUANT, _at, _barrier, _layouts

WORDS, MMA, A_OP, X_LD = _layouts(4)
WORDS8, MMA8, A_OP8, X_LD8 = _layouts(8)
X_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
X_SMEM3 = X_SMEM  # a stack of 2-D tiles: the layout of one
XS_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))  # rows of 16 sums
ASM_SUB = DEQUANT  # codes - 8
ASM_RAW = gl.constexpr("".join(line for line in DEQUANT.value.splitlines(True)
                               if not line.startswith("fma")))  # 128 + codes: without the subtraction


@gluon.jit
def _dequant(words, SUB: gl.constexpr, A_OP: gl.constexpr = A_OP, ROWS: gl.constexpr = 64):
    # [ROWS / 16, 8, 2, 4, 4] words -> the [ROWS, 128] bf16 A operand (layout A_OP), with no data movement
    if SUB:
        c = gl.inline_asm_elementwise(ASM_SUB, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], dtype=[gl.bfloat16] * 8,
                                      is_pure=True, pack=1)
    else:
        c = gl.inline_asm_elementwise(ASM_RAW, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], dtype=[gl.bfloat16] * 8,
                                      is_pure=True, pack=1)
    g0 = gl.join(gl.join(c[0], c[1]), gl.join(c[2], c[3]))
    g1 = gl.join(gl.join(c[4], c[5]), gl.join(c[6], c[7]))
    a = gl.join(g0, g1)  # [w, lr, s_hi, q, s_lo, p, h, g]: a join appends its new dimension last
    a = gl.permute(a, (0, 7, 1, 2, 4, 6, 3, 5))  # [w, g, lr, s_hi, s_lo, h, q, p]
    a = gl.reshape(a, (ROWS, 128))  # row 16 w + 8 g + lr, column 64 s_hi + 16 s_lo + 8 h + 2 q + p
    return gl.convert_layout(a, A_OP, assert_trivial=True)


@gluon.jit
def _tile(words, xv, x_smem, s_ptr, rows, tiles_k, t, acc, SUB: gl.constexpr, MMA: gl.constexpr = MMA,
          A_OP: gl.constexpr = A_OP):
    # one group: x's 16 x 128 tile into shared memory, the codes' MMA, the product scaled into acc
    _barrier()  # every warp done with the last tile's x
    x_smem.store(xv)
    fence_async_shared()
    _barrier()
    a = _dequant(words, SUB, A_OP, acc.shape[0])
    part = warpgroup_mma(a, x_smem.permute((1, 0)), gl.zeros(acc.shape, gl.float32, layout=MMA), use_acc=False)
    if not SUB:  # the MMA took 128 + code: less 136 x the group's sum of x, a token
        xs = gl.convert_layout(gl.sum(xv.to(gl.float32), axis=1), gl.SliceLayout(0, MMA))
        part = part - 136.0 * xs[None, :]
    s = gl.load(s_ptr + rows * tiles_k + t).to(gl.float32)
    return acc + part * s[:, None]


@gluon.jit
def _store_y(acc, y_ptr, ws_ptr, count_ptr, rows, cols, M, N, DET: gl.constexpr, MMA: gl.constexpr = MMA):
    # DET, as llmc's qlinear: bf16 y; with K splits, the split that arrives last sums the partials in order.
    # Otherwise the splits add into an fp32 y atomically
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    if DET:
        y_at = y_ptr + cols[None, :] * N + rows[:, None]
        n_split = gl.num_programs(1)
        if n_split == 1:
            gl.store(y_at, acc.to(gl.bfloat16), mask=cols[None, :] < M)
        else:
            ws_at = ws_ptr + cols[None, :] * N + rows[:, None]
            live = (cols[None, :] < M) & (rows[:, None] >= 0)  # the rows of x there are, acc's shape
            gl.store(ws_at + pid_k * 16 * N, acc, mask=live)
            _barrier()  # every thread's partials written before the arrival is counted
            if gl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") == n_split - 1:
                gl.atomic_xchg(count_ptr + pid_n, 0)
                tot = gl.zeros(acc.shape, gl.float32, layout=MMA)
                for sp in range(n_split):
                    tot += gl.load(ws_at + sp * 16 * N, mask=live, other=0.0, cache_modifier=".cg")
                gl.store(y_at, tot.to(gl.bfloat16), mask=cols[None, :] < M)
    else:
        gl.atomic_add(y_ptr + cols[None, :] * N + rows[:, None], acc, mask=cols[None, :] < M)


@gluon.jit
def int4_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, KSPLIT, SUB: gl.constexpr,
                     TILES: gl.constexpr = 1, AHEAD: gl.constexpr = 1, ws_ptr=None, count_ptr=None,
                     DET: gl.constexpr = False, WG: gl.constexpr = 1, LW: gl.constexpr = WORDS,
                     LM: gl.constexpr = MMA, LA: gl.constexpr = A_OP, LX: gl.constexpr = X_LD):
    # y[m, n] += sum_k x[m, k] (code[n, k] - 8) s[n, k // 128] over this program's KSPLIT groups; M <= 16.
    # WG warpgroups (1 or 2) of 64 weight rows each, sharing x's tile; LW, LM, LA, LX: WG's layouts (WORDS, MMA,
    # A_OP, X_LD for 1; WORDS8, ... for 2)
    # TILES groups a loop step (1 or 2; KSPLIT a multiple), the next step's words loaded before this one's math
    # (with TILES 1, AHEAD 2: the next two tiles' words); DET, ws_ptr, count_ptr: as `_store_y`
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    tiles_k = K // 128
    w = _at(4 * WG, 0, LW)  # warp: warpgroup w // 4 takes the 64-row tile pid_n * WG + w // 4
    w_idx = (w // 4) * tiles_k * 1024 + ((((w % 4) * 2 + _at(2, 2, LW)) * 8 + _at(8, 1, LW)) * 4 + _at(4, 3, LW)) * 4 \
        + _at(4, 4, LW)
    acc = gl.zeros([64 * WG, 16], gl.float32, layout=LM)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [16, 128], X_SMEM)
    xm = gl.arange(0, 16, layout=gl.SliceLayout(1, LX))
    xk = gl.arange(0, 128, layout=gl.SliceLayout(0, LX))
    x_rows = x_ptr + xm[:, None] * stride_xm + xk[None, :]
    x_ok = xm[:, None] < M
    rows = pid_n * 64 * WG + gl.arange(0, 64 * WG, layout=gl.SliceLayout(1, LM))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, LM))
    t0 = pid_k * KSPLIT
    tile_ptr = w_ptr + (pid_n * WG * tiles_k).to(gl.int64) * 1024
    if TILES == 1:
        words = gl.load(tile_ptr + t0 * 1024 + w_idx)
        if AHEAD == 2:
            nxt = gl.load(tile_ptr + gl.minimum(t0 + 1, tiles_k - 1) * 1024 + w_idx)
        for t in range(t0, t0 + KSPLIT):
            if AHEAD == 2:
                nn = gl.load(tile_ptr + gl.minimum(t + 2, tiles_k - 1) * 1024 + w_idx)
            else:
                nxt = gl.load(tile_ptr + gl.minimum(t + 1, tiles_k - 1) * 1024 + w_idx)  # the next tile's, ahead
            xv = gl.load(x_rows + t * 128, mask=x_ok, other=0.0)
            acc = _tile(words, xv, x_smem, s_ptr, rows, tiles_k, t, acc, SUB, LM, LA)
            words = nxt
            if AHEAD == 2:
                nxt = nn
    else:
        w0 = gl.load(tile_ptr + t0 * 1024 + w_idx)
        w1 = gl.load(tile_ptr + (t0 + 1) * 1024 + w_idx)
        for t in range(t0, t0 + KSPLIT, 2):
            n0 = gl.load(tile_ptr + gl.minimum(t + 2, tiles_k - 1) * 1024 + w_idx)  # the next step's, ahead
            n1 = gl.load(tile_ptr + gl.minimum(t + 3, tiles_k - 1) * 1024 + w_idx)
            x0 = gl.load(x_rows + t * 128, mask=x_ok, other=0.0)
            x1 = gl.load(x_rows + (t + 1) * 128, mask=x_ok, other=0.0)
            acc = _tile(w0, x0, x_smem, s_ptr, rows, tiles_k, t, acc, SUB, LM, LA)
            acc = _tile(w1, x1, x_smem, s_ptr, rows, tiles_k, t + 1, acc, SUB, LM, LA)
            w0 = n0
            w1 = n1
    _store_y(acc, y_ptr, ws_ptr, count_ptr, rows, cols, M, N, DET, LM)


@gluon.jit
def int4_gemv_xall_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, KT: gl.constexpr, AHEAD: gl.constexpr = 1,
                          RAW: gl.constexpr = False, ws_ptr=None, count_ptr=None, DET: gl.constexpr = False):
    # (ws_ptr, count_ptr: the split sums' workspace [splits, 16, N] and tile counters, read with DET only)
    # int4_gemv_kernel with the split's whole x [16, KT x 128] put in shared memory first: the loop then only
    # loads words and scales, dequantizes and multiplies. AHEAD: 1 or 2 tiles' words loaded ahead. RAW: the MMA
    # takes 128 + code (no subtraction a pair) and each group's product less 136 x its sum of x, the sums made
    # once before the loop
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    tiles_k = K // 128
    w_idx = (((_at(4, 0, WORDS) * 2 + _at(2, 2, WORDS)) * 8 + _at(8, 1, WORDS)) * 4 + _at(4, 3, WORDS)) * 4 \
        + _at(4, 4, WORDS)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [KT, 16, 128], X_SMEM3)
    xm = gl.arange(0, 16, layout=gl.SliceLayout(1, X_LD))
    xk = gl.arange(0, 128, layout=gl.SliceLayout(0, X_LD))
    t0 = pid_k * KT
    x_rows = x_ptr + xm[:, None] * stride_xm + t0 * 128 + xk[None, :]
    xs_smem = gl.allocate_shared_memory(gl.float32, [KT, 16], XS_SMEM)
    for i in gl.static_range(KT):
        xv = gl.load(x_rows + i * 128, mask=xm[:, None] < M, other=0.0)
        x_smem.index(i).store(xv)
        if RAW:
            xs_smem.index(i).store(gl.sum(xv.to(gl.float32), axis=1))
    fence_async_shared()
    _barrier()
    rows = pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, MMA))
    acc = gl.zeros([64, 16], gl.float32, layout=MMA)
    tile_ptr = w_ptr + (pid_n * tiles_k + t0).to(gl.int64) * 1024 + w_idx
    s_row = s_ptr + rows * tiles_k + t0
    words = gl.load(tile_ptr)
    if AHEAD == 2:
        nxt = gl.load(tile_ptr + 1024 * (KT > 1))
    for i in range(KT):
        if AHEAD == 2:
            nn = gl.load(tile_ptr + gl.minimum(i + 2, KT - 1) * 1024)
        else:
            nxt = gl.load(tile_ptr + gl.minimum(i + 1, KT - 1) * 1024)
        a = _dequant(words, not RAW)
        part = warpgroup_mma(a, x_smem.index(i).permute((1, 0)), gl.zeros([64, 16], gl.float32, layout=MMA),
                             use_acc=False)
        if RAW:
            part = part - 136.0 * xs_smem.index(i).load(gl.SliceLayout(0, MMA))[None, :]
        acc += part * gl.load(s_row + i).to(gl.float32)[:, None]
        words = nxt
        if AHEAD == 2:
            nxt = nn
    _store_y(acc, y_ptr, ws_ptr, count_ptr, rows, cols, M, N, DET)
'''


def load_kernel():
    """The kernel module, through llmc's kernel cache (Gluon reads a kernel's source from its file). Its shared
    pieces come from llmc's rendered kernel (one warpgroup, bf16), registered under the name the source imports."""
    from llmc.codegen.cache import load_source
    from llmc.codegen.kernels import load
    from llmc.codegen.qwgmma import QWgmmaSpec
    sys.modules["gluon_int4_lab_product"] = load(QWgmmaSpec("bf16", 1), pdl=False)
    return load_source(KERNEL_SOURCE, "gluon_int4_lab")


def wg_layouts(mod, wg: int) -> tuple:
    """The layouts `int4_gemv_kernel` takes for `wg` warpgroups (LW, LM, LA, LX)."""
    return (mod.WORDS, mod.MMA, mod.A_OP, mod.X_LD) if wg == 1 else (mod.WORDS8, mod.MMA8, mod.A_OP8, mod.X_LD8)


SASS_VARIANTS = {  # name: (kernel, constexprs, codes a thread a loop step)
    "sub": ("int4_gemv_kernel", {"SUB": True, "TILES": 1}, 64),
    "xsums": ("int4_gemv_kernel", {"SUB": False, "TILES": 1}, 64),
    "2tiles": ("int4_gemv_kernel", {"SUB": True, "TILES": 2}, 128),
    "xall": ("int4_gemv_xall_kernel", {"KT": 8, "AHEAD": 1, "RAW": False, "DET": False}, 64),
    "xraw": ("int4_gemv_xall_kernel", {"KT": 8, "AHEAD": 1, "RAW": True, "DET": False}, 64),
    "xall-det": ("int4_gemv_xall_kernel", {"KT": 8, "AHEAD": 1, "RAW": False, "DET": True}, 64),
    "sub-det-a2": ("int4_gemv_kernel", {"SUB": True, "TILES": 1, "AHEAD": 2, "DET": True}, 64),
    "sub-det-wg2": ("int4_gemv_kernel", {"SUB": True, "TILES": 1, "DET": True, "WG": 2}, 64),
}


def sass_counts(variant: str = "sub") -> dict:
    """Compile a variant for sm_90 here (no GPU needed) and count its MMA loop's instructions a thread."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sass_loop import cuobjdump, loop_opcodes
    name, consts, codes = SASS_VARIANTS[variant]
    consts = {"AHEAD": 1, "DET": False, **consts}  # every constexpr named, defaults too
    mod = load_kernel()
    fn = getattr(mod, name)
    warps = 4
    if name == "int4_gemv_kernel":
        consts = {"WG": 1, **consts}
        consts.update(zip(("LW", "LM", "LA", "LX"), wg_layouts(mod, consts["WG"])))
        warps = 4 * consts["WG"]
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "y_ptr": "*fp32", "M": "i32", "N": "i32",
           "K": "i32", "stride_xm": "i32"}
    if name == "int4_gemv_kernel":
        sig["KSPLIT"] = "i32"
    sig.update(ws_ptr="*fp32", count_ptr="*i32")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a not in ("M", "KSPLIT")}
    sig.update({c: "constexpr" for c in consts})
    sig = {a: sig[a] for a in fn.arg_names if a in sig}  # in the kernel's argument order
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        sass = subprocess.run([str(cuobjdump()), "-sass", str(cubin)], check=True, capture_output=True, text=True)
        res = subprocess.run([str(cuobjdump()), "-res-usage", str(cubin)], check=True, capture_output=True,
                             text=True).stdout
    ops = loop_opcodes(sass.stdout, mma=True)
    regs = int(res.split("REG:")[1].split()[0]) if "REG:" in res else None
    return {"variant": variant, "instructions": sum(ops.values()), "per_code": sum(ops.values()) / codes,
            "registers": regs, "opcodes": dict(collections.Counter(ops).most_common())}


def gpu_main(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quant_bench import graph_time_us
    mod = load_kernel()
    dev = "cuda"
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        scales = ((torch.rand(n, k // 128, generator=gen) + 0.5) / 40).to(torch.bfloat16)
        words = pack(codes.to(dev))
        s = scales.to(dev)
        w_ref = (codes.to(dev).float() - 8) * s.float().repeat_interleave(128, dim=1)
        copies = max(1, -(-2 * (60 << 20) // (words.numel() * 4)))
        ws = [words] + [words.clone() for _ in range(copies - 1)]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(dev)
            ref = x.float() @ w_ref.T
            tiles_k = k // 128
            ws_buf = torch.zeros(32 * 16 * n, dtype=torch.float32, device=dev)
            count = torch.zeros(n // TILE_N, dtype=torch.int32, device=dev)
            for variant in args.variants.split(","):
                base, det, ahead = variant.split("-")[0], "-det" in variant, 2 if "-a2" in variant else 1
                wg = 2 if "-wg2" in variant and base not in ("xall", "xraw") else 1
                sub, tiles = base != "xsums", 2 if base == "2tiles" else 1
                for split in [v for v in (1, 2, 4, 8, 16) if tiles_k % (v * tiles) == 0]:
                    if base in ("xall", "xraw") and tiles_k // split > 16:
                        continue  # x in shared memory: 4 KB a group
                    y = torch.zeros(m, n, dtype=torch.bfloat16 if det else torch.float32, device=dev)
                    grid = (n // (TILE_N * wg), split)
                    row = {"shape": name, "m": m, "variant": variant, "split": split}
                    last = dict(AHEAD=ahead, ws_ptr=ws_buf, count_ptr=count, DET=det, num_warps=4)
                    if base in ("xall", "xraw"):
                        kernel = mod.int4_gemv_xall_kernel
                        last.update(KT=tiles_k // split, RAW=base == "xraw")
                    else:
                        kernel = mod.int4_gemv_kernel
                        last.update(KSPLIT=tiles_k // split, SUB=sub, TILES=tiles, WG=wg, num_warps=4 * wg,
                                    **dict(zip(("LW", "LM", "LA", "LX"), wg_layouts(mod, wg))))
                    try:
                        kernel[grid](x, words, s, y, m, n, k, x.stride(0), **last)
                        torch.cuda.synchronize()
                        row["rel_err"] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                        calls = [lambda w=w, y=y, kernel=kernel, last=last, grid=grid:
                                 kernel[grid](x, w, s, y, m, n, k, x.stride(0), **last) for w in ws]
                        row["us"] = graph_time_us(calls, args.reps)
                        row["tb_s"] = (words.numel() * 4 + s.numel() * 2) / (row["us"] * 1e-6) / 1e12
                    except Exception as exc:  # reported, not fatal: the lab's first run on a GPU's triton
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        if args.out:  # after each linear, so that a run cut short keeps what it measured
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "gluon_int4_lab.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "rows": rows},
                                                                indent=1))
    print("\n| linear | rows | variant | best K split | us | TB/s | rel err |")
    print("|---|---|---|---|---|---|---|")
    best = {}
    for r in rows:
        key = (r["shape"], r["m"], r["variant"])
        if "us" in r and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    for (name, m, variant), r in best.items():
        print(f"| {name} | {m} | {variant} | {r['split']} | {r['us']:.1f} | {r['tb_s']:.2f} | {r['rel_err']:.1e} |")
    errors = [r for r in rows if "error" in r]
    if errors:
        print(f"{len(errors)} runs failed; the first: {errors[0]}")


def compare(lab_rows: list[dict], probe_rows: list[dict]) -> list[dict]:
    """Per linear and row count: the fastest lab variant (any K split) against llmc's fastest qlinear variant
    (`qlinear_probe.py`'s rows), and the four linears summed a layer; only runs whose bits were checked."""
    out = []
    for shape in SHAPES:
        for m in sorted({r["m"] for r in lab_rows}):
            lab = [r for r in lab_rows if r["shape"] == shape and r["m"] == m and "us" in r and r["rel_err"] < 1e-2]
            ref = [r for r in probe_rows if r["shape"] == shape and r["m"] == m and r.get("format") == "int4-g128"
                   and not r["variant"].startswith("wgmma")]  # the Triton qlinear's own variants
            if lab and ref:
                a, b = min(lab, key=lambda r: r["us"]), min(ref, key=lambda r: r["us"])
                out.append({"shape": shape, "m": m, "gluon_us": a["us"], "gluon": f"{a['variant']} split {a['split']}",
                            "qlinear_us": b["us"], "qlinear": b["variant"], "speedup": b["us"] / a["us"]})
    for m in sorted({r["m"] for r in out}):
        rows = [r for r in out if r["m"] == m]
        if len(rows) == len(SHAPES):
            g, q = sum(r["gluon_us"] for r in rows), sum(r["qlinear_us"] for r in rows)
            out.append({"shape": "a layer", "m": m, "gluon_us": g, "gluon": "", "qlinear_us": q, "qlinear": "",
                        "speedup": q / g})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass", action="store_true", help="compile for sm_90 here and count instructions (no GPU)")
    ap.add_argument("--compare", nargs=2, metavar=("LAB_JSON", "PROBE_JSON"),
                    help="the lab's timings against qlinear_probe.py's, per linear and a layer (no GPU)")
    ap.add_argument("--out", help="directory for gluon_int4_lab.json")
    ap.add_argument("--shapes", default="gate_up,down,qkv,o_proj", help="8B linears (comma-separated)")
    ap.add_argument("--ms", default="1,16", help="rows of x (comma-separated, at most 16)")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed (median)")
    ap.add_argument("--variants", default="sub,2tiles,xall,xraw,xall-det,xraw-det",
                    help="kernels to time (comma-separated; also xsums; suffixes -det, -a2, -wg2)")
    args = ap.parse_args()
    if args.sass:
        import triton
        print(f"triton {triton.__version__}, sm_90, 4 warps: the MMA loop's instructions a thread")
        for variant in SASS_VARIANTS:
            c = sass_counts(variant)
            print(f"{variant:7s} {c['instructions']} instructions a loop step, "
                  f"{c['per_code']:.2f} a code, {c['registers']} registers; "
                  + ", ".join(f"{k} {v}" for k, v in list(c["opcodes"].items())[:8]))
        return
    if args.compare:
        lab_rows = json.loads(Path(args.compare[0]).read_text())["rows"]
        probe_rows = json.loads(Path(args.compare[1]).read_text())
        print("| linear | rows | Gluon us (variant) | qlinear us (variant) | qlinear / Gluon |")
        print("|---|---|---|---|---|")
        for r in compare(lab_rows, probe_rows):
            print(f"| {r['shape']} | {r['m']} | {r['gluon_us']:.1f} {r['gluon']} | {r['qlinear_us']:.1f} {r['qlinear']} | "
                  f"{r['speedup']:.2f}x |")
        return
    if not torch.cuda.is_available():
        sys.exit("gluon_int4_lab: timing needs a CUDA GPU (--sass counts instructions without one)")
    gpu_main(args)


if __name__ == "__main__":
    main()
