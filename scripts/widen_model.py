"""Function-preserving widening of a Llama Hugging Face model to a larger shape.

Speculative decoding wants a target that behaves like a trained model (so draft acceptance is
realistic) but costs what a large model costs per step. This script takes a small trained Llama
(e.g. ``builtin:tiny-py``: hidden 384, 8 layers, 6 query heads over 2 KV heads of head_dim 64,
intermediate 1024, tied embeddings) and writes a ``LlamaForCausalLM`` directory of any larger shape
(e.g. Llama-3-8B's: hidden 4096, 32 layers, 32 heads over 8 KV heads, head_dim 128, intermediate
14336) that computes the *same function*: in fp32 its logits equal the source's up to float
rounding (~1e-6 relative), so its greedy tokens are identical. The vocabulary stays the source's.

Usage::

    python3 scripts/widen_model.py SRC_DIR OUT_DIR --hidden 4096 --layers 32 --heads 32 \
        --kv-heads 8 --intermediate 14336 [--head-dim 128] [--dtype bfloat16] \
        [--rounding {nearest,feedback,copies}]

or ``widen(src_dir, out_dir, hidden, layers, heads, kv_heads, intermediate, dtype, head_dim)``.

Notation: source h (hidden), L (layers), nh/nkv (query/KV heads), d (head_dim), i (intermediate);
target H, L', NH, NKV, D, I. Requirements (else ``ValueError``): every target size >= the source
size, NH % NKV == 0, D / d an integer r, and enough KV heads for the GQA mapping (step 4).

Construction, step by step (``x[:h]`` are the "real" dims, the rest "padding"):

1. **Embeddings / LM head.** ``E'[v, :h] = E[v]``, ``E'[v, h:] = 0``; same for an untied
   ``lm_head``. The residual stream therefore starts with zero padding. Tied stays tied (except
   with feedback rounding, step 7, and the logit shift, step 8).

2. **RMSNorm** (``y = w * x / sqrt(mean(x^2) + eps)``, mean over the *whole* hidden size). With
   zero padding, ``mean_H(x^2) = (h/H) * mean_h(x^2)``, so with ``eps' = eps * h/H``:
   ``sqrt(mean_H + eps') = sqrt(h/H) * sqrt(mean_h + eps)`` exactly, i.e. the widened norm
   divides by ``sqrt(h/H)`` times the source's denominator. Compensate with
   ``w'[:h] = w * sqrt(h/H)`` (or in the linears that read the norm, step 7); ``w'[h:] = 0``
   keeps the padding zero after every norm.
   LlamaConfig has one ``rms_norm_eps`` for all norms, and every norm sees the same padded
   residual, so ``rms_norm_eps' = rms_norm_eps * h / H`` is exact for all of them.
   Every projection reads only the real columns ``[:, :h]`` and writes only the real rows
   ``[:h, :]`` of the residual (other entries zero), so the padding stays exactly zero throughout.

3. **Head dim d -> D = r*d, rotary.** Llama's rotate_half RoPE pairs dims (j, j + D/2) of a head
   and rotates them at frequency ``theta^(-2j/D)``. Source dim k < d/2 is placed at ``j = r*k``
   and dim ``d/2 + k`` at ``D/2 + r*k``: the pair keeps its pairing and its frequency, since
   ``2(rk)/(rd) = 2k/d`` (in fp32 ``arange(0,D,2)/D`` and ``arange(0,d,2)/d`` are the same
   correctly rounded rational, so the inverse frequencies are bitwise equal). Other dims of q/k/v
   are zero rows and contribute nothing to q.k. The same placement is used for v (any placement
   works there) and for the matching o_proj columns. The softmax scale changes from
   ``d^-0.5`` to ``D^-0.5``; q_proj rows are multiplied by ``sqrt(D/d) = sqrt(r)`` to compensate.
   RoPE types ``default``, ``linear`` and ``llama3`` define each inverse frequency as a function of
   the default one alone, so they stay exact; others (dynamic, yarn, longrope...) depend on the
   head dim and are refused. (For a non-integer D/d one could instead keep dims at the same index
   and set ``rope_theta' = theta^(D/d)``, exact up to float rounding of the power; not done here:
   a non-integer ratio raises.)

4. **GQA mapping.** Source groups have gs = nh/nkv query heads per KV head, target groups
   G = NH/NKV. Source KV head g is copied into ``per = ceil(gs/G)`` consecutive target KV heads
   ``g*per .. g*per+per-1``; its m-th query head (source head ``g*gs + m``) goes to the
   ``m % G``-th query slot of target KV head ``g*per + m//G``, i.e. target query head
   ``(g*per + m//G)*G + m%G``. This needs ``nkv*per <= NKV``. Unused target query heads are zero
   (scores 0 -> uniform attention, but their o_proj columns are zero so they add nothing); unused
   KV heads are zero. Example: tiny-py 6q/2kv -> 32q/8kv: kv g -> g, q heads 3g..3g+2 ->
   4g..4g+2, q head 4g+3 and kv heads 2..7 zero.

5. **MLP** i -> I: gate/up rows ``[:i, :h]`` copied, down ``[:h, :i]`` copied, rest zero
   (``silu(0) * 0 = 0``).

6. **Layers** L -> L': the extra layers are *appended* after the source layers. Each is a widened
   copy of source layer ``k % L`` (realistic, finite activations, nothing is NaN: norms see the
   nonzero residual, eps > 0) with o_proj and down_proj set to zero, so it adds exactly 0 to the
   residual. Their per-step cost equals a real layer's.

7. **Rounding to a 16-bit dtype** (``--rounding``). The factors ``sqrt(h/H)`` and ``sqrt(D/d)`` are
   irrational for most shapes, so a source whose weights are exactly bf16 cannot be widened into
   exactly bf16 weights; each mode decides where the one extra rounding falls:

   * ``nearest`` (the only mode for float32): the construction above, every scaled weight rounded
     to nearest: the norm weights ``w * sqrt(h/H)`` and q_proj's rows ``* sqrt(D/d)``.
   * ``feedback``: every RMSNorm weight stays the source's
     (padded), and its factor ``c = sqrt(h/H)`` moves into the linears that read its output:
     q/k/v (input_layernorm), gate/up (post_attention_layernorm) and the LM head (final norm; the
     LM head becomes an untied ``E * c`` while the embeddings stay ``E``). q_proj takes
     ``c * sqrt(D/d)`` in one product. Each such matrix is rounded by `feedback_round`: GPTQ's
     column-by-column error feedback with round-to-nearest as the quantiser and the Hessian of
     that linear's inputs (the source's fp32 norm outputs on the calibration text of llmc's
     quantization passes, see `calibration_hessians`), so the rounding error is small in the
     linear's *outputs* rather than weight by weight. The rounding happens in the source's
     coordinates (rows are placed afterwards), so it costs a source-sized pass whatever the
     target's shape.

   * ``copies`` (default for bfloat16 and float16 where ``H >= 2h``): the norms keep no factor at
     all. The residual's padding is not zero but holds copies of its real dims, copy j scaled by
     ``s_j`` (`copy_scales`), with ``sum s_j^2 = H/h - 1``: every norm's mean square over H dims is
     then the source's over h, so ``rms_norm_eps`` and the norm weights stay the source's (zero on
     the copies), the norm outputs equal the source's, and q/k/v, gate/up and the (tied) LM head read
     them with the source's own weights. The copies are written by the embeddings, o_proj and
     down_proj, whose rows for copy j are the real rows times ``s_j``. Every ``s_j`` but the last is a
     power of two, exact in any format, so those copies are bit for bit the scaled real dims; the last
     carries the remainder (``sqrt(5/192)`` of the real dims on the 8B shape), rounded to nearest, so the
     mean square is off by about a bf16 ulp times that copy's 0.2% share of it. The norms' outputs in
     bf16 then differ from the source's only where that tiny error or the longer fp32 reduction moves
     a value across a rounding boundary. Only q_proj's ``sqrt(D/d)`` is left: its rows times the
     factor are rounded, and the rounding's remainder divided by ``s_1`` (a power of two) is a second
     block of q_proj weights over copy 1, where input_layernorm (alone) keeps the source's weight, so
     q_proj sums ``W_hi x + W_lo (s_1 x)`` in fp32: about 16 bits of ``sqrt(D/d) W``, no calibration.
     (Where ``s_1`` is not a power of two, with room for one copy only, q_proj's rows are rounded with
     error feedback instead, as ``feedback``.)

   On the 8B shape ``sqrt(3/32)`` and ``sqrt(3)/4`` have the mantissas of hidden 1024 / head_dim
   128's ``sqrt(3/8)`` and ``sqrt(3)/2`` (a power of two apart), so a hidden-1024 widening rounds
   every weight the same way and is a small stand-in for the 8B one
   (``benchmarks/widen_rounding.py`` measures both modes on it).

8. **Logit shift** (``--logit-shift``, default on with ``copies`` in a 16-bit dtype). A 16-bit LM head
   rounds each logit to the format's grid at the logit's magnitude: tiny-py's top logits are about 15,
   where bf16's step is 1/16, and near-ties between the top tokens are decided by that rounding (on
   tiny-py, rounding the fp32 model's logits alone to bf16 costs 0.8 of the 1.5 points by which
   tiny-py bf16's argmax differs from fp32's). Softmax and argmax are unchanged when every logit of a
   position moves by the same amount, so the widened LM head subtracts ``u . x``, a least-squares
   estimate of the position's top logit from the final norm's output ``x`` (`top_logit_fit`, the
   source in fp32 on the calibration text): the final norm keeps the source's weight on copy 1 too,
   and every row of the LM head reads copy 1 with ``-u / s_1`` beside the source's embedding on the
   real dims, which stay bit for bit (the head is untied; Llama-3-8B's is too). The shifted top
   logits are a few units, where bf16's grid is several times finer. Any rounding of ``u`` or of the
   copy moves all of a position's logits alike, so it changes nothing. What it does change: a
   repetition penalty that divides positive and multiplies negative logits (HF's, llmc's) acts on
   the shifted values, so penalised sampling is not the source's; greedy, temperature, top-k/p,
   min-p, presence/frequency penalties and log-probabilities are.

Exactness: in exact arithmetic the widened model equals the source (its logits less a per-position
shift with step 8); in fp32 the differences are rounding (the sqrt factors, the different reduction
lengths), ~1e-6 relative on logits. In a 16-bit dtype the scaled weights carry one extra rounding
(step 7), so its tokens can differ from the source's tokens in that dtype; the fp32 check is the
reference.

The output is written tensor by tensor into safetensors shards, so an 8B-shaped model never
needs more memory than one shard (default 2 GiB) plus a few tensors.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmc.errors import LLMCError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXACT_ROPE_TYPES = ("default", "linear", "llama3")
ROUNDINGS = ("nearest", "feedback", "copies")
# The linears that read each norm's output: with feedback rounding they carry the norm's factor.
NORM_READERS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}
COPY_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json",
)


@dataclass
class Plan:
    """Source and target shapes plus the head mappings (step 3 and 4 of the module docstring)."""

    h: int
    H: int
    L: int
    Lt: int
    nh: int
    NH: int
    nkv: int
    NKV: int
    d: int
    D: int
    i: int
    I: int
    q_map: list[int] = field(default_factory=list)  # source q head -> target q head
    kv_map: list[list[int]] = field(default_factory=list)  # source kv head -> target kv heads

    @property
    def r(self) -> int:
        return self.D // self.d

    def dim_index(self) -> torch.Tensor:
        """Target position within a head of each source head dim (keeps RoPE pairs/frequencies)."""
        half = self.d // 2
        k = torch.arange(self.d)
        return torch.where(k < half, self.r * k, self.D // 2 + self.r * (k - half))


def make_plan(h, L, nh, nkv, d, i, H, Lt, NH, NKV, D, I) -> Plan:
    """Check the target shape against the source and compute the GQA head mapping."""
    for name, src, dst in (("hidden", h, H), ("layers", L, Lt), ("heads", nh, NH),
                           ("kv_heads", nkv, NKV), ("head_dim", d, D), ("intermediate", i, I)):
        if dst < src:
            raise ValueError(f"target {name}={dst} is smaller than the source's {src}; "
                             "widening can only grow a model")
    if D % d:
        raise ValueError(f"target head_dim {D} is not an integer multiple of the source head_dim {d}: "
                         "RoPE frequencies can only be kept exactly for an integer ratio")
    if d % 2 or D % 2:
        raise ValueError("head_dim must be even for rotary embeddings")
    if NH % NKV:
        raise ValueError(f"target heads {NH} not divisible by kv_heads {NKV}")
    if nh % nkv:
        raise ValueError(f"source heads {nh} not divisible by kv_heads {nkv}")
    gs, G = nh // nkv, NH // NKV
    per = -(-gs // G)
    if nkv * per > NKV:
        raise ValueError(
            f"not enough target KV heads: each of the {nkv} source KV groups of {gs} query heads "
            f"needs {per} target KV head(s) of group size {G}, {nkv * per} > {NKV}")
    plan = Plan(h, H, L, Lt, nh, NH, nkv, NKV, d, D, i, I)
    plan.kv_map = [[g * per + j for j in range(per)] for g in range(nkv)]
    plan.q_map = [(g * per + m // G) * G + m % G for g in range(nkv) for m in range(gs)]
    assert len(set(plan.q_map)) == nh
    return plan


def _source_tensors(src: Path):
    """name -> (safe_open handle) over a single or sharded safetensors checkpoint."""
    from safetensors import safe_open

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    where = {}
    for f in files:
        handle = safe_open(str(f), framework="pt")
        for k in handle.keys():
            where[k] = handle
    return where


def feedback_round(w: torch.Tensor, hessian: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
                   damp: float = 0.01, act_order: bool = True, block: int = 128) -> torch.Tensor:
    """Round w [N, K] to `dtype` so that ``||X (Q - w)^T||`` is small for inputs X with ``X^T X ~ hessian``.

    GPTQ's error feedback (Frantar et al. 2022; llmc/passes/quantize/gptq.py does the same for int
    formats) with round-to-nearest `dtype` as the quantiser: columns are rounded one at a time, and
    each column's error moves onto the columns not yet rounded through the upper Cholesky factor of
    the damped inverse Hessian, one GEMM per block of `block` columns.

    Args:
        w: the weight [N, K] to round (any float dtype; the work is in fp64).
        hessian: ``X^T X`` [K, K] of the calibration inputs X [M, K] (any positive multiple).
        dtype: the dtype to round to.
        damp: added to the diagonal as ``damp * mean(diag H)`` (GPTQ's 1%), so that H is invertible
            and the feedback does not fit directions the calibration inputs barely visit.
        act_order: round the columns in order of decreasing ``H_ii`` (the inputs with most energy
            first, while most columns remain to absorb their error), else left to right.
        block: columns per batched update (speed only).

    Returns:
        Q [N, K] in `dtype`.

    Example:
        >>> x, w = torch.randn(256, 16) @ torch.randn(16, 16), torch.randn(8, 16)
        >>> feedback_round(w, x.T @ x).dtype
        torch.bfloat16
    """
    n, k = w.shape
    perm = torch.argsort(hessian.diagonal(), descending=True) if act_order else torch.arange(k, device=w.device)
    Wt = w.double().t()[perm].contiguous()  # [K, N]: w's columns in rounding order, each row contiguous
    H = hessian.double()[perm][:, perm]
    H.diagonal().add_(damp * H.diagonal().mean())
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # [K, K]
    Qt = torch.empty(k, n, dtype=dtype, device=w.device)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1, E1 = Wt[i1:i2].clone(), torch.zeros_like(Wt[i1:i2])  # [B, N]: the block, its scaled errors
        for i in range(i2 - i1):
            j = i1 + i
            Qt[j] = W1[i].to(dtype)
            E1[i] = (W1[i] - Qt[j].double()) / U[j, j]
            W1[i + 1:].addmm_(U[j, j + 1:i2, None], E1[i:i + 1], alpha=-1)  # rank 1; addr_ is slower
        Wt[i2:].addmm_(U[i1:i2, i2:].t(), E1, alpha=-1)
    return Qt[torch.argsort(perm)].t()


def _calibrate(src_dir, samples: int, hooks: dict) -> None:
    """Run the source in fp32 over the calibration text of llmc's quantization passes
    (``builtin:heldout``: the second half of the held-out text, `samples` windows of 256 tokens;
    benchmarks read its beginning), with ``hooks[name](module, args, out)`` on the modules named."""
    from transformers import AutoModelForCausalLM

    from llmc.passes.manager import PassContext
    from llmc.passes.quantize.calibrate import calibration_windows
    from llmc.passes.quantize.config import QuantConfig

    windows = calibration_windows(PassContext(state={"tokenizer_dir": str(src_dir)}),
                                  QuantConfig(calib_samples=samples))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32, local_files_only=True)
    model = model.to(device).eval()
    for name, module in model.named_modules():
        if name in hooks:
            module.register_forward_hook(hooks[name])
    with torch.no_grad():
        for i in range(0, len(windows), 8):
            model(torch.tensor(windows[i:i + 8], device=device))


def calibration_hessians(src_dir, samples: int = 128) -> dict[str, torch.Tensor]:
    """``X^T X`` [h, h] (fp64) of every RMSNorm's output, by module name, from the source in fp32 on
    the calibration text (`_calibrate`)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig.from_pretrained(src_dir, local_files_only=True)
    names = [f"model.layers.{k}.{n}" for k in range(cfg.num_hidden_layers) for n in NORM_READERS] + ["model.norm"]
    hessians: dict[str, torch.Tensor] = {}

    def observe(name):
        def hook(module, args, out):
            x = out.reshape(-1, out.shape[-1]).double()  # [tokens, h]
            hessians[name] = hessians[name] + x.T @ x if name in hessians else x.T @ x
        return hook

    _calibrate(src_dir, samples, {n: observe(n) for n in names})
    return {k: v.cpu() for k, v in hessians.items()}


def top_logit_fit(src_dir, samples: int = 128) -> tuple[torch.Tensor, dict]:
    """The least-squares ``u`` [h] (fp64) with ``u . x ~= max_v logit_v`` at every position, ``x`` being
    the final norm's output, from the source in fp32 on the calibration text (`_calibrate`): the
    logit shift of step 8. Also ``{"tokens", "top_logit_rms", "residual_rms"}``: how large the top
    logits are and what is left of them after the shift."""
    sums: dict[str, torch.Tensor] = {}

    def hook(module, args, out):
        x = args[0].reshape(-1, args[0].shape[-1]).double()  # the LM head's input [tokens, h]
        m = out.reshape(-1, out.shape[-1]).amax(-1).double()  # each position's largest logit
        for k, v in (("xx", x.T @ x), ("xm", x.T @ m), ("mm", m @ m), ("n", torch.tensor(float(len(m))))):
            sums[k] = sums[k] + v if k in sums else v
    _calibrate(src_dir, samples, {"lm_head": hook})
    xx, xm, mm, n = (sums[k].cpu() for k in ("xx", "xm", "mm", "n"))
    ridge = 1e-9 * xx.diagonal().mean() * torch.eye(len(xx), dtype=xx.dtype)
    u = torch.linalg.solve(xx + ridge, xm)
    residual = (mm - 2 * u @ xm + u @ xx @ u).clamp(min=0) / n
    return u, {"tokens": int(n), "top_logit_rms": (mm / n).sqrt().item(), "residual_rms": residual.sqrt().item()}


def feedback_weights(get, p: Plan, tied: bool, dtype: torch.dtype,
                     hessians: dict[str, torch.Tensor], copies: bool = False) -> dict[str, torch.Tensor]:
    """Every linear that reads a norm's output times that norm's factor (q_proj also times
    ``sqrt(D/d)``), rounded by `feedback_round`; by source name, the LM head as ``lm_head.weight``
    (``E * c`` when the source ties it to the embeddings). With `copies` the norms have no factor
    (step 7), so only q_proj's ``sqrt(D/d)`` is left to round."""
    c, q = (1.0 if copies else math.sqrt(p.h / p.H)), math.sqrt(p.D / p.d)
    jobs = [] if copies else [("lm_head.weight", "model.embed_tokens.weight" if tied else "lm_head.weight", c,
                               "model.norm")]
    for layer in range(p.L):
        pre = f"model.layers.{layer}."
        for norm, linears in NORM_READERS.items():
            for lin in linears:
                name, f = pre + lin + ".weight", c * q if lin.endswith("q_proj") else c
                if f != 1.0:
                    jobs.append((name, name, f, pre + norm))
    return {name: feedback_round(get(src).double() * f, hessians[norm], dtype)
            for name, src, f, norm in jobs}


def copy_scales(h: int, H: int) -> list[float]:
    """The scales of the copies of the residual's real dims that fill its padding (rounding "copies",
    step 7): copy j holds ``scales[j] * x[:h]`` in dims ``[(j+1)h, (j+2)h)``, and their squares sum to
    ``H/h - 1``, so that the mean square over all H dims equals the source's over h. Every scale but
    the last is a power of two (chosen greedily, largest first), so those copies are exact in any
    float format; the last carries the small remainder. Needs ``H >= 2h``.

    Example:
        >>> copy_scales(384, 768), copy_scales(384, 2048)[:3]
        ([1.0], [2.0, 0.5, 0.25])
    """
    from fractions import Fraction

    slots = (H - h) // h
    if slots < 1:
        raise ValueError(f"rounding 'copies' needs a hidden size of at least twice the source's ({2 * h}); "
                         f"{H} leaves no room for a copy: use rounding 'feedback'")
    rest, scales = Fraction(H - h, h), []
    while rest and len(scales) < slots - 1:
        e = 0
        while Fraction(4) ** e > rest:
            e -= 1
        while Fraction(4) ** (e + 1) <= rest:
            e += 1
        scales.append(2.0 ** e)
        rest -= Fraction(4) ** e
    if rest:
        scales.append(math.sqrt(rest))
    return scales


def _check_config(cfg) -> None:
    if cfg.model_type != "llama":
        raise ValueError(f"only Llama models are supported, got model_type={cfg.model_type!r}")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise ValueError("attention/mlp biases are not supported")
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    rtype = rope.get("rope_type", "default")
    if rtype not in EXACT_ROPE_TYPES:
        raise ValueError(f"rope_type {rtype!r} depends on head_dim; only {EXACT_ROPE_TYPES} are exact")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")


def widen(src_dir, out_dir, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
          dtype: torch.dtype = torch.float32, head_dim: int | None = None,
          shard_bytes: int = 2 << 30, rounding: str | None = None, calib_samples: int = 128,
          logit_shift: bool | None = None) -> Path:
    """Write a function-preserving widening of the Llama at ``src_dir`` to ``out_dir``.

    Args:
        src_dir: Hugging Face directory of a ``LlamaForCausalLM`` (safetensors weights).
        out_dir: output directory (created; existing weight files there are replaced).
        hidden, layers, heads, kv_heads, intermediate: target shape, each >= the source's.
        dtype: dtype of the written weights (computed in fp32, then cast).
        head_dim: target head dim; default ``hidden // heads``. Must be a multiple of the source's.
        shard_bytes: maximum size of one safetensors shard.
        rounding: ``"nearest"``, ``"feedback"`` or ``"copies"`` (step 7 of the module docstring);
            default copies for a 16-bit dtype (feedback where ``hidden < 2h``), nearest for float32.
        calib_samples: feedback rounding and the logit shift: calibration windows of 256 tokens.
        logit_shift: subtract a linear estimate of each position's top logit in the LM head (step 8);
            default on for the copies rounding in a 16-bit dtype, which it needs.

    Returns:
        ``out_dir`` as a Path. Raises ``ValueError`` for an impossible target shape or rounding.

    Example:
        >>> from llmc.models import builtin_dir
        >>> widen(builtin_dir("tiny-py"), "/tmp/wide", 1024, 8, 8, 2, 2048, torch.bfloat16)  # doctest: +SKIP
        PosixPath('/tmp/wide')
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    src, out = Path(src_dir), Path(out_dir)
    cfg = LlamaConfig.from_pretrained(src, local_files_only=True)
    if rounding is None:
        rounding = "nearest" if dtype == torch.float32 else "copies" if hidden >= 2 * cfg.hidden_size else "feedback"
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, not {rounding!r}")
    if rounding == "feedback" and dtype == torch.float32:
        raise ValueError("feedback rounding is for a 16-bit dtype; float32 keeps the factors in the norms "
                         "(rounding 'nearest')")
    _check_config(cfg)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden {hidden} not divisible by heads {heads}; pass head_dim")
        head_dim = hidden // heads
    p = make_plan(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                  cfg.num_key_value_heads, d, cfg.intermediate_size,
                  hidden, layers, heads, kv_heads, head_dim, intermediate)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    src_t = _source_tensors(src)
    V = src_t["model.embed_tokens.weight"].get_slice("model.embed_tokens.weight").get_shape()[0]

    def raw(name: str) -> torch.Tensor:
        return src_t[name].get_tensor(name).to(torch.float32)

    feedback, copies = rounding == "feedback", rounding == "copies"
    scales = copy_scales(p.h, p.H) if copies else []
    # copies: q_proj's sqrt(D/d) in two terms, the second reading copy 1, where its scale is a power of two
    split_q = copies and p.r != 1 and math.frexp(scales[0])[0] == 0.5
    calibrated = feedback or (copies and p.r != 1 and not split_q)
    if logit_shift is None:
        logit_shift = copies and dtype != torch.float32
    if logit_shift and not copies:
        raise ValueError("the logit shift reads a copy of the final norm's output: it needs rounding 'copies'")
    shift, shift_info = (top_logit_fit(src, calib_samples) if logit_shift else (None, {}))
    scaled, norm_scale, q_scale = {}, 1.0, 1.0
    if calibrated:  # the factors live in the rounded linears; the norms are the source's
        scaled = feedback_weights(raw, p, tied, dtype, calibration_hessians(src, calib_samples), copies)
    elif not copies:
        norm_scale = math.sqrt(p.h / p.H)
        q_scale = math.sqrt(p.D / p.d)

    def get(name: str) -> torch.Tensor:
        return scaled[name].float() if name in scaled else raw(name)
    idx = p.dim_index()
    src_rows = torch.arange(p.d)

    def pad(t: torch.Tensor, shape) -> torch.Tensor:
        o = torch.zeros(shape, dtype=dtype)
        o[tuple(slice(0, n) for n in t.shape)] = t.to(dtype)
        return o

    def norm(w: torch.Tensor) -> torch.Tensor:
        return pad(w * norm_scale, (p.H,))

    def residual(w: torch.Tensor, k: int) -> torch.Tensor:  # [h, k'] -> [H, k]: the real rows and their copies
        o = pad(w, (p.H, k))
        for j, s in enumerate(scales, 1):
            o[j * p.h:(j + 1) * p.h, :w.shape[1]] = (w * s).to(dtype)
        return o

    def q_proj(w):  # [nh*d, h] -> [NH*D, H]
        o = torch.zeros(p.NH * p.D, p.H, dtype=dtype)
        for s, t in enumerate(p.q_map):
            rows = w[s * p.d + src_rows].double() * math.sqrt(p.r) if split_q else w[s * p.d + src_rows] * q_scale
            o[t * p.D + idx, : p.h] = hi = rows.to(dtype)
            if split_q:  # the rounding's remainder, on copy 1 of the norm's output
                o[t * p.D + idx, p.h:2 * p.h] = ((rows - hi.double()) / scales[0]).to(dtype)
        return o

    def input_norm(w: torch.Tensor) -> torch.Tensor:
        o = norm(w)
        if split_q:  # copy 1 of the normed residual, for q_proj's second term
            o[p.h:2 * p.h] = w.to(dtype)
        return o

    def final_norm(w: torch.Tensor) -> torch.Tensor:
        o = norm(w)
        if logit_shift:  # copy 1 of the final normed residual, for the LM head's shift
            o[p.h:2 * p.h] = w.to(dtype)
        return o

    def lm_head(w: torch.Tensor) -> torch.Tensor:  # [V, h] -> [V, H]
        o = pad(w, (V, p.H))
        if logit_shift:  # every row alike: minus u . x, read from copy 1 (scale s_1)
            o[:, p.h:2 * p.h] = (-shift / scales[0]).to(dtype)
        return o

    def kv_proj(w):  # [nkv*d, h] -> [NKV*D, H]
        o = torch.zeros(p.NKV * p.D, p.H, dtype=dtype)
        for g, targets in enumerate(p.kv_map):
            for t in targets:
                o[t * p.D + idx, : p.h] = w[g * p.d + src_rows].to(dtype)
        return o

    def o_proj(w):  # [h, nh*d] -> [H, NH*D]
        o = torch.zeros(p.h, p.NH * p.D)
        for s, t in enumerate(p.q_map):
            o[:, t * p.D + idx] = w[:, s * p.d + src_rows]
        return residual(o, p.NH * p.D)

    # Ordered list of (name, shape, builder) for the whole target checkpoint.
    entries = []
    entries.append(("model.embed_tokens.weight", (V, p.H),
                    lambda: residual(get("model.embed_tokens.weight").T, V).T))
    for layer in range(p.Lt):
        sl = layer % p.L
        extra = layer >= p.L
        pre, spre = f"model.layers.{layer}.", f"model.layers.{sl}."
        zero_out = (lambda shape: (lambda: torch.zeros(shape, dtype=dtype)))
        entries += [
            (pre + "input_layernorm.weight", (p.H,), lambda n=spre: input_norm(get(n + "input_layernorm.weight"))),
            (pre + "self_attn.q_proj.weight", (p.NH * p.D, p.H),
             lambda n=spre: q_proj(get(n + "self_attn.q_proj.weight"))),
            (pre + "self_attn.k_proj.weight", (p.NKV * p.D, p.H),
             lambda n=spre: kv_proj(get(n + "self_attn.k_proj.weight"))),
            (pre + "self_attn.v_proj.weight", (p.NKV * p.D, p.H),
             lambda n=spre: kv_proj(get(n + "self_attn.v_proj.weight"))),
            (pre + "self_attn.o_proj.weight", (p.H, p.NH * p.D),
             zero_out((p.H, p.NH * p.D)) if extra
             else (lambda n=spre: o_proj(get(n + "self_attn.o_proj.weight")))),
            (pre + "post_attention_layernorm.weight", (p.H,),
             lambda n=spre: norm(get(n + "post_attention_layernorm.weight"))),
            (pre + "mlp.gate_proj.weight", (p.I, p.H),
             lambda n=spre: pad(get(n + "mlp.gate_proj.weight"), (p.I, p.H))),
            (pre + "mlp.up_proj.weight", (p.I, p.H),
             lambda n=spre: pad(get(n + "mlp.up_proj.weight"), (p.I, p.H))),
            (pre + "mlp.down_proj.weight", (p.H, p.I),
             zero_out((p.H, p.I)) if extra
             else (lambda n=spre: residual(get(n + "mlp.down_proj.weight"), p.I))),
        ]
    entries.append(("model.norm.weight", (p.H,), lambda: final_norm(get("model.norm.weight"))))
    if not tied or feedback or logit_shift:
        head = "model.embed_tokens.weight" if tied and not feedback else "lm_head.weight"
        entries.append(("lm_head.weight", (V, p.H), lambda: lm_head(get(head))))

    # Assign shards by size, then build and write one shard at a time.
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards, cur, cur_bytes = [], [], 0
    for e in entries:
        nbytes = math.prod(e[1]) * itemsize
        if cur and cur_bytes + nbytes > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(e)
        cur_bytes += nbytes
    shards.append(cur)

    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.safetensors")) + list(out.glob("*.safetensors.index.json")):
        old.unlink()
    n = len(shards)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for name, shape, build in shard:
            t = build().contiguous()
            assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, (name, t.shape, shape)
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * itemsize
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)  # safetensors creates 0600 files
        del tensors
    if n > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")

    new = LlamaConfig.from_pretrained(src, local_files_only=True)
    new.hidden_size, new.num_hidden_layers = p.H, p.Lt
    new.num_attention_heads, new.num_key_value_heads = p.NH, p.NKV
    new.head_dim, new.intermediate_size = p.D, p.I
    new.rms_norm_eps = cfg.rms_norm_eps if copies else cfg.rms_norm_eps * p.h / p.H
    new.tie_word_embeddings = tied and not feedback and not logit_shift
    new.architectures = ["LlamaForCausalLM"]
    new.dtype = dtype
    new.save_pretrained(out)
    for fname in COPY_FILES:
        if (src / fname).is_file():
            shutil.copy2(src / fname, out / fname)
    (out / "widen_info.json").write_text(json.dumps({
        "source": str(src.resolve()),
        "source_shape": {"hidden": p.h, "layers": p.L, "heads": p.nh, "kv_heads": p.nkv,
                         "head_dim": p.d, "intermediate": p.i},
        "target_shape": {"hidden": p.H, "layers": p.Lt, "heads": p.NH, "kv_heads": p.NKV,
                         "head_dim": p.D, "intermediate": p.I},
        "q_head_map": p.q_map, "kv_head_map": p.kv_map,
        "extra_layers": list(range(p.L, p.Lt)),
        "dtype": str(dtype).removeprefix("torch."),
        "rounding": rounding,
        **({"copy_scales": scales, "q_proj_in_two_terms": split_q} if copies else {}),
        **({"calibration": {"text": "builtin:heldout", "windows": calib_samples, "window_tokens": 256}}
           if calibrated or logit_shift else {}),
        "logit_shift": {"fit": "least squares of each position's top logit on the final norm's output",
                        **shift_info} if logit_shift else None,
        "note": "function-preserving widening (scripts/widen_model.py); extra layers have zero "
                "o_proj/down_proj; logits equal the source's up to float rounding in fp32"
                + (", less a per-position shift (softmax and argmax unchanged)" if logit_shift else ""),
    }, indent=2) + "\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--kv-heads", type=int, required=True)
    ap.add_argument("--intermediate", type=int, required=True)
    ap.add_argument("--head-dim", type=int, default=None, help="default: hidden // heads")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--rounding", choices=ROUNDINGS, default=None,
                    help="where a 16-bit dtype's extra rounding falls (module docstring, step 7); "
                         "default: copies for bfloat16/float16 (feedback below twice the source's hidden "
                         "size), nearest for float32")
    ap.add_argument("--calib-samples", type=int, default=128,
                    help="feedback rounding and the logit shift: calibration windows of 256 tokens")
    ap.add_argument("--logit-shift", action=argparse.BooleanOptionalAction, default=None,
                    help="subtract a linear estimate of each position's top logit in the LM head, so a 16-bit "
                         "dtype rounds the logits near zero (module docstring, step 8); default: on for the "
                         "copies rounding in bfloat16/float16")
    ap.add_argument("--shard-gb", type=float, default=2.0, help="max safetensors shard size (GiB)")
    a = ap.parse_args(argv)
    src = a.src_dir
    if src.startswith("builtin:"):
        from llmc.models import builtin_dir

        src = builtin_dir(src.removeprefix("builtin:"))
    t0 = time.perf_counter()
    try:
        out = widen(src, a.out_dir, a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate,
                    dtype=DTYPES[a.dtype], head_dim=a.head_dim, shard_bytes=int(a.shard_gb * (1 << 30)),
                    rounding=a.rounding, calib_samples=a.calib_samples, logit_shift=a.logit_shift)
    except (ValueError, LLMCError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 2**30:.2f} GiB, {a.dtype}) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
