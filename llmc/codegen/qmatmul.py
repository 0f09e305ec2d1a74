"""Quantized linear layers (the `qlinear` op): y = act(x @ W.T + b), W in a `QuantFormat` (llmc/ir/quant.py).

At decode a linear is a weight stream, and a quantized one streams a half (int8) or a quarter
(int4) of bf16's bytes: the kernel must turn codes into dot operands as fast as HBM delivers them
and keep enough programs in flight. One template (`qmatmul_linear.py.jinja`) serves the three
formats with matmul.py's machinery: split-K in one launch (the last split of an output tile sums
the partials in split order and runs the epilogue), up to four 16-row tiles per program at up to
64 tokens (W is read once, and a row's sums do not depend on its batch), configs from
`autotune.Tuner` per M bucket. Above 64 tokens the same kernel runs tall tiles: a tiled GEMM
that dequantizes each weight tile in registers.

- ``int`` (weight-only): codes are dequantized in the main loop. A code becomes the exact float
  ``code - zero`` in two ALU instructions (or-ing 2^23's exponent into an int32 code gives the
  float 2^23 + code; subtracting 2^23 + zero leaves code - zero), with no int-to-float conversion,
  an instruction at a fraction of the ALU rate that would cap the stream below HBM speed at int4;
  int4's low nibble comes from its whole byte less 16 x the high nibble (one FMA on the wide
  floating-point pipe instead of a mask on the narrower integer one). That small integer is exact
  in bf16 and f16, so the dot runs in x's dtype without rounding the weight, and the group's scale
  multiplies the fp32 dot of the columns that share it: one multiply per output and group, not
  per weight, and closer to the reference than a weight rounded to bf16. Per-channel scales, bias
  and act are applied once, in the epilogue. Compiled, int4 codes with a bf16 / f16 x skip fp32
  altogether: inline PTX (`NIBBLES_ASM`, with zero points too) puts two nibbles into the
  mantissas of a packed pair and subtracts with one packed FMA, 0.59-0.78x the main loop's
  instructions on Hopper (`benchmarks/sass_loop.py`), where int4 decode is bound by issuing them.
  `SWAP_AB` configs compute (W x.T), making the weight tile the MMA's tall operand: Hopper's wgmma
  takes it from registers, where it was dequantized.
- int4 g128 at up to 64 tokens on an sm_90 GPU can also run `qgemv_wgmma_int4.py.jinja` (llmc/codegen/qwgmma.py):
  Gluon, its codes loaded from a layout of their own straight into the warpgroup MMA's registers; the tuner
  times it beside the Triton kernel in every decode bucket and keeps it where it is faster. Its tall form (one
  MMA of 64 or 128 of x's rows a group) is timed in the buckets of 32 to 128 tokens that share no choice (full
  decode batches; `LLMC_QWGMMA_TALL=0` keeps it out), never in a batch-invariant group.
- int4 at 1 to 4 tokens can also stream through `qgemv_int4.py.jinja` (`QGemvSpec`), on the FMA pipes:
  each int32 word of codes yields its 8 codes with one shift and 8 LOP3s (the and-or into 2^23's
  exponent), one subtraction or FMA each, and one FMA per row of x. It is offered to the tuner only
  where every token count sharing the choice fits it (`llmc compile --no-batch-invariant`: 1 to 4
  share), so a row's sums still never depend on its batch within a group. On the H200 it is not yet
  faster than the tensor-core kernel (8B o_proj 11.3 against 10.2 us, gate/up 57.8 against 43.0 us
  at batch 1; benchmarks/RESULTS.md), so the tuner keeps the latter there.
- ``w8a8``: `quantize_act` (llmc/codegen/act_quant.py) writes int8 codes and a per-token scale; the
  GEMM dots int8 into int32 (exact, so split-K partials add exactly too) and applies both scales in
  the epilogue.
- ``fp8``: the same with e4m3 codes and fp32 accumulation.

Past 64 tokens (prefill chunks, mixed steps) the GEMMs turn compute-bound, and the tuner also times
library GEMMs (`library_candidates`), keeping them where they win: fp8 through `torch._scaled_mm`
(cuBLASLt/CUTLASS with per-token and per-channel scales), w8a8 through `torch._int_mm` and a
generated one-pass epilogue (the GEMM kernel's in its order, so the two agree bit for bit), and int
weights dequantized to x's dtype by a generated kernel (`qdequant.py.jinja`: a pass over W that
only steps of some hundreds of rows amortize) and multiplied by cuBLAS. The 128+ bucket (a full
batch of decodes, up to 1023 rows) also times one tall swapped tile over every row with a K split
(`SPLIT_TALL_TILES`); mixed steps of 512 to 1023 tokens and the largest steps (chunked prefills)
have a 512+ and a 1024+ bucket of their own (`qlinear_bucket`).

`prepare` converts a weight to the kernel's layout once, when a plan is built (`PreparedQWeight`).
"""
from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass
from typing import Any

import torch

from llmc.codegen import qwgmma
from llmc.codegen.act_quant import quantize_act
from llmc.codegen.autotune import M_BUCKETS, Tuner, bucket_size, m_bucket, timing_io
from llmc.codegen.elementwise import HELPERS, cast_expr, cast_helpers, compiled, interpreting, op_expr
from llmc.codegen.kernels import KernelSpec, tile_counters
from llmc.codegen.matmul import MAX_M_TILES, m_tiles
from llmc.errors import CompileError
from llmc.intmath import cdiv
from llmc.ir import quant
from llmc.ir.ops import LINEAR_ACTS
from llmc.ir.quant import QuantFormat, QuantizedWeight
from llmc.ir.types import dtype_name

ACTS = ("",) + tuple(LINEAR_ACTS)
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# columns per nibble plane (int4) or per tile (int8): 64 B of codes per weight row and step, and a
# power of two that divides the group size so that a plane never straddles two scales
MAX_RUN = 64
MIN_RUN = 16  # the shortest K a tensor-core dot takes
# programs a decode launch aims at (the splits of the default config): ~4 per SM of an H200
TARGET_PROGRAMS = 512
GEMV_ROWS = 4  # the most rows of x `qgemv_int4` takes (past it the FMA pipes, not HBM, set the pace)
LARGE_M = 1024  # a qlinear's largest bucket (`qlinear_bucket`), timed at this many rows
# mixed steps of 512 to 1023 tokens (the measured token budget's steps, padded to their piecewise graphs'
# 512): compute-bound like prefill chunks, yet timed at 128 rows they took a full decode batch's choice
MID_M = 512
# the row counts a qlinear's tuning times, one per bucket of `qlinear_bucket`: the decode buckets, then 128+,
# 512+ and 1024+ (mixed steps and prefill chunks), where a library GEMM may win
TUNED_ROWS = (*M_BUCKETS, MID_M, LARGE_M)


# -- the kernel's weight layout --------------------------------------------------------------------

