"""int4 g128 decode GEMV on Hopper's warpgroup MMA, its codes loaded straight into the MMA's registers (Gluon).

llmc's int4 qlinear (Triton, `qmatmul_linear.py.jinja`) dequantizes in registers, but its codes reach the MMA
operand's register layout through shared memory, two bytes a load, then byte permutes and shifts: Triton
chooses that path and a kernel cannot name the operand's layout. On an H200 the int4 decode is bound by
issuing those instructions, not by HBM (benchmarks/RESULTS.md). This kernel is written in Gluon, Triton's
explicit-layout dialect, over a weight layout made for it once, when a plan first launches it:

- A 64-row x 128-column tile (one scale group) is 1,024 int32 words. A word holds the 8 codes one thread of the
  warpgroup MMA's A operand needs from a 16 x 16 block: rows r and r + 8, columns k, k + 1, k + 8, k + 9
  (`word_position`). A thread's 4 words of a tile are one 16-byte load; a warp reads 512 contiguous bytes.
- Inline PTX turns a word into 4 pairs of x's dtype less 8 (3 shifts, 4 LOP3s, 4 packed FMAs: 1.375
  instructions a code); joins, a permute and a reshape make the operand, and `convert_layout(...,
  assert_trivial=True)` proves when the kernel compiles that no data moves.
- x's 16-row tiles (up to 4) are the MMA's B operands (through shared memory), each against the same codes;
  each group's products take their scales; K splits are summed in a fixed order by the split that arrives
  last. Every 16-row tile runs the same operations, so a row's sums never depend on M.

Its main loop issues 2.4 instructions a code on sm_90 against the qlinear's 3.6 (`benchmarks/gluon_int4_lab.py
--sass`). It takes int4 with groups of 128 and no zero points, no bias or activation, bf16 / f16 x of up to 64
rows, N a multiple of 64 and K of 128, on an sm_90 GPU; the qlinear's tuner offers it beside its own configs
where every M sharing the choice is at most 64 (every decode bucket, batch-invariant or not), and keeps it only
where it is faster over the buckets that share the choice.

Its tall form (`QWgmmaSpec.rows` 64 or 128, `tall_candidates`) takes any M: a program runs one MMA of 64 or 128
of x's rows against each dequantized group, so that at a full decode batch (128 rows: 256 FLOPs a weight, where
the tensor cores, not the weight's bytes, set the pace) the dequantization is spread over 8 times the MMA work of
a 16-row tile. It is timed in the buckets of 32 to 128 tokens that share no choice with another (a row's sums
there may depend on its block of x; `LLMC_QWGMMA_TALL=0` keeps it out). On an H100 the tuning chose it for all
four of the 8B shape's linears at 128 rows (154.0 against 168.6 us a layer for the Triton kernel's choices), and
the int4 decode step of 128 sequences ran 4.6% faster (benchmarks/RESULTS.md, 2026-12-08).

The tall form's pipelined configs (`PIPE`, `pipe_candidates`; timed only where `LLMC_QWGMMA_PIPE=1` until their
sums have been checked on a GPU) store each group's folded codes into shared memory and leave its MMA, read from
there, in flight while the next group is dequantized: the register-operand forms must wait for each MMA first
(triton-lang/triton#9433), so their tensor cores and dequantization take turns.

A weight either form runs holds its codes twice on the GPU (the nibble planes for the other buckets, these words
for this one): int4's GPU memory for the chosen linears doubles.
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from llmc.codegen.kernels import KernelSpec, tile_counters
from llmc.errors import CompileError
from llmc.intmath import cdiv

TILE_N, TILE_K = 64, 128  # a tile: 64 weight rows (a warpgroup's 4 warps x 16), one group of 128 columns
WORDS_A_TILE = TILE_N * TILE_K // 8
MAX_TILES = 4  # x's 16-row tiles (the MMA's N) a launch takes, each its own MMA against the same codes
MAX_ROWS = 16 * MAX_TILES
# (warpgroups, groups' words loaded ahead, programs as a multiple of qmatmul.TARGET_PROGRAMS) the tuner tries: the
# fastest at 1 and 16 rows of the 8B linears on an H100 took 1-2x (benchmarks/gluon_int4_lab.py)
CONFIGS = ((1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 2, 1))
# configs not yet chosen on a GPU, timed where `LLMC_QWGMMA_TRY=1` (`tuned_candidates`): 4 warpgroups, 256 weight
# rows a program, which read x's tiles from L2 half as often as 2 (on an H200 the batch-invariant tuning of the 8B
# int4 linears chose none: benchmarks/RESULTS.md, 2026-12-07, x a group ahead)
TRIAL_CONFIGS = ((4, 1, 1), (4, 1, 2))
# (x's rows a program, warpgroups, programs as a multiple of qmatmul.TARGET_PROGRAMS, FOLD) of the kernel's taller
# form, for steps of more than 64 tokens (`tall_candidates`): one MMA of 64 or 128 columns (x's rows) a group, where
# the GEMV runs one of 16 for each 16 rows. At 128 rows the 8B int4 linears are bound by the tensor cores, not by
# the weight's bytes (2 x 128 FLOPs a weight), which a 16-column MMA does not keep busy. x copied a group ahead only.
# FOLD: the scales folded into the codes (rounded once to x's dtype) and the MMAs accumulating straight into one
# fp32 sum, rather than each group's product scaled in fp32 and added (64 fewer registers of products in flight).
# At 128 rows a K split's [splits, M, N] fp32 partials cost more than at the GEMV's 16 rows, so smaller splits are
# timed too: on an H100 (`qlinear_probe.py --variants wgmma-tall-grid --ms 128`) a quarter of the default split took
# qkv from 33.9 us (27.4 at half) to 23.9; o_proj's best was 2 warpgroups of 64 rows at a split of 2 (17.1
# against 18.1), down's the same (44.7 against 45.8); 2 warpgroups of 128 rows, which read x from L2 half as often,
# won no linear.
TALL_CONFIGS = ((128, 1, 1, False), (128, 1, 0.5, False), (128, 2, 1, False), (64, 1, 1, False),
                (128, 1, 1, True), (128, 2, 1, True), (64, 1, 1, True), (64, 2, 1, True),
                (128, 1, 0.25, False), (64, 1, 0.5, False), (64, 2, 0.125, False))
TALL_MIN_ROWS = 32  # the smallest single-bucket M the tall form is timed at (never in a shared, batch-invariant group)
# the largest: a full decode batch. At 512 rows four blocks of x each dequantize the whole weight, and on an H100
# the dequantized library GEMM or the Triton kernel beat it on every 8B linear there (benchmarks/RESULTS.md,
# 2026-12-07, the tall form measured); a step of 129-511 tokens runs the 128-token bucket's choice
TALL_MAX_ROWS = 128
# x's dtype: (Gluon's name, PTX's, the bits of one, of the magic M whose last mantissa bit is 1, of -(M + 8))
DTYPES = {torch.bfloat16: ("bfloat16", "bf16", "0x3F803F80", "0x43004300", "0xC308C308"),
          torch.float16: ("float16", "f16", "0x3C003C00", "0x64006400", "0xE408E408")}


def word_position(rows: torch.Tensor, cols: torch.Tensor, tiles_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(word index, bit offset) of the code at (row, column) of a weight with `tiles_k` groups a row."""
    tn, r = rows // TILE_N, rows % TILE_N
    tk, kk = cols // TILE_K, cols % TILE_K
    w, g, lr = r // 16, (r // 8) % 2, r % 8  # warp, row half (+8), row within the half
    s_hi, s_lo, h, q, p = kk // 64, (kk // 16) % 4, (kk // 8) % 2, (kk // 2) % 4, kk % 2
    word = (tn * tiles_k + tk) * WORDS_A_TILE + (((w * 2 + s_hi) * 8 + lr) * 4 + q) * 4 + s_lo
    return word, 16 * p + 4 * (2 * g + h)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 (N a multiple of 64, K of 128) -> the kernel's int32 words on the codes' device,
    `word_position`'s layout, made one 64-row tile band at a time (a band's int64 temporaries, not the weight's)."""
    n, k = codes.shape
    shifts = torch.tensor([16 * p + 4 * (2 * g + h) for g in (0, 1) for h in (0, 1) for p in (0, 1)],
                          device=codes.device, dtype=torch.int64)
    out = torch.empty(n * k // 8, dtype=torch.int32, device=codes.device)
    band = TILE_N * k // 8
    for i in range(n // TILE_N):
        c = codes[i * TILE_N:(i + 1) * TILE_N].to(torch.int64)
        c = c.view(1, 4, 2, 8, k // TILE_K, 2, 4, 2, 4, 2)  # tn w g lr tk s_hi s_lo h q p
        c = c.permute(0, 4, 1, 5, 3, 8, 6, 2, 7, 9).reshape(-1, 8)  # words in memory order, codes (g, h, p)
        words = (c << shifts).sum(dim=1)
        out[i * band:(i + 1) * band] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return out


def unpack(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The codes [N, K] (int32) back from `pack`'s words."""
    rows = torch.arange(n).repeat_interleave(k)
    cols = torch.arange(k).repeat(n)
    word, bit = word_position(rows, cols, k // TILE_K)
    return ((words.cpu().to(torch.int64)[word] >> bit) & 15).view(n, k).to(torch.int32)


def mirror_operand(tile_words: torch.Tensor) -> torch.Tensor:
    """The kernel's `_operand` on one 64-row tile's 1,024 words, in torch (codes, not values): the inline PTX's 8
    outputs, then the same joins, permute and reshape. Checks `pack` against the kernel's op sequence on a CPU."""
    w5 = tile_words.to(torch.int64).view(4, 2, 8, 4, 4).permute(0, 2, 1, 3, 4)  # memory [w, s_hi, lr, q, s_lo]
    outs = []
    for i in range(4):  # pair i: bits 4i (p = 0) and 16 + 4i (p = 1)
        outs += [(w5 >> (4 * i)) & 15, (w5 >> (16 + 4 * i)) & 15]

    def join(a, b):  # gl.join appends its new dimension last
        return torch.stack([a, b], dim=-1)
    g0 = join(join(outs[0], outs[1]), join(outs[2], outs[3]))
    g1 = join(join(outs[4], outs[5]), join(outs[6], outs[7]))
    a = join(g0, g1)  # [w, lr, s_hi, q, s_lo, p, h, g]
    return a.permute(0, 7, 1, 2, 4, 6, 3, 5).reshape(TILE_N, TILE_K)


@dataclass(frozen=True)
class QWgmmaSpec(KernelSpec):
    """y = x @ W.T for an int4 g128 W without zero points, x and y of `dtype` (bf16 / f16), on `warpgroups`
    warpgroups of 64 weight rows a program."""

    template = "qgemv_wgmma_int4.py.jinja"
    dtype: str
    warpgroups: int = 1
    rows: int = 16  # x's rows an MMA takes: 16 (the GEMV, up to MAX_TILES MMAs), or 64 / 128 (the tall form)
    fold: bool = False  # the tall form's scales folded into the codes, its MMAs summing into one fp32 sum (`FOLD`)
    pipe: bool = False  # the tall form's folded codes through shared memory, one MMA left in flight (`PIPE`)

    def context(self) -> dict[str, Any]:
        gl_name, ptx, one, magic, bias = next(v for v in DTYPES.values() if v[1] == self.dtype)
        tall = self.rows > 16
        return {"dtype": gl_name, "ptx_type": ptx, "one_bits": one, "magic_bits": magic, "bias_bits": bias,
                "magic": "128" if ptx == "bf16" else "1024", "warpgroups": self.warpgroups,
                "max_tiles": MAX_TILES if self.rows == 16 else 1, "xn": self.rows,
                "fold": (self.fold or self.pipe) and tall, "pipe": self.pipe and tall}


def fits(p, dtype: torch.dtype, has_bias: bool, act: str) -> bool:
    """Whether this kernel takes a prepared weight `p` (`qmatmul.PreparedQWeight`) with x of `dtype`."""
    f = p.fmt
    return (f.kind == "int" and f.bits == 4 and f.group_size == TILE_K and not f.has_zeros and not has_bias
            and not act and dtype in DTYPES and p.out_features % TILE_N == 0 and p.in_features % TILE_K == 0
            and p.padded_k == p.in_features)


def offered(device: torch.device) -> bool:
    """Whether a tuning on `device` times this kernel: it runs there (`runs_here`) and `LLMC_QWGMMA` is not 0
    (read at each tuning; the switch keeps the tuner to the Triton kernels, for comparison)."""
    return os.environ.get("LLMC_QWGMMA", "1") != "0" and runs_here(device)


def tall_offered() -> bool:
    """Whether a tuning that offers the kernel also times its tall form (`tall_candidates`): unless
    `LLMC_QWGMMA_TALL=0` (read at each tuning; the switch keeps the tall form out, for comparison)."""
    return os.environ.get("LLMC_QWGMMA_TALL", "1") != "0"


def pipe_offered() -> bool:
    """Whether a tuning that times the tall form also times its pipelined configs (`pipe_candidates`): where
    `LLMC_QWGMMA_PIPE=1` (read at each tuning). Off by default until their sums have been checked on a GPU."""
    return os.environ.get("LLMC_QWGMMA_PIPE", "0") == "1"


def runs_here(device: torch.device) -> bool:
    """Whether the device runs the kernel: an NVIDIA GPU of compute capability 9.0 (warpgroup MMA), compiled."""
    from llmc.codegen.elementwise import interpreting
    return (device.type == "cuda" and torch.version.hip is None and not interpreting()
            and torch.cuda.get_device_capability(device) == (9, 0))


def candidates(n: int, k: int, configs=CONFIGS) -> list[dict]:
    """The tuner's configs of this kernel for a weight of n rows and k columns, each with x's tiles loaded when
    used and copied a group ahead (`XASYNC`: on an H200 the batch-invariant tuning chose the copies ahead for
    the 8B int4 QKV, gate/up and down projections); K splits as the qlinear's own (`qmatmul._split`: a power of
    two, at most 16, dividing K's groups)."""
    from llmc.codegen.qmatmul import _split  # qmatmul imports this module
    out = []
    for wg, ahead, scale in configs:
        if n % (TILE_N * wg):
            continue
        out.append({"WGMMA": True, "WG": wg, "AHEAD": ahead, "SPLIT_K": _split(n, k, TILE_N * wg, TILE_K, scale)})
    out = [dict(c) for c in dict.fromkeys(tuple(c.items()) for c in out)]
    return out + [dict(c, XASYNC=True) for c in out]


def trial_candidates(n: int, k: int) -> list[dict]:
    """The configs of `TRIAL_CONFIGS`; `benchmarks/qlinear_probe.py --variants wgmma-trial` measures them alone."""
    return candidates(n, k, TRIAL_CONFIGS)


def tall_candidates(n: int, k: int, m: int = 128) -> list[dict]:
    """The tall form's configs (`TALL_CONFIGS`, `XN` rows of x a program) for a bucket of `m` tokens (32+); its
    `FOLD` configs unless `LLMC_QWGMMA_FOLD=0` (read at each tuning). From `qmatmul.LARGE_M` tokens on, no K split:
    x's blocks alone make programs enough, and split partials would take [splits, M, N] fp32 (as the qlinear's
    prefill tiles)."""
    from llmc.codegen.qmatmul import LARGE_M, _split
    fold = os.environ.get("LLMC_QWGMMA_FOLD", "1") != "0"
    out = [{"WGMMA": True, "XN": xn, "WG": wg, "AHEAD": 1,
            "SPLIT_K": 1 if m >= LARGE_M else _split(n, k, TILE_N * wg, TILE_K, scale),
            "XASYNC": True, **({"FOLD": True} if f else {})}
           for xn, wg, scale, f in TALL_CONFIGS if n % (TILE_N * wg) == 0 and (fold or not f)]
    return [dict(c) for c in dict.fromkeys(tuple(c.items()) for c in out)]


def pipelined(configs: list[dict]) -> list[dict]:
    """Tall configs' unfolded ones as `PIPE` configs: each group's codes, times their scales (as `FOLD`'s), stored
    into one of two shared-memory buffers, its MMA read from there and left in flight while the next group is
    dequantized (at most one in flight). The register-operand forms cannot overlap the two: their MMA reads
    registers the next group's code may reuse (triton-lang/triton#9433), so each waits."""
    return [dict(c, PIPE=True) for c in configs if not c.get("FOLD")]


def pipe_candidates(n: int, k: int, m: int = 128) -> list[dict]:
    """The tuner's pipelined configs: `tall_candidates`, `pipelined`."""
    return pipelined(tall_candidates(n, k, m))


def tuned_candidates(n: int, k: int) -> list[dict]:
    """What a tuning times of this kernel: `candidates`, and `trial_candidates` too where `LLMC_QWGMMA_TRY=1`
    (read at each tuning), until GPU timings show them worth their tuning time."""
    extra = trial_candidates(n, k) if os.environ.get("LLMC_QWGMMA_TRY", "0") == "1" else []
    return candidates(n, k) + extra


_WORDS: dict[int, torch.Tensor] = {}  # id(prepared qweight) -> its words (made by the first launch)


def words_of(p) -> torch.Tensor:
    """The prepared weight's codes in this kernel's layout, made by its first launch (eager: a CUDA graph's
    warm-up run, never its capture) and kept as long as the weight's own codes live."""
    key = id(p.qweight)
    w = _WORDS.get(key)
    if w is None:
        if p.qweight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the int4 wgmma kernel makes its weight layout on its first launch: run the step "
                               "once eagerly before a CUDA graph captures it")
        w = _WORDS[key] = pack(p.codes())  # `fits`: K holds no padding
        weakref.finalize(p.qweight, _WORDS.pop, key, None)
    return w


def launch(compiled, x2: torch.Tensor, p, y2: torch.Tensor, cfg: dict) -> None:
    """One call on rows x2 [M, K] into y2 [M, N]: the GEMV (M <= MAX_ROWS), or the tall form (`XN` in `cfg`: any
    M, grid (x's blocks of XN rows, weight tiles, K splits), so that the blocks sharing a weight tile run side by
    side); `compiled` is `elementwise.compiled`."""
    M, N, K = x2.shape[0], p.out_features, p.in_features
    xn = cfg.get("XN", 16)
    if not runs_here(x2.device):
        raise CompileError(f"qlinear: the int4 wgmma kernel runs on an sm_90 GPU, not on {x2.device}; tune on this "
                           f"device again")
    if xn == 16 and M > MAX_ROWS:
        raise CompileError(f"qlinear: the int4 wgmma GEMV takes up to {MAX_ROWS} rows, not {M}; tune again")
    wg, split = cfg["WG"], cfg["SPLIT_K"]
    # cp.async copies 16 bytes a thread: x's rows must start 16-byte aligned, which the compiled kernel knows where
    # Triton specializes x's pointer and row stride as multiples of 16; otherwise x goes through registers, with
    # the same sums
    xasync = bool(cfg.get("XASYNC")) and x2.data_ptr() % 16 == 0 and x2.stride(0) % 16 == 0
    dt = {torch.bfloat16: "bf16", torch.float16: "f16"}[x2.dtype]
    grid = (N // (TILE_N * wg), split) if xn == 16 else (cdiv(M, xn), N // (TILE_N * wg), split)
    ws = torch.empty((split, M, N) if split > 1 else (1,), device=x2.device, dtype=torch.float32)
    counts = tile_counters(x2.device, math.prod(grid[:-1])) if split > 1 else ws  # one a tile the splits share
    compiled(QWgmmaSpec(dt, wg, xn, bool(cfg.get("FOLD")), bool(cfg.get("PIPE")))).qwgmma_kernel[grid](
        x2, words_of(p), p.scales, y2, ws, counts, x2.stride(0), p.scales.stride(0), y2.stride(0), M, N, K,
        cdiv(K // TILE_K, split), AHEAD=cfg["AHEAD"], M_TILES=cdiv(M, 16) if xn == 16 else xn // 16,
        XASYNC=xasync, num_warps=4 * wg)
