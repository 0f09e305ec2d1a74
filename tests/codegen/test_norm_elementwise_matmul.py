"""rms_norm, fused elementwise, matmul+epilogue and argmax kernels against the IR's reference ops.

On CPU the kernels run under the Triton interpreter (tests/codegen/conftest.py sets TRITON_INTERPRET
before triton is imported); with `TRITON_INTERPRET=0` on a GPU machine they run compiled on CUDA.
bfloat16 runs under the interpreter too: it holds bf16 as raw uint16 bits, so our kernels do no
arithmetic in bf16 (they widen to fp32 first, and feed tl.dot fp32 there), and its fp32 -> bf16
cast truncates, so the kernels round to nearest even in integer arithmetic first (`_rne_bf16`).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmc.codegen import autotune
from llmc.codegen import matmul as mm
from llmc.codegen.autotune import Tuner, m_bucket
from llmc.codegen.elementwise import (ElementwiseSpec, broadcast_kind, fused_elementwise, interpreting,
                                      spec_from_ops)
from llmc.codegen.kernels import render
from llmc.codegen.matmul import MatmulSpec, candidates, matmul, reference
from llmc.codegen.norm import RmsNormSpec, rms_norm
from llmc.codegen.sampling import argmax
from llmc.errors import CompileError
from llmc.ir.ops import get_op
from tests.codegen.conftest import library_interpreted


INTERPRETED = library_interpreted()
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRETED and (interpreting() or not torch.cuda.is_available()),
    reason="triton was imported (compiled) before tests/codegen/conftest.py could set TRITON_INTERPRET=1 "
           "and there is no GPU: run `TRITON_INTERPRET=1 pytest tests/codegen/test_norm_elementwise_matmul.py`")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True, scope="module")
def _cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMC_CACHE_DIR", str(tmp_path_factory.mktemp("llmc_cache")))
        yield


def rand(*shape, dtype=torch.float32, gen=None):
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


def close(out, ref, dtype, scale=1.0):
    tol = TOL[dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)


def ref_op(op, args, **attrs):
    opdef = get_op(op)
    return opdef.ref(list(args), opdef.complete_attrs(attrs), None)


# ----------------------------------------------------------------------------------------- rms_norm

NORM_SHAPES = [(1, 64), (7, 96), (2, 3, 128), (5, 1)]  # one row; non-power-of-two; leading dims; H = 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(dtype, shape, residual):
    g = torch.Generator().manual_seed(hash((str(dtype), shape, residual)) % 2**31)
    H = shape[-1]
    # x is a strided view (rows of a wider buffer) to check the row stride is honoured
    x = rand(*shape[:-1], H + 5, dtype=dtype, gen=g)[..., 2:H + 2]
    w = (1 + 0.1 * rand(H, gen=g)).to(dtype)
    r = rand(*shape, dtype=dtype, gen=g) if residual else None
    for wfc in (True, False):
        got = rms_norm(x, w, 1e-6, residual=r, weight_first_cast=wfc)
        h = x + r if residual else x
        ref = ref_op("rms_norm", [h, w], eps=1e-6, weight_first_cast=wfc)
        if residual:
            got, got_h = got
            assert torch.equal(got_h, h), "h = x + r must be exactly torch's add in the input dtype"
        close(got, ref, dtype)


def test_rms_norm_f32_weight_promotes():
    x, w = rand(3, 40, dtype=torch.bfloat16), rand(40)
    close(rms_norm(x, w), ref_op("rms_norm", [x, w]), torch.float32)  # bf16 x, f32 w: an f32 result (Llama)


def test_rms_norm_source_counts_bytes():
    src = render(RmsNormSpec(4096, "bf16", residual=True))
    assert "def rms_norm_kernel(" in src and "bytes per row" in src and "h_ptr" in src


# ------------------------------------------------------------------------------------- elementwise

def region_ref(spec: ElementwiseSpec, tensors):
    """The region run op by op with the registry's reference implementations (torch's numerics)."""
    env = {n: t for (n, _, _), t in zip(spec.inputs, tensors)}
    for out, op, args, attrs in spec.body:
        env[out] = ref_op(op, [env[a] for a in args], **dict(attrs))
        if op == "constant":
            env[out] = env[out].to(DEVICE)
    return [env[n] for n, _ in spec.outputs]


UNARY = [("neg", {}), ("silu", {}), ("gelu", {}), ("gelu", {"approximate": "tanh"}), ("relu", {}), ("sigmoid", {}),
         ("tanh", {}), ("exp", {}), ("log", {}), ("sqrt", {}), ("rsqrt", {}), ("reciprocal", {}), ("abs", {}),
         ("cos", {}), ("sin", {})]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,attrs", UNARY, ids=[f"{o}{'_' + a['approximate'] if a else ''}" for o, a in UNARY])
def test_unary(op, attrs, dtype):
    g = torch.Generator().manual_seed(hash((op, str(attrs), str(dtype))) % 2**31)
    x = rand(3, 37, dtype=dtype, gen=g) * 2
    if op in ("log", "sqrt", "rsqrt", "reciprocal"):
        x = x.abs() + 0.25
    if op == "tanh":  # both branches of _tanh: the series near 0 and the exp form
        x[0, :8] = torch.tensor([1e-4, -3e-3, 0.03, -0.06, 0.07, -0.5, 4.0, -20.0]).to(dtype)
    spec = spec_from_ops([("x", torch_name(dtype), "full")], [(op, ["x"], attrs)])
    (y,) = fused_elementwise(spec, [x])
    close(y, region_ref(spec, [x])[0], dtype)


def torch_name(dtype):
    return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]


BINARY = ["add", "sub", "mul", "div", "pow", "maximum", "minimum", "silu_mul"]
KIND_SHAPE = {"full": (4, 6, 9), "row": (4, 6, 1), "col": (9,), "scalar": ()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", BINARY)
def test_binary_broadcast(op, dtype):
    g = torch.Generator().manual_seed(hash((op, str(dtype))) % 2**31)
    for kind, shape in KIND_SHAPE.items():
        x, y = rand(4, 6, 9, dtype=dtype, gen=g), rand(*shape, dtype=dtype, gen=g)
        if op == "pow":  # a negative base with integer exponents, a positive one with any
            y = y.round() if kind in ("row", "scalar") else y
            x = x if kind in ("row", "scalar") else x.abs() + 0.5
        if op == "div":
            y = y.sign() * (y.abs() + 0.5)
        spec = spec_from_ops([("x", torch_name(dtype), "full"), ("y", torch_name(dtype), kind)], [(op, ["x", "y"], {})])
        (out,) = fused_elementwise(spec, [x, y])
        close(out, region_ref(spec, [x, y])[0], dtype, scale=4.0)


# a single element; non-power-of-two; leading dims; single rows (the widest tile) narrower and wider than it
REGION_SHAPES = [(1, 1), (5, 33), (2, 3, 64), (1, 1, 37), (1, 1500)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", REGION_SHAPES)
def test_region_dag(dtype, shape):
    """A DAG with shared values, every broadcast kind, literals, an explicit cast and two outputs."""
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    dt = torch_name(dtype)
    C = shape[-1]
    x = rand(*shape, dtype=dtype, gen=g)[..., :C]
    gate = rand(*shape, dtype=dtype, gen=g)
    scale = rand(*shape[:-1], 1, dtype=dtype, gen=g)
    bias = rand(C, gen=g)  # an f32 column vector promotes the region to f32
    s = rand(dtype=dtype, gen=g)
    inputs = [("x", dt, "full"), ("gate", dt, "full"), ("scale", dt, "row"), ("bias", "f32", "col"),
              ("s", dt, "scalar")]
    ops = [("mul", ["x", "scale"], {}, "xs"),
           ("silu_mul", ["gate", "xs"], {}, "act"),
           ("add", ["act", "bias"], {}, "biased"),          # f32 from here
           ("cast", ["biased"], {"dtype": dt}, "low"),      # back to the input dtype: a real rounding
           ("mul", ["low", 0.5], {}, "half"),
           ("gelu", ["half"], {"approximate": "tanh"}, "y1"),
           ("sub", ["y1", "s"], {}, "y2"),
           ("maximum", ["y2", "xs"], {}, "y3")]
    spec = spec_from_ops(inputs, ops, outputs=["y3", "biased"])
    assert [d for _, d in spec.outputs] == [dt, "f32"]
    tensors = [x, gate, scale, bias, s]
    got = fused_elementwise(spec, tensors)
    for out, ref in zip(got, region_ref(spec, tensors)):
        close(out, ref, dtype, scale=4.0)


def test_region_integer_and_dict_inputs():
    spec = spec_from_ops([("pos", "i64", "full"), ("f", "f32", "scalar")],
                         [("mul", ["pos", 3], None), ("add", ["t0", 1], None), ("mul", ["t1", "f"], None)],
                         outputs=["t1", "t2"])
    assert [d for _, d in spec.outputs] == ["i64", "f32"]
    pos = torch.arange(-5, 12, device=DEVICE).reshape(1, 17)
    f = torch.tensor(0.25, device=DEVICE)
    a, b = fused_elementwise(spec, {"pos": pos, "f": f})
    assert torch.equal(a, pos * 3 + 1) and torch.equal(b, (pos * 3 + 1) * f)


def test_spec_from_ops_format_and_errors():
    spec = spec_from_ops([("g", "bf16", "full"), ("u", "bf16", "full")],
                         [("silu", ["g"], {}), ("mul", ["t0", "u"], {}), ("mul", ["t1", 0.5], None)])
    assert [o for o, *_ in spec.body] == ["t0", "t1", "t2_c1", "t2"] and spec.outputs == (("t2", "bf16"),)
    assert spec == spec_from_ops([("g", "bf16", "full"), ("u", "bf16", "full")],
                                 [("silu", ["g"], {}), ("mul", ["t0", "u"], {}), ("mul", ["t1", 0.5], {})])
    src = render(spec)
    assert "def fused_elementwise_kernel(" in src and "fused:" in src and "one kernel per op" in src
    with pytest.raises(CompileError, match="undefined"):
        spec_from_ops([("x", "f32", "full")], [("add", ["x", "nope"], {})])
    with pytest.raises(CompileError, match="cannot be fused"):
        spec_from_ops([("x", "f32", "full")], [("softmax", ["x"], {})])
    with pytest.raises(CompileError, match="integer"):
        render(spec_from_ops([("x", "i64", "full")], [("exp", ["x"], {})]))
    with pytest.raises(CompileError, match="broadcast kind"):
        ElementwiseSpec((("x", "f32", "diagonal"),), (("y", "neg", ("x",), ()),), (("y", "f32"),))


def test_broadcast_kind():
    assert broadcast_kind((3, 5), (3, 5)) == "full"
    assert broadcast_kind((3, 1), (3, 5)) == "row"
    assert broadcast_kind((5,), (2, 3, 5)) == "col"
    assert broadcast_kind((1, 1, 5), (2, 3, 5)) == "col"
    assert broadcast_kind((), (3, 5)) == "scalar"
    with pytest.raises(CompileError):
        broadcast_kind((3, 1, 5), (3, 4, 5))


# ------------------------------------------------------------------------------------------ matmul

MM_SHAPES = [(1, 40, 100), (5, 96, 257), (33, 70, 64)]  # M = 1; non-power-of-two N, K; a second M bucket


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mnk", MM_SHAPES)
def test_matmul(dtype, mnk):
    M, N, K = mnk
    g = torch.Generator().manual_seed(hash((str(dtype), mnk)) % 2**31)
    x = rand(M, K, dtype=dtype, gen=g)
    w = (rand(N, K, gen=g) / K ** 0.5).to(dtype)
    b = rand(N, dtype=dtype, gen=g)
    close(matmul(x, w), reference(x, w), dtype)
    close(matmul(x, w, b, ("silu",)), reference(x, w, b, ("silu",)), dtype)
    split = dict(candidates("1")[6], BLOCK_K=32)  # split-K = 4: partials summed by the last split of a tile
    epi = (("gelu", {"approximate": "tanh"}),)
    close(matmul(x, w, b, epi, config=split), reference(x, w, b, epi), dtype)


# bf16 only compiled: the interpreter runs bf16 dots in fp32, so it would repeat the fp32 case at twice the time
@pytest.mark.parametrize("dtype", [torch.float32] + ([] if interpreting() else [torch.bfloat16]), ids=str)
def test_every_decode_candidate_at_a_tiny_models_shape(dtype):
    """Every config the tuning may choose for 1 to 64 rows (split-K up to 8, where most splits get no K tile
    at K = 128) at a linear shape of the tiny test Llama, against torch, every split counter back at zero
    after. Compiled on a GPU (`TRITON_INTERPRET=0`) this is the check of the tuned path at small shapes."""
    from llmc.codegen.kernels import check_counters_released
    N, K = 320, 128
    g = torch.Generator().manual_seed(5)
    w = (rand(N, K, gen=g) / K ** 0.5).to(dtype)
    for m in (1, 5):
        x = rand(m, K, gen=g).to(dtype)
        want = reference(x, w)
        for cfg in candidates("1"):
            close(matmul(x, w, config=cfg), want, dtype)
    check_counters_released()


def test_split_k_sums_in_split_order_and_leaves_counters_at_zero():
    from llmc.codegen.matmul import tile_counters
    g = torch.Generator().manual_seed(3)
    M, N, K = 5, 70, 200
    x, w, b = rand(M, K, gen=g), rand(N, K, gen=g) / K ** 0.5, rand(N, gen=g)
    cfg = dict(candidates("1")[6], BLOCK_K=32)  # 4 splits of 64 keys (the last one short)
    first = matmul(x, w, b, ("silu",), config=cfg)
    # the same sum, written out: partials of 64 keys each, added in split order, then the epilogue
    parts = [x[:, k:k + 64] @ w[:, k:k + 64].T for k in range(0, K, 64)]
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    close(first, torch.nn.functional.silu(acc + b), torch.float32)
    assert int(tile_counters(x.device, 1).abs().sum()) == 0  # every tile's counter reset by its last split
    assert torch.equal(matmul(x, w, b, ("silu",), config=cfg), first)  # a second launch: the same bits


def test_row_tiles_per_program():
    from llmc.codegen.matmul import m_tiles
    assert [m_tiles(m, 16) for m in (1, 16, 17, 33, 48, 64)] == [1, 1, 2, 4, 4, 4]
    assert m_tiles(65, 16) == m_tiles(128, 64) == m_tiles(100, 64) == 1 and m_tiles(64, 64) == 1


@pytest.mark.parametrize("split_k", [1, 4])
def test_matmul_row_tiles_of_one_program_equal_tiles_alone(split_k):
    """Up to 64 rows, one program loops over the 16-row tiles with each w tile it loads: every tile
    comes out bitwise as it does launched alone (bitwise row by row, whatever the row's place in its
    tile, only on the GPU: the interpreter's dot is numpy's, whose sums depend on a row's place;
    `scripts/gpu_check_split.py` checks that)."""
    g = torch.Generator().manual_seed(11)
    M, N, K = 64, 70, 200
    x, w, b = rand(M, K, gen=g), rand(N, K, gen=g) / K ** 0.5, rand(N, gen=g)
    cfg = dict(candidates("1")[0], BLOCK_K=32, SPLIT_K=split_k)
    full = matmul(x, w, b, ("silu",), config=cfg)  # 4 tiles in each program
    close(full, reference(x, w, b, ("silu",)), torch.float32)
    for t in range(4):
        assert torch.equal(matmul(x[16 * t:16 * t + 16], w, b, ("silu",), config=cfg), full[16 * t:16 * t + 16])
    assert torch.equal(matmul(x[:20], w, b, ("silu",), config=cfg)[:16], full[:16])  # 2 tiles, the second short
    for i in (17, 40, 63):
        close(matmul(x[i:i + 1], w, b, ("silu",), config=cfg)[0], full[i], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 17, 70])  # one row tile; row tiles in one program; one tile per program
def test_silu_mul_prologue_equals_the_product_kernel_then_the_matmul(dtype, m):
    """The SwiGLU product formed in the matmul's prologue (silu_mul_linear) gives the bits of the product kernel
    followed by the plain matmul on the same tiles, with gate and up the halves of one gate/up output, with a
    bias and with split-K; and it matches the torch reference."""
    g = torch.Generator().manual_seed(m)
    K, N = 96, 40
    gu = rand(m, 2 * K, dtype=dtype, gen=g)
    gate, up = gu[:, :K], gu[:, K:]  # strided rows, as a fused gate/up projection writes them
    w, b = (rand(N, K, gen=g) / K ** 0.5).to(dtype), rand(N, dtype=dtype, gen=g)
    product = mm.silu_mul_product(gate, up)
    for cfg in (None, dict(candidates("1")[6], BLOCK_K=32)):  # the default tiles; 4 splits of K
        for bias in (None, b):
            fused = matmul(gate, w, bias, up=up, config=cfg)
            assert torch.equal(fused, matmul(product, w, bias, config=cfg))
            close(fused, reference(gate, w, bias, up=up), dtype)
    # an untuned linear (cuBLAS) forms the same product first; with prologue=False the generated path does too
    close(mm.linear(gate, w, b, tuner=Tuner(frozen=True), up=up), reference(product, w, b), dtype)
    assert torch.equal(mm.linear(gate, w, b, up=up, prologue=False), matmul(product, w, b))
    # the prologue is part of the kernel's identity and its tuning key
    assert MatmulSpec("bf16", False, (), "silu_mul").key(N, K) != MatmulSpec("bf16", False, ()).key(N, K)
    with pytest.raises(CompileError, match="prologue"):
        MatmulSpec("f32", False, (), "gelu_mul")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 17, 70])  # one row tile; row tiles in one program; one tile per program
def test_swiglu_epilogue_equals_the_matmul_then_the_product_kernel(dtype, m):
    """The SwiGLU product in a gate/up projection's epilogue (linear_silu_mul) gives the bits of the plain
    matmul on the same tiles followed by the product kernel, with a bias and with split-K (its partials of
    both halves in one workspace), and matches the torch reference; the cuBLAS path and the unfused generated
    path (fused=False) form the same product after the projection."""
    g = torch.Generator().manual_seed(m)
    K, N = 96, 40
    x = rand(m, K, dtype=dtype, gen=g)
    w, b = (rand(2 * N, K, gen=g) / K ** 0.5).to(dtype), rand(2 * N, dtype=dtype, gen=g)
    for cfg in (None, dict(candidates("1")[6], BLOCK_K=32)):  # the default tiles; 4 splits of K
        for bias in (None, b):
            fused = matmul(x, w, bias, config=cfg, gated=True)
            assert fused.shape == (m, N)
            assert torch.equal(fused, mm.swiglu_of(matmul(x, w, bias, config=cfg)))
            close(fused, reference(x, w, bias, gated=True), dtype)
    y = reference(x, w, b)
    torch.testing.assert_close(reference(x, w, b, gated=True).float(),
                               (F.silu(y[:, :N].float()) * y[:, N:].float()).to(dtype).float())
    close(mm.linear(x, w, b, tuner=Tuner(frozen=True), gated=True), reference(x, w, b, gated=True), dtype)
    assert torch.equal(mm.linear(x, w, b, gated=True, fused=False), mm.swiglu_of(matmul(x, w, b)))
    out = torch.empty(m, N, dtype=dtype, device=DEVICE)
    assert mm.linear(x, w, b, gated=True, out=out) is out and torch.equal(out, matmul(x, w, b, gated=True))
    # the epilogue is part of the kernel's identity and its tuning key; it takes no other epilogue op
    assert MatmulSpec("bf16", False, (), "", True).key(2 * N, K) != MatmulSpec("bf16", False, ()).key(2 * N, K)
    with pytest.raises(CompileError, match="gated"):
        MatmulSpec("f32", False, ("silu",), "", True)


def test_a_config_runs_the_stages_that_fit_the_devices_shared_memory(monkeypatch):
    """fp32 tiles of the gated kernel at its default config need 3 x 81,920 bytes of shared memory, more
    than an H100's or H200's 232,448 (the launch failed there): the launch takes a stage fewer; a config
    that fits, and any launch off the GPU, runs as given."""
    class Cuda:
        type, index = "cuda", 0

    monkeypatch.setattr(autotune, "shared_memory_limit", lambda index: 232448)
    cfg = candidates("16")[0]
    assert cfg["num_stages"] == 4
    assert autotune.fit_stages(cfg, 81920, Cuda()) == dict(cfg, num_stages=3)
    assert autotune.fit_stages(cfg, 40960, Cuda()) is cfg
    assert autotune.fit_stages(cfg, 300000, Cuda())["num_stages"] == 1
    assert autotune.fit_stages(cfg, 81920, torch.device("cpu")) is cfg
    seen = []
    fit = autotune.fit_stages  # on a GPU the launches below need it: the first overflows without it
    monkeypatch.setattr(mm, "fit_stages", lambda c, nbytes, device: seen.append(nbytes) or fit(c, nbytes, device))
    x, w = rand(17, 96), rand(80, 96)
    matmul(x, w, gated=True)  # two row tiles: two x tiles and the gate's and up's w tiles a stage
    matmul(x, w[:40])
    matmul(x[:1], w[:40], up=x[:1])  # one row tile of x and one of up
    assert seen == [(2 * 64 + 2 * 16) * 128 * 4, (64 + 2 * 16) * 128 * 4, (64 + 2 * 16) * 128 * 4]


def test_matmul_leading_dims_and_strided_rows():
    x = rand(2, 3, 48)[:, :, :40]  # rows with a stride > K
    w, b = rand(24, 40) / 40 ** 0.5, rand(24)
    close(matmul(x, w, b, ("relu",)), reference(x, w, b, ("relu",)), torch.float32)
    with pytest.raises(CompileError, match="epilogue"):
        MatmulSpec("f32", False, ("add",))


# ------------------------------------------------------------------------------------------ argmax

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nv", [(1, 1), (3, 1000), (4, 5003)])  # V = 1; non-power-of-two; V > one block
def test_argmax(dtype, nv):
    N, V = nv
    g = torch.Generator().manual_seed(hash((str(dtype), nv)) % 2**31)
    logits = (rand(N, V + 3, gen=g) * 4).round().to(dtype)[:, :V]  # rounded: many ties; strided rows
    if N > 2:
        logits[1] = float("-inf")
        logits[2, V // 2] = float("nan")
        logits[2, V - 1] = float("nan")
    assert torch.equal(argmax(logits), logits.argmax(-1))
    assert torch.equal(argmax(logits[0]), logits[0].argmax())


def test_argmax_split_over_programs(monkeypatch):
    """A row split over programs (a batch-1 decode's vocabulary on many SMs) gives torch.argmax's index: ties
    across splits to the lowest index, the first NaN over everything, an all -inf row 0, and a split past the
    row's end (rounded-up chunks) taking no part."""
    import llmc.codegen.sampling as sampling
    monkeypatch.setattr(sampling, "SPLIT_ARGMAX", True)
    assert [sampling.argmax_splits(n, v) for n, v in ((1, 128256), (8, 128256), (128, 128256), (300, 128256),
                                                      (1, 1000))] == [63, 63, 8, 3, 1]
    monkeypatch.setattr(sampling, "SPLIT_PROGRAMS", 264)
    monkeypatch.setattr(sampling, "SPLIT_BLOCK", 16)
    N, V = 66, 65  # 4 splits of 32 logits: the last starts past the row
    assert sampling.argmax_splits(N, V) == 4
    g = torch.Generator().manual_seed(5)
    logits = (rand(N, V, gen=g) * 2).round()
    logits[0] = float("-inf")
    logits[1, 40] = logits[1, 3] = float("nan")
    logits[2] = 0.0
    logits[2, 17] = logits[2, 50] = 1.0  # a tie across two splits
    logits[3, 64] = 100.0  # the last logit, alone in its split
    assert torch.equal(argmax(logits), logits.argmax(-1))
    assert torch.equal(argmax(logits.bfloat16()), logits.bfloat16().argmax(-1))
    # every split count, up to MAX_SPLITS, through the one merge of MAX_SPLITS lanes
    for n, splits in ((1, 64), (40, 6), (100, 2)):
        assert sampling.argmax_splits(n, 1024) == splits
        logits = (rand(n, 1024, gen=g) * 4).round()
        assert torch.equal(argmax(logits), logits.argmax(-1))


# ---------------------------------------------------------------------------------------- autotune

def test_m_bucket():
    assert [m_bucket(m) for m in (1, 2, 3, 4, 5, 16, 17, 64, 65, 128, 4096)] == \
        ["1", "2", "4", "4", "8", "16", "32", "64", "128+", "128+", "128+"]


def test_tuner_untimed_without_gpu():
    calls = []
    cfg = Tuner().choose("k", "1", [{"A": 1}, {"A": 2}], bench=calls.append)
    if not autotune.can_time():
        assert cfg == {"A": 1} and calls == []


def test_tuner_records_persist_and_are_reused(tmp_path, monkeypatch):
    """Timing is faked (no GPU here): the record is made once, saved, loaded, and never retuned."""
    tuned = []

    def fake_tune(cands, bench, baseline, margin=0.97, lighter=None, within=0.0):
        tuned.append(len(cands))
        return autotune.TuneRecord(dict(cands[1]), triton_ms=0.010, cublas_ms=0.008, prefer_cublas=True)

    monkeypatch.setattr(autotune, "can_time", lambda: True)
    monkeypatch.setattr(Tuner, "tune", staticmethod(fake_tune))
    t = Tuner(device="test-gpu")
    key = MatmulSpec("bf16", True, ("silu",)).key(4096, 4096)
    assert t.choose(key, "4", [{"A": 1}, {"A": 2}], bench=None) == {"A": 2}
    assert t.choose(key, "4", [{"A": 1}, {"A": 2}], bench=None) == {"A": 2} and tuned == [2]
    t.save(tmp_path / "tuning.json")
    data = (tmp_path / "tuning.json").read_text()
    assert '"prefer_cublas": true' in data and '"cublas_ms": 0.008' in data
    monkeypatch.setattr(autotune, "_device_name", lambda: "test-gpu")
    t2 = Tuner.load(tmp_path / "tuning.json")
    assert t2.choose(key, "4", [{"A": 1}], bench=None) == {"A": 2} and tuned == [2]
    assert t2.lookup(key, "4").prefer_cublas
    monkeypatch.setattr(autotune, "_device_name", lambda: "another-gpu")
    assert Tuner.load(tmp_path / "tuning.json").records == {}  # measured elsewhere: tuned afresh


def test_decode_buckets_share_one_choice_timed_on_their_sum(monkeypatch):
    """Buckets 1..64 get one config, the one fastest summed over all seven (so a sequence's GEMMs do
    not change with its batch); 128+ is chosen alone. Timing is faked: a config's "time" is the sum of
    per-bucket costs its bench reports, so the winner at M=1 alone (A=1) loses on the sum (A=2)."""
    cost = {1: {1: 1.0, 2: 2.0, 4: 2.0, 8: 2.0, 16: 2.0, 32: 2.0, 64: 2.0},
            2: {1: 1.5, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 1.0, 64: 1.0}}
    seen = []

    def fake_launch(spec, x2, w, b, y2, cfg, u2=None):
        seen.append((x2.shape[0], cfg["A"]))
        return cost[cfg["A"]].get(x2.shape[0], 9.0)

    monkeypatch.setattr(autotune, "can_time", lambda: True)
    monkeypatch.setattr(autotune, "gpu_time_ms", lambda fn: sum(fn()))
    monkeypatch.setattr(mm, "_launch", fake_launch)
    monkeypatch.setattr(mm, "candidates", lambda bucket, shared=True: [{"A": 1}, {"A": 2}])
    monkeypatch.setattr(mm, "reference", lambda *a, **k: 100.0)
    t = Tuner(device="test-gpu")
    x, w = rand(3, 32), rand(16, 32)
    mm.matmul(x, w, tuner=t)  # M=3: bucket "4", tuned with the whole group
    key = MatmulSpec("f32", False).key(16, 32)
    assert {b: r["config"]["A"] for b, r in t.records[key].items()} == {b: 2 for b in autotune.JOINT_BUCKETS}
    assert {m for m, _ in seen} == {1, 2, 3, 4, 8, 16, 32, 64}  # bucket sizes timed, then x's own 3 rows
    assert not t.lookup(key, "4").prefer_cublas
    seen.clear()
    mm.matmul(rand(1, 32), w, tuner=t)
    assert seen == [(1, 2)]  # recorded: not retimed
    mm.matmul(rand(130, 32), w, tuner=t)
    assert set(t.records[key]) == {*autotune.JOINT_BUCKETS, "128+"}
    t2 = Tuner(device="test-gpu", joint=autotune.DECODE_JOINT_BUCKETS)  # --no-batch-invariant
    mm.matmul(rand(20, 32), w, tuner=t2)
    assert set(t2.records[key]) == {"32"}
    monkeypatch.undo()
    assert candidates("32")[0]["BLOCK_M"] == 16 and candidates("32", shared=False)[0]["BLOCK_M"] == 32


def test_a_tie_goes_to_the_generated_kernel_for_a_joint_group_and_to_cublas_alone(monkeypatch):
    """The generated kernel 2% slower than cuBLAS: kept for buckets 1..64 (only it keeps a row's sums
    the same at every batch size), not for 128+ (a bucket of its own, where a tie keeps cuBLAS)."""
    monkeypatch.setattr(autotune, "can_time", lambda: True)
    monkeypatch.setattr(autotune, "gpu_time_ms", lambda fn: sum(fn()))
    monkeypatch.setattr(mm, "_launch", lambda spec, x2, w, b, y2, cfg, u2=None: 1.02)
    monkeypatch.setattr(mm, "candidates", lambda bucket, shared=True: [{"A": 1}])
    monkeypatch.setattr(mm, "reference", lambda *a, **k: 1.0)
    t = Tuner(device="test-gpu")
    w = rand(16, 32)
    mm.matmul(rand(3, 32), w, tuner=t)
    mm.matmul(rand(130, 32), w, tuner=t)
    key = MatmulSpec("f32", False).key(16, 32)
    assert not t.lookup(key, "1").prefer_cublas and not t.lookup(key, "64").prefer_cublas
    assert t.lookup(key, "128+").prefer_cublas
    monkeypatch.setattr(mm, "_launch", lambda spec, x2, w, b, y2, cfg, u2=None: 1.04)  # 4% slower: cuBLAS
    t2 = Tuner(device="test-gpu")
    mm.matmul(rand(3, 32), w, tuner=t2)
    assert t2.lookup(key, "1").prefer_cublas


def test_tuning_cache_is_reused_across_compiles_per_device(tmp_path, monkeypatch):
    """A persistent tuner times a key once per GPU, bucket sharing and kernel version: a second
    compile's tuner finds it in the cache and times nothing, and its tuning.json holds only the
    keys it used; another GPU or another joint grouping has a cache file of its own. Timing is faked."""
    tuned = []

    def fake_tune(cands, bench, baseline, margin=0.97, lighter=None, within=0.0):
        tuned.append(len(cands))
        return autotune.TuneRecord(dict(cands[-1]), triton_ms=0.010, cublas_ms=None, prefer_cublas=False)

    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "can_time", lambda: True)
    monkeypatch.setattr(autotune, "_device_name", lambda: "Test GPU 1")
    monkeypatch.setattr(Tuner, "tune", staticmethod(fake_tune))
    cands = [{"A": 1}, {"A": 2}]
    first = Tuner.persistent()
    assert first.choose("k1", autotune.JOINT_BUCKETS, cands, bench=None) == {"A": 2}
    first.choose("k2", "128+", cands, bench=None)
    first.save_cache()
    assert tuned == [2, 2] and first.cache_path.parent == tmp_path / "tuning"
    second = Tuner.persistent()
    assert second.choose("k1", autotune.JOINT_BUCKETS, cands, bench=None) == {"A": 2} and tuned == [2, 2]
    assert set(second.to_json(keys=second.used)["kernels"]) == {"k1"}
    second.choose("k3", "128+", cands, bench=None)
    second.save_cache()
    assert set(Tuner.persistent().records) == {"k1", "k2", "k3"}  # merged, none lost
    assert Tuner.persistent(autotune.DECODE_JOINT_BUCKETS).records == {}  # other sharing: its own file
    monkeypatch.setattr(autotune, "_device_name", lambda: "Test GPU 2")
    assert Tuner.persistent().records == {}
    (Tuner.persistent().cache_path).parent.mkdir(exist_ok=True)
    Tuner.persistent().cache_path.write_text("{not json")
    assert Tuner.persistent().records == {}  # a damaged cache is rebuilt, not fatal


