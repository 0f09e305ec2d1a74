"""benchmarks/gluon_int4_lab.py's int4 layout: the host packing is the one the kernel's loads, joins, permute and
reshape read, and the kernel compiles for sm_90 with its operand conversion free of data movement."""
import pytest
import torch

from tests.scripts import BENCHMARKS, load_script


@pytest.fixture(scope="module")
def lab():
    return load_script("gluon_int4_lab", BENCHMARKS)


def test_pack_round_trips(lab):
    codes = torch.randint(0, 16, (128, 384), dtype=torch.int32)
    words = lab.pack(codes)
    assert words.numel() == 128 * 384 // 8
    assert torch.equal(lab.unpack(words, 128, 384), codes)


@pytest.mark.parametrize("tile_n,tile_k", [(0, 0), (1, 2)])
def test_kernels_op_sequence_reads_each_tile_in_place(lab, tile_n, tile_k):
    codes = torch.randint(0, 16, (128, 384), dtype=torch.int32)
    words = lab.pack(codes)
    start = (tile_n * 3 + tile_k) * lab.WORDS_A_TILE
    tile = lab.mirror_dequant(words[start:start + lab.WORDS_A_TILE]).to(torch.int32)
    assert torch.equal(tile, codes[64 * tile_n:64 * (tile_n + 1), 128 * tile_k:128 * (tile_k + 1)])


def test_kernel_compiles_for_hopper_without_moving_the_operand(lab):
    pytest.importorskip("triton.experimental.gluon")
    counts = lab.sass_counts("sub")  # convert_layout(..., assert_trivial=True) fails the compile otherwise
    assert counts["opcodes"].get("HGMMA", 0) == 8  # a 64 x 128 tile: 8 MMAs of K 16
    # no byte permutes: each code's register is where the MMA reads it
    assert counts["opcodes"].get("PRMT", 0) == 0 and counts["per_code"] < 3.0


def test_pack_puts_each_code_where_word_position_says(lab):
    codes = torch.randint(0, 16, (128, 256), dtype=torch.int32)
    words = lab.pack(codes).to(torch.int64)
    rows = torch.arange(128).repeat_interleave(256)
    cols = torch.arange(256).repeat(128)
    word, bit = lab.word_position(rows, cols, 2)
    assert torch.equal((words[word] >> bit) & 15, codes.flatten().to(torch.int64))


def test_compare_takes_each_sides_fastest_checked_run(lab):
    lab_rows, probe_rows = [], []
    for shape in lab.SHAPES:
        lab_rows += [{"shape": shape, "m": 1, "variant": "xall", "split": 2, "us": 10.0, "rel_err": 1e-3},
                     {"shape": shape, "m": 1, "variant": "xraw", "split": 4, "us": 5.0, "rel_err": 0.5},  # wrong bits
                     {"shape": shape, "m": 1, "variant": "sub", "split": 1, "error": "no"}]
        probe_rows += [{"shape": shape, "m": 1, "format": "int4-g128", "variant": v, "us": us}
                       for v, us in (("default", 20.0), ("split2", 15.0))]
    rows = lab.compare(lab_rows, probe_rows)
    per = [r for r in rows if r["shape"] == "qkv"][0]
    assert per["gluon_us"] == 10.0 and per["qlinear_us"] == 15.0 and per["speedup"] == 1.5
    layer = rows[-1]
    assert layer["shape"] == "a layer" and layer["gluon_us"] == 40.0 and layer["qlinear_us"] == 60.0
