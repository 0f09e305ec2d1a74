"""The attention kernels (rope + KV write, paged prefill, split-K decode) against the golden model.

The kernels run on CPU under the Triton interpreter. How `TRITON_INTERPRET` works in triton 3.9:
`triton.jit` reads it when it decorates a function, and triton decorates its *own* library
(`tl.zeros`, `tl.max`, `tl.sum`, `tl.cdiv`, ... are `@jit` functions) when `triton` is first
imported. So the variable must be set before the process's first `import triton`: set later, our
kernels become interpreted functions that call compiled-mode library functions and fail with
"Cannot call @triton.jit'd outside of the scope of a kernel" (seen with triton 3.9). One process
runs triton either interpreted or compiled, never both. Hence `_interpreted_here()`:

- triton not imported yet and no GPU (CI), or the variable already set: set it (for the whole
  session: every triton kernel on a GPU-less host needs it) and run the tests in this process;
- otherwise (triton already imported compiled, e.g. by a GPU test module collected earlier):
  the tests here skip and `test_interpreted_in_child` reruns this file in a fresh
  `python -m pytest` with the variable set, so the result never depends on collection order.

Rendered modules are cached by a key that includes the interpret flag, so an already-loaded compiled
module is never reused here; `test_kernels_run_interpreted` checks that.

bfloat16: the triton 3.9 interpreter stores bf16 tensors as their uint16 bit patterns and its
`tl.dot` runs `np.matmul` on that storage directly, so a bf16 `tl.dot` returns garbage (~1e8) on
CPU. The attention specs render their dots with fp32 operands when interpreting bf16 (exact: bf16
is the top half of an fp32); the tests here run those sources as the triton-interpret backend does,
and `test_bf16_attention_renders_plain_dots_when_compiled` checks the GPU's sources keep bf16 dots.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch


def _interpreted_here() -> bool:
    """Whether this process runs triton interpreted (setting TRITON_INTERPRET if it still can)."""
    if os.environ.get("LLMC_INTERPRET_CHILD") == "1" or (
            "triton" not in sys.modules and not torch.cuda.is_available()):
        os.environ["TRITON_INTERPRET"] = "1"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(tl.zeros, InterpretedFunction)  # the library was decorated interpreted


INTERPRETED = _interpreted_here()

from llmc.codegen.attention import (DECODE_TILE_CANDIDATES, PREFILL_TILE_CANDIDATES, PagedAttentionSpec,  # noqa: E402
                                    RopeKVWriteSpec, decode_partition, dtype_name, paged_attention,
                                    rope_kv_write)
from llmc.codegen.kernels import load  # noqa: E402
from llmc.errors import LLMCError  # noqa: E402
from llmc.ir.ops import _rope_ref  # noqa: E402
from llmc.ir.paged_attention import QMAX, _read, _to_q, _write, paged_attention_ref, scale_width  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module", autouse=True)
def interpreted(tmp_path_factory):
    if not INTERPRETED:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMC_CACHE_DIR", str(tmp_path_factory.mktemp("llmc_cache")))
        yield


@pytest.fixture(autouse=True)
def needs_interpreter(request):
    if not INTERPRETED and request.node.originalname != "test_interpreted_in_child":
        pytest.skip("triton was imported compiled in this process: test_interpreted_in_child runs these")


def test_interpreted_in_child():
    """This file in a fresh interpreted process, when this one imported triton compiled first."""
    if INTERPRETED:
        pytest.skip("this process runs triton interpreted: the tests ran here")
    if os.environ.get("LLMC_INTERPRET_CHILD") == "1":
        pytest.fail("the child process could not run triton interpreted")
    env = dict(os.environ, TRITON_INTERPRET="1", LLMC_INTERPRET_CHILD="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


def close(out, ref, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def make_case(ctx, new, Hq, Hkv, D, BS, dtype, seed, spare_blocks=3):
    """Random ragged metadata: shuffled block tables, garbage in free slots, the new tokens last."""
    g = torch.Generator().manual_seed(seed)
    N = len(ctx)
    per_seq = [-(-c // BS) for c in ctx]
    NB = sum(per_seq) + spare_blocks
    perm = torch.randperm(NB, generator=g)
    M = max(per_seq)
    bt = torch.zeros(N, M, dtype=torch.int32)
    i0 = 0
    for i, nb in enumerate(per_seq):
        bt[i, :nb] = perm[i0:i0 + nb]
        bt[i, nb:] = perm[-1]  # padding entries point anywhere valid: never read
        i0 += nb
    slots = [int(bt[i, p // BS]) * BS + p % BS for i in range(N) for p in range(ctx[i] - new[i], ctx[i])]
    T = sum(new)
    return dict(
        q=torch.randn(T, Hq, D, generator=g).to(dtype),
        k=torch.randn(T, Hkv, D, generator=g).to(dtype),
        v=torch.randn(T, Hkv, D, generator=g).to(dtype),
        cache=torch.randn(2, NB, BS, Hkv, D, generator=g).to(dtype),
        qsl=torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(ctx, dtype=torch.int32),
        bt=bt, slots=torch.tensor(slots, dtype=torch.int64))


def reference(c, cache, scale=None, causal=True, window=0):
    """paged_attention_ref on [T, H, D] tensors; writes the new K/V into `cache` (and `scale`)."""
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731  [T, H, D] -> [1, H, T, D]
    x = [t(c["q"]), t(c["k"]), t(c["v"]), cache, c["qsl"], c["seq_lens"], c["bt"], c["slots"]]
    attrs = dict(scale=c["q"].shape[-1] ** -0.5, causal=causal, window=window)
    return paged_attention_ref(x + ([scale] if scale is not None else []), attrs, None)[0].transpose(0, 1)


def run_attention(c, causal=True, window=0, **kw):
    """The kernels on the cache the reference wrote; compares and returns nothing."""
    cache = c["cache"].clone()
    ref = reference(c, cache, causal=causal, window=window)
    new = (c["qsl"][1:] - c["qsl"][:-1])
    out = paged_attention(c["q"], cache, c["qsl"], c["seq_lens"], c["bt"], c["q"].shape[-1] ** -0.5, causal=causal,
                          window=window, max_seqlen_q=int(new.max()), max_seqlen_k=int(c["seq_lens"].max()), **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    close(out, ref, c["q"].dtype)


def test_kernels_run_interpreted():
    from triton.runtime.interpreter import InterpretedFunction
    spec = PagedAttentionSpec(24, 4, 2, 4, "float16", "float16")
    assert isinstance(load(spec).paged_attention_prefill_kernel, InterpretedFunction)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_bf16_attention_renders_plain_dots_when_compiled(monkeypatch, mode):
    """Interpreted, a bf16 kernel's dots take fp32 operands; compiled (the GPU), bf16 ones."""
    import llmc.codegen.attention as attention
    from llmc.codegen.kernels import render
    spec = PagedAttentionSpec(64, 4, 2, 16, "bfloat16", "bfloat16", mode=mode)
    widened = "tl.dot(q.to(tl.float32), k.to(tl.float32)"
    assert widened in render(spec)
    assert widened not in render(PagedAttentionSpec(64, 4, 2, 16, "float16", "float16", mode=mode))
    monkeypatch.setattr(attention, "interpreting", lambda: False)
    src = render(spec)
    assert widened not in src and "tl.dot(q, k)" in src and "tl.dot(p.to(v.dtype), v)" in src