def test_shipped_choices_start_a_tuning_and_this_machines_own_win(tmp_path, monkeypatch):
    """A table shipped in llmc/codegen/tuned/ under the cache file's name (same GPU, triton, joint buckets
    and kernel sources) seeds a persistent tuner; records this machine timed win over it, and a table of
    another name (other kernels) is not read. The tables shipped load, each named for its GPU."""
    shipped = tmp_path / "tuned"
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "_device_name", lambda: "Test GPU 1")
    monkeypatch.setattr(autotune, "SHIPPED_DIR", shipped)
    rec = lambda a: {"config": {"A": a}, "triton_ms": 1.0, "cublas_ms": None, "prefer_cublas": False}  # noqa: E731
    path = Tuner.persistent().cache_path
    shipped.mkdir()
    Tuner({"k1": {"1": rec(1), "2": rec(1)}, "k2": {"1": rec(2)}}, "Test GPU 1").save(shipped / path.name)
    Tuner({"k9": {"1": rec(9)}}, "Test GPU 1").save(shipped / ("x" + path.name))
    assert Tuner.persistent().records == {"k1": {"1": rec(1), "2": rec(1)}, "k2": {"1": rec(2)}}
    path.parent.mkdir(parents=True)
    Tuner({"k1": {"1": rec(3)}, "k3": {"1": rec(4)}}, "Test GPU 1").save(path)
    t = Tuner.persistent()
    assert t.records == {"k1": {"1": rec(3), "2": rec(1)}, "k2": {"1": rec(2)}, "k3": {"1": rec(4)}}
    monkeypatch.setattr(autotune, "_device_name", lambda: "Test GPU 2")
    assert Tuner.persistent().records == {}
    tables = sorted((Path(autotune.__file__).parent / "tuned").glob("*.json"))
    monkeypatch.setattr(autotune, "_device_name", lambda: None)  # read as on a machine without a GPU
    assert tables
    for table in tables:
        t = Tuner.load(table)
        slug = "".join(c if c.isalnum() else "-" for c in t.device).strip("-").lower()
        assert t.records and table.name.startswith(slug + "-")


