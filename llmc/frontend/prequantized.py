"""Pre-quantized Hugging Face checkpoints (GPTQ, AWQ): their packed linears as llmc `int` weights.

A checkpoint whose config.json has a ``quantization_config`` stores each quantized ``nn.Linear``
(out features N, in features K) as int32 words of packed codes plus fp16 scales, in the layout of
the library that wrote it. llmc reads the codes, zero points and scales as they are (no
requantization, so nothing is lost) into the `int` format of `llmc.ir.quant`, where
``W[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g]``.

GPTQ (AutoGPTQ / GPTQModel; ``quant_method: "gptq"``, ``bits`` 4 or 8, ``group_size`` g or -1 for
one group per output row, ``desc_act``, ``checkpoint_format`` (or ``format``) "gptq" or "gptq_v2"):

- ``qweight`` int32 ``[K*bits/32, N]``: packed along K, low bits first: word ``[r, n]`` holds
  ``q[k, n]`` for ``k = r*32/bits + j`` at bits ``j*bits ..``.
- ``qzeros`` int32 ``[G, N*bits/32]``: packed along N the same way.
- ``scales`` fp16 ``[G, N]``; ``g_idx`` int32 ``[K]``: the group of each input column.
- ``W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``, where ``z`` is the stored zero point
  plus one in the classic "gptq" format (AutoGPTQ packs ``zeros - 1`` and every kernel adds the one
  back; a 4-bit zero point is then 1..16) and the stored one in "gptq_v2".
- With activation order (``desc_act``) GPTQ quantizes the columns in order of decreasing Hessian
  diagonal and ``g_idx`` is not ``k // g``: a group's columns are scattered over K. llmc's groups
  are contiguous, so the columns are sorted by ``g_idx`` (stably): the stored weight reads the
  inputs ``x[..., act_order]``, and the graph gathers those columns before the qlinear.

AWQ (AutoAWQ "GEMM"; ``quant_method: "awq"``, ``bits`` 4, ``group_size``, ``zero_point: true``,
``version`` (or ``format``) "gemm"):

- ``qweight`` int32 ``[K, N/8]`` and ``qzeros`` int32 ``[G, N/8]``: packed along N, eight 4-bit
  codes a word in AutoAWQ's interleaved order: nibble ``i`` (bits ``4i ..``) of word ``c`` holds
  column ``8c + AWQ_ORDER[i]``.
- ``scales`` fp16 ``[G, N]``; ``W[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]``.

Scales stay fp16 as stored (exact); zero points become u8. Where every zero point of a linear is
``2^(bits-1)`` (symmetric GPTQ), the weight takes the symmetric form, which stores none.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from llmc.errors import CompileError
from llmc.ir.graph import Graph, Value
from llmc.ir.quant import MIN_GROUP, QuantFormat, QuantizedWeight, pack

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SUPPORTED = ("GPTQ (bits 4 or 8, checkpoint_format gptq or gptq_v2) and AWQ (bits 4, version gemm, with zero "
             "points)")


@dataclass(frozen=True)
class Scheme:
    """A checkpoint's validated quantization_config."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # input columns per group; -1: one group per output row
    zeros_minus_one: bool  # classic GPTQ: the stored zero points are the real ones minus one
    desc_act: bool = False


def read_scheme(qc: dict) -> Scheme:
    """The scheme of a quantization_config, or a CompileError naming what llmc does not import."""
    method = str(qc.get("quant_method", "")).lower()
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "gptq":
        bits = int(qc.get("bits", 4))
        fmt = "marlin" if qc.get("is_marlin_format") else \
            str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if bits not in (4, 8):
            raise CompileError(f"GPTQ with {bits} bits is not supported; llmc imports {SUPPORTED}")
        if fmt not in ("gptq", "gptq_v2"):
            raise CompileError(f"GPTQ checkpoint format {fmt!r} is not supported; llmc imports {SUPPORTED}")
        scheme = Scheme("gptq", bits, group_size, fmt == "gptq", bool(qc.get("desc_act", False)))
    elif method == "awq":
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        version = str(qc.get("version") or qc.get("format") or "gemm").lower()
        if bits != 4:
            raise CompileError(f"AWQ with {bits} bits is not supported; llmc imports {SUPPORTED}")
        if version != "gemm":
            raise CompileError(f"AWQ version {version!r} is not supported; llmc imports {SUPPORTED}")
        if not qc.get("zero_point", True):
            raise CompileError(f"AWQ without zero points is not supported; llmc imports {SUPPORTED}")
        scheme = Scheme("awq", 4, group_size, False)
    else:
        raise CompileError(f"quantization method {repr(method) if method else '(none given)'} is not supported; "
                           f"llmc imports {SUPPORTED}")
    if group_size != -1 and (group_size <= 0 or group_size % MIN_GROUP):
        raise CompileError(f"{method.upper()} group_size {group_size} is not supported; llmc imports -1 (per "
                           f"channel) or a positive multiple of {MIN_GROUP}, the fewest input columns its quantized "
                           "kernels take per scale")
    return scheme