@dataclass(frozen=True)
class PreparedQWeight:
    """A quantized weight in the layout the kernels stream, made once by `prepare`.

    int: ``qweight`` u8 [N, KW * bits / 8], K padded with zero codes to KW, a whole number of pack
    tiles of `pack` columns. An int8 tile is `run` columns, one byte each. An int4 tile holds two
    nibble planes: byte j of tile t has column t*pack + j in its low nibble and column
    t*pack + run + j in its high one, so each plane is a run of contiguous columns inside one scale
    group, dotted against a contiguous slice of x with no interleaving shuffle (the canonical
    layout pairs columns 2j and 2j+1 in a byte). ``scales`` [N, G] and ``zeros`` [N, G] as given.
    w8a8 / fp8: ``qweight`` [N, K] as given, ``scales`` f32 [N].
    """

    fmt: QuantFormat
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    in_features: int
    run: int = 0  # int: columns per plane; 0 for w8a8 / fp8

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def pack(self) -> int:
        """Columns per pack tile (int), 0 for w8a8 / fp8."""
        return self.run * (2 if self.fmt.bits == 4 else 1) if self.fmt.kind == "int" else 0

    @property
    def padded_k(self) -> int:
        """KW: the columns a weight row holds."""
        return self.qweight.shape[1] * (2 if self.fmt.kind == "int" and self.fmt.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        """Bytes a call reads of the weight: codes, scales and zero points."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros) if t is not None)

    def codes(self) -> torch.Tensor:
        """int: the codes [N, KW] (u8, one a byte, in column order, K's padding included)."""
        if self.fmt.bits != 4:
            return self.qweight
        p = self.qweight.view(self.out_features, self.padded_k // self.pack, self.run)
        return torch.stack((p & 0xF, p >> 4), dim=2).reshape(self.out_features, self.padded_k)

    def canonical(self) -> QuantizedWeight:
        """The weight back in llmc/ir/quant.py's layout."""
        if self.fmt.kind != "int":
            return QuantizedWeight(self.fmt, self.qweight, self.scales.reshape(-1, 1), None)
        codes = self.codes()[:, :self.in_features]
        return QuantizedWeight(self.fmt, quant.pack(self.fmt, codes), self.scales, self.zeros)

    def dequantize(self) -> torch.Tensor:
        """The dense fp32 weight [N, K] (for checks; the kernels never materialize it)."""
        return self.canonical().dequantize()


def _run(fmt: QuantFormat) -> int:
    if not fmt.group_size:
        return MAX_RUN
    run = min(MAX_RUN, fmt.group_size & -fmt.group_size)  # the largest power of two dividing the group
    if run < MIN_RUN:
        raise CompileError(f"qlinear: group size {fmt.group_size} ({fmt.label}) is not a multiple of {MIN_RUN}, "
                           f"the shortest run of columns a tensor-core dot takes per scale; quantize with a group "
                           f"size of 32, 64 or 128")
    return run


def _check(fmt: QuantFormat, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> int:
    """K of a weight in the canonical layout, or a CompileError saying what does not match `fmt`."""
    want = {"int": torch.uint8, "w8a8": torch.int8, "fp8": torch.float8_e4m3fn}[fmt.kind]
    if qweight.dim() != 2 or qweight.dtype != want:
        raise CompileError(f"qlinear: {fmt.label} weights are {want} [N, K{'/2' if fmt.bits == 4 else ''}], "
                           f"not {qweight.dtype} {list(qweight.shape)}")
    n, k = qweight.shape[0], qweight.shape[1] * (2 if fmt.kind == "int" and fmt.bits == 4 else 1)
    groups = 1
    if fmt.kind == "int" and fmt.group_size:
        if k % fmt.group_size:
            raise CompileError(f"qlinear: group size {fmt.group_size} does not divide the {k} input columns")
        groups = k // fmt.group_size
    if tuple(scales.shape) != (n, groups) or not scales.dtype.is_floating_point:
        raise CompileError(f"qlinear: {fmt.label} scales should be float [{n}, {groups}], "
                           f"not {scales.dtype} {list(scales.shape)}")
    if fmt.has_zeros != (zeros is not None):
        raise CompileError(f"qlinear: {fmt.label} {'needs' if fmt.has_zeros else 'takes no'} zero points")
    if zeros is not None and (zeros.shape != scales.shape or zeros.dtype != torch.uint8):
        raise CompileError(f"qlinear: zero points should be u8 {list(scales.shape)}, like the scales, "
                           f"not {zeros.dtype} {list(zeros.shape)}")
    # 0..2^bits: classic GPTQ checkpoints store zero - 1, so a zero of 0 wraps and reads back as 16 (4-bit);
    # code - zero stays exact in every path (fp32, and MAGIC + 16 in the PTX's bf16 / f16)
    if zeros is not None and zeros.numel() and int(zeros.max()) > 1 << fmt.bits:
        raise CompileError(f"qlinear: a zero point of {int(zeros.max())} is outside the {fmt.bits}-bit codes' range "
                           f"0..{1 << fmt.bits}")
    if any(t.device != qweight.device for t in (scales, zeros) if t is not None):
        raise CompileError("qlinear: qweight, scales and zeros must be on one device")
    return k


def prepare(fmt: QuantFormat, qweight: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor | None = None) -> PreparedQWeight:
    """Convert a quantized weight from quant.py's canonical layout to the kernels' (once, at load).

    Args:
        fmt: the weight's format.
        qweight, scales, zeros: the canonical tensors (see llmc/ir/quant.py), on the device the
            kernels will run on.

    Returns:
        The prepared weight (tensors on the same device). int4 is repacked into nibble planes and
        int K is padded to whole pack tiles (see `PreparedQWeight`); 8-bit codes are used as given.

    Example:
        >>> qw = quant.quantize_rtn(torch.randn(96, 256), QuantFormat("int", 4, 64))
        >>> p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
        >>> torch.equal(p.dequantize(), qw.dequantize())
        True
    """
    k = _check(fmt, qweight, scales, zeros)
    if fmt.kind != "int":
        return PreparedQWeight(fmt, qweight.contiguous(), scales.float().reshape(-1).contiguous(), None, k)
    run = _run(fmt)
    pack = run * (2 if fmt.bits == 4 else 1)
    kw = cdiv(k, pack) * pack
    codes = quant.codes(fmt, qweight)
    if kw != k:
        codes = torch.nn.functional.pad(codes, (0, kw - k))  # zero codes: x is masked to 0 there
    if fmt.bits == 4:
        t = codes.view(codes.shape[0], kw // pack, 2, run)
        codes = t[:, :, 0] | (t[:, :, 1] << 4)
    return PreparedQWeight(fmt, codes.reshape(qweight.shape[0], -1).contiguous(), scales.contiguous(),
                           zeros.contiguous() if zeros is not None else None, k, run)


# -- kernel specs ----------------------------------------------------------------------------------

def _sum(*terms) -> str:
    """The expression of a sum of constants, names and (factor, constant or name) products, constants folded."""
    const, names = 0.0, []
    for t in terms:
        f, v = t if isinstance(t, tuple) else (1.0, t)
        if isinstance(v, str):
            names.append(v if f == 1.0 else f"{f} * {v}")
        else:
            const += f * v
    return " + ".join([repr(const)] + names)


# Per 2 bytes of int4 codes (a 16-bit register: Triton packs 2 u8 elements, element 0 in the low byte;
# 2 is what a thread holds contiguously of a wgmma register operand, so no bytes are moved to pack more),
# the low and the high nibble of each, less the zero point 8, as a bf16 / f16 pair (one 32-bit register
# per plane, element 0 in the low half). `prmt` spreads the two bytes into the two halves of a register;
# `and`-`or` (one LOP3) puts a nibble into the mantissa of MAGIC (2^7 for bf16, 2^10 for f16, whose last
# mantissa bit is worth 1), giving MAGIC + q exactly; one packed FMA subtracts MAGIC + 8. That is 6
# instructions for 4 codes where fp32 arithmetic and a conversion take 8 for 2 (byte extraction, shift,
# two ORs, two subtractions, an FMA and a pack per byte).
NIBBLES_ASM = """{
.reg .b32 t, h, one, bias;
mov.b32 one, ONE;
mov.b32 bias, BIAS;
cvt.u32.u16 t, $2;
prmt.b32 t, t, 0, 0x4140;
shr.u32 h, t, 4;
lop3.b32 t, t, 0x000F000F, MAGIC, 0xea;
lop3.b32 h, h, 0x000F000F, MAGIC, 0xea;
fma.rn.TYPE $0, t, one, LOW_BIAS;
fma.rn.TYPE $1, h, one, HIGH_BIAS;
}"""
# With zero points the addends are operands instead of `bias`: each element's -(MAGIC + zero) in x's
# dtype (an integer of at most 9 significant bits: exact for the 0..15 of int4), $3 for the low plane
# and $4 for the high one (`bias` is then unused, and ptxas drops it).
# (MAGIC, ONE, BIAS = -(MAGIC + 8)) as 16-bit patterns, the PTX type and MAGIC's value, per x dtype
NIBBLE_CONSTANTS = {"bf16": (0x4300, 0x3F80, 0xC308, "bf16x2", 128), "f16": (0x6400, 0x3C00, 0xE408, "f16x2", 1024)}


def _nibbles_asm(dtype: str, zero_points: bool = False) -> str:
    """The PTX of `_nibbles` (`_nibbles_zp` with `zero_points`) for x's dtype; "" where none applies."""
    if dtype not in NIBBLE_CONSTANTS:
        return ""
    magic, one, bias, ptx_type, _ = NIBBLE_CONSTANTS[dtype]
    twice = lambda v: f"0x{v:04X}{v:04X}"  # noqa: E731
    low, high = ("$3", "$4") if zero_points else ("bias", "bias")
    return (NIBBLES_ASM.replace("LOW_BIAS", low).replace("HIGH_BIAS", high).replace("MAGIC", twice(magic))
            .replace("ONE", twice(one)).replace("BIAS", twice(bias)).replace("TYPE", ptx_type))


def _act_lines(act: str, helpers: set[str]) -> list[str]:
    if not act:
        return []
    op, attrs = ("gelu", {"approximate": "tanh"}) if act == "gelu_tanh" else (act, {})
    return [f"acc = {op_expr(op, ['acc'], attrs, helpers)}"]


def _summary(act: str, has_bias: bool) -> str:
    """The kernel's formula, for its docstring: act(x @ W.T + b)."""
    s = "x @ W.T" + (" + b" if has_bias else "")
    return f"{act}({s})" if act else s


@dataclass(frozen=True)
class QMatmulSpec(KernelSpec):
    """y = act(x @ W.T + b) for W in format (kind, bits, group_size, has_zeros) and prepared with
    `run` columns per plane; x, y of `dtype`."""

    template = "qmatmul_linear.py.jinja"
    kind: str
    bits: int
    group_size: int
    has_zeros: bool
    run: int
    dtype: str
    has_bias: bool
    act: str = ""

    def __post_init__(self):
        if self.act not in ACTS:
            raise CompileError(f"qlinear: activation {self.act!r} cannot be fused; use one of "
                               f"{', '.join(map(repr, ACTS))}")

    @classmethod
    def of(cls, p: PreparedQWeight, dtype: torch.dtype, has_bias: bool, act: str) -> "QMatmulSpec":
        f = p.fmt
        return cls(f.kind, f.bits, f.group_size, f.has_zeros, p.run, dtype_name(dtype), has_bias, act)

    @property
    def fmt(self) -> QuantFormat:
        return QuantFormat(self.kind, self.bits, self.group_size, self.has_zeros)

    def key(self, n: int, k: int) -> str:
        """The autotune key: this kernel at a static weight shape [n, k] (apart from matmul's keys)."""
        return f"qlinear[{self.fmt.label},{self.dtype},bias={int(self.has_bias)},act={self.act or 'none'}]N{n}K{k}"

    def context(self) -> dict[str, Any]:
        helpers: set[str] = set()
        act_lines = _act_lines(self.act, helpers)
        int_w, a8 = self.kind == "int", self.kind != "int"
        # the interpreter's tl.dot runs np.matmul on bf16's raw uint16 bits: feed it fp32 there
        # (int8 and fp8 dots it runs exactly: int32 sums, fp8 widened to fp16)
        up = ".to(tl.float32)" if int_w and self.dtype == "bf16" and interpreting() else ""
        if int_w and self.dtype == "f32":
            dot_kwargs = ', input_precision="ieee"'  # tf32 would round x to 10 bits, past the 1e-4 tolerance
        elif self.kind == "fp8":
            # Hopper's fp8 MMA sums in reduced precision: move its sum into the fp32 accumulator every
            # `fp8_promote()` of K (at most once a tile), as the reference sums in fp32
            p = fp8_promote()
            dot_kwargs = f", max_num_imprecise_acc=({p} if a.shape[1] >= {p} else a.shape[1])"
        elif self.kind == "w8a8":
            dot_kwargs = ", out_dtype=tl.int32"  # triton 3.6 checks the accumulator against it (default fp32)
        else:
            dot_kwargs = ""
        ctx = {"int_weights": int_w, "a8": a8, "has_bias": self.has_bias, "has_zeros": self.has_zeros,
               "max_m_tiles": MAX_M_TILES, "act_lines": act_lines, "up": up, "dot_kwargs": dot_kwargs,
               "acc_type": "tl.int32" if self.kind == "w8a8" else "tl.float32", "packed_nibbles": self.packed_nibbles,
               "scale_in_epilogue": a8 or not self.group_size, "store_cast": cast_expr("acc", self.dtype),
               "label": self.fmt.label, "summary": _summary(self.act, self.has_bias),
               "bytes_comment": self._bytes_comment(),
               "layout": "K-major codes" if a8 else f"{'nibble planes' if self.bits == 4 else 'bytes'} "
                                                    f"of {self.run} columns",
               "helpers": [HELPERS[h] for h in sorted(helpers)] + cast_helpers([self.dtype])}
        if int_w:
            ctx.update(self._int_context(up))
        return ctx

    def _int_context(self, up: str) -> dict[str, Any]:
        """The int main loop's lines: per pack tile (scales, zero points, the dequantized planes w0
        and w1) and per row tile ("@": the tile's index; its dots, then the group's scale)."""
        run, four, grouped = self.run, self.bits == 4, bool(self.group_size)
        offsets = [0, run] if four else [0]  # the planes' first columns in a pack tile
        # planes in one scale group are dotted into one partial, multiplied by the scale once
        share = not grouped or self.group_size % (len(offsets) * run) == 0
        units = [offsets] if share else [[o] for o in offsets]
        zero = {o: float(1 << (self.bits - 1)) for o in offsets}  # a plane's zero point: constant or [BLOCK_N, 1]
        prologue, tile = [], []
        if self.has_zeros and not grouped:
            prologue.append("z = tl.load(z_ptr + rn * stride_zn, mask=n_ok, other=0).to(tl.float32)[:, None]")
            zero = {o: "z" for o in offsets}
        for u, unit in enumerate(units if grouped else []):
            tile += [f"g = tl.minimum(k0 + {unit[0]}, K - 1) // {self.group_size}  # past K (padding, x = 0): the last",
                     f"s{u} = _per_n(tl.load(s_ptr + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32), "
                     f"SWAP_AB)"]
            if self.has_zeros:
                tile.append(f"z{u} = tl.load(z_ptr + rn * stride_zn + g, mask=n_ok, other=0).to(tl.float32)[:, None]")
                zero.update({o: f"z{u}" for o in unit})
        # the dot's operand: code - zero, a small integer, exact in x's dtype (fp32 where the
        # interpreter dots bf16 as fp32)
        dot_type = {"bf16": "tl.bfloat16", "f16": "tl.float16"}.get(self.dtype, "tl.float32")
        cast = "" if self.dtype == "f32" or up else f".to({dot_type})"
        if self.packed_nibbles and self.has_zeros:
            # both planes straight from the bytes, less each plane's zero point (NIBBLES_ASM, zero_points)
            magic = float(NIBBLE_CONSTANTS[self.dtype][4])
            lo, hi = (f"tl.broadcast_to((-({magic} + {zero[o]})).to({dot_type}), (BLOCK_N, {run}))" for o in (0, run))
            tile.append(f"w0, w1 = _nibbles_zp(codes, {lo}, {hi})  # columns k0 + rr; k0 + {run} + rr")
        elif self.packed_nibbles:
            # both planes straight from the bytes, two codes per 32-bit instruction (NIBBLES_ASM)
            tile.append("w0, w1 = _nibbles(codes)  # the low plane: columns k0 + rr; the high: k0 + "
                        f"{run} + rr")
        elif four:
            lo, hi = zero[0], zero[run]
            # the low plane from the whole byte (2^23 + 16 hi + lo) less 16 x the high plane's value: one
            # FMA instead of masking the low nibble, as the integer pipe is the narrower one
            tile += [f"hi = _dequant(codes >> 4, {_sum(8388608.0, hi)})  # the high plane: columns k0 + {run} + rr",
                     f"w0 = tl.fma(hi, -16.0, _dequant(codes, {_sum(8388608.0, lo, (16.0, hi))})){cast}  # the low: "
                     f"the byte less 16 x its high nibble",
                     f"w1 = hi{cast}"]
        else:
            tile.append(f"w0 = _dequant(codes, {_sum(8388608.0, zero[0])}){cast}")
        rows = []
        for u, unit in enumerate(units):
            into = "p" if grouped else "acc@"
            for j, o in enumerate(unit):
                acc_in = "_zeros(BLOCK_M, BLOCK_N, SWAP_AB)" if grouped and not j else into
                rows.append(f"{into} = _dot(_x_tile(x_ptr, stride_xm, rm@, k0 + {o} + rr, M, K), "
                            f"w{offsets.index(o)}, {acc_in}, SWAP_AB)")
            if grouped:
                rows.append(f"acc@ += p * s{u}")
        return {"run": run, "pack": run * len(offsets), "byte_offset": "k0 // 2" if four else "k0",
                "prologue": prologue, "tile_lines": tile, "row_tile_lines": rows,
                "nibbles_asm": _nibbles_asm(self.dtype, self.has_zeros), "dtype": self.dtype,
                "dot_type": dot_type}

    @property
    def packed_nibbles(self) -> bool:
        """int4 codes dotted in bf16 or f16, compiled (the interpreter runs no PTX): the planes come from
        inline PTX (`_nibbles`, or `_nibbles_zp` with zero points), not from fp32 arithmetic.
        `LLMC_INT4_PTX=0` keeps the fp32 arithmetic (read once per process, when a kernel is rendered)."""
        return (self.kind == "int" and self.bits == 4 and self.dtype in ("bf16", "f16")
                and not interpreting() and os.environ.get("LLMC_INT4_PTX", "1") != "0")

    def _bytes_comment(self) -> list[str]:
        e = {"bf16": 2, "f16": 2, "f32": 4}[self.dtype]
        if self.kind == "int":
            text = (f"bytes: W's codes read once ({self.bits / 8:g}NK) with their scales, x ({e}MK, from L2 per N "
                    f"tile), y written once ({e}MN); the dequantized W never leaves registers (a bf16 copy "
                    f"would write and read 4NK more)")
        else:
            text = (f"bytes: W read once (NK), x's 1-byte codes (MK, from L2 per N tile) and scales, y written "
                    f"once ({e}MN); the epilogue's scales, bias and act cost no pass over y")
        return textwrap.wrap(text, 96)


@dataclass(frozen=True)
class QGemvSpec(KernelSpec):
    """y = act(x @ W.T + b) for 1 to `GEMV_ROWS` rows of x and an int4 W whose groups hold whole pack
    tiles (or per-channel scales): the FMA-pipe weight stream of `qgemv_int4.py.jinja`."""

    template = "qgemv_int4.py.jinja"
    group_size: int
    has_zeros: bool
    run: int
    dtype: str
    has_bias: bool
    act: str = ""
    joined: bool = False  # a word's 4 bytes joined into one [.., 4] operand against 4 contiguous x

    def context(self) -> dict[str, Any]:
        helpers: set[str] = set()
        act_lines = _act_lines(self.act, helpers)
        grouped = bool(self.group_size)
        corr = " - z * xs@[None, :]" if self.has_zeros else ""
        # a word's 8 products (less zero x the word's x sum) take the group's scale in one FMA
        row_update = f"acc@ = tl.fma(p@{corr}, s, acc@)" if grouped else f"acc@ += p@{corr}"
        fmt = QuantFormat("int", 4, self.group_size, self.has_zeros)
        planes = [{"src": "w" if b < 2 else "w_hi", "p": 8 * (b % 2) + 4 * half, "col": b + half * self.run,
                   "mult": float(1 << (8 * (b % 2) + 4 * half)), "first": not b and not half,
                   "what": f"byte {b}, {'high' if half else 'low'} nibble: columns c0 + {b + half * self.run}"}
                  for b in range(4) for half in range(2)]
        return {"max_rows": GEMV_ROWS, "planes": planes, "joined": self.joined, "run": self.run, "words": self.run // 4,
                "pack": 2 * self.run,
                "group_size": self.group_size, "grouped": grouped, "has_zeros": self.has_zeros,
                "has_bias": self.has_bias, "zero": 0 if self.has_zeros else 8, "row_update": row_update,
                "act_lines": act_lines, "store_cast": cast_expr("acc", self.dtype), "label": fmt.label,
                "summary": _summary(self.act, self.has_bias),
                "helpers": [HELPERS[h] for h in sorted(helpers)] + cast_helpers([self.dtype])}


def gemv_fits(p: PreparedQWeight) -> bool:
    """Whether `qgemv_int4` takes this weight: int4 with per-channel scales or groups of whole pack tiles."""
    f = p.fmt
    return f.kind == "int" and f.bits == 4 and (not f.group_size or f.group_size % p.pack == 0)


@dataclass(frozen=True)
class QDequantSpec(KernelSpec):
    """W [N, K] in `dtype` from a prepared int weight (`qdequant.py.jinja`): what a library GEMM takes
    at large M (`LIBRARY` "dequant")."""

    template = "qdequant.py.jinja"
    bits: int
    group_size: int
    has_zeros: bool
    run: int
    dtype: str

    def context(self) -> dict[str, Any]:
        fmt = QuantFormat("int", self.bits, self.group_size, self.has_zeros)
        return {"bits": self.bits, "four": self.bits == 4, "run": self.run, "grouped": bool(self.group_size),
                "group_size": self.group_size, "has_zeros": self.has_zeros, "zero": float(1 << (self.bits - 1)),
                "dtype": self.dtype, "label": fmt.label, "store_cast": cast_expr("w", self.dtype),
                "layout": f"{'nibble planes' if self.bits == 4 else 'bytes'} of {self.run} columns",
                "helpers": cast_helpers([self.dtype])}


@dataclass(frozen=True)
class QScaleEpilogueSpec(KernelSpec):
    """y = act(acc * sx * s + b) from a library int8 GEMM's int32 dots (`qscale_epilogue.py.jinja`)."""

    template = "qscale_epilogue.py.jinja"
    dtype: str
    has_bias: bool
    act: str = ""

    def context(self) -> dict[str, Any]:
        helpers: set[str] = set()
        act_lines = _act_lines(self.act, helpers)
        return {"dtype": self.dtype, "has_bias": self.has_bias, "act_lines": act_lines,
                "summary": _summary(self.act, self.has_bias), "store_cast": cast_expr("acc", self.dtype),
                "helpers": [HELPERS[h] for h in sorted(helpers)] + cast_helpers([self.dtype])}


def dequantize_prepared(p: PreparedQWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight [N, K] of a prepared int weight in `dtype`, by a generated kernel: each value
    (code - zero) x scale in fp32, rounded once (as `PreparedQWeight.dequantize` then a cast).

    Example:
        >>> qw = quant.quantize_rtn(torch.randn(96, 256), QuantFormat("int", 4, 64))
        >>> p = prepare(qw.fmt, *qw.tensors())
        >>> torch.equal(dequantize_prepared(p, torch.float32), p.dequantize())
        True
    """
    f, (n, k) = p.fmt, (p.out_features, p.in_features)
    out = torch.empty(n, k, dtype=dtype, device=p.qweight.device)
    if n and k:
        zeros = (p.zeros,) if p.zeros is not None else ()
        mod = compiled(QDequantSpec(f.bits, f.group_size, f.has_zeros, p.run, dtype_name(dtype)))
        block_n = 32
        mod.dequant_kernel[(cdiv(n, block_n), cdiv(k, p.run))](
            p.qweight, p.scales, *zeros, out, n, k, p.qweight.stride(0), p.scales.stride(0),
            *(z.stride(0) for z in zeros), out.stride(0), BLOCK_N=block_n, num_warps=4)
    return out


# -- configs ---------------------------------------------------------------------------------------

# (BLOCK_N, BLOCK_K columns, K split as a multiple of `_split`'s, SWAP_AB, warps, stages), the default first
DECODE_TILES = ((64, 256, 1, True, 4, 3), (64, 256, 1, False, 4, 3), (32, 256, 1, False, 4, 3),
                (32, 256, 1, True, 4, 3), (64, 128, 1, False, 4, 4), (64, 128, 1, True, 4, 4),
                (128, 128, 1, True, 4, 3), (64, 512, 1, True, 4, 2), (64, 256, 2, False, 4, 3),
                (64, 256, 2, True, 4, 3), (64, 256, 0.5, True, 4, 3), (128, 256, 1, True, 8, 3))
MID_TILES = ((64, 128, 1, False, 4, 4), (64, 128, 1, True, 4, 4), (128, 128, 1, False, 4, 3),
             (128, 128, 1, True, 4, 3), (64, 256, 1, False, 4, 3), (32, 256, 1, True, 4, 3))
# (BLOCK_M, BLOCK_N, BLOCK_K columns, SWAP_AB, warps, stages): prefill, one K split
PREFILL_TILES = ((64, 128, 128, False, 4, 3), (128, 128, 128, False, 8, 3), (128, 128, 64, False, 8, 4),
                 (128, 64, 128, False, 4, 3), (64, 64, 128, False, 4, 4), (64, 256, 64, False, 8, 3),
                 (128, 128, 128, True, 8, 3))
# (BLOCK_M, BLOCK_N, BLOCK_K columns, K split as a multiple of `_split`'s, SWAP_AB, warps, stages): the 128+
# bucket's other shape, a step of about 128 rows (a full batch of decodes). One tall tile then takes every
# row, and a weight tile is dequantized once for all of them, but the N tiles alone are too few programs to
# keep the GPU busy at 4096 to 6144 columns (32 to 96 of 132 SMs): the split brings them to ~512 (the last:
# ~128 wide programs, the fastest fp8 down projection of the 8B shape at 128 rows on the H200, 33.4 us
# against 38.7 for torch._scaled_mm and 43.8 for the others; benchmarks/w8_sweep.py)
SPLIT_TALL_TILES = ((128, 64, 128, 1, True, 4, 3), (128, 64, 256, 1, True, 8, 3), (64, 64, 128, 1, True, 4, 3),
                    (128, 128, 128, 1, True, 8, 3), (64, 128, 128, 0.25, True, 4, 4))


def _cfg(bm, bn, bk, split_k, swap, warps, stages) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split_k, "SWAP_AB": swap,
            "num_warps": warps, "num_stages": stages}


def _split(n: int, kw: int, bn: int, bk: int, scale: float = 1.0) -> int:
    """The power-of-two K split that brings a decode launch to about `scale` x TARGET_PROGRAMS
    programs (the N tiles alone are too few to keep HBM busy); at most 16, and dividing K's
    BLOCK_K steps where they divide evenly, so that no split reads a ragged tile (EVEN_K)."""
    tiles, steps, s = cdiv(n, bn), cdiv(kw, bk), 1
    even = kw % bk == 0
    while tiles * s * 2 <= scale * TARGET_PROGRAMS and s * 2 <= min(16, steps) and not (even and steps % (s * 2)):
        s *= 2
    return s


# (BLOCK_N, BLOCK_W words, K split as a multiple of `_split`'s, warps, stages, JOINED) of `qgemv_int4`:
# the fastest of a sweep on the H200 (benchmarks/gemv_sweep.py), the default first
GEMV_TILES = ((64, 32, 1, 4, 3, True), (16, 32, 1, 4, 3, True), (64, 32, 1, 4, 3, False), (32, 32, 1, 4, 3, False),
              (64, 16, 1, 4, 3, True))


def gemv_candidates(n: int, kw: int) -> list[dict]:
    """`qgemv_int4` configs for a weight of n rows and kw (padded) columns."""
    out = [{"GEMV": True, "JOINED": joined, "BLOCK_N": bn, "BLOCK_W": bw, "SPLIT_K": _split(n, kw, bn, 8 * bw, scale),
            "num_warps": w, "num_stages": st} for bn, bw, scale, w, st, joined in GEMV_TILES]
    return [dict(c) for c in dict.fromkeys(tuple(c.items()) for c in out)]


def candidates(bucket: str, n: int, kw: int, pack: int = 0, shared: bool = True) -> list[dict]:
    """Configs to try for an M bucket and a weight of n rows and kw columns, the default first (what
    CPU, interpreter and an untuned GPU use).

    `pack`: the columns of an int weight's pack tile (BLOCK_K is a multiple), 0 for 8-bit codes.
    Up to 16 tokens, and up to 64 when the bucket shares its choice with smaller ones (`shared`),
    tiles are 16 rows tall whatever M is, so a row's sum does not depend on its batch; the K split
    is shape-dependent, as the program count is what saturates HBM.
    """
    m = bucket_size(bucket)
    if m > 64:
        out = [_cfg(bm, bn, max(cols, pack), 1, swap, w, st) for bm, bn, cols, swap, w, st in PREFILL_TILES]
        if m < LARGE_M:
            out += [_cfg(bm, bn, max(cols, pack), _split(n, kw, bn, max(cols, pack), scale), swap, w, st)
                    for bm, bn, cols, scale, swap, w, st in SPLIT_TALL_TILES]
    else:
        bm, tiles = (16, DECODE_TILES) if m <= 16 or shared else (m, MID_TILES)
        out = [_cfg(bm, bn, max(cols, pack), _split(n, kw, bn, max(cols, pack), scale), swap, w, st)
               for bn, cols, scale, swap, w, st in tiles]
    return [dict(c) for c in dict.fromkeys(tuple(c.items()) for c in out)]  # without repeats, in order


TMA_MAX_BOX = 256  # the most elements a TMA box spans along any of its dimensions


def fp8_promote() -> int:
    """How many of K an fp8 MMA sums in its reduced precision before the sum moves into the fp32
    accumulator: 128 by default (a quarter of the FADDs of every 32, one per instruction: 3-15% faster
    GEMMs of the 8B shape at 128 rows on an H100, with the same largest error against the fp32 reference;
    benchmarks/RESULTS.md 2026-12-07), or 32, 64, 256 through `LLMC_FP8_PROMOTE` (read when a kernel
    is rendered)."""
    v = os.environ.get("LLMC_FP8_PROMOTE", "128")
    if v not in ("32", "64", "128", "256"):
        raise CompileError(f"LLMC_FP8_PROMOTE={v!r}: give 32, 64, 128 or 256 (of K summed before each promotion)")
    return int(v)


def tma_offered() -> bool:
    """Whether a qlinear's tuning also times its configs with tiles loaded through TMA descriptors
    (`tma_candidates`): `LLMC_QLINEAR_TMA=1` (read at each tuning)."""
    return os.environ.get("LLMC_QLINEAR_TMA", "0") == "1"


def tma_candidates(configs: list[dict]) -> list[dict]:
    """The TMA twins of generated-kernel configs (boxes of at most `TMA_MAX_BOX` per side), and of the split
    tall tiles (the 128+ bucket's) with deeper pipelines: a bulk copy in flight holds no registers."""
    generated = [c for c in configs if not c.get("LIBRARY") and not c.get("GEMV")]
    out = [dict(c, TMA=True) for c in generated if max(c["BLOCK_N"], c["BLOCK_K"]) <= TMA_MAX_BOX]
    out += [dict(c, TMA=True, num_stages=c["num_stages"] + 2) for c in generated
            if c["SPLIT_K"] > 1 and c["BLOCK_M"] > 16 and c["BLOCK_K"] <= 128]
    return [dict(c) for c in dict.fromkeys(tuple(c.items()) for c in out)]


# -- launching -------------------------------------------------------------------------------------

def _launch_gemv(spec: QMatmulSpec, x2: torch.Tensor, p: PreparedQWeight, b: torch.Tensor | None,
                 y2: torch.Tensor, cfg: dict) -> None:
    """One `qgemv_int4` call on rows x2 [M <= GEMV_ROWS, K]."""
    M, N, K = x2.shape[0], p.out_features, p.in_features
    if M > GEMV_ROWS or not gemv_fits(p):
        raise CompileError(f"qlinear: the GEMV kernel takes int4 weights in whole pack tiles and up to {GEMV_ROWS} "
                           f"rows, not {p.fmt.label} at {M} rows")
    gspec = QGemvSpec(spec.group_size, spec.has_zeros, spec.run, spec.dtype, spec.has_bias, spec.act,
                      bool(cfg.get("JOINED")))
    split_k = cfg["SPLIT_K"]
    grid = (cdiv(N, cfg["BLOCK_N"]), split_k)
    ws = torch.empty((split_k, M, N) if split_k > 1 else (1,), device=x2.device, dtype=torch.float32)
    counts = tile_counters(x2.device, grid[0]) if split_k > 1 else ws
    w32 = p.qweight.view(torch.int32)
    zeros = (p.zeros,) if p.zeros is not None else ()
    bias = (b,) if b is not None else ()
    compiled(gspec).qgemv_kernel[grid](
        x2, w32, p.scales, *zeros, *bias, y2, ws, counts,
        x2.stride(0), w32.stride(0), p.scales.stride(0), *(z.stride(0) for z in zeros), y2.stride(0),
        M, N, K, w32.shape[1], ROWS=M, BLOCK_N=cfg["BLOCK_N"], BLOCK_W=cfg["BLOCK_W"], SPLIT_K=split_k,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _launch_library(spec: QMatmulSpec, x2: torch.Tensor, p: PreparedQWeight, b: torch.Tensor | None,
                    y2: torch.Tensor, library: str, x_scales: torch.Tensor | None) -> None:
    """A qlinear call through a library GEMM (cuBLAS / CUTLASS through torch): "dequant" (int: W
    dequantized to x's dtype by a generated kernel, then x @ W.T), "scaled_mm" (fp8 codes of x and W
    with per-token and per-channel scales, bf16 out), "int_mm" (int8 dots into int32, then the
    generated epilogue kernel). Bias and act follow in torch where the library does not take them."""
    M, N = x2.shape[0], p.out_features
    if library == "dequant":
        w = dequantize_prepared(p, x2.dtype)
        if b is not None:
            torch.addmm(b.to(x2.dtype), x2, w.t(), out=y2)
        else:
            torch.mm(x2, w.t(), out=y2)
        if spec.act:
            y2.copy_(LINEAR_ACTS[spec.act](y2))
        return
    q, sx = quantize_act(x2, spec.kind) if x_scales is None else (x2, x_scales)
    q, sx = q.contiguous(), sx.float().contiguous()  # libraries take row-major x (codes from a norm may be views)
    if library == "scaled_mm":
        if b is None and not spec.act and y2.dtype == torch.bfloat16 and y2.is_contiguous():
            # straight into y: a copy of the output costs a mixed step's GEMM about a tenth of its time
            torch._scaled_mm(q, p.qweight.t(), scale_a=sx, scale_b=p.scales.view(1, N), out_dtype=torch.bfloat16,
                             out=y2)
            return
        y = torch._scaled_mm(q, p.qweight.t(), scale_a=sx, scale_b=p.scales.view(1, N),
                             out_dtype=torch.bfloat16)
        if b is not None:
            y = y.float().add_(b.float()).to(torch.bfloat16)
        y2.copy_(LINEAR_ACTS[spec.act](y) if spec.act else y)
        return
    assert library == "int_mm", library
    acc = torch._int_mm(q, p.qweight.t())
    mod = compiled(QScaleEpilogueSpec(spec.dtype, b is not None, spec.act))
    bm, bn = 32, 128
    mod.epilogue_kernel[(cdiv(M, bm), cdiv(N, bn))](
        acc, sx, p.scales, *((b,) if b is not None else ()), y2, M, N, acc.stride(0), y2.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, num_warps=4)


def library_candidates(bucket: str, p: PreparedQWeight, dtype: torch.dtype) -> list[dict]:
    """The library GEMMs a qlinear's tuner may try at this M bucket (see `_launch_library`): where M is
    large enough for a library GEMM's tiles and its shape rules hold. int's dequantization costs a
    pass over W per call (writing and reading 2 bytes a weight), which steps of some hundreds of rows
    amortize: timed from the 128+ bucket on."""
    m, f, (n, k) = bucket_size(bucket), p.fmt, (p.out_features, p.in_features)
    if f.kind == "int":
        return [{"LIBRARY": "dequant"}] if m >= 128 else []
    if f.kind == "fp8" and dtype == torch.bfloat16 and m >= 128 and k % 16 == 0 and n % 16 == 0:
        return [{"LIBRARY": "scaled_mm"}]
    if f.kind == "w8a8" and m >= 128 and k % 8 == 0 and n % 8 == 0:  # torch._int_mm: M > 16, K and N by 8
        return [{"LIBRARY": "int_mm"}]
    return []


def qlinear_bucket(m: int) -> str:
    """A qlinear's M bucket: autotune's, with the largest steps (chunked prefills) in a 1024+ of their
    own, where a library GEMM over a dequantized weight can win, and mixed steps of 512 to 1023 tokens in
    a 512+ (the 128+ bucket, timed at 128 rows, keeps 65 to 511)."""
    if m >= LARGE_M:
        return f"{LARGE_M}+"
    return f"{MID_M}+" if m >= MID_M else m_bucket(m)


def _launch(spec: QMatmulSpec, x2: torch.Tensor, p: PreparedQWeight, b: torch.Tensor | None, y2: torch.Tensor,
            cfg: dict, x_scales: torch.Tensor | None = None) -> None:
    """One qlinear call on rows x2 [M, K]: the activation codes first for w8a8 / fp8 (unless x2 holds
    them already, with `x_scales` [M, 1]), then the GEMM."""
    if cfg.get("GEMV"):
        return _launch_gemv(spec, x2, p, b, y2, cfg)
    if cfg.get("WGMMA"):
        return qwgmma.launch(compiled, x2, p, y2, cfg)
    if cfg.get("LIBRARY"):
        return _launch_library(spec, x2, p, b, y2, cfg["LIBRARY"], x_scales)
    M, N, K = x2.shape[0], p.out_features, p.in_features
    sx: tuple = ()
    if spec.kind != "int":
        x2, s = quantize_act(x2, spec.kind) if x_scales is None else (x2, x_scales)
        sx = (s,)
    split_k = cfg["SPLIT_K"]
    mt = m_tiles(M, cfg["BLOCK_M"])
    grid = (cdiv(M, cfg["BLOCK_M"] * mt), cdiv(N, cfg["BLOCK_N"]), split_k)
    ws = torch.empty((split_k, M, N) if split_k > 1 else (1,), device=x2.device,
                     dtype=torch.int32 if spec.kind == "w8a8" else torch.float32)
    counts = tile_counters(x2.device, grid[0] * grid[1]) if split_k > 1 else ws
    zeros = (p.zeros,) if p.zeros is not None else ()
    bias = (b,) if b is not None else ()
    # int: W's codes come in boxes of one pack tile's bytes (`run`); 8-bit: x's codes and W in BLOCK_K columns
    a8 = spec.kind != "int"
    box = cfg["BLOCK_K"] if a8 else p.run
    tma = (bool(cfg.get("TMA")) and max(cfg["BLOCK_M"], cfg["BLOCK_N"], box) <= TMA_MAX_BOX
           and tma_fits(*((x2,) if a8 else ()), p.qweight))
    descs = {"w_desc": _descriptor(p.qweight, cfg["BLOCK_N"], box) if tma else None, "TMA": tma}
    if a8:
        descs["x_desc"] = _descriptor(x2, cfg["BLOCK_M"], cfg["BLOCK_K"]) if tma else None
    compiled(spec).qmatmul_kernel[grid](
        x2, p.qweight, p.scales, *zeros, *sx, *bias, y2, ws, counts,
        stride_xm=x2.stride(0), stride_wn=p.qweight.stride(0), stride_sn=p.scales.stride(0),
        **({"stride_zn": p.zeros.stride(0)} if p.zeros is not None else {}), stride_ym=y2.stride(0),
        M=M, N=N, K=K, KW=p.padded_k, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        SPLIT_K=split_k, M_TILES=mt, SWAP_AB=cfg["SWAP_AB"], EVEN_K=p.padded_k % (cfg["BLOCK_K"] * split_k) == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **descs)


def tma_fits(*ts: torch.Tensor) -> bool:
    """Whether 2-D tensors of 1-byte codes can be read through TMA descriptors (`TMA` configs): 16-byte
    aligned starts and row strides, unit column strides. Where they cannot, a TMA config runs with pointer
    loads (the same sums: only how the tiles reach shared memory differs)."""
    return all(t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in ts)


def _descriptor(t: torch.Tensor, rows: int, cols: int):
    """A host-side TMA descriptor of t [R, C] in [rows, cols] boxes (zeros read past its edges)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [rows, cols])


def qlinear(x: torch.Tensor, prepared: PreparedQWeight, bias: torch.Tensor | None = None, act: str = "", *,
            tuner: Tuner | None = None, config: dict | None = None, out: torch.Tensor | None = None,
            x_scales: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = act(x @ W.T + bias) for a quantized W, with generated Triton kernels.

    Args:
        x: [..., K] activations, bf16, f16 or f32 (any row stride, unit column stride).
        prepared: the weight, from `prepare`.
        bias: optional [N] bias (any float dtype).
        act: "", "silu", "relu", "gelu" or "gelu_tanh", applied to the fp32 accumulator.
        tuner: chooses (on a GPU: times once, records, then reuses) the config for this shape's M
            bucket; None: the bucket's default config, untimed.
        config: a fixed config instead (a dict as in `candidates`).
        out: a contiguous [..., N] tensor of x's dtype to write y into; allocated when None.
        x_scales: for w8a8 / fp8 weights, x's per-token scales [..., 1] when x holds its codes already
            (made by the norm before, `rms_norm_quant`); y is then of `dtype`.

    Returns:
        y [..., N] of x's dtype (of `dtype` with codes).

    Example:
        >>> qw = quant.quantize_rtn(torch.randn(96, 256), QuantFormat("int", 4, 64))
        >>> y = qlinear(torch.randn(3, 256), prepare(qw.fmt, *qw.tensors()), act="silu")
    """
    K, N = x.shape[-1], prepared.out_features
    if K != prepared.in_features:
        raise CompileError(f"qlinear: x has {K} input features but the weight ({prepared.fmt.label}, "
                           f"[{N}, {prepared.in_features}]) takes {prepared.in_features}")
    if x_scales is not None:
        want = {"w8a8": torch.int8, "fp8": torch.float8_e4m3fn}.get(prepared.fmt.kind)
        if x.dtype != want or dtype not in X_DTYPES or x_scales.shape != x.shape[:-1] + (1,):
            raise CompileError(f"qlinear: codes {x.dtype} {list(x.shape)} with scales {list(x_scales.shape)} do not "
                               f"fit a {prepared.fmt.label} weight giving {dtype}")
    elif x.dtype not in X_DTYPES:
        raise CompileError(f"qlinear: activations are bf16, f16 or f32, not {x.dtype}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise CompileError(f"qlinear: bias {list(bias.shape)} should be [{N}]")
    if x.device != prepared.qweight.device:
        raise CompileError(f"qlinear: x is on {x.device}, the weight on {prepared.qweight.device}")
    ydtype = x.dtype if x_scales is None else dtype
    spec = QMatmulSpec.of(prepared, ydtype, bias is not None, act)
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    x2 = x2.view(-1, K) if x2.dim() == 2 or x2.is_contiguous() else x2.reshape(-1, K)
    b = bias.contiguous() if bias is not None else None
    M = x2.shape[0]
    y = out if out is not None else torch.empty(x.shape[:-1] + (N,), dtype=ydtype, device=x.device)
    if M == 0 or N == 0:
        return y
    kw, pack = prepared.padded_k, prepared.pack
    if config is None and tuner is None:
        config = candidates(m_bucket(M), N, kw, pack)[0]
    elif config is None:
        bucket = qlinear_bucket(M)
        if bucket != m_bucket(M) and tuner.frozen and tuner.lookup(spec.key(N, K), bucket) is None:
            bucket = m_bucket(M)  # an artifact tuned before the 1024+ or 512+ bucket: its 128+ choice
        group = tuner.joint if bucket in tuner.joint else (bucket,)
        io = timing_io(group, K, N, ydtype, x2.device)  # with codes too: the choice is the float x's
        cands = candidates(bucket, N, kw, pack, len(group) > 1)
        if tma_offered():
            cands += tma_candidates(cands)
        largest = max(map(bucket_size, group))  # the kernels below only where every M sharing the choice fits
        if gemv_fits(prepared) and largest <= GEMV_ROWS:
            cands += gemv_candidates(N, kw)
        if x_scales is None and qwgmma.offered(x2.device) and qwgmma.fits(prepared, ydtype, b is not None, act):
            if largest <= qwgmma.MAX_ROWS:
                cands += qwgmma.tuned_candidates(N, K)
            tall = qwgmma.TALL_MIN_ROWS <= largest <= qwgmma.TALL_MAX_ROWS
            if len(group) == 1 and tall and qwgmma.tall_offered():  # never shared
                cands += qwgmma.tall_candidates(N, K, largest)
                cands += qwgmma.pipe_candidates(N, K, largest) if qwgmma.pipe_offered() else []
        if x2.device.type == "cuda" and len(group) == 1:
            cands += library_candidates(bucket, prepared, ydtype)
        config = tuner.choose(spec.key(N, K), group, cands,
                              bench=lambda cfg: [_launch(spec, xi, prepared, b, yi, cfg) for xi, yi in io()],
                              accept=None if tuner.frozen else recorded_config_runs(x2.device))
    _launch(spec, x2, prepared, b, y.view(-1, N), config, x_scales.reshape(-1, 1) if x_scales is not None else None)
    return y


def recorded_config_runs(device: torch.device):
    """Whether a qlinear config recorded by an earlier compile (or a shipped table) may run in this compile: not a
    wgmma kernel's where that kernel is not offered here (`LLMC_QWGMMA=0`, or not an sm_90 GPU; its tall form's
    where `LLMC_QWGMMA_TALL=0`, its pipelined configs' unless `LLMC_QWGMMA_PIPE=1`), nor a TMA config's where TMA
    configs are not (`LLMC_QLINEAR_TMA`); such a choice is timed afresh (`Tuner.choose`'s `accept`)."""
    wgmma, tall, pipe, tma = qwgmma.offered(device), qwgmma.tall_offered(), qwgmma.pipe_offered(), tma_offered()
    return lambda cfg: ((wgmma or not cfg.get("WGMMA")) and (tall or not cfg.get("XN"))
                        and (pipe or not cfg.get("PIPE")) and (tma or not cfg.get("TMA")))


def ready_layouts(p: PreparedQWeight, tuner: Tuner | None, dtype: torch.dtype, has_bias: bool, act: str) -> None:
    """Make now the weight layouts that the tuned choices for `p` launch (the int4 wgmma GEMV's words,
    `qwgmma.words_of`): when a plan is built, before the KV cache sizes itself from the memory left, rather
    than at a first launch. `dtype`: x's."""
    # a frozen tuner's (an artifact's) records run wherever the kernel does; a compile's, only where it is offered
    # (it times the others afresh: `recorded_config_runs`)
    if tuner is None or not (qwgmma.runs_here if tuner.frozen else qwgmma.offered)(p.qweight.device):
        return
    key = QMatmulSpec.of(p, dtype, has_bias, act).key(p.out_features, p.in_features)
    if any((rec.get("config") or {}).get("WGMMA") for rec in tuner.records.get(key, {}).values()):
        qwgmma.words_of(p)


def reference(x: torch.Tensor, fmt: QuantFormat, qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor | None = None, bias: torch.Tensor | None = None, act: str = "") -> torch.Tensor:
    """The same computation by the qlinear op's reference (quant.qlinear_ref, then act on its result)."""
    y = quant.qlinear_ref(x, fmt, qweight, scales, zeros, bias)
    return LINEAR_ACTS[act](y) if act else y