def test_quantized_decode_renders_the_codes_widening_when_compiled(monkeypatch):
    """Compiled (the GPU), an 8-bit cache's codes come as 16-bit pairs unpacked by PTX; without those
    (LLMC_KV_CODE_WORDS=0, or heads not a multiple of 16 wide) Triton's cast widens them to fp16 straight; only
    the interpreter's cast goes through fp32."""
    import llmc.codegen.attention as attention
    from llmc.codegen.kernels import render
    spec = PagedAttentionSpec(64, 4, 2, 16, "bfloat16", "float8_e4m3fn", mode="decode")
    assert "k.to(tl.float32).to(tl.float16)" in render(spec) and "_code_words(" not in render(spec)
    monkeypatch.setattr(attention, "interpreting", lambda: False)
    assert "_code_words(" in render(spec)
    monkeypatch.setattr(attention, "KV_CODE_WORDS", False)
    src = render(spec)
    assert "_code_words(" not in src and "k.to(tl.float16)" in src and "tl.float32).to(tl.float16)" not in src


# --------------------------------------------------------------------------------------------- rope + write

def rope_case(dtype, cache_dtype, seed):
    Hq, Hkv, D, BS = 4, 2, 24, 4
    c = make_case([6, 1, 11], [3, 1, 4], Hq, Hkv, D, BS, dtype, seed)
    T = c["q"].shape[0]
    g = torch.Generator().manual_seed(seed + 1000)
    qkv = torch.randn(T, Hq + 2 * Hkv, D, generator=g).to(dtype)  # a fused QKV projection: strided views
    q, k, v = qkv.split([Hq, Hkv, Hkv], dim=1)
    pos = torch.randint(0, 50, (T,), generator=g).float()
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)  # [T, D]
    slots = c["slots"].clone()
    slots[1] = -1  # skipped write
    return q, k, v, ang.cos().to(dtype), ang.sin().to(dtype), c["cache"].to(cache_dtype), slots


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_rope_kv_write(dtype):
    q, k, v, cos, sin, cache, slots = rope_case(dtype, dtype, seed=1)
    ref_cache = cache.clone()
    q_ref = _rope_ref((q, cos[:, None], sin[:, None]), {}, None)
    k_ref = _rope_ref((k, cos[:, None], sin[:, None]), {}, None)
    _write(ref_cache, None, 0, k_ref, slots)
    _write(ref_cache, None, 1, v, slots)
    out = rope_kv_write(q, k, v, cos, sin, cache, slots)
    close(out, q_ref, dtype)
    close(cache, ref_cache, dtype)  # includes the untouched slots and the skipped token's