def test_artifact_tuner_never_times_and_runs_cublas_where_untuned(monkeypatch):
    """An artifact's tuner is frozen: a bucket with a record uses it, one without (a 128+ prefill)
    runs cuBLAS, and nothing is timed at run time even on a GPU."""
    monkeypatch.setattr(autotune, "can_time", lambda: True)
    monkeypatch.setattr(autotune, "gpu_time_ms", lambda fn: pytest.fail("timed at run time"))
    used = []
    monkeypatch.setattr(mm, "_launch", lambda spec, x2, w, b, y2, cfg, u2=None: used.append(("triton", x2.shape[0])))
    monkeypatch.setattr(mm, "reference", lambda x, *a, **k: used.append(("cublas", x.shape[0])))
    key = MatmulSpec("f32", False).key(16, 32)
    rec = {"config": dict(candidates("1")[0]), "triton_ms": 1.0, "cublas_ms": 2.0, "prefer_cublas": False}
    t = Tuner.from_artifact({"format": autotune.FORMAT, "device": None, "kernels": {key: {"1": rec}}})
    assert t.frozen
    w = rand(16, 32)
    mm.linear(rand(1, 32), w, tuner=t)
    mm.linear(rand(130, 32), w, tuner=t)
    assert used == [("triton", 1), ("cublas", 130)]
    assert mm.matmul(rand(130, 32), w, tuner=t) is not None and used[-1] == ("triton", 130)  # default tiles
    assert "128+" not in t.records[key]


