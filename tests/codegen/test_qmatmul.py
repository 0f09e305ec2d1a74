"""qlinear kernels (llmc/codegen/qmatmul.py) against the qlinear op's reference, for every weight format.

On CPU the kernels run under the Triton interpreter (tests/codegen/conftest.py sets TRITON_INTERPRET
before triton is imported); with `TRITON_INTERPRET=0` on a GPU machine they run compiled on CUDA.
The interpreter dots int8 exactly (numpy int32 sums, whatever K) and fp8 widened to fp16, so the
w8a8 and fp8 GEMMs run their own operand types here; bf16 operands are fed to its dot as fp32.
"""
from __future__ import annotations

import pytest
import torch

from llmc.codegen import autotune
from llmc.codegen import qmatmul as qm
from llmc.codegen.autotune import Tuner
from llmc.codegen.elementwise import interpreting
from llmc.codegen.kernels import render, tile_counters
from llmc.codegen.matmul import MatmulSpec
from llmc.codegen.act_quant import ACT_ONE_PASS, quantize_act
from llmc.codegen.qmatmul import QMatmulSpec, candidates, prepare, qlinear, reference
from llmc.errors import CompileError
from llmc.ir import quant
from llmc.ir.quant import QuantFormat, quantize_rtn
from tests.codegen.conftest import library_interpreted


INTERPRETED = library_interpreted()
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRETED and (interpreting() or not torch.cuda.is_available()),
    reason="triton was imported (compiled) before tests/codegen/conftest.py could set TRITON_INTERPRET=1 "
           "and there is no GPU: run `TRITON_INTERPRET=1 pytest tests/codegen/test_qmatmul.py`")

FORMATS = {"int4-g64": QuantFormat("int", 4, 64), "int4-g64-zp": QuantFormat("int", 4, 64, True),
           "int4-ch": QuantFormat("int", 4), "int8-ch": QuantFormat("int", 8), "int8-g64": QuantFormat("int", 8, 64),
           "w8a8": QuantFormat("w8a8", 8), "fp8": QuantFormat("fp8", 8)}
# fp32 x: the int formats' products are exact (a code minus its zero is a small integer), so only
# fp32 summation order differs from the reference; w8a8 and fp8 quantize x to the reference's very
# codes (test_activation_codes_are_torchs), after which w8a8's integer sums are exact and fp8's
# differ by fp32 summation order alone: all within 1e-4. bf16 x: the output's rounding, 1e-2
# (the reference applies act to y already rounded to bf16, the kernel before rounding).
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# (M, bias, act): M = 1 and 3 (one 16-row tile), 17 (two tiles in one program), 70 (prefill tiles)
CASES = [(1, False, ""), (3, True, "silu"), (17, True, "gelu_tanh"), (70, True, "gelu")]


@pytest.fixture(autouse=True, scope="module")
def _cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMC_CACHE_DIR", str(tmp_path_factory.mktemp("llmc_cache")))
        yield


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % 2**31)


def rand(*shape, dtype=torch.float32, g=None):
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


def quantized(fmt, n, k, g):
    w = torch.randn(n, k, generator=g) / k ** 0.5
    qw = quantize_rtn(w, fmt, torch.bfloat16)
    return quant.QuantizedWeight(fmt, *(t.to(DEVICE) if t is not None else None
                                        for t in (qw.qweight, qw.scales, qw.zeros)))


# On a GPU, FP8 tensor cores add the products of one MMA instruction (32 along K) at reduced
# precision before each promotion into the fp32 accumulator (max_num_imprecise_acc=32), ~2^-13
# relative per partial sum: fp32 x is then held to 1e-3 against the exact reference, not 1e-4.
FP8_GPU_TOL = 1e-3


def close(out, ref, dtype, kind=""):
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    tol = max(TOL[dtype], FP8_GPU_TOL) if kind == "fp8" and not INTERPRETED else TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def run_and_check(qw, x, b=None, act="", **kw):
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    y = qlinear(x, p, b, act, **kw)
    close(y, reference(x, qw.fmt, qw.qweight, qw.scales, qw.zeros, b, act), x.dtype, qw.fmt.kind)
    return y


# ------------------------------------------------------------------------------------------ formats

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FORMATS))
def test_qlinear_formats(name, dtype):
    N, K = 160, 256  # N: two and a half 64-column tiles
    g = gen(name, str(dtype))
    qw = quantized(FORMATS[name], N, K, g)
    for M, has_bias, act in CASES:
        b = rand(N, dtype=dtype, g=g) if has_bias else None
        run_and_check(qw, rand(M, K, dtype=dtype, g=g), b, act)


@pytest.mark.parametrize("name,k", [("int4-ch", 200), ("int4-g64", 320), ("int8-ch", 96), ("int4-g64-zp", 192),
                                    ("w8a8", 200), ("fp8", 136)])