def random_scales(NB, Hkv, D, BS, seed, dtype):
    """A quantized cache's kv_scale in some earlier state: random centres, positive per-token scales."""
    scale = torch.randn(NB, Hkv, scale_width(D, BS), generator=torch.Generator().manual_seed(seed))
    scale[..., 2 * D:] = scale[..., 2 * D:].abs() * 0.02 + 0.01
    return scale.to(dtype)


def dequantized(cache, scale):
    """[2, NB*BS, Hkv, D] fp32: every slot of a quantized cache as the golden model reads it."""
    NB, BS = cache.shape[1], cache.shape[2]
    return torch.stack([_read(cache, scale, w, torch.arange(NB), NB * BS, torch.float32) for w in (0, 1)])


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=dtype_name)
def test_rope_kv_write_quantized(kv_dtype):
    """int8 / fp8 caches: the kernel stores what the golden model stores. Block starts inside the step
    (the centre taken from this step's token), before it (the stored centre), and a skipped write."""
    dtype = torch.float16
    q, k, v, cos, sin, cache, slots = rope_case(dtype, kv_dtype, seed=2)
    NB, BS, Hkv, D = cache.shape[1:]
    scale = random_scales(NB, Hkv, D, BS, seed=3, dtype=dtype)
    ref_cache, ref_scale = cache.clone(), scale.clone()
    k_ref = _rope_ref((k, cos[:, None], sin[:, None]), {}, None)
    _write(ref_cache, ref_scale, 0, k_ref, slots)
    _write(ref_cache, ref_scale, 1, v, slots)
    out = rope_kv_write(q, k, v, cos, sin, cache, slots, kv_scale=scale)
    close(out, _rope_ref((q, cos[:, None], sin[:, None]), {}, None), dtype)
    torch.testing.assert_close(scale, ref_scale, rtol=2e-3, atol=1e-3)  # centres: the roped k, one fp16 ulp
    # the kernel ropes in fp32 and the reference in fp16 steps, so a roped k (and a centre) may
    # differ in its last bit, and its code round the other way: by one code step for int8, by one
    # fp8 spacing (up to 32 near 448) for fp8; never by more, and only for a few entries
    step = float(ref_scale[..., 2 * D:].float().max()) * (1 if kv_dtype == torch.int8 else 32)
    got, want = dequantized(cache, scale), dequantized(ref_cache, ref_scale)
    torch.testing.assert_close(got, want, rtol=0, atol=1.01 * step + 2e-3)
    assert ((got - want).abs() > 1e-3).float().mean() < 0.05
    if kv_dtype == torch.int8:  # the codes themselves: equal but for a rare tie rounded the other way
        assert (cache.float() - ref_cache.float()).abs().max() <= 1
        assert (cache == ref_cache).float().mean() > 0.99


# --------------------------------------------------------------------------------------------- prefill

