"""Quantized weights are a format, not a dtype: the `qlinear` op's formats and their reference math.

A quantized linear `y = act(x @ W.T + b)` keeps W as integer (or fp8) codes plus scales (and zero
points), as params of one `qlinear` node, and its reference implementation dequantizes on the fly.
Every method (RTN, GPTQ, AWQ, SmoothQuant, FP8, imported GPTQ/AWQ checkpoints) ends in one of these
formats, so the kernels, the artifact and the generic passes know four layouts, not six methods.

Formats (`QuantFormat.kind`), for a weight of N output rows and K input columns:

- ``int`` (weight-only, activations stay in the model dtype; "W4A16"/"W8A16"):
  ``qweight`` u8: for 4 bits ``[N, K/2]``, column ``2j`` in the low nibble and ``2j+1`` in the high
  one; for 8 bits ``[N, K]``. Codes are unsigned, ``0 .. 2^bits-1``.
  ``scales`` ``[N, G]`` (G = K / group_size groups, 1 when per-channel), a float dtype.
  ``zeros`` u8 ``[N, G]`` when ``has_zeros`` (asymmetric); otherwise the zero point is ``2^(bits-1)``
  (symmetric). ``W[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g]``.
- ``w8a8`` (SmoothQuant-style int8): ``qweight`` i8 ``[N, K]`` in ``[-127, 127]``, ``scales`` f32
  ``[N, 1]``; activations are quantized per token at run time, ``sx = max|x_t| / 127``,
  ``xq = round(x / sx)``; ``y = (xq @ q.T) * sx * s`` with an exact integer accumulation.
- ``fp8`` (e4m3 weights and per-token e4m3 activations): ``qweight`` f8e4m3 ``[N, K]``, ``scales``
  f32 ``[N, 1]``; ``sx = max|x_t| / 448``; ``y = (fp8(x / sx) @ q.T) * sx * s`` (fp32 accumulation).

Every operand but ``x`` has N as its first dim, so linears that read the same input fuse by
concatenating each operand along dim 0 (see `fuse_parallel_linears`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.errors import IRError

KINDS = ("int", "w8a8", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127


# the fewest input columns per scale a grouped format may have: the quantized kernels' shortest run of columns
# per scale (a tensor-core dot's K, codegen/qmatmul.MIN_RUN)
MIN_GROUP = 16


@dataclass(frozen=True)
class QuantFormat:
    """How one linear's weight is stored; `attrs()` are the qlinear node's attributes."""

    kind: str = "int"
    bits: int = 4
    group_size: int = 0  # int only: input columns per scale; 0 = one scale per output row
    has_zeros: bool = False  # int only: stored zero points (asymmetric)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise IRError(f"unknown quantization format {self.kind!r}; known: {', '.join(KINDS)}")
        if self.kind == "int" and self.bits not in (4, 8):
            raise IRError(f"int weights have 4 or 8 bits, not {self.bits}")
        if self.kind != "int" and (self.bits != 8 or self.group_size or self.has_zeros):
            raise IRError(f"{self.kind} weights are 8-bit, per output channel, symmetric")
        if self.group_size < 0 or self.group_size % 2:
            raise IRError(f"group size must be 0 (per channel) or a positive even number, not {self.group_size}")

    @property
    def label(self) -> str:
        if self.kind == "int":
            g = f"g{self.group_size}" if self.group_size else "ch"
            return f"w{self.bits}a16-{g}" + ("-zp" if self.has_zeros else "")
        return "w8a8-int8" if self.kind == "w8a8" else "w8a8-fp8"

    def bits_per_weight(self, k: int, scale_bytes: int = 2) -> float:
        """Storage bits per weight including scales and zero points (what a bits budget counts)."""
        groups = 1 if self.kind != "int" or not self.group_size else k // self.group_size
        extra = groups * (8 * (scale_bytes if self.kind == "int" else 4) + (8 if self.has_zeros else 0))
        return self.bits + extra / k

    def groups(self, k: int) -> int:
        if self.kind != "int" or not self.group_size:
            return 1
        if k % self.group_size:
            raise IRError(f"group size {self.group_size} does not divide the {k} input columns")
        return k // self.group_size

    def to_json(self) -> dict:
        """The fields as JSON (a precision plan's entry; `QuantFormat(**d)` reads it back)."""
        return {"kind": self.kind, "bits": self.bits, "group_size": self.group_size, "has_zeros": self.has_zeros}

    def attrs(self, in_features: int) -> dict:
        return {**self.to_json(), "in_features": int(in_features)}

    @classmethod
    def from_attrs(cls, a: dict) -> "QuantFormat":
        return cls(a["kind"], a["bits"], a["group_size"], a["has_zeros"])


@dataclass
class QuantizedWeight:
    """A weight in a `QuantFormat`: the tensors a qlinear node takes after x."""

    fmt: QuantFormat
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.fmt.kind == "int" and self.fmt.bits == 4 else 1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.fmt, self.qweight, self.scales, self.zeros).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])