def test_ragged_k(name, k):
    """K not a multiple of the tiles: int weights are padded with zero codes to whole pack tiles (x
    is masked to 0 there, and the padding's scale group clamped into range: int4-g64 at K = 320 has
    a high plane of padding); 8-bit codes are masked past K."""
    g = gen(name, k)
    qw = quantized(FORMATS[name], 96, k, g)
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    assert p.padded_k > k if qw.fmt.kind == "int" else p.padded_k == k
    run_and_check(qw, rand(5, k, g=g), rand(96, g=g), "silu")


def test_group_of_two_scales_per_pack_tile_and_f16():
    """Group 32 for int4: each nibble plane (32 columns) has its own scale; f16 activations."""
    g = gen("g32")
    qw = quantized(QuantFormat("int", 4, 32, True), 96, 256, g)
    assert prepare(qw.fmt, *qw.tensors()).run == 32
    for M in (1, 20):
        run_and_check(qw, rand(M, 256, dtype=torch.float16, g=g), rand(96, dtype=torch.float16, g=g), "relu")


@pytest.mark.parametrize("name", ["int4-g64-zp", "int8-ch", "w8a8", "fp8"])
def test_split_k_and_swapped_operands(name):
    """Every split count and both operand orders give the reference; splits leave the tile counters
    at 0 (K = 384 in 4 splits: the last one has no tile). w8a8 sums integers, so its result is
    bitwise the same however K is split."""
    g = gen("split", name)
    qw = quantized(FORMATS[name], 96, 384, g)
    x, b = rand(3, 384, g=g), rand(96, g=g)
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    base = dict(candidates("1", 96, p.padded_k, p.pack)[0], BLOCK_K=max(64, p.pack))
    outs = [run_and_check(qw, x, b, "silu", config=dict(base, SPLIT_K=s, SWAP_AB=swap))
            for s in (1, 2, 4) for swap in (False, True)]
    assert int(tile_counters(x.device, 1).abs().sum()) == 0
    if name == "w8a8":
        assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("name", ["int4-g64", "w8a8"])
def test_tall_split_tiles_of_the_128_bucket(name):
    """The 128+ bucket's swapped tall tiles with a K split (a full batch of decodes in one row tile):
    on a Llama-3-8B o_proj the split brings the programs to a few hundred, and at 70 rows (one
    partly filled tile) and 140 (two tiles) every such config gives the reference."""
    tall = [c for c in candidates("128+", 4096, 4096, 128) if c["SPLIT_K"] > 1]
    assert tall and all(c["SWAP_AB"] and c["BLOCK_M"] >= 64 for c in tall)
    for bm, bn, cols, scale, *_ in qm.SPLIT_TALL_TILES:  # each split to between half and all of its programs' aim
        split = qm._split(4096, 4096, bn, max(cols, 128), scale)
        assert scale * qm.TARGET_PROGRAMS / 2 < 4096 // bn * split <= scale * qm.TARGET_PROGRAMS
    assert not any(c["SPLIT_K"] > 1 for c in candidates("1024+", 4096, 4096, 128))  # enough row tiles there
    g = gen("tall", name)
    qw = quantized(FORMATS[name], 64, 256, g)
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    b = rand(64, g=g)
    for m in (70, 140):
        x = rand(m, 256, g=g)
        for c in qm.SPLIT_TALL_TILES[:1]:
            cfg = qm._cfg(c[0], c[1], max(c[2], p.pack), 2, c[4], c[5], c[6])
            run_and_check(qw, x, b, "silu", config=cfg)
    assert int(tile_counters(x.device, 4).abs().sum()) == 0


@pytest.mark.parametrize("name", ["w8a8", "fp8", "int4-g64", "int4-g64-zp", "int8-ch"])
def test_tma_configs_equal_pointer_loads(name):
    """A config with its tiles loaded through TMA descriptors gives bitwise the pointer loads' result: at 1
    row (a 16-row box, 15 rows of it past M), 17 (two row tiles in a program) and 140 (tall tiles), with K
    splits and N, K past the boxes' edges (96 x 320: zeros read there; int weights in boxes of one pack
    tile's bytes). 8-bit codes in a buffer whose rows are not 16-byte aligned run with pointer loads."""
    g = gen("tma", name)
    qw = quantized(FORMATS[name], 96, 320, g)
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    b = rand(96, g=g)
    bk = max(128, p.pack)
    for m, cfg in ((1, qm._cfg(16, 64, bk, 2, True, 4, 3)), (17, qm._cfg(16, 64, bk, 1, False, 4, 3)),
                   (140, qm._cfg(128, 64, bk, 2, True, 4, 4))):
        x = rand(m, 320, g=g)
        y = run_and_check(qw, x, b, "silu", config=cfg)
        assert torch.equal(run_and_check(qw, x, b, "silu", config=dict(cfg, TMA=True)), y)
    assert int(tile_counters(x.device, 8).abs().sum()) == 0
    if qw.fmt.kind == "int":
        return
    codes, scales = quantize_act(x, name)
    odd = torch.empty(m, 321, dtype=codes.dtype, device=codes.device)[:, :320]  # rows 321 bytes apart
    odd.copy_(codes)
    assert qm.tma_fits(codes) and not qm.tma_fits(odd)
    cfg = dict(qm._cfg(128, 64, 128, 2, True, 4, 4), TMA=True)
    assert torch.equal(qlinear(odd, p, b, "silu", config=cfg, x_scales=scales, dtype=x.dtype),
                       qlinear(codes, p, b, "silu", config=cfg, x_scales=scales, dtype=x.dtype))


