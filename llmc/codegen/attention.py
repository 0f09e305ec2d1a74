"""Attention-side kernels of the CUDA backend: fused rope + paged KV write, and paged attention.

Two kernel families, each a frozen spec naming its template (all decisions are made here):

- `RopeKVWriteSpec` (`rope_kv_write.py.jinja`): one pass over the new tokens that ropes q and k and
  scatters the roped k and the v into the paged cache (`rope_kv_write`).
- `PagedAttentionSpec` (`paged_attention_{prefill,decode}.py.jinja`): attention of the new tokens
  over each sequence's whole context, read from the cache through the block table
  (`paged_attention`). Prefill is a flash-attention loop over key tiles; decode is split-K
  "flash decoding" (partitions of a fixed number of keys, combined by the split that finishes
  last, in one launch) so that a few long sequences still fill the GPU.

Layouts are the token-flattened ones of `llmc/ir/paged_attention.py` (the golden model): q, k, v
[T, H, D]; kv_cache [2, NB, BS, Hkv, D]; kv_scale [NB, Hkv, 2D + 2BS]. The kernels run on CUDA, or on
CPU under `TRITON_INTERPRET=1` (set before the first `load` of a spec: `triton.jit` reads it when
the rendered module is imported).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from llmc.codegen.elementwise import compiled, interpreting
from llmc.codegen.kernels import KernelSpec, tile_counters
from llmc.errors import LLMCError
from llmc.intmath import cdiv, next_pow2
from llmc.ir.paged_attention import QMAX, scale_width, tiny

LOG2E = 1.4426950408889634
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
QUANTIZED = ("int8", "float8_e4m3fn")
# decode over a quantized cache in a 16-bit model with the codes in fp16 dots (PagedAttentionSpec.context), and
# each key tile's block centres read once; read when this module is imported: LLMC_KV_CODE_DOTS=0 gives the
# dequantize-then-dot form, LLMC_KV_CENTRE_DOTS=0 a centre read per key, LLMC_KV_CODE_WORDS=0 the codes loaded as
# they are and widened by Triton's casts
KV_CODE_DOTS = os.environ.get("LLMC_KV_CODE_DOTS", "1") != "0"
KV_CODE_WORDS = os.environ.get("LLMC_KV_CODE_WORDS", "1") != "0"
KV_CENTRE_DOTS = os.environ.get("LLMC_KV_CENTRE_DOTS", "1") != "0"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# rope + KV write


@dataclass(frozen=True)
class RopeKVWriteSpec(KernelSpec):
    """Rope q and k of the new tokens and write k, v into the paged cache, in one kernel.

    One program per token handles all its heads, so cos/sin are read once per token. Quantized
    caches (int8 / fp8) are written as the golden model writes them: each entry relative to its
    block's first entry, with a scale per token and head (`llmc/ir/paged_attention.py`).
    """

    template: ClassVar[str] = "rope_kv_write.py.jinja"
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    dtype: str = "float16"
    cache_dtype: str = "float16"
    block_size: int = 16

    def __post_init__(self):
        if self.head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got {self.head_dim}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"cache block_size must be a power of two, got {self.block_size}")

    @property
    def quantized(self) -> bool:
        return self.cache_dtype in QUANTIZED

    def context(self) -> dict[str, Any]:
        return {**super().context(), "quantized": self.quantized}

    def constexprs(self) -> dict[str, Any]:
        c = dict(NUM_Q_HEADS=self.num_q_heads, NUM_KV_HEADS=self.num_kv_heads, HEAD_DIM=self.head_dim,
                 HALF=self.head_dim // 2, BLOCK_HQ=next_pow2(self.num_q_heads),
                 BLOCK_HKV=next_pow2(self.num_kv_heads), BLOCK_D=next_pow2(self.head_dim), BLOCK_SIZE=self.block_size)
        if self.quantized:  # kv_scale holds the model's dtype
            c.update(QMAX=QMAX[DTYPES[self.cache_dtype]], TINY=tiny(DTYPES[self.dtype]))
        return c


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  kv_scale: torch.Tensor | None = None, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Apply rotate-half rope to q and k, write k and v into the paged cache, return the roped q.

    Args:
        q: [T, Hq, D] queries; k, v: [T, Hkv, D] new keys and values (any strides).
        cos, sin: [T, D] rope tables of each token's position.
        kv_cache: [2, NB, BS, Hkv, D]; written in place at `slot_mapping`.
        slot_mapping: [T] int flat slot (block * BS + offset) per token; -1 skips the token.
        kv_scale: [NB, Hkv, 2D + 2BS] in q's dtype, required for int8 / fp8 caches (the blocks' centres and
            per-token scales, `scale_layout` in llmc/ir/paged_attention.py); written in place.
        q_out: a contiguous [T, Hq, D] tensor for the result; allocated when None.

    Returns:
        [T, Hq, D] roped q (contiguous, q's dtype).

    Example:
        >>> q_roped = rope_kv_write(q, k, v, cos, sin, kv_cache, slot_mapping)  # doctest: +SKIP
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    assert k.shape == v.shape == (T, Hkv, D), (q.shape, k.shape, v.shape)
    assert cos.shape == sin.shape == (T, D), (cos.shape, sin.shape)
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[3:] == (Hkv, D), kv_cache.shape
    assert slot_mapping.shape == (T,), slot_mapping.shape
    quant = kv_cache.dtype in QMAX
    assert (kv_scale is not None) == quant, "kv_scale is required exactly for int8 / fp8 caches"
    if quant:
        assert kv_scale.shape == (kv_cache.shape[1], Hkv, scale_width(D, kv_cache.shape[2])), kv_scale.shape
        assert kv_scale.dtype == q.dtype, "kv_scale holds the model's dtype (q's)"
    spec = RopeKVWriteSpec(D, Hq, Hkv, dtype_name(q.dtype), dtype_name(kv_cache.dtype), kv_cache.shape[2])
    if q_out is None:
        q_out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    compiled(spec).rope_kv_write_kernel[(T,)](
        q, k, v, cos, sin, slot_mapping, q_out, kv_cache, *((kv_scale,) if quant else ()),
        *q.stride(), *k.stride(), *v.stride(), *cos.stride(), *sin.stride(), *q_out.stride(),
        *kv_cache.stride(), *(kv_scale.stride() if quant else ()),
        **spec.constexprs(), num_warps=4 if Hq * next_pow2(D) >= 2048 else 1)
    return q_out


# ---------------------------------------------------------------------------------------------
# paged attention


@dataclass(frozen=True)
class PagedAttentionSpec(KernelSpec):
    """Paged attention of the new tokens over each sequence's cached context.

    The query heads sharing one kv head are packed into the rows of one tile (GQA packing, as in
    vLLM's unified attention kernel): each K/V tile is read once per kv head instead of once per
    query head, which divides the dominant memory traffic by Hq / Hkv. The head dim is padded to a
    power of two (and at least 16, the smallest `tl.dot` operand) with masks.
    """

    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    block_size: int
    dtype: str = "float16"
    kv_dtype: str = "float16"
    mode: str = "prefill"
    causal: bool = True
    sliding_window: bool = False
    block_m: int = 0  # rows of a query tile (query tokens x packed heads); 0 = pick from head_dim
    block_n: int = 0  # keys per inner-loop tile; 0 = pick from head_dim
    split: bool = False  # decode only: contexts may span several partitions (else one covers them all)
    packed: bool = False  # prefill only: a 1D grid over the step's query tiles, fixed for any step (graphs)

    def __post_init__(self):
        if self.mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be 'prefill' or 'decode', got {self.mode!r}")
        if self.packed and self.mode != "prefill":
            raise ValueError("packed is a prefill launch")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"cache block_size must be a power of two, got {self.block_size}")
        for f in ("block_m", "block_n"):
            v = getattr(self, f)
            if v and (v < 16 or v & (v - 1)):
                raise ValueError(f"{f} must be a power of two >= 16 (tl.dot), got {v}")

    @property
    def template(self) -> str:  # one spec class, two templates: the mode picks
        return f"paged_attention_{self.mode}.py.jinja"

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def tiles(self) -> tuple[int, int]:
        """(BLOCK_M, BLOCK_N). Tutorial-06 sizes: 64 x 64 keeps a D<=64 tile pair in registers; for
        D=128 halve the key tile so q, k, v and the accumulator still fit without spilling."""
        bd = max(16, next_pow2(self.head_dim))
        block_n = self.block_n or (64 if bd <= 64 else 32)
        group_p2 = next_pow2(self.group)
        if self.mode == "decode":  # one query token: the rows are only the group's heads
            # a bf16 model over an int8 / fp8 cache: 64-key tiles (8B shape on an H100, benchmarks/attention_bench.py,
            # 2026-12-06: 4-8% faster than 32 over the tuning's steps with blocks of 16 and of 64)
            wide = self.kv_dtype in QUANTIZED and self.dtype == "bfloat16"
            return max(16, group_p2), self.block_n or (64 if wide else block_n)
        return max(self.block_m or 64, group_p2), block_n

    def context(self) -> dict[str, Any]:
        ctx = super().context()
        block_n = self.tiles()[1]
        code_dots = (self.mode == "decode" and self.kv_dtype in QUANTIZED and self.dtype in ("bfloat16", "float16")
                     and KV_CODE_DOTS)
        ctx.update(quantized=self.kv_dtype in QUANTIZED, direct_output=not self.split,
                   # decode over a quantized cache with the codes in fp16 dots: the codes enter the dots as they
                   # are (exact in fp16), each key's scale multiplies its score after the dot and each value's
                   # scale its probability before it; on the GPU the codes arrive as 16-bit pairs unpacked by PTX
                   # (heads of a multiple of 16 wide), and in a bf16 model each key tile's block centres are
                   # read once (a row per block, at most 16 a tile)
                   code_dots=code_dots,
                   # (else the codes' cast to fp16, straight on the GPU; the interpreter's goes through fp32)
                   widen_codes=".to(tl.float32)" if interpreting() else "",
                   code_words=code_dots and KV_CODE_WORDS and not interpreting() and self.head_dim % 16 == 0,
                   # where the key tile divides the block, each tile lies in one block, and its centres enter as
                   # rank-1 terms (no per-key centre and no spreading dots)
                   tile_in_block=code_dots and self.block_size % block_n == 0,
                   block_centres=(code_dots and KV_CENTRE_DOTS and self.dtype == "bfloat16"
                                  and self.block_size % block_n != 0 and block_n // self.block_size <= 16),
                   n_centres=max(1, block_n // self.block_size),
                   # fp32 must not drop to tf32 on the GPU; the argument means nothing for 16-bit inputs
                   dot_args=', input_precision="ieee"' if self.dtype == "float32" else "",
                   # the interpreter's tl.dot multiplies bf16's raw uint16 bits: widen its operands
                   # to fp32 there (exact, as the GPU's bf16 dot with an fp32 accumulator)
                   widen=".to(tl.float32)" if self.dtype == "bfloat16" and interpreting() else "")
        return ctx

    def constexprs(self) -> dict[str, Any]:
        block_m, block_n = self.tiles()
        group_p2 = next_pow2(self.group)
        c = dict(HEAD_DIM=self.head_dim, BLOCK_D=max(16, next_pow2(self.head_dim)), GROUP=self.group,
                 GROUP_P2=group_p2, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=self.block_size)
        if self.mode == "prefill":
            c["BLOCK_Q"] = block_m // group_p2
        if self.packed:
            c.update(NUM_KV_HEADS=self.num_kv_heads, SEQ_CHUNK=PACKED_SEQ_CHUNK, HEAVY_SEQS=HEAVY_FIRST_SEQS)
        return c


# decode kernel launches the compile times per attention shape (the first: the default for 128-dim heads):
# key tiles of 32 to 128 keys (256-key partitions hold a whole number of each, so a sequence's splits,
# and its sums' batch independence, stay as they are), deeper load pipelines, more warps for larger tiles
DECODE_TILE_CANDIDATES = [dict(BLOCK_N=n, num_stages=st, num_warps=w)
                          for n, st, w in ((32, 2, 4), (32, 3, 4), (64, 2, 4), (64, 3, 4), (64, 3, 8), (128, 2, 8),
                                           (128, 3, 8))]


# prefill kernel launches the compile times per attention shape (the first: the default): query tiles of
# 64 or 128 rows (tokens x the group's heads), key tiles of 32 to 128, more warps for the larger tiles
PREFILL_TILE_CANDIDATES = [dict(BLOCK_M=m, BLOCK_N=n, num_stages=st, num_warps=w)
                           for m, n, st, w in ((64, 32, 2, 4), (64, 64, 2, 4), (64, 64, 3, 4), (128, 32, 2, 8),
                                               (128, 64, 2, 8), (128, 64, 3, 8), (128, 128, 2, 8), (64, 128, 2, 8))]


# prefill steps of at most this many sequences launch their last query tiles first (the template's
# heavy_first); steps of more run sequence by sequence. On the H200 (benchmarks/attention_bench.py, 2026-12-04)
# the last tiles first ran a fresh 2,048-token prompt 1.24x (8B shape) and 1.37x (1B) faster and four 512-token
# chunks 1.15x, but a step of 128 decode rows beside one chunk 0.89x (1B): its decode rows' programs, all in
# the last wave, then read their K/V with no prompt tile beside them
HEAVY_FIRST_SEQS = 4
# a packed prefill launch reads the step's query start offsets this many at a time
PACKED_SEQ_CHUNK = 128


def attention_tiles_key(head_dim: int, num_q_heads: int, num_kv_heads: int, dtype: str, kv_dtype: str,
                        window: bool, mode: str = "decode") -> str:
    """The tuning record's key of a decode (or prefill) attention launch (tuning.json, bucket `mode`)."""
    return f"paged_attention_{mode}:d{head_dim}:hq{num_q_heads}:hkv{num_kv_heads}:{dtype}:{kv_dtype}" + \
        (":window" if window else "")


# keys per split of split-K decode, at least (decode_partition); read when this module is imported, checked where used
DECODE_MIN_PARTITION = os.environ.get("LLMC_DECODE_PARTITION", "256")


@functools.lru_cache(maxsize=None)
def _keys(setting: str) -> int:
    n = int(setting) if setting.strip().isdigit() else 0
    if n < 1:
        raise LLMCError(f"LLMC_DECODE_PARTITION must be a positive whole number of keys per split, not {setting!r}")
    return n


def decode_partition(max_seqlen_k: int, block_n: int, min_partition: int | None = None, max_splits: int = 128
                     ) -> int:
    """Keys per split of split-K decode: `min_partition` keys, more only past `max_splits` splits.

    The partition does not depend on how many sequences share the step, so neither does a
    sequence's summation order (a sequence's tokens are the same alone or in a batch). Under CUDA
    graphs `max_seqlen_k` is the model's context limit, so every decode step of contexts up to
    min_partition x max_splits keys (32 Ki by default) splits them the same way. A sequence uses only
    the splits its own length needs: a short context is one program per kv head with no partials.
    A multiple of `block_n`.
    """
    per = max(min_partition or _keys(DECODE_MIN_PARTITION), cdiv(max(max_seqlen_k, 1), max_splits))
    return cdiv(per, block_n) * block_n


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, causal: bool = True,
                    window: int = 0, kv_scale: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                    max_seqlen_k: int | None = None, *, block_m: int = 0, block_n: int = 0,
                    partition_size: int | None = None, out: torch.Tensor | None = None,
                    decode_tiles: dict | None = None, prefill_tiles: dict | None = None, decode_rows: int = 0,
                    context_limit: int | None = None,
                    rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of the new tokens over their sequences' whole context, read from the paged cache.

    The cache must already hold the new K/V (`rope_kv_write` ran first). The new tokens of
    sequence i are its last n_i = qsl[i+1] - qsl[i] positions.

    Args:
        q: [T, Hq, D] queries (any strides).
        kv_cache: [2, NB, BS, Hkv, D] (float16 / bfloat16 / float32, or int8 / fp8 with kv_scale).
        query_start_loc: [N+1] int32 start of each sequence's new tokens in T.
        seq_lens: [N] int32 context length after this step (cached + new).
        block_tables: [N, M] int32 blocks of each sequence, in order.
        scale: softmax scale (usually D ** -0.5).
        causal: mask keys after each query's position.
        window: > 0 limits each query to its last `window` keys (sliding window).
        kv_scale: [NB, Hkv, 2D + 2BS] for int8 / fp8 caches: the blocks' centres and per-token scales.
        max_seqlen_q: largest n_i; 1 selects the split-K decode kernels. Computed (a host sync) if None.
        max_seqlen_k: largest seq_len; sizes the decode splits. Computed (a host sync) if None.
        block_m, block_n: tile overrides (0 = the spec's choice); partition_size: decode keys per
            split override (a multiple of the key tile; keep it fixed under CUDA graphs).
        decode_tiles: the decode kernel's launch, as tuned (`DECODE_TILE_CANDIDATES`): {"BLOCK_N",
            "num_stages", "num_warps"}; block_n, if given, still wins. None: the spec's defaults.
        prefill_tiles: the prefill kernel's launch, as tuned (`PREFILL_TILE_CANDIDATES`): {"BLOCK_M",
            "BLOCK_N", "num_stages", "num_warps"}; block_m / block_n, if given, still win.
        out: a contiguous [T, Hq, D] tensor for the result; allocated when None.
        decode_rows: how many leading sequences have exactly one new token (a mixed step's decodes: the
            scheduler puts them first). With prompt rows after them they run on the split-K decode kernel,
            the rest on the prefill kernel (two launches): in the prefill kernel a decode row would fill one
            of its query tile's rows per head and launch a program for every query tile of the step's
            longest chunk. 0 (or every row a decode): one launch.
        context_limit: the longest context the caller's decode steps size their splits for (the model's
            limit, as under the runtime's CUDA graphs); the decode partition follows it, so a sequence's
            sums are the same in an eager step as in a graph's. None: max_seqlen_k.
        rows: a mixed step's rows split for a launch that does not depend on them (a CUDA graph's:
            runtime.step_graphs, kind "mixed"): (decode_qsl, prompt_qsl), each [N+1] int32 like
            query_start_loc, decode_qsl with the prompt rows empty (no tokens) and prompt_qsl with the decode
            rows empty (`mixed_rows`). The decode kernel then runs over all N rows (a row without a token returns
            at once) and the prefill kernel on a packed grid sized for max_seqlen_q tokens (the step's token
            count) in N sequences. Each row's programs compute what decode_rows' two launches compute, so
            the outputs are the same bits. Needs max_seqlen_q and max_seqlen_k; decode_rows is ignored.

    Returns:
        [T, Hq, D] attention output in q's dtype.

    Example:
        >>> out = paged_attention(q, kv_cache, qsl, seq_lens, block_tables, 64 ** -0.5,
        ...                       max_seqlen_q=1, max_seqlen_k=4096)  # doctest: +SKIP
    """
    T, Hq, D = q.shape
    _, NB, BS, Hkv, Dk = kv_cache.shape
    N = seq_lens.shape[0]
    assert Dk == D and kv_cache.shape[0] == 2, (q.shape, kv_cache.shape)
    assert Hq % Hkv == 0, (Hq, Hkv)
    assert query_start_loc.shape == (N + 1,) and block_tables.shape[0] == N, (query_start_loc.shape, block_tables.shape)
    assert query_start_loc.dtype == seq_lens.dtype == block_tables.dtype == torch.int32
    quant = kv_cache.dtype in QMAX
    assert (kv_scale is not None) == quant, "kv_scale is required exactly for int8 / fp8 caches"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    if out is None:
        out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if T == 0 or N == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    mode = "decode" if max_seqlen_q == 1 else "prefill"
    quantized = (kv_scale,) if quant else ()
    base = (("head_dim", D), ("num_q_heads", Hq), ("num_kv_heads", Hkv), ("block_size", BS),
            ("dtype", dtype_name(q.dtype)), ("kv_dtype", dtype_name(kv_cache.dtype)), ("sliding_window", window > 0),
            ("block_n", block_n))
    if rows is not None:
        assert max_seqlen_k is not None, "a launch for any mixed step needs max_seqlen_k"
        decode_qsl, prompt_qsl = rows
        assert decode_qsl.shape == prompt_qsl.shape == query_start_loc.shape
        _decode(q, kv_cache, quantized, decode_qsl, seq_lens, block_tables, N, out, scale, window, max_seqlen_k,
                context_limit or max_seqlen_k, partition_size, decode_tiles, base)
        _prefill(q, kv_cache, quantized, prompt_qsl, seq_lens, block_tables, out, scale, causal, window,
                 max_seqlen_q, block_m, prefill_tiles, base, packed=True)
        return out
    if mode == "decode" or 0 < decode_rows < N:
        D1 = N if mode == "decode" else decode_rows
        if max_seqlen_k is None:
            max_seqlen_k = int(seq_lens[:D1].max())
        _decode(q, kv_cache, quantized, query_start_loc, seq_lens, block_tables, D1, out, scale, window,
                max_seqlen_k, context_limit or max_seqlen_k, partition_size, decode_tiles, base)
        if mode == "decode":
            return out
        query_start_loc, seq_lens, block_tables = query_start_loc[D1:], seq_lens[D1:], block_tables[D1:]
    _prefill(q, kv_cache, quantized, query_start_loc, seq_lens, block_tables, out, scale, causal, window,
             max_seqlen_q, block_m, prefill_tiles, base)
    return out


def _pointers_and_strides(q, kv_cache, quantized, qsl, seq_lens, block_tables, out) -> tuple[tuple, tuple]:
    """The kernels' tensor arguments, then their strides (kv_scale's only for quantized caches: the
    templates drop them otherwise)."""
    return ((q, kv_cache, *quantized, qsl, seq_lens, block_tables),
            (*q.stride(), *out.stride(), *kv_cache.stride(), *(quantized[0].stride() if quantized else ()),
             *block_tables.stride()))


def _tiles_key(tiles: dict | None) -> tuple | None:
    return tuple(sorted(tiles.items())) if tiles else None


def _tiled(base: tuple, tiles: tuple | None) -> tuple[dict, dict, dict]:
    """(the spec's arguments with the tuned key tile where no override gives one, the launch options, the tuned
    record as a dict) of a launch; the kernels' defaults where nothing was tuned."""
    base, t = dict(base), dict(tiles or ())
    if not t:
        return base, dict(num_warps=4, num_stages=2), t
    base["block_n"] = base["block_n"] or t["BLOCK_N"]
    return base, dict(num_warps=t["num_warps"], num_stages=t["num_stages"]), t