# -- packing --------------------------------------------------------------------------------------

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> u8 [N, K/2], column 2j in the low nibble."""
    if q.shape[-1] % 2:
        raise IRError(f"int4 packing needs an even number of input columns, not {q.shape[-1]}")
    q = q.to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """u8 [N, K/2] -> u8 [N, K] codes 0..15."""
    lo, hi = p & 0xF, p >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def codes(fmt: QuantFormat, qweight: torch.Tensor) -> torch.Tensor:
    """The integer (or fp8) codes as a [N, K] tensor."""
    return unpack_int4(qweight) if fmt.kind == "int" and fmt.bits == 4 else qweight


# -- reference math -------------------------------------------------------------------------------

def dequantize(fmt: QuantFormat, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None = None) -> torch.Tensor:
    """The dense fp32 weight [N, K] that a quantized one stands for."""
    q = codes(fmt, qweight)
    if fmt.kind != "int":
        return q.float() * scales.float().reshape(-1, 1)
    n, k = q.shape
    g = k // scales.shape[1]
    z = zeros.float() if zeros is not None else torch.full_like(scales, float(1 << (fmt.bits - 1)), dtype=torch.float32)
    s = scales.float().repeat_interleave(g, dim=1)
    return (q.float() - z.repeat_interleave(g, dim=1)) * s


def quantize_activations(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantization of x [..., K]: (codes, scale [..., 1] fp32)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8)
    # divided by a tensor, not a Python number: on CUDA, torch divides by a host scalar as a multiply by its
    # reciprocal (not correctly rounded), which would make the scales, and so the codes, differ by device
    qmax = torch.full_like(amax, INT8_MAX if kind == "w8a8" else FP8_MAX)
    s = amax / qmax
    if kind == "w8a8":
        return torch.round(xf / s).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), s
    return (xf / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def qlinear_ref(x: torch.Tensor, fmt: QuantFormat, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + b for a quantized W, in the exact arithmetic each format specifies."""
    if fmt.kind != "int":
        return qlinear_codes_ref(*quantize_activations(x, fmt.kind), fmt, qweight, scales, bias, x.dtype)
    w = dequantize(fmt, qweight, scales, zeros)
    y = torch.matmul(x.float(), w.t())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def qlinear_codes_ref(xq: torch.Tensor, sx: torch.Tensor, fmt: QuantFormat, qweight: torch.Tensor,
                      scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """y = x @ W.T + b (as `dtype`) for w8a8 / fp8 from x's codes and per-token scales (`quantize_activations`)."""
    acc_dtype = torch.float64 if fmt.kind == "w8a8" else torch.float32  # int8 products sum exactly in f64
    y = torch.matmul(xq.to(acc_dtype), qweight.to(acc_dtype).t()).float() * sx * scales.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


# -- round-to-nearest (the baseline every method is measured against, and GPTQ's inner step) -------

def int_scales(w: torch.Tensor, fmt: QuantFormat, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group scales (and zero points) of w [N, K] for an int format, min-max over each group.
    Scales are rounded to `scale_dtype` here, so codes are computed against the stored scale."""
    n, k = w.shape
    wg = w.float().reshape(n, fmt.groups(k), -1)
    return range_scales(wg.amin(-1), wg.amax(-1), fmt, scale_dtype)


def range_scales(lo: torch.Tensor, hi: torch.Tensor, fmt: QuantFormat,
                 scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales (and zero points) whose grid spans [lo, hi] per group (symmetric: [-max|.|, max|.|])."""
    qmax = (1 << fmt.bits) - 1
    if fmt.has_zeros:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        s = ((hi - lo) / qmax).clamp_min(1e-10).to(scale_dtype)
        z = torch.round(-lo / s.float()).clamp(0, qmax).to(torch.uint8)
        return s, z
    half = 1 << (fmt.bits - 1)
    amax = torch.maximum(lo.abs(), hi.abs())
    s = (amax / (half - 1)).clamp_min(1e-10).to(scale_dtype)  # codes -half+1 .. half-1 around half
    return s, None


def quantize_int_with(w: torch.Tensor, fmt: QuantFormat, scales: torch.Tensor,
                      zeros: torch.Tensor | None) -> torch.Tensor:
    """Codes [N, K] (u8, unpacked) of w against given per-group scales and zero points."""
    n, k = w.shape
    g = k // scales.shape[1]
    qmax = (1 << fmt.bits) - 1
    z = zeros.float() if zeros is not None else torch.full(scales.shape, float(1 << (fmt.bits - 1)), device=scales.device)
    q = torch.round(w.float() / scales.float().repeat_interleave(g, 1)) + z.repeat_interleave(g, 1)
    return q.clamp_(0, qmax).to(torch.uint8)


def pack(fmt: QuantFormat, q: torch.Tensor) -> torch.Tensor:
    return pack_int4(q) if fmt.kind == "int" and fmt.bits == 4 else q.contiguous()


def quantize_rtn(w: torch.Tensor, fmt: QuantFormat, scale_dtype: torch.dtype = torch.bfloat16) -> QuantizedWeight:
    """Round-to-nearest quantization of a dense weight [N, K] into `fmt`."""
    if fmt.kind == "int":
        s, z = int_scales(w, fmt, scale_dtype)
        return QuantizedWeight(fmt, pack(fmt, quantize_int_with(w, fmt, s, z)), s, z)
    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True).clamp_min(1e-10)
    if fmt.kind == "w8a8":
        s = amax / INT8_MAX
        return QuantizedWeight(fmt, torch.round(wf / s).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), s)
    s = amax / FP8_MAX
    return QuantizedWeight(fmt, (wf / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s)


# ---------------------------------------------------------------- quantized embedding tables

def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An embedding table [V, H] as int8 codes [V, H] in [-127, 127] and one fp32 scale per row [V]
    (absmax / 127): what a `qembedding` op gathers."""
    wf = w.float()
    s = (wf.abs().amax(dim=1) / 127).clamp_min(1e-10)
    q = torch.round(wf / s[:, None]).clamp(-127, 127).to(torch.int8)
    return q, s


def qembedding_ref(qweight: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Rows of the int8 table at ids, each times its scale, in `dtype`: [*ids.shape, H]."""
    flat = ids.reshape(-1)
    rows = qweight.index_select(0, flat).float() * scales.float().index_select(0, flat)[:, None]
    return rows.to(dtype).reshape(*ids.shape, qweight.shape[1])