def test_tma_candidates_are_offered_on_request(monkeypatch):
    """`LLMC_QLINEAR_TMA=1` offers each generated-kernel config's TMA twin (boxes of at most 256 a side) and
    deeper pipelines of the split tall tiles; unset, none. Library and GEMV configs have none."""
    monkeypatch.delenv("LLMC_QLINEAR_TMA", raising=False)
    assert not qm.tma_offered()
    monkeypatch.setenv("LLMC_QLINEAR_TMA", "1")
    assert qm.tma_offered()
    base = candidates("128+", 4096, 14336)
    twins = qm.tma_candidates(base + [{"LIBRARY": "scaled_mm"}] + qm.gemv_candidates(4096, 4096))
    assert twins and all(c["TMA"] and max(c["BLOCK_N"], c["BLOCK_K"]) <= 256 for c in twins)
    assert {tuple(sorted((k, v) for k, v in c.items() if k != "TMA")) for c in twins if c["num_stages"] <= 4} \
        <= {tuple(sorted(c.items())) for c in base}
    assert any(c["num_stages"] == 6 and c["SPLIT_K"] > 1 for c in twins)


def test_row_tiles_of_one_program_equal_tiles_alone():
    """Up to 64 rows a program dots each weight tile it dequantizes with every 16-row tile: each tile
    comes out bitwise as it does launched alone (see the matmul test for why only tile by tile here)."""
    g = gen("tiles")
    qw = quantized(FORMATS["int4-g64"], 96, 256, g)
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    x, b = rand(64, 256, g=g), rand(96, g=g)
    cfg = dict(candidates("64", 96, p.padded_k, p.pack)[0], SPLIT_K=2)
    full = run_and_check(qw, x, b, "silu", config=cfg)  # 4 tiles in each program
    for t in range(4):
        assert torch.equal(qlinear(x[16 * t:16 * t + 16], p, b, "silu", config=cfg), full[16 * t:16 * t + 16])


def test_leading_dims_strided_rows_and_out():
    g = gen("strided")
    qw = quantized(FORMATS["int4-g64"], 96, 256, g)
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    x = rand(2, 3, 300, g=g)[:, :, 20:276]  # rows with a stride > K
    out = torch.empty(2, 3, 96, device=DEVICE)
    y = qlinear(x, p, out=out)
    assert y is out and y.shape == (2, 3, 96)
    close(y, reference(x, qw.fmt, qw.qweight, qw.scales), torch.float32)


# ------------------------------------------------------------------------- activation quantization

def test_activation_codes_are_torchs():
    """The per-token kernel gives quant.quantize_activations' codes and scales bit for bit, ties
    included (round half to even for int8; e4m3's midpoints, subnormal ones too, for fp8): a row in one
    pass (K up to act_quant.ACT_ONE_PASS) and one too wide for it, read twice in blocks."""
    g = gen("act")
    for kind, ties in (("w8a8", [127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 3.5]),
                       ("fp8", [448.0, 1.0625, 17.0, 432.0, -1.1875, 2.0 ** -10, 1.5 * 2.0 ** -9, -3 * 2.0 ** -10])):
        for dtype, k in ((torch.float32, 2500), (torch.bfloat16, 2500), (torch.float32, ACT_ONE_PASS + 700)):
            x = rand(5, k, dtype=dtype, g=g) * 3
            x[1, :8] = torch.tensor(ties, dtype=dtype)
            x[1, 8:] = 0
            x[2] = 0  # an all-zero row: the scale's floor
            q, s = quantize_act(x, kind)
            q_ref, s_ref = quant.quantize_activations(x, kind)
            assert torch.equal(s, s_ref)
            assert q.dtype == q_ref.dtype and torch.equal(q.float(), q_ref.float()), (kind, dtype)


# --------------------------------------------------------------------------------------- layout