def test_an_invariant_artifact_tuner_keeps_the_generated_kernel_in_the_joint_buckets(monkeypatch):
    """Where cuBLAS won a joint group, a plain engine runs it; a speculating one (`invariant`) runs the
    group's generated config at every joint width, so a verify step of 40 rows sums each row as a plain
    step of 32 does, and still runs cuBLAS past the joint buckets."""
    monkeypatch.setattr(autotune, "can_time", lambda: True)  # records are read as on a GPU
    monkeypatch.setattr(autotune, "gpu_time_ms", lambda fn: pytest.fail("timed at run time"))
    used = []
    monkeypatch.setattr(mm, "_launch", lambda spec, x2, w, b, y2, cfg, u2=None: used.append(("triton", x2.shape[0], cfg)))
    monkeypatch.setattr(mm, "reference", lambda x, *a, **k: used.append(("cublas", x.shape[0])))
    key = MatmulSpec("f32", False).key(16, 32)
    cfg = dict(candidates("1")[1])
    rec = {"config": cfg, "triton_ms": 1.2, "cublas_ms": 1.0, "prefer_cublas": True}
    tuning = {"format": autotune.FORMAT, "device": None,
              "kernels": {key: {**{b: rec for b in autotune.JOINT_BUCKETS}, "128+": rec}}}
    w = rand(16, 32)
    for invariant in (False, True):
        t = Tuner.from_artifact(tuning, invariant=invariant)
        used.clear()
        for m in (32, 40, 200):
            mm.linear(rand(m, 32), w, tuner=t)
        expect = [("triton", 32, cfg), ("triton", 40, cfg)] if invariant else [("cublas", 32), ("cublas", 40)]
        assert used == expect + [("cublas", 200)], invariant
    assert tuning["kernels"][key]["32"]["prefer_cublas"]  # the artifact's record is left as it was


