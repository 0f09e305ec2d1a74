"""benchmarks/gluon_int4_lab.py: its kernels compile for sm_90 with their operand conversion free of data movement,
and its comparison against qlinear_probe.py. Its packing is llmc's (tests/codegen/test_qwgmma.py checks it)."""
import pytest

from tests.scripts import BENCHMARKS, load_script


@pytest.fixture(scope="module")
def lab():
    return load_script("gluon_int4_lab", BENCHMARKS)


def test_kernel_compiles_for_hopper_without_moving_the_operand(lab):
    pytest.importorskip("triton.experimental.gluon")
    counts = lab.sass_counts("sub")  # convert_layout(..., assert_trivial=True) fails the compile otherwise
    assert counts["opcodes"].get("HGMMA", 0) == 8  # a 64 x 128 tile: 8 MMAs of K 16
    # no byte permutes: each code's register is where the MMA reads it
    assert counts["opcodes"].get("PRMT", 0) == 0 and counts["per_code"] < 3.0


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