PREFILL = {
    # prefix hits (9 cached + 3 new), a lone token in a context of 1, a full prefill; block 4; D=24
    "mixed": dict(ctx=[12, 1, 17], new=[3, 1, 17], Hq=4, Hkv=2, D=24, BS=4),
    # GQA with a non-power-of-two group (3), sliding window, block 16, chunked prefill
    "window_gqa": dict(ctx=[21, 9], new=[8, 9], Hq=6, Hkv=2, D=32, BS=16, window=5),
    # D=80, no GQA, bidirectional (non-causal), small key tile to cross several blocks of 4
    "noncausal_d80": dict(ctx=[7, 19], new=[7, 5], Hq=2, Hkv=2, D=80, BS=4, causal=False),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("case", list(PREFILL))
def test_prefill(case, dtype):
    p = dict(PREFILL[case])
    causal, window = p.pop("causal", True), p.pop("window", 0)
    c = make_case(p.pop("ctx"), p.pop("new"), **p, dtype=dtype, seed=10)
    run_attention(c, causal=causal, window=window, block_m=16, block_n=16)


def test_prefill_default_tiles():
    """The spec's own tile choice (64 x 64) on a case where one tile covers several sequences' rows."""
    c = make_case([5, 40], [2, 33], 4, 1, 16, 8, torch.float16, seed=11)
    run_attention(c)


@pytest.mark.parametrize("tiles", PREFILL_TILE_CANDIDATES,
                         ids=lambda t: f"m{t['BLOCK_M']}-n{t['BLOCK_N']}-s{t['num_stages']}-w{t['num_warps']}")
def test_prefill_tuned_launches(tiles):
    """Every prefill launch the compile may choose (attention.PREFILL_TILE_CANDIDATES): a chunk of 150 new tokens
    after 150 cached (whole key tiles left of each query tile run unmasked), a decode row beside it, and a fresh
    prompt of 140 (a ragged last tile)."""
    c = make_case([300, 9, 140], [150, 1, 140], 4, 2, 32, 16, torch.float16, seed=12)
    run_attention(c, prefill_tiles=tiles)


@pytest.mark.parametrize("tiles", [PREFILL_TILE_CANDIDATES[1], PREFILL_TILE_CANDIDATES[3]],
                         ids=lambda t: f"m{t['BLOCK_M']}-n{t['BLOCK_N']}")
def test_prefill_launch_orders_give_the_same_bits(tiles, monkeypatch):
    """The two launch orders (last query tiles first across the step, or sequence by sequence) run the same
    programs: a prompt of 70 over 30 cached keys, a decode row and a fresh prompt of 45 give the same bits
    either way, and the reference's values."""
    import llmc.codegen.attention as attention
    c = make_case([100, 9, 45], [70, 1, 45], 4, 2, 32, 16, torch.float16, seed=13)
    cache = c["cache"].clone()
    ref = reference(c, cache)
    outs = []
    for seqs in (0, 3):  # sequence by sequence; last tiles first (3 sequences)
        monkeypatch.setattr(attention, "HEAVY_FIRST_SEQS", seqs)
        outs.append(paged_attention(c["q"], cache, c["qsl"], c["seq_lens"], c["bt"], 32 ** -0.5, max_seqlen_q=70,
                                    max_seqlen_k=100, prefill_tiles=tiles))
    assert torch.equal(outs[0], outs[1])
    close(outs[0], ref, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
def test_mixed_step_runs_its_decode_rows_on_the_decode_kernel(dtype):
    """A mixed step's leading one-token rows (decode_rows) run on the split-K decode kernel and the prompt rows
    on the prefill kernel: each row gets the reference's values, each decode row the bits of a decode step of
    those rows alone (the same partition: a sequence's sums do not depend on what it was scheduled with), and
    each prompt row the bits of the one-launch step."""
    c = make_case([70, 9, 300, 40, 120], [1, 1, 1, 40, 30], 4, 2, 32, 16, dtype, seed=14)
    cache = c["cache"].clone()
    ref = reference(c, cache)
    kw = dict(max_seqlen_k=300, block_m=16, block_n=16)
    mixed = paged_attention(c["q"], cache, c["qsl"], c["seq_lens"], c["bt"], 32 ** -0.5, max_seqlen_q=40,
                            decode_rows=3, context_limit=1024, **kw)
    close(mixed, ref, dtype)
    decodes = paged_attention(c["q"][:3], cache, c["qsl"][:4], c["seq_lens"][:3], c["bt"][:3], 32 ** -0.5,
                              max_seqlen_q=1, context_limit=1024, **kw)
    assert torch.equal(mixed[:3], decodes)
    one_launch = paged_attention(c["q"], cache, c["qsl"], c["seq_lens"], c["bt"], 32 ** -0.5, max_seqlen_q=40, **kw)
    assert torch.equal(mixed[3:], one_launch[3:])
    assert not torch.equal(mixed[:3], one_launch[:3])  # the decode rows did take the other kernel


def _padded_rows(c, decode_rows: int, pad: int, tokens: int):
    """A mixed step as a captured graph holds it: `pad` more rows holding no tokens, the token rows padded to
    `tokens`, and the (decode_qsl, prompt_qsl) pair of the rows split at `decode_rows`."""
    import numpy as np

    from llmc.codegen.attention import mixed_rows
    N, T = c["seq_lens"].shape[0], c["q"].shape[0]
    qsl = np.concatenate([c["qsl"].numpy(), np.full(pad, T, np.int32)])
    rows = tuple(torch.from_numpy(a.copy()) for a in mixed_rows(qsl, decode_rows))
    bt = torch.cat([c["bt"], torch.zeros(pad, c["bt"].shape[1], dtype=torch.int32)])
    lens = torch.cat([c["seq_lens"], torch.ones(pad, dtype=torch.int32)])
    q = torch.cat([c["q"], torch.zeros(tokens - T, *c["q"].shape[1:], dtype=c["q"].dtype)])
    return q, torch.from_numpy(qsl), lens, bt, rows, N


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("prompts", [1, 5], ids=lambda n: f"{n}-prompts")
def test_a_launch_for_any_mixed_step_gives_the_two_launches_bits(dtype, prompts):
    """A mixed step launched as a captured graph launches it (`rows`: the decode kernel over every row, the
    prefill kernel on a packed grid sized for the bucket's tokens, padding rows and tokens past the step's)
    gives each row the bits of the eager step's two launches (decode_rows), in both launch orders (one prompt:
    its last tiles first; five: sequence by sequence)."""
    ctx = [70, 9, 300][:3] + [40, 120, 60, 33, 18][:prompts]
    new = [1, 1, 1] + [40, 30, 7, 33, 1][:prompts]
    c = make_case(ctx, new, 4, 2, 32, 16, dtype, seed=15)
    cache = c["cache"].clone()
    ref = reference(c, cache)
    kw = dict(max_seqlen_k=300, block_m=16, block_n=16, context_limit=1024)
    eager = paged_attention(c["q"], cache, c["qsl"], c["seq_lens"], c["bt"], 32 ** -0.5,
                            max_seqlen_q=max(new), decode_rows=3, **kw)
    close(eager, ref, dtype)
    T = c["q"].shape[0]
    q, qsl, lens, bt, rows, N = _padded_rows(c, 3, pad=4, tokens=T + 20)
    packed = paged_attention(q, cache, qsl, lens, bt, 32 ** -0.5, max_seqlen_q=T + 20, rows=rows, **kw)
    assert torch.equal(packed[:T], eager)


def test_a_packed_launch_of_a_step_without_prompts_writes_nothing():
    """Every row a decode (or padding): the packed prefill grid's programs all return."""
    c = make_case([70, 9], [1, 1], 4, 2, 32, 16, torch.float32, seed=16)
    cache = c["cache"].clone()
    reference(c, cache)
    q, qsl, lens, bt, rows, N = _padded_rows(c, 2, pad=2, tokens=16)
    out = torch.full((16, 4, 32), 7.0)
    paged_attention(q, cache, qsl, lens, bt, 32 ** -0.5, max_seqlen_q=16, max_seqlen_k=70, rows=rows,
                    context_limit=1024, block_m=16, block_n=16, out=out)
    decodes = paged_attention(c["q"], cache, c["qsl"], c["seq_lens"], c["bt"], 32 ** -0.5, max_seqlen_q=1,
                              max_seqlen_k=70, context_limit=1024, block_m=16, block_n=16)
    assert torch.equal(out[:2], decodes) and bool((out[2:] == 7.0).all())


# --------------------------------------------------------------------------------------------- decode

DECODE = {
    # 4 heads on 1 kv head; 70 keys in splits of 16 (5 splits), a context of 1, block 4, D=24
    "splits": dict(ctx=[70, 1, 33], Hq=4, Hkv=1, D=24, BS=4, partition=16),
    # sliding window 20 over 50 / 64 keys: the early splits are empty and must weigh zero
    "window": dict(ctx=[50, 64], Hq=4, Hkv=2, D=32, BS=16, partition=16, window=20),
    # one split (direct output, no reduce kernel), D=80
    "direct_d80": dict(ctx=[23, 5], Hq=2, Hkv=1, D=80, BS=4, partition=None),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("case", list(DECODE))
def test_decode(case, dtype):
    p = dict(DECODE[case])
    window, partition = p.pop("window", 0), p.pop("partition")
    ctx = p.pop("ctx")
    c = make_case(ctx, [1] * len(ctx), **p, dtype=dtype, seed=20)
    run_attention(c, window=window, block_n=16, partition_size=partition)


@pytest.mark.parametrize("tiles", DECODE_TILE_CANDIDATES,
                         ids=lambda t: f"n{t['BLOCK_N']}-s{t['num_stages']}-w{t['num_warps']}")
def test_decode_tuned_launches(tiles):
    """Every launch the compile may choose (attention.DECODE_TILE_CANDIDATES): 600 keys in three 256-key
    splits of 32 to 128-key tiles, a one-key context, one of 300 over a 16-slot block size."""
    c = make_case([600, 1, 300], [1, 1, 1], 4, 2, 32, 16, torch.float16, seed=22)
    run_attention(c, decode_tiles=tiles)


@pytest.mark.parametrize("partition", [32, 16], ids=["one-split", "split"])
def test_decode_with_max_seqlen_k_below_a_context_is_right_and_releases_its_counters(partition):
    """A launch sized for fewer keys than a sequence holds (max_seqlen_k 32 over contexts of 100 and 70: one
    split of 32 keys, or two of 16 where the sequences need seven and five) still attends over every key, and
    every split counts itself in: a count left above zero would make the next split launch over that
    counter (matmul split-K shares the buffer) finish its tile early or never."""
    from llmc.codegen.kernels import check_counters_released
    c = make_case([100, 70, 9], [1, 1, 1], 4, 2, 32, 16, torch.float32, seed=23)
    cache = c["cache"].clone()
    ref = reference(c, cache)
    out = paged_attention(c["q"], cache, c["qsl"], c["seq_lens"], c["bt"], 32 ** -0.5, max_seqlen_q=1,
                          max_seqlen_k=32, block_n=16, partition_size=partition)
    close(out, ref, torch.float32)
    check_counters_released()


def test_decode_partition_does_not_depend_on_the_batch():
    assert decode_partition(4096, 32) == 256  # a long context is split into 16 partitions
    assert decode_partition(10, 16) == 256  # a short one uses only the first: one program per kv head
    assert decode_partition(1 << 20, 64) == (1 << 20) // 128  # past 128 splits the partitions grow
    assert decode_partition(100, 48) % 48 == 0


def test_decode_partition_follows_its_setting(monkeypatch):
    """LLMC_DECODE_PARTITION (read at import: DECODE_MIN_PARTITION) sets the fewest keys a split holds."""
    import llmc.codegen.attention as attention
    monkeypatch.setattr(attention, "DECODE_MIN_PARTITION", "1024")
    assert decode_partition(4096, 64) == 1024 and decode_partition(4096, 64, min_partition=256) == 256
    assert decode_partition(1 << 20, 64) == (1 << 20) // 128
    for bad in ("0", "-256", "1k", ""):
        monkeypatch.setattr(attention, "DECODE_MIN_PARTITION", bad)
        with pytest.raises(LLMCError, match="LLMC_DECODE_PARTITION must be a positive whole number"):
            decode_partition(4096, 64)


@pytest.mark.parametrize("tiles", [None, DECODE_TILE_CANDIDATES[-1]], ids=["fixed-tiles", "tuned-launch"])
def test_decode_sequence_alone_equals_in_batch(tiles):
    """A sequence's decode output is bitwise the same alone and among others (fixed partitions), with fixed
    tiles and with a launch the compile may choose (one choice serves every batch)."""
    c = make_case([70, 9, 33, 50], [1, 1, 1, 1], 4, 2, 24, 4, torch.float16, seed=21)
    kw = dict(block_m=16, block_n=16, max_seqlen_q=1, max_seqlen_k=128, partition_size=16)  # 1-5 splits each
    if tiles is not None:  # 128-key tiles in 256-key partitions over 600 keys
        c = make_case([600, 9, 300, 257], [1, 1, 1, 1], 4, 2, 24, 16, torch.float16, seed=21)
        kw = dict(max_seqlen_q=1, max_seqlen_k=4096, decode_tiles=tiles)
    both = paged_attention(c["q"], c["cache"], c["qsl"], c["seq_lens"], c["bt"], 24 ** -0.5, **kw)
    for i in (0, 3):
        alone = paged_attention(c["q"][i:i + 1], c["cache"], torch.tensor([0, 1], dtype=torch.int32),
                                c["seq_lens"][i:i + 1], c["bt"][i:i + 1], 24 ** -0.5, **kw)
        assert torch.equal(alone[0], both[i])


def test_decode_launched_for_a_context_bucket_gives_the_limits_bits():
    """A decode graph of a context bucket (step_graphs.decode_contexts) launches attention for the bucket's keys
    with the model's limit as `context_limit`: the partition follows the limit, so each sequence's sums, and
    its output bit for bit, are those of the limit's launch (600, 9 and 300 keys in 256-key partitions under a
    1,024-key bucket, against a 4,096-key launch; and past 32 Ki keys, where the partition grows)."""
    c = make_case([600, 9, 300], [1, 1, 1], 4, 2, 32, 16, torch.float16, seed=25)
    cache = c["cache"].clone()
    reference(c, cache)
    for limit in (4096, 1 << 16):
        run = lambda k: paged_attention(c["q"], cache, c["qsl"], c["seq_lens"], c["bt"], 32 ** -0.5,  # noqa: E731
                                        max_seqlen_q=1, max_seqlen_k=k, context_limit=limit)
        assert torch.equal(run(1024), run(limit))


# --------------------------------------------------------------------------------------------- int8 cache

def run_quantized(ctx, new, D, BS, dtype, kv_dtype, seed, window=0, **kw):
    """(the kernels' output, the reference's) over an int8 / fp8 cache of random codes, centres and scales
    (4 q heads over 2); the reference writes the new K/V first (new centres where a block starts)."""
    c = make_case(ctx, new, 4, 2, D, BS, dtype, seed=seed)
    NB, Hkv = c["cache"].shape[1], c["cache"].shape[3]
    scale = random_scales(NB, Hkv, D, BS, seed=seed + 1, dtype=dtype)
    cache = _to_q(c["cache"].float() / 0.02, kv_dtype, QMAX[kv_dtype])
    ref = reference(c, cache, scale, window=window)
    out = paged_attention(c["q"], cache, c["qsl"], c["seq_lens"], c["bt"], D ** -0.5, kv_scale=scale, window=window,
                          block_m=16, **kw)
    return out, ref


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=dtype_name)
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_quantized_cache(mode, kv_dtype):
    """int8 / fp8 K/V dequantized in the kernels with the centres and scales the reference wrote."""
    new = [5, 1, 30] if mode == "prefill" else [1, 1, 1]
    out, ref = run_quantized([13, 1, 30], new, 24, 4, torch.float16, kv_dtype, seed=30, block_n=16, partition_size=16)
    close(out, ref, torch.float16)


def _kernels_with_code_dots(monkeypatch, on: bool):
    """Kernels rendered with attention.KV_CODE_DOTS = on, fresh before and after."""
    import llmc.codegen.attention as attention
    from llmc.codegen import elementwise
    elementwise._module.cache_clear()
    monkeypatch.setattr(attention, "KV_CODE_DOTS", on)
    yield
    monkeypatch.undo()
    elementwise._module.cache_clear()


@pytest.fixture
def code_dots(monkeypatch):
    """Quantized caches' codes in fp16 dots (the default)."""
    yield from _kernels_with_code_dots(monkeypatch, True)


@pytest.fixture
def dequantize_then_dot(monkeypatch):
    """LLMC_KV_CODE_DOTS=0: K/V dequantized into q's dtype before the dots."""
    yield from _kernels_with_code_dots(monkeypatch, False)


QUANTIZED_DECODE_CASES = {
    # (block size, key tile): four blocks a tile, two, a tile inside one block, sixteen
    "bs4_n16": dict(BS=4, block_n=16), "bs16_n32": dict(BS=16, block_n=32), "bs32_n16": dict(BS=32, block_n=16),
    "bs2_n32": dict(BS=2, block_n=32),
    # a sliding window starting inside a block and a tile; several splits
    "window": dict(BS=4, block_n=16, window=11), "splits": dict(BS=4, block_n=16, partition=32),
    # tiles inside one block (their centres as rank-1 terms): one tile a block, and two with a window and splits
    "bs16_n16": dict(BS=16, block_n=16), "in_block_window_splits": dict(BS=32, block_n=16, window=21, partition=32),
}


def run_decode_case(case, kv_dtype, dtype):
    """run_quantized for one new token on each of four sequences, over QUANTIZED_DECODE_CASES[case]."""
    p = QUANTIZED_DECODE_CASES[case]
    ctx = [45, 1, 70, 16]
    return run_quantized(ctx, [1] * len(ctx), 32, p["BS"], dtype, kv_dtype, seed=40, window=p.get("window", 0),
                         block_n=p["block_n"], partition_size=p.get("partition"), max_seqlen_k=max(ctx))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=dtype_name)
@pytest.mark.parametrize("case", list(QUANTIZED_DECODE_CASES))
def test_decode_over_a_quantized_cache_in_bf16_and_fp32(case, kv_dtype, dtype, dequantize_then_dot):
    """Decode over an int8 / fp8 cache in a bf16 or fp32 model, K/V dequantized before the dots
    (LLMC_KV_CODE_DOTS=0; fp32 models always), gives the reference's outputs, whatever the key tile's span of
    blocks (a part of one to sixteen), the window or the splits. In bf16 this form rounds each dequantized K/V
    vector to bf16 before its dots: up to 0.031 off here, hence 4e-2 (the codes in fp16 dots: one ulp, below)."""
    out, ref = run_decode_case(case, kv_dtype, dtype)
    tol = 4e-2 if dtype == torch.bfloat16 else TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=dtype_name)