@functools.lru_cache(maxsize=None)
def _prefill_launch(base: tuple, causal: bool, block_m: int, tiles: tuple | None, packed: bool = False
                    ) -> tuple[PagedAttentionSpec, dict, dict]:
    """A prefill launch's spec, constexprs and launch options (memoized: a mixed step launches attention
    eagerly once per layer, and building these costs more host time than the launch)."""
    base, launch, t = _tiled(base, tiles)
    spec = PagedAttentionSpec(**base, mode="prefill", causal=causal, block_m=block_m or t.get("BLOCK_M", 0),
                              packed=packed)
    return spec, spec.constexprs(), launch


@functools.lru_cache(maxsize=None)
def _decode_launch(base: tuple, tiles: tuple | None) -> tuple[int, dict, PagedAttentionSpec, PagedAttentionSpec, dict]:
    """A decode launch's key tile, launch options, specs (one split; split-K) and constexprs (memoized)."""
    base, launch, _ = _tiled(base, tiles)
    one, split = (PagedAttentionSpec(**base, mode="decode", split=s) for s in (False, True))
    return one.tiles()[1], launch, one, split, one.constexprs()


def _prefill(q, kv_cache, quantized, qsl, seq_lens, block_tables, out, scale, causal, window, max_seqlen_q,
             block_m, prefill_tiles, base, packed: bool = False) -> None:
    """paged_attention's prefill launch over every sequence of qsl (one or more new tokens each), or with
    `packed` over the rows of qsl that hold tokens (the others none), for steps of up to max_seqlen_q tokens."""
    N, Hkv = seq_lens.shape[0], kv_cache.shape[3]
    tensors, strides = _pointers_and_strides(q, kv_cache, quantized, qsl, seq_lens, block_tables, out)
    spec, c, launch = _prefill_launch(base, causal, block_m, _tiles_key(prefill_tiles), packed)
    if packed:  # each sequence holds at most one partial tile: the step's tiles are at most these
        grid = (Hkv * (cdiv(max_seqlen_q, c["BLOCK_Q"]) + N),)
        arg = N
    else:
        tiles, heavy_first = cdiv(max_seqlen_q, c["BLOCK_Q"]), N <= HEAVY_FIRST_SEQS
        grid = (Hkv, N, tiles) if heavy_first else (tiles, N, Hkv)
        arg = int(heavy_first)
    compiled(spec).paged_attention_prefill_kernel[grid](
        out, *tensors, *strides, scale * LOG2E, window, arg, **c, **launch)