@dataclass
class ImportedLinear:
    """One quantized linear of a checkpoint in llmc's format."""

    weight: QuantizedWeight  # its columns in act order when there is one
    act_order: torch.Tensor | None = None  # i64 [K]: the input column each stored column reads

    def dense(self) -> torch.Tensor:
        """The fp32 weight [N, K] in the model's own column order (what capture runs with)."""
        w = self.weight.dequantize()
        if self.act_order is None:
            return w
        out = torch.empty_like(w)
        out[:, self.act_order] = w
        return out


@dataclass
class PrequantizedCheckpoint:
    """A GPTQ/AWQ checkpoint: its quantized linears by module name, and every other tensor."""

    scheme: Scheme
    linears: dict[str, ImportedLinear]
    tensors: dict[str, torch.Tensor]

    def dense_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A plain state dict: each quantized linear's dequantized weight as `<module>.weight`."""
        sd = {k: t.to(dtype) if t.is_floating_point() else t for k, t in self.tensors.items()}
        sd.update({f"{name}.weight": lin.dense().to(dtype) for name, lin in self.linears.items()})
        return sd


def read_prequantized(path: Path, qc: dict) -> PrequantizedCheckpoint:
    """Read a local GPTQ/AWQ checkpoint (every *.safetensors file of `path`) into llmc's format.

    Args:
        path: the model directory.
        qc: the `quantization_config` of its config.json.
    Returns:
        The checkpoint, with each linear that has a `<module>.qweight` converted exactly.

    Example:
        >>> ckpt = read_prequantized(Path("Llama-GPTQ"), cfg["quantization_config"])  # doctest: +SKIP
        >>> ckpt.linears["model.layers.0.mlp.up_proj"].weight.fmt.label               # doctest: +SKIP
        'w4a16-g128-zp'
    """
    from safetensors.torch import load_file
    scheme = read_scheme(qc)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    required = ("qweight", "qzeros", "scales")
    linears = {}
    for name in sorted(k[:-len(".qweight")] for k in tensors if k.endswith(".qweight")):
        missing = [p for p in required if f"{name}.{p}" not in tensors]
        if missing:
            raise CompileError(f"{path}: the {scheme.method.upper()} linear {name} has no {', '.join(missing)}")
        t = [tensors.pop(f"{name}.{p}") for p in required]
        linears[name] = gptq_linear(scheme, *t, tensors.pop(f"{name}.g_idx", None), name=name) \
            if scheme.method == "gptq" else awq_linear(scheme, *t, name=name)
    if not linears:
        raise CompileError(f"{path}: config.json declares {scheme.method.upper()} quantization but no tensor "
                           "is a packed `<module>.qweight`")
    return PrequantizedCheckpoint(scheme, linears, tensors)


# -- the two layouts ------------------------------------------------------------------------------