@pytest.mark.parametrize("case", list(QUANTIZED_DECODE_CASES))
def test_decode_with_the_codes_in_fp16_dots(case, kv_dtype, dtype, code_dots):
    """The default decode over a quantized cache: the codes enter fp16 dots as they are, scaled after them, q
    and p x scale shifted by powers of two into fp16's range; in bf16 the tile's block centres are read once,
    and a tile inside one block (the key tile divides the block) adds its centres as rank-1 terms.
    Within one bf16 ulp of the outputs (2-4 here: 0.0156) where the dequantize-then-dot form is two ulps off,
    whatever the blocks, window or splits."""
    from llmc.codegen.attention import PagedAttentionSpec
    p = QUANTIZED_DECODE_CASES[case]
    ctx = PagedAttentionSpec(head_dim=32, num_q_heads=4, num_kv_heads=2, block_size=p["BS"], dtype=dtype_name(dtype),
                             kv_dtype=dtype_name(kv_dtype), mode="decode", block_n=p["block_n"]).context()
    assert ctx["code_dots"]
    assert ctx["tile_in_block"] == (p["BS"] % p["block_n"] == 0)
    assert not (ctx["tile_in_block"] and ctx["block_centres"])
    out, ref = run_decode_case(case, kv_dtype, dtype)
    if dtype == torch.bfloat16:  # one ulp of the largest outputs' binade
        top = float(ref.float().abs().max())
        assert (out.float() - ref.float()).abs().max() <= 2.0 ** (math.ceil(math.log2(top)) - 8)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("q_scale", [3e4, 1e-30], ids=["q-past-fp16", "q-tiny"])
