"""fuse_act_quant: W8A8 / FP8 activation codes made by the op before the linears (norms, SwiGLU).

The rewrite on a compiled tiny Llama (every norm or SwiGLU product that feeds only w8a8 / fp8
linears is fused, the rest left), the fused model's prompt log-probabilities equal to the unfused model's bit for bit
(reference backend), and the fused kernels against the reference backend under the Triton
interpreter."""
from __future__ import annotations

import pytest
import torch

import llmc
from llmc.passes.fuse_act_quant import FuseActQuant
from llmc.passes.manager import PassResult
from llmc.runtime.llm import LLM, SamplingParams

SQ = {"method": "smoothquant", "calib_samples": 8, "calib_len": 32}
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


def _logprobs(art, backend="reference"):
    out = LLM(art, backend=backend).generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor(out.prompt_logprobs[1:])


@pytest.fixture(scope="module")
def fused(llama_dir, tmp_path_factory):
    return llmc.compile(llama_dir, tmp_path_factory.mktemp("nq") / "sq.llmc", quant=SQ, verify=True)


def test_norms_feeding_code_linears_make_the_codes(llama_dir, fused, tmp_path):
    for art, kind in ((fused, "w8a8"), (llmc.compile(llama_dir, tmp_path / "fp8.llmc", quant={"method": "fp8"}), "fp8")):
        ops = art.summary()["op_counts"]
        # per layer the input norm feeds the fused qkv, the post-attention norm the fused gate/up and
        # the SwiGLU product down; o_proj reads attention, and the final norm feeds the dense LM head
        assert ops.get("rms_norm_quant", 0) + ops.get("add_rms_norm_quant", 0) == 2 * 2, ops
        assert ops["silu_mul_quant"] == 2 and ops.get("silu_mul", 0) == 0
        assert ops["qlinear_codes"] == 2 * 3 and ops["qlinear"] == 2
        assert ops.get("add_rms_norm", 0) + ops.get("rms_norm", 0) == 1
        assert all(n.attrs["kind"] == kind for n in art.graph.nodes if n.op.endswith("_quant"))


def test_a_float_gate_up_feeding_a_code_linear_keeps_its_product_for_the_codes(llama_dir, tmp_path):
    """Gate/up kept in the model dtype, down W8A8: the SwiGLU product stays out of the gate/up projection's
    epilogue (fuse_linear_epilogue declines), so that it makes the down projection's codes (silu_mul_quant)."""
    art = llmc.compile(llama_dir, None, quant={**SQ, "skip": ("lm_head", "gate_proj", "up_proj")})
    ops = art.summary()["op_counts"]
    assert ops["silu_mul_quant"] == 2 and "linear_silu_mul" not in ops and ops["linear"] == 2 + 1, ops
    plain = llmc.compile(llama_dir, None, dtype="float32")  # nothing quantized: the product in the epilogue
    assert plain.summary()["op_counts"]["linear_silu_mul"] == 2


def test_fused_equals_unfused_bit_for_bit(llama_dir, fused, tmp_path, monkeypatch):
    monkeypatch.setattr(FuseActQuant, "run", lambda self, graph, ctx: PassResult(graph, changed=False))
    unfused = llmc.compile(llama_dir, tmp_path / "unfused.llmc", quant=SQ)
    assert "qlinear_codes" not in unfused.summary()["op_counts"]
    assert torch.equal(_logprobs(fused), _logprobs(unfused))


def test_kernels_match_the_reference_backend(fused):
    pytest.importorskip("triton")
    from tests.codegen.conftest import library_interpreted
    if not library_interpreted():
        pytest.skip("triton was imported compiled before TRITON_INTERPRET=1 could be set")
    got, want = _logprobs(fused, "triton-interpret"), _logprobs(fused)
    assert (got - want).abs().max() < 1e-3


