"""The int4 wgmma GEMV and its tall form (llmc/codegen/qwgmma.py, Gluon): its weight layout on the CPU, its compile
for sm_90 on any machine, and its sums against the qlinear reference on an sm_90 GPU (`TRITON_INTERPRET=0 pytest
tests/codegen/test_qwgmma.py`; Gluon kernels do not run under Triton's interpreter)."""
from __future__ import annotations

import pytest
import torch

from llmc.codegen import qmatmul as qm
from llmc.codegen import qwgmma
from llmc.codegen.kernels import load
from llmc.errors import CompileError
from llmc.ir import quant
from llmc.ir.quant import QuantFormat, quantize_rtn

G128 = QuantFormat("int", 4, 128)
ON_HOPPER = torch.cuda.is_available() and qwgmma.runs_here(torch.device("cuda"))


def prepared(n: int, k: int, fmt: QuantFormat = G128, device: str = "cpu", seed: int = 0) -> qm.PreparedQWeight:
    g = torch.Generator().manual_seed(seed)
    qw = quantize_rtn(torch.randn(n, k, generator=g), fmt)
    return qm.prepare(qw.fmt, *(t.to(device) if t is not None else None for t in (qw.qweight, qw.scales, qw.zeros)))


def test_pack_round_trips_and_puts_each_code_where_word_position_says():
    codes = torch.randint(0, 16, (128, 384), dtype=torch.int32)
    words = qwgmma.pack(codes)
    assert words.dtype == torch.int32 and words.numel() == 128 * 384 // 8
    assert torch.equal(qwgmma.unpack(words, 128, 384), codes)
    rows = torch.arange(128).repeat_interleave(384)
    cols = torch.arange(384).repeat(128)
    word, bit = qwgmma.word_position(rows, cols, 3)
    assert torch.equal((words.to(torch.int64)[word] >> bit) & 15, codes.flatten().to(torch.int64))


@pytest.mark.parametrize("tile_n,tile_k", [(0, 0), (1, 2)])
def test_kernels_op_sequence_reads_each_tile_in_place(tile_n, tile_k):
    """`mirror_operand` repeats the kernel's inline PTX outputs, joins, permute and reshape in torch: on packed
    words it gives back each 64 x 128 tile's codes in place."""
    codes = torch.randint(0, 16, (128, 384), dtype=torch.int32)
    words = qwgmma.pack(codes)
    start = (tile_n * 3 + tile_k) * qwgmma.WORDS_A_TILE
    tile = qwgmma.mirror_operand(words[start:start + qwgmma.WORDS_A_TILE]).to(torch.int32)
    assert torch.equal(tile, codes[64 * tile_n:64 * (tile_n + 1), 128 * tile_k:128 * (tile_k + 1)])


def test_words_come_from_the_prepared_nibble_planes():
    p = prepared(128, 256)
    want = qwgmma.pack(quant.codes(p.fmt, p.canonical().qweight).to(torch.int32))
    assert torch.equal(qwgmma.words_of(p), want)
    assert qwgmma.words_of(p) is qwgmma.words_of(p)  # made once


def test_fits_only_what_the_kernel_computes():
    p = prepared(128, 256)
    assert qwgmma.fits(p, torch.bfloat16, False, "") and qwgmma.fits(p, torch.float16, False, "")
    assert not qwgmma.fits(p, torch.float32, False, "")  # the MMA's operands are 16-bit
    assert not qwgmma.fits(p, torch.bfloat16, True, "") and not qwgmma.fits(p, torch.bfloat16, False, "silu")
    assert not qwgmma.fits(prepared(128, 256, QuantFormat("int", 4, 128, True)), torch.bfloat16, False, "")
    assert not qwgmma.fits(prepared(128, 256, QuantFormat("int", 4, 64)), torch.bfloat16, False, "")
    assert not qwgmma.fits(prepared(96, 256), torch.bfloat16, False, "")  # 64-row tiles
    assert not qwgmma.fits(prepared(128, 256, QuantFormat("int", 8, 128)), torch.bfloat16, False, "")