def test_code_dots_keep_q_and_the_value_scales_in_fp16s_range(q_scale, code_dots):
    """q far past fp16's largest value or near its smallest, and value scales past 65504 / 2^14: the power-of-two
    shifts keep every fp16 operand finite and normal, and the outputs are the reference's."""
    c = make_case([40, 21], [1, 1], 4, 2, 32, 4, torch.bfloat16, seed=41)
    c["q"] = (c["q"].float() * q_scale).to(torch.bfloat16)
    NB, Hkv = c["cache"].shape[1], c["cache"].shape[3]
    scale = random_scales(NB, Hkv, 32, 4, seed=42, dtype=torch.bfloat16)
    scale[:, :, 2 * 32 + 4:] *= 1e7  # the value scales: p x scale up to 3e5
    cache = _to_q(c["cache"].float() / 0.02, torch.int8, QMAX[torch.int8])
    ref = reference(c, cache, scale)
    out = paged_attention(c["q"], cache, c["qsl"], c["seq_lens"], c["bt"], 32 ** -0.5, kv_scale=scale, block_m=16,
                          block_n=16, max_seqlen_k=40)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1.6e-2 * ref.float().abs().max().item())


def test_code_dots_compile_for_hopper_with_fewer_instructions():
    """The decode kernel with the codes in fp16 dots, its codes unpacked from 16-bit pairs by PTX, compiles for
    sm_90 here (ptxas ships with triton). Its main loop over int8 and fp8 caches issues fewer instructions than
    the dequantize-then-dot form's and reads no code from shared memory a byte at a time (that form's loop
    does). Its values on the GPU: scripts/gpu_check_attention.py --golden-only."""
    from tests.codegen.conftest import sass_loop as load_sass_loop
    sass_loop = load_sass_loop()
    byte_loads = lambda c: sum(n for op, n in c.items() if op in ("LDS.U8", "LDS.S8"))  # noqa: E731
    for kv in ("int8", "float8_e4m3fn"):
        old, new = (sass_loop.count_attention("64,4,3", kv, on, modifiers=True) for on in (False, True))
        assert sum(new.values()) < sum(old.values()), (kv, sum(new.values()), sum(old.values()))
        assert byte_loads(old) > 32 and byte_loads(new) == 0, (kv, byte_loads(old), byte_loads(new))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=dtype_name)