@pytest.mark.parametrize("kind", ["w8a8", "fp8"])
@pytest.mark.parametrize("dtype,residual", [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_norm_kernel_codes_are_the_unfused_codes(kind, dtype, residual):
    pytest.importorskip("triton")
    from tests.codegen.conftest import library_interpreted
    if not library_interpreted():
        pytest.skip("triton was imported compiled before TRITON_INTERPRET=1 could be set")
    from llmc.codegen.norm import rms_norm_quant
    from llmc.ir.ops import get_op
    from llmc.ir.quant import quantize_activations
    g = torch.Generator().manual_seed(7)
    x, r = (torch.randn(5, 96, generator=g).to(dtype) * 3 for _ in range(2))
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    x[2] = 0  # an all-zero row: the scale's floor
    outs = rms_norm_quant(x, w, kind, 1e-5, residual=r if residual else None)
    a = {"eps": 1e-5, "weight_first_cast": True}
    if residual:
        normed, h = get_op("add_rms_norm").ref([x, r, w], a, None)
        assert torch.equal(outs[2], h)
    else:
        normed = get_op("rms_norm").ref([x, w], a, None)
    codes, scales = quantize_activations(normed, kind)
    assert outs[0].dtype == codes.dtype and torch.equal(outs[0].view(torch.int8), codes.view(torch.int8))
    assert torch.equal(outs[1], scales)


@pytest.mark.parametrize("kind", ["w8a8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel_codes(kind, dtype):
    """silu(gate) * up quantized in one kernel, from strided slices of one [T, 2I] tensor (as the fused
    gate/up linear leaves them): the codes of the fp32 product rounded once to x's dtype, as the
    unfused elementwise kernel stores it (torch's and Triton's sigmoid may differ in the last bit:
    a code may move one step in a rare position)."""
    pytest.importorskip("triton")
    from tests.codegen.conftest import library_interpreted
    if not library_interpreted():
        pytest.skip("triton was imported compiled before TRITON_INTERPRET=1 could be set")
    from llmc.codegen.act_quant import quantize_act
    from llmc.ir.quant import quantize_activations
    g = torch.Generator().manual_seed(3)
    gu = (torch.randn(6, 2 * 80, generator=g) * 2).to(dtype)
    gate, up = gu[:, :80], gu[:, 80:]
    codes, scales = quantize_act(gate, kind, up=up)
    gf, uf = gate.float(), up.float()
    want_codes, want_scales = quantize_activations((gf * torch.sigmoid(gf) * uf).to(dtype), kind)
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    diff = (codes.float() - want_codes.float()).abs()
    step = 1.0 if kind == "w8a8" else want_codes.float().abs().clamp_min(2 ** -6) / 8  # e4m3: 3 mantissa bits
    assert (diff <= step * 1.01).all() and (diff > 0).float().mean() < 0.02


def test_linears_compile_their_recorded_choices_on_threads_before_tuning(llama_dir, tmp_path, monkeypatch):
    """_tune_linears first runs every distinct linear at every decode bucket with the records frozen: once
    here, collecting the kernels they would compile (each distinct one is then compiled once, on threads),
    then on threads (they find their kernels compiled; nothing is timed there); then it tunes each in turn
    with the compile's own tuner."""
    import threading

    from llmc import compiler
    from llmc.codegen import matmul as mm
    from llmc.codegen.autotune import M_BUCKETS, Tuner
    from llmc.ir.ops import FLOAT_LINEARS, linear_weight_inputs
    art = llmc.compile(llama_dir, tmp_path / "f32.llmc")
    calls, lock = [], threading.Lock()

    def linear(x, w, b, epi, tuner, up=None, gated=False):
        with lock:
            calls.append((threading.current_thread().name.startswith("llmc-tune"), tuner.frozen, tuple(w.shape),
                          x.shape[0]))
    monkeypatch.setattr(mm, "linear", linear)
    monkeypatch.setenv("LLMC_TUNE_THREADS", "4")
    compiler._tune_linears(art.graph, Tuner(device="test-gpu"), compiler._Progress(False), device="cpu")
    shapes = {tuple(art.graph.weights[linear_weight_inputs(n)[0].name].shape)
              for n in art.graph.nodes if n.op in FLOAT_LINEARS}
    want = sorted((s, m) for s in shapes for m in M_BUCKETS[:-1])
    collected, first, then = calls[:len(want)], calls[len(want):2 * len(want)], calls[2 * len(want):]
    assert all(frozen and not threaded for threaded, frozen, *_ in collected) and sorted(r[2:] for r in collected) == want
    assert all(threaded and frozen for threaded, frozen, *_ in first) and sorted(r[2:] for r in first) == want
    assert not any(threaded or frozen for threaded, frozen, *_ in then) and sorted(r[2:] for r in then) == want


def test_linears_fed_codes_are_tuned(llama_dir, tmp_path, monkeypatch):
    """Compile tunes the linears whose codes a norm or SwiGLU made (qlinear_codes) as it tunes plain
    quantized linears: each distinct one timed once per bucket with float x of its output dtype (the
    kernel's key), up to the 512+ and 1024+ buckets. Recorded here instead of timed (no GPU)."""
    from llmc import compiler
    from llmc.codegen import matmul as mm
    from llmc.codegen import qmatmul as qmm
    art = llmc.compile(llama_dir, tmp_path / "fp8.llmc", quant={"method": "fp8"})
    calls = []
    monkeypatch.setattr(qmm, "qlinear", lambda x, p, b, act, tuner: calls.append(
        ((p.out_features, p.in_features), x.shape[0], x.dtype)))
    monkeypatch.setattr(mm, "linear", lambda *a, **k: None)
    compiler._tune_linears(art.graph, None, compiler._Progress(False), device="cpu")
    shapes = {tuple(art.graph.weights[n.inputs[2].name].shape) for n in art.graph.nodes if n.op == "qlinear_codes"}
    assert len(shapes) == 3  # qkv, gate/up, down: none was tuned before
    for shape in shapes:
        assert sorted(m for s, m, _ in calls if s == shape) == [1, 2, 4, 8, 16, 32, 64, 128, 512, 1024]
    assert {d for *_, d in calls} == {torch.float32}  # the artifact's dtype, not the codes' int8 / fp8