@pytest.mark.parametrize("name", list(FORMATS))
def test_prepare_round_trip(name):
    qw = quantized(FORMATS[name], 64, 320 if name.startswith("int4") else 256, gen("prep", name))
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    assert p.qweight.device == qw.qweight.device and p.in_features == qw.in_features
    assert torch.equal(p.dequantize(), qw.dequantize())
    bits = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in p.canonical().tensors()]
    assert all(torch.equal(a, b) for a, b in zip(bits, (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
                                                       for t in qw.tensors())))


def test_int4_nibble_planes():
    """Byte j of a pack tile holds column j in its low nibble and column run + j in its high one."""
    fmt = QuantFormat("int", 4, 64)
    codes = torch.randint(0, 16, (3, 256), dtype=torch.uint8)
    p = prepare(fmt, quant.pack_int4(codes), torch.ones(3, 4))
    run, pack = p.run, p.pack
    assert (run, pack) == (64, 128) and p.qweight.shape == (3, 128)
    for t in range(256 // pack):
        tile = p.qweight[:, t * run:(t + 1) * run]
        assert torch.equal(tile & 0xF, codes[:, t * pack:t * pack + run])
        assert torch.equal(tile >> 4, codes[:, t * pack + run:(t + 1) * pack])


def test_unsupported_inputs_are_clear_errors():
    g = gen("errors")
    qw = quantized(FORMATS["int4-g64"], 32, 128, g)
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    with pytest.raises(CompileError, match="x has 96 input features but .* takes 128"):
        qlinear(rand(2, 96, g=g), p)
    with pytest.raises(CompileError, match="activations are bf16, f16 or f32"):
        qlinear(torch.ones(2, 128, dtype=torch.int32, device=DEVICE), p)
    with pytest.raises(CompileError, match="activation 'tanh' cannot be fused"):
        qlinear(rand(2, 128, g=g), p, act="tanh")
    with pytest.raises(CompileError, match="bias"):
        qlinear(rand(2, 128, g=g), p, rand(31, g=g))
    fmt8 = QuantFormat("int", 4, 8)
    with pytest.raises(CompileError, match="group size 8 .* not a multiple of 16"):
        prepare(fmt8, qw.qweight, torch.ones(32, 16, device=DEVICE), None)
    with pytest.raises(CompileError, match="weights are torch.uint8"):
        prepare(qw.fmt, qw.qweight.to(torch.int8), qw.scales, None)
    with pytest.raises(CompileError, match=r"scales should be float \[32, 2\]"):
        prepare(qw.fmt, qw.qweight, qw.scales[:, :1], None)
    with pytest.raises(CompileError, match="zero points"):
        prepare(FORMATS["int4-g64-zp"], qw.qweight, qw.scales, None)


# ---------------------------------------------------------------------------------------- tuning

def test_candidates():
    """Decode tiles are 16 rows (a row's sums do not depend on its batch), BLOCK_K a whole number of
    pack tiles, and the K split brings a Llama-3-8B-sized launch to a few hundred programs."""
    for pack in (0, 32, 64, 128):
        for bucket in ("1", "32", "128+"):
            for c in candidates(bucket, 4096, 4096, pack):
                assert c["BLOCK_K"] % max(pack, 1) == 0 and 4096 % (c["BLOCK_K"] * c["SPLIT_K"]) == 0
    d = candidates("1", 4096, 4096, 128)[0]
    assert d["BLOCK_M"] == 16 and 256 <= 64 * d["SPLIT_K"] <= qm.TARGET_PROGRAMS
    assert candidates("32", 4096, 4096, 128, shared=False)[0]["BLOCK_M"] == 32
    assert candidates("128+", 4096, 4096, 128)[0]["BLOCK_M"] >= 64
    assert candidates("1", 96, 256, 128)[0]["SPLIT_K"] <= 2  # never more splits than K steps


def test_decode_buckets_share_one_choice_under_their_own_key(monkeypatch):
    """As for matmul: buckets 1..64 get the config fastest on their summed time, recorded under a
    qlinear key (format and dtype in it, never a matmul key); 128+ is chosen alone. Timing is faked."""
    cost = {1: {1: 1.0, 64: 9.0}, 2: {1: 2.0, 64: 1.0}}
    seen = []

    def fake_launch(spec, x2, p, b, y2, cfg, x_scales=None):
        seen.append((x2.shape[0], cfg["A"]))
        return cost[cfg["A"]].get(x2.shape[0], 1.0)

    monkeypatch.setattr(autotune, "can_time", lambda: True)
    monkeypatch.setattr(autotune, "gpu_time_ms", lambda fn: sum(fn()))
    monkeypatch.setattr(qm, "_launch", fake_launch)
    monkeypatch.setattr(qm, "candidates", lambda bucket, n, kw, pack, shared=True: [{"A": 1}, {"A": 2}])
    g = gen("tune")
    qw = quantized(FORMATS["int4-g64"], 32, 128, g)
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    t = Tuner(device="test-gpu")
    qlinear(rand(3, 128, g=g), p, tuner=t)
    key = QMatmulSpec.of(p, torch.float32, False, "").key(32, 128)
    assert key.startswith("qlinear[w4a16-g64,f32,") and key != MatmulSpec("f32", False).key(32, 128)
    assert {b: r["config"]["A"] for b, r in t.records[key].items()} == {b: 2 for b in autotune.JOINT_BUCKETS}
    seen.clear()
    qlinear(rand(1, 128, g=g), p, tuner=t)
    assert seen == [(1, 2)]  # recorded: not retimed
    qlinear(rand(130, 128, g=g), p, tuner=t)
    assert set(t.records[key]) == {*autotune.JOINT_BUCKETS, "128+"}


def test_source_names_its_layout_and_bytes():
    src = render(QMatmulSpec("int", 4, 128, False, 64, "bf16", True, "silu"))
    assert "def qmatmul_kernel(" in src and "nibble planes of 64 columns" in src and "0.5NK" in src
    # symmetric int4: the zero point 8 folded into the constants (the low plane: the byte less 16 x the high)
    assert "_dequant(codes >> 4, 8388616.0)" in src and "_dequant(codes, 8388744.0)" in src


# ------------------------------------------------------------------------------------- int4 GEMV

GEMV_FORMATS = {"int4-g128": QuantFormat("int", 4, 128), "int4-g128-zp": QuantFormat("int", 4, 128, True),
                "int4-ch": QuantFormat("int", 4), "int4-ch-zp": QuantFormat("int", 4, 0, True),
                "int4-g256": QuantFormat("int", 4, 256)}


def gemv_cfg(joined, split_k=1, block_n=16, block_w=16):
    return {"GEMV": True, "JOINED": joined, "BLOCK_N": block_n, "BLOCK_W": block_w, "SPLIT_K": split_k,
            "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("joined", [False, True])
@pytest.mark.parametrize("name", list(GEMV_FORMATS))
def test_gemv_formats(name, joined):
    """Both GEMV variants against the reference: 1 to 4 rows, bias and act, one split and several
    (N = 72: a ragged last tile of rows; K = 512 over splits of 2 words tiles)."""
    g = gen("gemv", name, joined)
    qw = quantized(GEMV_FORMATS[name], 72, 512, g)
    for M, dtype, has_bias, act, split_k in ((1, torch.float32, False, "", 1), (3, torch.float32, True, "silu", 2),
                                             (4, torch.bfloat16, False, "", 4), (2, torch.bfloat16, True, "", 1)):
        b = rand(72, dtype=dtype, g=g) if has_bias else None
        run_and_check(qw, rand(M, 512, dtype=dtype, g=g), b, act, config=gemv_cfg(joined, split_k))


@pytest.mark.parametrize("joined", [False, True])
def test_gemv_rows_alone_equal_rows_together(joined):
    """A row's sums are the same whatever else shares the launch (rows share loads, never sums), and
    a K split sums its partials in split order: bitwise equal results."""
    g = gen("gemv-rows", joined)
    qw = quantized(GEMV_FORMATS["int4-g128"], 48, 1024, g)
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    x = rand(4, 1024, dtype=torch.bfloat16, g=g)
    cfg = gemv_cfg(joined, split_k=2)
    together = qlinear(x, p, config=cfg)
    for m in (1, 2, 3):
        assert torch.equal(qlinear(x[:m], p, config=cfg), together[:m])
        assert torch.equal(qlinear(x[m:m + 1], p, config=cfg), together[m:m + 1])


def test_gemv_refuses_what_it_cannot_stream():
    g = gen("gemv-refuse")
    qw = quantized(FORMATS["int4-g64"], 32, 256, g)  # two groups per 128-column pack tile
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    assert not qm.gemv_fits(p)
    with pytest.raises(CompileError, match="GEMV"):
        qlinear(rand(1, 256, g=g), p, config=gemv_cfg(True))
    qw = quantized(GEMV_FORMATS["int4-g128"], 32, 256, g)
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    with pytest.raises(CompileError, match="up to 4 rows"):
        qlinear(rand(5, 256, g=g), p, config=gemv_cfg(True))


def test_gemv_is_a_candidate_only_where_every_sharing_bucket_fits(monkeypatch):
    """Batch-invariant tuning (1..64 share) never offers the GEMV; `--no-batch-invariant` (1..4
    share) offers it for int4 weights it fits, and the choice is recorded for all three buckets."""
    offered = []

    def fake_choose(self, key, buckets, cands, bench, baseline=None, margin=0.97, accept=None):
        offered.append((tuple(buckets), any(c.get("GEMV") for c in cands)))
        return dict(cands[0])

    monkeypatch.setattr(Tuner, "choose", fake_choose)
    g = gen("gemv-cands")
    qw = quantized(GEMV_FORMATS["int4-g128"], 32, 256, g)
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    x = rand(1, 256, g=g)
    qlinear(x, p, tuner=Tuner(device="test-gpu"))
    qlinear(x, p, tuner=Tuner(device="test-gpu", joint=autotune.DECODE_JOINT_BUCKETS))
    qlinear(rand(8, 256, g=g), p, tuner=Tuner(device="test-gpu", joint=autotune.DECODE_JOINT_BUCKETS))
    assert offered == [(autotune.JOINT_BUCKETS, False), (("1", "2", "4"), True), (("8",), False)]
    for c in qm.gemv_candidates(4096, 4096):
        assert c["GEMV"] and 4096 % (8 * c["BLOCK_W"] * c["SPLIT_K"]) == 0


# ------------------------------------------------------------------------------------------ library GEMMs

@pytest.mark.parametrize("name,k", [("int4-g64", 256), ("int4-g64-zp", 192), ("int4-ch", 200), ("int8-ch", 96),
                                    ("int8-g64", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_prepared_is_the_weight_rounded_once(name, k, dtype):
    qw = quantized(FORMATS[name], 48, k, gen("dq", name))
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    assert torch.equal(qm.dequantize_prepared(p, dtype), p.dequantize().to(dtype))


@pytest.mark.parametrize("name,library", [("int4-g64-zp", "dequant"), ("int8-ch", "dequant"),
                                          ("w8a8", "int_mm"), ("fp8", "scaled_mm")])
def test_library_gemms_agree_with_the_reference(name, library):
    """Each library path at a chunked-prefill-like M (bias and act on); w8a8's int32 dots are exact, and its
    epilogue kernel repeats the generated GEMM's in its order: the two agree bit for bit."""
    N, K, M = 96, 256, 40
    dtype = torch.bfloat16  # what the library paths serve (scaled_mm gives bf16 only)
    g = gen("lib", name)
    qw = quantized(FORMATS[name], N, K, g)
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    x, b = rand(M, K, dtype=dtype, g=g), rand(N, dtype=dtype, g=g)
    y = qlinear(x, p, b, "silu", config={"LIBRARY": library})
    ref = reference(x, qw.fmt, qw.qweight, qw.scales, qw.zeros, b, "silu")
    # dequant rounds W to bf16 before the GEMM; scaled_mm adds the bias to its bf16-rounded output
    tol = 2e-2 if library in ("dequant", "scaled_mm") else TOL[dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol)
    if library == "int_mm":
        assert torch.equal(y, qlinear(x, p, b, "silu", config=candidates("128+", N, K)[0]))
    # without bias and act (scaled_mm then writes y itself), into a given output
    out = torch.full((M, N), float("nan"), dtype=dtype, device=x.device)
    assert qlinear(x, p, config={"LIBRARY": library}, out=out) is out
    ref = reference(x, qw.fmt, qw.qweight, qw.scales, qw.zeros)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_library_candidates_where_their_shapes_and_m_fit():
    def p_of(name, n=4096, k=4096):
        qw = quantized(FORMATS[name], n, k, gen("cands", name))
        return prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    bf16 = torch.bfloat16
    assert qm.library_candidates("1024+", p_of("int4-g64"), bf16) == [{"LIBRARY": "dequant"}]
    assert qm.library_candidates("128+", p_of("int4-g64"), bf16) == [{"LIBRARY": "dequant"}]
    assert qm.library_candidates("64", p_of("int4-g64"), bf16) == []  # W's pass costs more than it saves
    assert qm.library_candidates("128+", p_of("fp8"), bf16) == [{"LIBRARY": "scaled_mm"}]
    assert qm.library_candidates("128+", p_of("fp8"), torch.float16) == []
    assert qm.library_candidates("64", p_of("w8a8"), bf16) == []
    assert qm.library_candidates("1024+", p_of("w8a8", 4100, 4096), bf16) == []  # N not a multiple of 8
    assert [qm.qlinear_bucket(m) for m in (64, 65, 511, 512, 1023, 1024, 4096)] == \
        ["64", "128+", "128+", "512+", "512+", "1024+", "1024+"]


def test_an_artifact_tuned_before_the_1024_bucket_keeps_its_128_choice(monkeypatch):
    monkeypatch.setattr(autotune, "can_time", lambda: True)
    seen = []
    monkeypatch.setattr(qm, "_launch", lambda spec, x2, p, b, y2, cfg, x_scales=None: seen.append(cfg))
    qw = quantized(FORMATS["int4-g64"], 32, 128, gen("old"))
    p = prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    key = QMatmulSpec.of(p, torch.float32, False, "").key(32, 128)
    rec = {"config": {"A": 7}, "triton_ms": 1.0, "cublas_ms": None, "prefer_cublas": False}
    t = Tuner({key: {"128+": rec}}, device="test-gpu", frozen=True)
    qlinear(torch.zeros(1500, 128), p, tuner=t)
    qlinear(torch.zeros(600, 128), p, tuner=t)  # nor one before the 512+ bucket
    assert seen == [{"A": 7}, {"A": 7}]


# ------------------------------------------------------------------------- int4 codes unpacked by PTX

def _from_half(bits, dtype: str):
    """16-bit bf16 / f16 patterns (in uint32s) as float64."""
    import numpy as np
    if dtype == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.astype(np.uint16).view(np.float16).astype(np.float64)


def _to_half(v, dtype: str):
    """Values that bf16 / f16 hold exactly as their 16-bit patterns (in uint32s)."""
    import numpy as np
    if dtype == "bf16":
        return v.astype(np.float32).view(np.uint32) >> 16
    return v.astype(np.float16).view(np.uint16).astype(np.uint32)


def _run_nibbles_asm(asm: str, x16, *more) -> list:
    """The outputs ($0, $1) of `NIBBLES_ASM` (with or without zero points) on 16-bit inputs ($2) and 32-bit
    ones ($3, ...), executed instruction by instruction: the few PTX instructions it uses (mov, cvt,
    prmt, shr, lop3, packed fma), by their PTX ISA definitions."""
    import numpy as np
    regs = {"$2": x16.astype(np.uint32), **{f"${3 + i}": r.astype(np.uint32) for i, r in enumerate(more)}}
    val = lambda t: np.uint32(int(t, 0)) if t[0].isdigit() else regs[t]  # noqa: E731
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." :
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            regs[d] = np.full_like(regs["$2"], val(src[0]))
        elif op == "cvt.u32.u16":
            regs[d] = val(src[0]) & 0xFFFF
        elif op == "prmt.b32":  # d.byte[i] = byte sel[i] of {b, a} (a: bytes 0-3, b: 4-7)
            a, b, sel = val(src[0]), val(src[1]), int(src[2], 0)
            pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
            regs[d] = sum(pool[(sel >> (4 * i)) & 7] << np.uint32(8 * i) for i in range(4)).astype(np.uint32)
        elif op == "shr.u32":
            regs[d] = val(src[0]) >> np.uint32(int(src[1], 0))
        elif op == "lop3.b32":  # bit = lut[4a + 2b + c]
            a, b, c, lut = val(src[0]), val(src[1]), val(src[2]), int(src[3], 0)
            out = np.zeros_like(regs["$2"])
            for i in range(8):
                if lut >> i & 1:
                    out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
            regs[d] = out
        elif op.startswith("fma.rn."):
            kind = op.rsplit(".", 1)[1].removesuffix("x2")
            a, b, c = (val(t) for t in src)
            lanes = []
            for shift in (0, 16):
                r = _from_half((a >> shift) & 0xFFFF, kind) * _from_half((b >> shift) & 0xFFFF, kind) + \
                    _from_half((c >> shift) & 0xFFFF, kind)
                assert np.array_equal(_from_half(_to_half(r, kind), kind), r), "a result the type cannot hold exactly"
                lanes.append(_to_half(r, kind) << np.uint32(shift))
            regs[d] = lanes[0] | lanes[1]
        else:
            raise AssertionError(f"an instruction the emulator lacks: {line}")
    return [regs["$0"], regs["$1"]]


def _assert_planes(planes, x, dtype: str, zero) -> None:
    """Each output pair (low plane, high plane) holds its bytes' nibbles less `zero(plane, element)`,
    element 0 (the byte at the lower address) in the low half, exactly."""
    import numpy as np
    for p, (plane, shift) in enumerate(zip(planes, (0, 4))):
        for e in (0, 1):
            want = ((x >> (8 * e + shift)) & 0xF).astype(np.float64) - zero(p, e)
            assert np.array_equal(_from_half((plane >> np.uint32(16 * e)) & 0xFFFF, dtype), want), (dtype, shift, e)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_nibbles_ptx_gives_every_code_less_8(dtype):
    """The inline PTX that unpacks int4 codes on the GPU (compiled kernels only; the interpreter runs the
    fp32 path), run here instruction by instruction on all 65,536 pairs of bytes: the low plane's pair
    holds each byte's low nibble - 8, the high plane's its high nibble - 8, element 0 (the byte at the
    lower address) in the low half, exactly."""
    import numpy as np
    x = np.arange(1 << 16, dtype=np.uint32)
    _assert_planes(_run_nibbles_asm(qm._nibbles_asm(dtype), x), x, dtype, lambda p, e: 8)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_nibbles_ptx_with_zero_points(dtype):
    """With zero points (AWQ checkpoints, asymmetric RTN) the PTX takes each plane's -(MAGIC + zero) as a
    pair in x's dtype and gives each nibble less its own zero, exactly, on all byte pairs and zero
    points 0..16 (at random per element; 16 is a classic GPTQ checkpoint's wrapped 0); a zero point past that
    is refused at prepare."""
    import numpy as np
    x = np.arange(1 << 16, dtype=np.uint32)
    zeros = np.random.default_rng(0).integers(0, 17, size=(2, 2, 1 << 16)).astype(np.uint32)  # [plane, element]
    magic = qm.NIBBLE_CONSTANTS[dtype][4]
    bias = [_to_half(-(magic + zeros[p, 0].astype(np.float64)), dtype)
            | (_to_half(-(magic + zeros[p, 1].astype(np.float64)), dtype) << np.uint32(16)) for p in (0, 1)]
    planes = _run_nibbles_asm(qm._nibbles_asm(dtype, zero_points=True), x, *bias)
    _assert_planes(planes, x, dtype, lambda p, e: zeros[p, e])
    qw = quantized(FORMATS["int4-g64-zp"], 8, 128, gen("zp-range"))
    with pytest.raises(CompileError, match="zero point of 17 is outside the 4-bit codes' range 0..16"):
        prepare(qw.fmt, qw.qweight, qw.scales, torch.full_like(qw.zeros, 17))
    zeros16 = torch.full_like(qw.zeros, 16)
    zeros16[::2] = 3
    x = rand(5, 128, g=gen("zp16"))
    got = qlinear(x, prepare(qw.fmt, qw.qweight, qw.scales, zeros16))
    close(got, reference(x, qw.fmt, qw.qweight, qw.scales, zeros16), x.dtype)


def test_packed_nibbles_compile_for_hopper():
    """The int4 kernel with its PTX unpacking compiles for sm_90 on this machine (ptxas ships with
    triton), with and without zero points, and its main loop unpacks with packed FMAs (HFMA2; ptxas
    makes x * 1 + bias an HADD2) and no fp32 subtraction; LLMC_INT4_PTX=0 gives the fp32 path's loop.
    Correct results on the GPU: the tests above with TRITON_INTERPRET=0."""
    from tests.codegen.conftest import sass_loop as load_sass_loop
    sass_loop = load_sass_loop()
    ptx, fp32 = (sass_loop.count("16,64,256,4,1,1", p, 4, 128, "bf16", 4) for p in (True, False))
    assert ptx["HFMA2"] and not ptx["FADD"] and not ptx["F2FP"]
    assert fp32["FADD"] and fp32["F2FP"] and not fp32["HFMA2"]
    zp = sass_loop.count("16,64,256,4,1,1", True, 4, 128, "bf16", 4, zero_points=True)
    assert (zp["HFMA2"] or zp["HADD2"]) and not zp["FADD"] and not zp["F2FP"]


def test_tma_tiles_compile_for_hopper():
    """With `TMA` the fp8 kernel's MMA loop compiled for sm_90 loads its tiles by TMA (UTMALDG), none through
    per-thread copies (LDGSTS), and issues fewer instructions than with pointer loads; the int4 loop loads its
    codes by TMA too."""
    from tests.codegen.conftest import sass_loop as load_sass_loop
    sass_loop = load_sass_loop()
    ptr, tma = (sass_loop.compiled_loop(sass_loop._COMPILE_W8, {}, mma=True, cfg=(128, 64, 128, 4, 1, 3), tma=t,
                                        kind="fp8") for t in (False, True))
    assert ptr["LDGSTS"] and not ptr["UTMALDG"] and tma["UTMALDG"] and not tma["LDGSTS"]
    assert sum(tma.values()) < sum(ptr.values())
    int4 = sass_loop.count("16,64,256,4,1,1", True, 4, 128, "bf16", 4, tma=True)
    assert int4["UTMALDG"]


def test_fp8_promotion_interval_sets_the_mma_loop_fadds(monkeypatch):
    """`LLMC_FP8_PROMOTE` sets how many of K an fp8 MMA sums before its sum moves into the fp32 accumulator:
    every 128 instead of every 32 compiles to a quarter of the MMA loop's FADDs on sm_90 (BLOCK_K 128); a
    value that is not 32, 64, 128 or 256 is refused with what to give."""
    from tests.codegen.conftest import sass_loop as load_sass_loop
    sass_loop = load_sass_loop()
    every = {p: sass_loop.compiled_loop(sass_loop._COMPILE_W8, {"LLMC_FP8_PROMOTE": str(p)}, mma=True,
                                        cfg=(128, 64, 128, 4, 1, 3), tma=False, kind="fp8") for p in (32, 128)}
    assert every[128]["FADD"] * 4 == every[32]["FADD"] > 0
    monkeypatch.setenv("LLMC_FP8_PROMOTE", "48")
    with pytest.raises(CompileError, match="32, 64, 128 or 256"):
        qm.fp8_promote()