def test_kernels_ran_in_the_expected_mode():
    from llmc.codegen.cache import _device_tag
    from llmc.codegen.kernels import load
    from triton.runtime.interpreter import InterpretedFunction
    assert (_device_tag() == "interp") == INTERPRETED
    kernel = load(RmsNormSpec(64, "f32", residual=False)).rms_norm_kernel
    assert isinstance(kernel, InterpretedFunction) == INTERPRETED


def test_candidates_are_warmed_up_on_threads_before_they_are_timed(monkeypatch):
    """A tuning first runs every candidate once, on threads (their kernels compile in parallel: a cold
    tuning is mostly compiling), then times each; a candidate that fails in the warm-up is skipped by the
    timing as before, and LLMC_TUNE_THREADS=0 leaves each candidate to compile when it is first timed."""
    import threading
    events, lock = [], threading.Lock()
    together = threading.Barrier(3)  # the three warm-ups that launch meet here: they run at once

    def bench(cfg):
        with lock:
            events.append(("run", cfg["A"], threading.current_thread().name))
        if cfg["A"] == 3:
            raise RuntimeError("out of shared memory")
        if ("timed",) not in events:
            together.wait(timeout=10)  # raises BrokenBarrierError if the warm-ups ran one by one
        return [1.0 / cfg["A"]]

    def timed(fn):
        events.append(("timed",))
        return sum(fn())
    monkeypatch.setattr(autotune, "gpu_time_ms", timed)
    monkeypatch.setenv("LLMC_TUNE_THREADS", "4")
    rec = Tuner.tune([{"A": 1}, {"A": 2}, {"A": 3}, {"A": 4}], bench, None)
    assert rec.config == {"A": 4} and not together.broken
    warm = events[:events.index(("timed",))]
    assert sorted(a for _, a, _ in warm) == [1, 2, 3, 4] and all(n.startswith("llmc-tune") for *_, n in warm)
    events.clear()
    monkeypatch.setenv("LLMC_TUNE_THREADS", "0")
    Tuner.tune([{"A": 1}, {"A": 2}], bench, None)
    assert events[0] == ("timed",) and len(events) == 4  # no warm-up: timed, run, timed, run


