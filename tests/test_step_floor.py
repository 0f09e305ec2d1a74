"""benchmarks/step_floor.py models the 8B decode step that llmc runs: its kernels, in the profile's counts, with
the bytes each moves; and its streaming kernel reads every word it is given (else its timings mean nothing)."""
import collections

import pytest

from llmc.ir.quant import QuantFormat
from tests.scripts import BENCHMARKS, load_script


@pytest.fixture(scope="module")
def floor():
    return load_script("step_floor", BENCHMARKS)


def test_step_has_the_profiles_kernels(floor):
    shape = floor.SHAPES["8b"]
    kinds = collections.Counter(name for name, _ in floor.step_kernels(shape, floor.INT4, 192))
    # the batch-1 profile of the int4 step: 129 quantized GEMMs (4 a layer and the LM head), 65 norms
    # (2 a layer and the final one), one rope/K-V write and one attention a layer
    assert kinds["qkv"] + kinds["o_proj"] + kinds["gate_up"] + kinds["down"] + kinds["lm_head"] == 129
    assert kinds["norm"] == 65 and kinds["rope_kv"] == 32 and kinds["attention"] == 32
    assert sum(kinds.values()) == 293


def test_weight_bytes_follow_the_format(floor):
    shape = floor.SHAPES["8b"]
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    bf16 = dict(floor.step_kernels(shape, None, 0))
    int4 = dict(floor.step_kernels(shape, QuantFormat("int", 4, 128), 0))
    rows = (h + 2 * inter) * 2  # one row in, two out
    assert bf16["gate_up"] == h * 2 * inter * 2 + rows
    # 4 bits a weight and a bf16 scale a group of 128
    assert int4["gate_up"] == h * 2 * inter // 2 + (h // 128) * 2 * inter * 2 + rows
    chains = floor.chains(shape, 192)
    total = sum(b for _, b in chains["int4"])
    assert chains["one"] == [("all", total)] and sum(b for _, b in chains["empty"]) == 0
    assert 3.8e9 < total < 4.0e9 and 14.9e9 < sum(b for _, b in chains["bf16"]) < 15.2e9


def test_attention_reads_the_context(floor):
    shape = floor.SHAPES["8b"]
    a0 = dict(floor.step_kernels(shape, None, 0))["attention"]
    a1 = dict(floor.step_kernels(shape, None, 100))["attention"]
    assert a1 - a0 == 100 * shape["num_key_value_heads"] * shape["head_dim"] * 2 * 2  # K and V in bf16


@pytest.mark.parametrize("programs,block", [(1, 1024), (3, 1024), (5, 2048)])
def test_stream_kernel_reads_every_word(floor, programs, block):
    got, want = floor.summed("cpu", programs, block)
    assert got == want


@pytest.mark.parametrize("ahead,load_poll", [(0, False), (1, True), (2, False)])
def test_persistent_kernel_reads_every_word_of_every_phase(floor, ahead, load_poll):
    # phases of ragged, empty and one-word sizes; one program, so its grid barriers never wait on another
    sizes = [5000, 0, 17, 3000, 1]
    got, want, waits_out = floor.persistent_summed(sizes, "cpu", programs=1, block=256, ahead=ahead,
                                                   load_poll=load_poll)
    assert got == want and waits_out == 0


@pytest.mark.parametrize("load_poll", [False, True])
def test_persistent_kernel_counts_barrier_waits_that_run_out(floor, load_poll):
    # the interpreter runs programs one after another: the first program's waits run out of polls, the sums stay
    # whole, and the counters are reset for the next launch (persistent_summed launches twice)
    got, want, waits_out = floor.persistent_summed([5000, 300, 17, 3000], "cpu", programs=3, block=128, ahead=2,
                                                   limit=3, load_poll=load_poll)
    assert got == want and waits_out == 6