def unpack_words(p: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words packed along `dim` (low bits first) -> one code per element, i32, `dim` 32/bits
    times longer. An arithmetic shift of a negative word fills with ones that the mask drops."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:  # [R, C] -> [R, 32/bits, C] -> [R*32/bits, C]
        return ((p.unsqueeze(1) >> shifts[:, None]) & ((1 << bits) - 1)).reshape(-1, p.shape[1])
    return ((p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(p.shape[0], -1)


def gptq_linear(scheme: Scheme, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, name: str = "") -> ImportedLinear:
    """One GPTQ linear (layout in the module docstring) as an exact llmc `int` weight."""
    per_word = 32 // scheme.bits
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    g = _group(name, scheme, k)
    _check(name, "scales", scales, (k // g, n))
    _check(name, "qzeros", qzeros, (k // g, n // per_word))
    q = unpack_words(qweight, scheme.bits, 0).t()  # [N, K]
    z = unpack_words(qzeros, scheme.bits, 1).t() + int(scheme.zeros_minus_one)  # [N, G]
    groups, order = torch.arange(k) // g, None
    if g_idx is None and scheme.desc_act:
        raise CompileError(f"{name}: a GPTQ checkpoint with desc_act needs each linear's g_idx")
    if g_idx is not None:
        _check(name, "g_idx", g_idx, (k,))
        g_idx = g_idx.long()
        if not torch.equal(g_idx, groups):
            order = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[order], groups):
                raise CompileError(f"{name}: its g_idx does not put {g} input columns in each group; llmc "
                                   "imports activation order only with groups of equal size")
            q = q[:, order]
    return ImportedLinear(_int_weight(name, scheme.bits, g if k // g > 1 else 0, q, z, scales.t()), order)


def awq_linear(scheme: Scheme, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               name: str = "") -> ImportedLinear:
    """One AWQ GEMM linear (layout in the module docstring) as an exact llmc `int` weight."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    g = _group(name, scheme, k)
    _check(name, "scales", scales, (k // g, n))
    _check(name, "qzeros", qzeros, (k // g, n // 8))
    columns = torch.argsort(torch.tensor(AWQ_ORDER))  # the nibble holding each column of a word

    def unpack(p):
        return unpack_words(p, 4, 1).reshape(p.shape[0], -1, 8)[..., columns].reshape(p.shape[0], -1)

    q, z = unpack(qweight).t(), unpack(qzeros).t()  # [N, K], [N, G]
    return ImportedLinear(_int_weight(name, 4, g if k // g > 1 else 0, q, z, scales.t()))


def _int_weight(name: str, bits: int, group_size: int, q: torch.Tensor, z: torch.Tensor,
                scales: torch.Tensor) -> QuantizedWeight:
    if int(z.max()) > 255:
        raise CompileError(f"{name}: zero point {int(z.max())} does not fit llmc's 8-bit zero points")
    symmetric = bool((z == 1 << (bits - 1)).all())
    fmt = QuantFormat("int", bits, group_size, has_zeros=not symmetric)
    zeros = None if symmetric else z.to(torch.uint8).contiguous()
    return QuantizedWeight(fmt, pack(fmt, q.to(torch.uint8)), scales.contiguous(), zeros)


def _group(name: str, scheme: Scheme, k: int) -> int:
    g = k if scheme.group_size == -1 else scheme.group_size
    if k % g:
        raise CompileError(f"{name}: group size {g} does not divide its {k} input columns")
    return g


def _check(name: str, part: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != shape:
        raise CompileError(f"{name}.{part} has shape {list(t.shape)}; the quantization_config and its qweight "
                           f"give {list(shape)}")


# -- the graph ------------------------------------------------------------------------------------

def to_qlinear(g: Graph, linears: dict[str, ImportedLinear]) -> None:
    """Replace each `linear` node over an imported linear's dense stand-in (the param
    `<module>.weight`) by a `qlinear` over the imported tensors, as params `<module>.qweight`,
    `.scales`, `.zeros` (when it has them) and `.act_order` (for activation order: a `gather` of
    x's columns before the qlinear, shared by the linears that read the same x in the same order,
    as q/k/v and gate/up do since GPTQ orders by the Hessian of their common input)."""
    by_weight = {f"{name}.weight": name for name in linears}
    gathered: dict[tuple[Value, bytes], Value] = {}
    params: dict[str, list[Value]] = {}
    for node in list(g.nodes):
        if node.op != "linear" or node.inputs[1].name not in by_weight:
            continue
        name = by_weight[node.inputs[1].name]
        w, order, x = linears[name].weight, linears[name].act_order, node.inputs[0]
        if order is not None:
            key = (x, order.numpy().tobytes())
            if key not in gathered:
                index = g.add_param(f"{name}.act_order", order)
                gathered[key] = g.insert_before(node, g.make_node("gather", [x, index], {"dim": -1},
                                                                  meta=node.meta)).out
            x = gathered[key]
        if name not in params:
            parts = ("qweight", "scales", "zeros")[:len(w.tensors())]
            params[name] = [g.add_param(f"{name}.{p}", t) for p, t in zip(parts, w.tensors())]
        q = g.make_node("qlinear", [x, *params[name], *node.inputs[2:]], w.fmt.attrs(w.in_features),
                        meta=node.meta)
        g.insert_before(node, q)
        g.replace_uses(node.out, q.out)
        g.remove_nodes([node])
        g.rename(q.out, node.out.name)
    unseen = sorted(set(linears) - set(params))
    if unseen:
        raise CompileError(f"the quantized {unseen[0]} is in no linear node of the captured model; llmc imports "
                           "GPTQ/AWQ weights of nn.Linear layers that the forward uses")
    shared = sorted(by_weight[v.name] for n in g.nodes for v in n.inputs
                    if v is not None and v.name in by_weight)
    if shared:
        raise CompileError(f"the weight of the quantized {shared[0]} feeds more than its linear layer (tied to "
                           "an embedding?); llmc imports GPTQ/AWQ weights of nn.Linear layers only")
    g.remove_unused_params()