def test_a_tuning_whose_every_candidate_fails_says_why(monkeypatch):
    """When no candidate runs, the error names the last failure (device memory held elsewhere, say), which a
    compile that falls back to a default prints."""
    def bench(cfg):
        raise MemoryError(f"CUDA out of memory (config {cfg['A']})")
    monkeypatch.setattr(autotune, "gpu_time_ms", lambda fn: fn())
    monkeypatch.setenv("LLMC_TUNE_THREADS", "0")
    with pytest.raises(RuntimeError, match=r"every candidate failed .*the last with MemoryError: CUDA out of "
                                           r"memory \(config 2\)"):
        Tuner.tune([{"A": 1}, {"A": 2}], bench, None)


def test_a_lighter_config_within_the_tolerance_wins(monkeypatch):
    """With `lighter`, the lightest config timed within `within` of the fastest is chosen (the fastest of equal
    weight), with its own time; one further off, or none given, leaves the fastest."""
    times = {(64, 4): 1.007, (128, 8): 1.0, (32, 4): 1.015, (64, 8): 1.005, (16, 2): None}

    def bench(cfg):
        if times[cfg["N"], cfg["W"]] is None:
            raise RuntimeError("out of shared memory")  # a lighter config that fails is no candidate
        return times[cfg["N"], cfg["W"]]
    monkeypatch.setattr(autotune, "gpu_time_ms", lambda fn: fn())
    monkeypatch.setenv("LLMC_TUNE_THREADS", "0")
    cands = [{"N": n, "W": w} for n, w in times]
    warps = lambda cfg: cfg["W"]  # noqa: E731
    rec = Tuner.tune(cands, bench, None, lighter=warps, within=0.02)
    assert rec.config == {"N": 64, "W": 4} and rec.triton_ms == 1.007
    assert Tuner.tune(cands, bench, None, lighter=warps, within=0.004).config == {"N": 128, "W": 8}
    assert Tuner.tune(cands, bench, None).config == {"N": 128, "W": 8}