def test_a_head_major_cache_gives_the_token_major_ones_bits(kv_dtype):
    """The cache's memory order (kv_cache.KV_LAYOUTS) is the cache's own: rope_kv_write stores, and a mixed step
    (decode rows split + prompt rows) and a decode step read, the same values in the same order either way."""
    from llmc.runtime.kv_cache import empty_cache
    dtype = torch.bfloat16
    c = make_case([70, 9, 300, 40, 120], [1, 1, 1, 40, 30], 4, 2, 32, 16, dtype, seed=15)
    T, NB, D = c["q"].shape[0], c["cache"].shape[1], 32
    g = torch.Generator().manual_seed(16)
    cos, sin = torch.randn(T, D, generator=g).to(dtype), torch.randn(T, D, generator=g).to(dtype)
    base = c["cache"] if kv_dtype == dtype else _to_q(c["cache"].float() / 0.02, kv_dtype, QMAX[kv_dtype])
    runs = []
    for layout in ("tokens", "heads"):
        cache = empty_cache(tuple(base.shape), kv_dtype, "cpu", layout)
        cache.copy_(base)
        assert cache.is_contiguous() == (layout == "tokens")
        scale = random_scales(NB, 2, D, 16, seed=17, dtype=dtype) if kv_dtype != dtype else None
        q = rope_kv_write(c["q"], c["k"], c["v"], cos, sin, cache, c["slots"], kv_scale=scale)
        kw = dict(kv_scale=scale, max_seqlen_k=300, block_m=16, block_n=16, context_limit=1024)
        mixed = paged_attention(q, cache, c["qsl"], c["seq_lens"], c["bt"], D ** -0.5, max_seqlen_q=40,
                                decode_rows=3, **kw)
        decodes = paged_attention(q[:3], cache, c["qsl"][:4], c["seq_lens"][:3], c["bt"][:3], D ** -0.5,
                                  max_seqlen_q=1, **kw)
        runs.append((cache.contiguous(), scale, mixed, decodes))
    for a, b in zip(*runs):
        assert a is None and b is None or torch.equal(a, b)


def test_rejects_bad_specs():
    with pytest.raises(ValueError):
        PagedAttentionSpec(24, 6, 4, 4)  # 6 q heads on 4 kv heads
    with pytest.raises(ValueError):
        PagedAttentionSpec(24, 4, 2, 6)  # block size not a power of two
    with pytest.raises(ValueError):
        RopeKVWriteSpec(23, 4, 2)  # odd head dim