def test_candidates_split_k_evenly_and_pair_warpgroups_only_over_whole_tiles():
    for n, k in ((28672, 4096), (4096, 14336), (6144, 4096), (192, 384)):
        for c in qwgmma.candidates(n, k):
            assert (k // 128) % c["SPLIT_K"] == 0 and c["SPLIT_K"] <= 16
            assert n % (64 * c["WG"]) == 0 and c["AHEAD"] in (1, 2)
    assert {c["WG"] for c in qwgmma.candidates(192, 384)} == {1}


def test_tall_candidates_cover_whole_tiles_and_split_k_evenly():
    for n, k in ((28672, 4096), (4096, 14336), (6144, 4096), (192, 384)):
        cands = qwgmma.tall_candidates(n, k)
        assert cands and all(c["XN"] in (64, 128) and c["XASYNC"] and c["WGMMA"] for c in cands)
        for c in cands:
            assert (k // 128) % c["SPLIT_K"] == 0 and c["SPLIT_K"] <= 16 and n % (64 * c["WG"]) == 0
    assert {c["WG"] for c in qwgmma.tall_candidates(192, 384)} == {1}
    assert qwgmma.tall_candidates(4096, 14336)[1]["SPLIT_K"] * 2 == qwgmma.tall_candidates(4096, 14336)[0]["SPLIT_K"]
    assert {c["SPLIT_K"] for c in qwgmma.tall_candidates(4096, 14336, qm.LARGE_M)} == {1}  # no [splits, M, N] at prefill


def test_folded_tall_configs_are_timed_unless_switched_off(monkeypatch):
    monkeypatch.delenv("LLMC_QWGMMA_FOLD", raising=False)
    both = qwgmma.tall_candidates(4096, 4096)
    assert any(c.get("FOLD") for c in both) and any(not c.get("FOLD") for c in both)
    monkeypatch.setenv("LLMC_QWGMMA_FOLD", "0")
    assert qwgmma.tall_candidates(4096, 4096) == [c for c in both if not c.get("FOLD")]


def _fake_sm90_tuning(monkeypatch) -> list[list[dict]]:
    """A tuning as on an sm_90 GPU, faked: each group's first candidate wins untimed. Returns the candidate lists
    the tuner was given, one a timed group."""
    from llmc.codegen import autotune
    from llmc.codegen.autotune import Tuner
    monkeypatch.setattr(qwgmma, "runs_here", lambda device: True)
    monkeypatch.setattr(autotune, "can_time", lambda: True)
    timed = []

    def fake_tune(cands, bench, baseline, margin=0.97, lighter=None, within=0.0):
        timed.append(cands)
        return autotune.TuneRecord(dict(cands[0]), triton_ms=0.02)
    monkeypatch.setattr(Tuner, "tune", staticmethod(fake_tune))
    return timed


def _offered(monkeypatch, m: int, joint=None) -> list[dict]:
    """The configs a tuning on a (faked) sm_90 GPU times for an int4 g128 weight at m rows."""
    from llmc.codegen.autotune import Tuner
    timed = _fake_sm90_tuning(monkeypatch)
    monkeypatch.setattr(qm, "_launch", lambda *a, **k: None)
    tuner = Tuner(device="test-gpu") if joint is None else Tuner(device="test-gpu", joint=joint)
    qm.qlinear(torch.zeros(m, 256, dtype=torch.bfloat16), prepared(128, 256), tuner=tuner)
    assert len(timed) == 1
    return timed[0]


@pytest.mark.parametrize("m,joint,tall", [(1, None, False), (64, None, False), (130, None, True),
                                          (700, None, False), (2000, None, False), (32, ("1", "2", "4"), True),
                                          (16, ("1", "2", "4"), False)])
def test_tall_form_is_timed_only_in_buckets_that_share_no_choice(monkeypatch, m, joint, tall):
    """The tall form's rows may depend on their block of x, so the batch-invariant group of 1-64 tokens never times
    it; a bucket of its own of 32 to 128 tokens does (unless `LLMC_QWGMMA_TALL=0`), the 512+ and 1024+ buckets never
    (the library GEMM and the Triton kernel won them). The GEMV is timed only up to 64."""
    monkeypatch.delenv("LLMC_QWGMMA_TALL", raising=False)  # the default
    cands = _offered(monkeypatch, m, joint)
    assert any(c.get("XN") for c in cands) == tall
    assert any(c.get("WGMMA") and not c.get("XN") for c in cands) == (m <= 64)
    assert qm.recorded_config_runs(torch.device("cuda"))(qwgmma.tall_candidates(128, 256)[0])
    monkeypatch.setenv("LLMC_QWGMMA_TALL", "0")
    assert not any(c.get("XN") for c in _offered(monkeypatch, m, joint))
    assert not qm.recorded_config_runs(torch.device("cuda"))(qwgmma.tall_candidates(128, 256)[0])


def test_pipelined_tall_configs_are_timed_only_when_asked(monkeypatch):
    """`PIPE` configs (the folded codes through shared memory, one MMA in flight) are each unfolded tall config
    with the flag; a tuning times them only where `LLMC_QWGMMA_PIPE=1`, and a recorded one runs only there."""
    pipes = qwgmma.pipe_candidates(4096, 14336)
    assert pipes == [dict(c, PIPE=True) for c in qwgmma.tall_candidates(4096, 14336) if not c.get("FOLD")]
    monkeypatch.delenv("LLMC_QWGMMA_PIPE", raising=False)
    assert not any(c.get("PIPE") for c in _offered(monkeypatch, 128))
    assert not qm.recorded_config_runs(torch.device("cuda"))(pipes[0])
    monkeypatch.setenv("LLMC_QWGMMA_PIPE", "1")
    cands = _offered(monkeypatch, 128)
    assert [c for c in cands if c.get("PIPE")] == qwgmma.pipe_candidates(128, 256)
    assert not any(c.get("PIPE") for c in _offered(monkeypatch, 64))  # never in the batch-invariant group
    assert qm.recorded_config_runs(torch.device("cuda"))(pipes[0])
    # its spec renders the folded sums' template with the pipelined loop; a GEMV spec ignores the flag
    assert qwgmma.QWgmmaSpec("bf16", 1, 128, False, True).context()["fold"]
    assert not qwgmma.QWgmmaSpec("bf16", 1, 16, False, True).context()["pipe"]


def test_not_offered_off_hopper_and_refused_there_with_a_clear_error():
    p = prepared(128, 256)
    assert not qwgmma.offered(torch.device("cpu"))
    cfg = {"WGMMA": True, "WG": 1, "AHEAD": 1, "SPLIT_K": 1}
    with pytest.raises(CompileError, match="sm_90"):
        qm.qlinear(torch.randn(1, 256, dtype=torch.bfloat16), p, config=cfg)
    with pytest.raises(CompileError, match="runs on an sm_90 GPU, not on cpu"):
        qm.qlinear(torch.randn(130, 256, dtype=torch.bfloat16), p, config=qwgmma.tall_candidates(128, 256)[0])


def test_switch_keeps_the_tuner_off_it(monkeypatch):
    monkeypatch.setenv("LLMC_QWGMMA", "0")
    assert not qwgmma.offered(torch.device("cuda"))


def test_trial_configs_are_timed_only_when_asked(monkeypatch):
    monkeypatch.delenv("LLMC_QWGMMA_TRY", raising=False)
    assert qwgmma.tuned_candidates(4096, 4096) == qwgmma.candidates(4096, 4096)
    monkeypatch.setenv("LLMC_QWGMMA_TRY", "1")
    both = qwgmma.tuned_candidates(4096, 4096)
    assert [c for c in both if c["WG"] == 4] == qwgmma.trial_candidates(4096, 4096)
    assert [c for c in both if c["WG"] != 4] == qwgmma.candidates(4096, 4096)
    assert qwgmma.trial_candidates(192, 384) == []  # 4 warpgroups only over whole tiles


def test_each_config_is_offered_with_x_loaded_when_used_and_copied_ahead():
    cands = qwgmma.candidates(4096, 4096)
    plain = [c for c in cands if not c.get("XASYNC")]
    assert [c for c in cands if c.get("XASYNC")] == [dict(c, XASYNC=True) for c in plain]
    assert len(plain) == len({tuple(c.items()) for c in plain})


@pytest.mark.parametrize("dtype,warpgroups,rows,fold,pipe", [
    ("bf16", 1, 16, False, False), ("f16", 1, 16, False, False), ("bf16", 2, 16, False, False),
    ("bf16", 4, 16, False, False), ("bf16", 1, 128, False, False), ("f16", 2, 64, False, False),
    ("bf16", 1, 128, True, False), ("f16", 2, 64, True, False), ("bf16", 1, 128, False, True),
    ("f16", 2, 64, False, True)])
def test_kernel_compiles_for_hopper_without_moving_the_operand(dtype, warpgroups, rows, fold, pipe):
    """The rendered kernel compiles for sm_90 on any machine: `convert_layout(..., assert_trivial=True)` fails the
    compile unless the dequantized codes are already where the MMA reads them; PDL's wait is in the PTX, and the
    MMA is as wide as x's rows a program (16 for the GEMV's tiles, 64 or 128 for the tall form). The pipelined
    tall form leaves one MMA in flight (`wgmma.wait_group 1`) and reads its A operand from shared memory."""
    pytest.importorskip("triton.experimental.gluon")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    fn = load(qwgmma.QWgmmaSpec(dtype, warpgroups, rows, fold, pipe), pdl=True).qwgmma_kernel
    fn = getattr(fn, "fn", fn)  # PDLKernel wraps it
    ty = {"bf16": "bf16", "f16": "fp16"}[dtype]
    sig = {"x_ptr": f"*{ty}", "w_ptr": "*i32", "s_ptr": "*bf16", "y_ptr": f"*{ty}", "ws_ptr": "*fp32",
           "count_ptr": "*i32", "stride_xm": "i32", "stride_sn": "i32", "stride_ym": "i32", "M": "i32", "N": "i32",
           "K": "i32", "KSPLIT": "i32", "AHEAD": "constexpr", "M_TILES": "constexpr", "XASYNC": "constexpr"}
    launches = ((1, 1, False), (2, 4, False), (1, 4, True)) if rows == 16 else ((1, rows // 16, True),
                                                                                   (1, rows // 16, False))
    for ahead, m_tiles, xasync in launches:
        consts = {"AHEAD": ahead, "M_TILES": m_tiles, "XASYNC": xasync}
        aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ("x_ptr", "w_ptr", "stride_xm")}
        src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()},
                             attrs=aligned)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4 * warpgroups})
        ptx = k.asm["ptx"]
        assert "griddepcontrol.wait" in ptx and f"wgmma.mma_async.sync.aligned.m64n{rows}k16" in ptx
        assert ("wgmma.wait_group.sync.aligned 1;" in ptx) == pipe


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon's warpgroup MMA needs an sm_90 GPU, compiled")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_sums_match_the_reference_and_rows_do_not_depend_on_m(dtype):
    """Every config against the reference at 1 to 64 rows (one to four x tiles, a ragged last one), and each
    row's sums bit-equal alone, in a 16-row launch and in a 64-row one."""
    p = prepared(256, 1024, device="cuda", seed=1)
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(2)).to(dtype).cuda()
    ref = qm.reference(x.float(), p.fmt, *(t for t in p.canonical().tensors()))
    for cfg in (qwgmma.candidates(256, 1024) + qwgmma.trial_candidates(256, 1024)
                + [{"WGMMA": True, "WG": 1, "AHEAD": 1, "SPLIT_K": 8}]):
        together = qm.qlinear(x, p, config=cfg)
        assert ((together.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2, cfg
        for m in (1, 3, 16, 40):
            assert torch.equal(qm.qlinear(x[:m], p, config=cfg), together[:m]), (cfg, m)
        assert torch.equal(qm.qlinear(x[37:38], p, config=cfg), together[37:38]), cfg


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon's warpgroup MMA needs an sm_90 GPU, compiled")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fold", [False, True], ids=["scaled", "fold"])
def test_gpu_tall_form_matches_the_reference_at_any_rows(dtype, fold):
    """Every tall config against the reference at ragged row counts (one block of x and several, a last one
    partly empty), with K splits, and with x whose rows are not 16-byte aligned (loaded through registers)."""
    p = prepared(384, 2048, device="cuda", seed=6)
    x = torch.randn(300, 2049, generator=torch.Generator().manual_seed(7)).to(dtype).cuda()
    split = {"WGMMA": True, "XN": 64, "WG": 2, "AHEAD": 1, "SPLIT_K": 4, "XASYNC": True, **({"FOLD": True} if fold else {})}
    for cfg in [c for c in qwgmma.tall_candidates(384, 2048) if bool(c.get("FOLD")) == fold] + [split]:
        for m in (33, 128, 130, 300):
            for xs in (x[:m, :2048], x[:m, 1:]):
                ref = qm.reference(xs.float(), p.fmt, *(t for t in p.canonical().tensors()))
                y = qm.qlinear(xs, p, config=cfg)
                assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2, (cfg, m, xs.data_ptr() % 16)
        assert torch.equal(qm.qlinear(x[:130, :2048], p, config=cfg),
                           qm.qlinear(x[:130, :2048].contiguous(), p, config=cfg)), cfg


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon's warpgroup MMA needs an sm_90 GPU, compiled")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_pipelined_tall_form_sums_as_the_folded_one(dtype):
    """Each `PIPE` config against the reference and bit for bit against the same config folded (the same products
    in the same order), at ragged row counts, with K splits, and with x loaded through registers (rows not 16-byte
    aligned)."""
    p = prepared(384, 2048, device="cuda", seed=8)
    x = torch.randn(300, 2049, generator=torch.Generator().manual_seed(9)).to(dtype).cuda()
    split = {"WGMMA": True, "XN": 64, "WG": 2, "AHEAD": 1, "SPLIT_K": 4, "XASYNC": True, "PIPE": True}
    for cfg in qwgmma.pipe_candidates(384, 2048) + [split]:
        folded = {k: v for k, v in cfg.items() if k != "PIPE"} | {"FOLD": True}
        for m in (33, 128, 130, 300):
            for xs in (x[:m, :2048], x[:m, 1:]):
                ref = qm.reference(xs.float(), p.fmt, *(t for t in p.canonical().tensors()))
                y = qm.qlinear(xs, p, config=cfg)
                assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2, (cfg, m)
                assert torch.equal(y, qm.qlinear(xs, p, config=folded)), (cfg, m, xs.data_ptr() % 16)


def test_a_plan_makes_the_words_its_tuned_choices_launch(monkeypatch):
    """`qmatmul.ready_layouts` makes the words when a plan is built (before the KV cache takes the memory left),
    only for a weight whose recorded choices launch this kernel."""
    from llmc.codegen.autotune import Tuner
    monkeypatch.setattr(qwgmma, "runs_here", lambda device: True)
    chosen, other = prepared(128, 256, seed=3), prepared(128, 256, seed=4)
    key = qm.QMatmulSpec.of(chosen, torch.bfloat16, False, "").key(128, 256)
    rec = {"config": {"WGMMA": True, "WG": 1, "AHEAD": 1, "SPLIT_K": 1}, "triton_ms": 0.01, "cublas_ms": None,
           "prefer_cublas": False}
    tuner = Tuner({key: {"1": rec}}, frozen=True)
    qm.ready_layouts(other, Tuner({}, frozen=True), torch.bfloat16, False, "")
    assert id(other.qweight) not in qwgmma._WORDS
    qm.ready_layouts(chosen, tuner, torch.bfloat16, False, "")
    assert id(chosen.qweight) in qwgmma._WORDS
    qm.ready_layouts(chosen, None, torch.bfloat16, False, "")  # no tuner: nothing to read, nothing made


def test_a_switched_off_kernels_records_are_timed_afresh_and_make_no_words(monkeypatch):
    """`LLMC_QWGMMA=0` keeps the kernel out of a compile whose tuning cache or shipped table recorded it: the
    record is refused (`recorded_config_runs`), the group timed again and its records replaced; no words are made
    for it. An artifact's frozen records still run as compiled."""
    from llmc.codegen.autotune import Tuner
    timed = _fake_sm90_tuning(monkeypatch)
    p = prepared(128, 256, seed=5)
    key = qm.QMatmulSpec.of(p, torch.bfloat16, False, "").key(128, 256)
    wgmma = {"WGMMA": True, "WG": 1, "AHEAD": 1, "SPLIT_K": 1}
    group = ("1", "2", "4")
    records = lambda: {key: {b: {"config": dict(wgmma), "triton_ms": 0.01} for b in group}}  # noqa: E731
    plain = [{"BLOCK_N": 64}]
    device = torch.device("cuda")

    monkeypatch.setenv("LLMC_QWGMMA", "1")
    assert Tuner(records()).choose(key, group, plain, bench=None, accept=qm.recorded_config_runs(device)) == wgmma
    assert timed == []

    monkeypatch.setenv("LLMC_QWGMMA", "0")
    t = Tuner(records())
    assert t.choose(key, group, plain, bench=None, accept=qm.recorded_config_runs(device)) == plain[0]
    assert len(timed) == 1 and all(t.lookup(key, b).config == plain[0] for b in group)
    qm.ready_layouts(p, Tuner(records()), torch.bfloat16, False, "")
    assert id(p.qweight) not in qwgmma._WORDS
    frozen = Tuner(records(), frozen=True)
    assert frozen.choose(key, group, plain, bench=None, accept=qm.recorded_config_runs(device)) == wgmma
    monkeypatch.delenv("LLMC_QLINEAR_TMA", raising=False)  # TMA configs alike: off unless asked
    assert not qm.recorded_config_runs(device)({"BLOCK_N": 64, "TMA": True})
    monkeypatch.setenv("LLMC_QLINEAR_TMA", "1")
    assert qm.recorded_config_runs(device)({"BLOCK_N": 64, "TMA": True})


def test_shipped_int4_choices_are_configs_the_tuner_offers():
    """Every qlinear choice of the shipped tables (int4 g128) is one this tree's tuning would time for its key and
    bucket: a table carried over a kernel change (renamed with the sources) must not hold a config the kernels
    no longer take."""
    import json
    import re

    from llmc.codegen import autotune
    pack = prepared(64, 256).pack  # the pack tile's columns: the format's, not the shape's
    seen = 0
    for table in sorted(autotune.SHIPPED_DIR.glob("*.json")):
        data = json.loads(table.read_text())
        joint = data["joint_buckets"]
        for key, by_bucket in data["kernels"].items():
            if not key.startswith("qlinear[w4a16-g128,"):
                continue
            n, k = map(int, re.search(r"N(\d+)K(\d+)$", key).groups())
            for bucket, rec in by_bucket.items():
                offered = qm.candidates(bucket, n, k, pack, bucket in joint) + qwgmma.candidates(n, k)
                if bucket not in joint and autotune.bucket_size(bucket) >= qwgmma.TALL_MIN_ROWS:
                    offered += qwgmma.tall_candidates(n, k, autotune.bucket_size(bucket))
                if autotune.bucket_size(bucket) <= qm.GEMV_ROWS:
                    offered += qm.gemv_candidates(n, k)
                if autotune.bucket_size(bucket) >= 128:
                    offered.append({"LIBRARY": "dequant"})
                assert rec["config"] in offered, (table.name, key, bucket, rec["config"])
                seen += 1
    assert seen  # the H200 table ships the 8B int4 linears' choices