def test_a_source_loaded_by_threads_at_once_is_one_module():
    """A warm-up's threads all ask for their kernel's module at once: they get one module (whose JIT
    functions then hold every config compiled), and one set of timing inputs."""
    import threading
    import uuid

    from llmc.codegen.cache import load_source
    source = f"# {uuid.uuid4()}\nVALUE = 7\n"
    got, start = [], threading.Barrier(8)

    def load():
        start.wait(timeout=10)
        got.append(load_source(source, "threads"))
    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len({id(m) for m in got}) == 1 and got[0].VALUE == 7
    io = autotune.timing_io(("1", "2"), 8, 4, torch.float32, "cpu")
    made = []
    threads = [threading.Thread(target=lambda: made.append(io())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(m is made[0] for m in made) and [x.shape[0] for x, _ in made[0]] == [1, 2]


def test_each_shipped_table_is_named_for_the_kernel_sources_here(monkeypatch):
    """A shipped table's name is the cache name its GPU, Triton version and joint buckets give with the kernel
    sources of this tree: otherwise no compile reads it. A kernel change must remake the table (or, where no
    kernel the table holds a choice for changed, rename it to the name this test prints)."""
    import json

    import triton
    tables = sorted((Path(autotune.__file__).parent / "tuned").glob("*.json"))
    assert tables
    for table in tables:
        meta = json.loads(table.read_text())
        monkeypatch.setattr(triton, "__version__", meta["triton"])
        want = autotune.cache_file(meta["device"], meta["joint_buckets"]).name
        assert table.name == want, f"{table.name}: the kernel sources now give {want}"