def mixed_rows(qsl: np.ndarray, decode_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(decode_qsl, prompt_qsl) of `paged_attention`'s `rows` from a step's query start offsets (host side):
    the first `decode_rows` sequences (one token each) kept in the first and emptied in the second, the rest
    the other way round."""
    at = qsl[decode_rows]
    return np.minimum(qsl, at), np.maximum(qsl, at)


def _decode(q, kv_cache, quantized, qsl, seq_lens, block_tables, N, out, scale, window, max_seqlen_k, context_limit,
            partition_size, decode_tiles, base) -> None:
    """paged_attention's split-K decode launch over the first N sequences of qsl (one new token each, at its
    last position, so causal masks nothing)."""
    Hkv, Hq = kv_cache.shape[3], q.shape[1]
    tensors, strides = _pointers_and_strides(q, kv_cache, quantized, qsl, seq_lens, block_tables, out)
    tile_n, launch, one, split, c = _decode_launch(base, _tiles_key(decode_tiles))
    partition = partition_size or decode_partition(max(context_limit, max_seqlen_k), tile_n)
    assert partition % tile_n == 0, f"partition_size {partition} must be a multiple of the key tile {tile_n}"
    splits = cdiv(max(max_seqlen_k, 1), partition)
    mod = compiled(split if splits > 1 else one)
    # partials: [N, Hq, splits] running max / sum and [N, Hq, splits, BLOCK_D] unnormalized output, fp32
    m_part = torch.empty((N, Hq, splits), dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    o_part = torch.empty((N, Hq, splits, c["BLOCK_D"]), dtype=torch.float32, device=q.device)
    counts = tile_counters(q.device, N * Hkv) if splits > 1 else m_part
    mod.paged_attention_decode_kernel[(N, Hkv, splits)](
        out, m_part, l_part, o_part, counts, *tensors, *strides, *m_part.stride(), *o_part.stride(),
        scale * LOG2E, window, partition, **c, **launch)
