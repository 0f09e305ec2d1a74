"""benchmarks/persistent_linears.py times a layer's int4 linears run as one persistent kernel against one launch a
linear: its GEMV must compute each linear (checked against torch), and both ways of running must give the same
bits (else the timings compare different work)."""
import pytest
import torch

from tests.scripts import BENCHMARKS, load_script

# a small decoder: hidden 256, intermediate 512, q/k/v 384 wide; K splits that leave some splits empty
SHAPE = dict(hidden=256, inter=512, qkv=384)
SPLITS = {"qkv": 2, "o_proj": 1, "gate_up": 1, "down": 3}


@pytest.fixture(scope="module")
def pl():
    return load_script("persistent_linears", BENCHMARKS)


def test_each_linear_matches_torch(pl):
    chain = pl.Chain(**SHAPE, layers=1, splits=SPLITS, block_n=32, device="cpu")
    errors = pl.phase_errors(chain, pl.launch_calls(chain, 32, 4, 3, pdl=False))
    assert chain.phases == ["qkv", "o_proj", "gate_up", "down"]
    # bf16 outputs; gate/up's SwiGLU multiplies two bf16-rounded sums
    assert max(errors) < 0.02, errors


@pytest.mark.parametrize("block_w", [16, 32])
def test_persistent_kernel_gives_the_launches_bits(pl, block_w):
    chain = pl.Chain(**SHAPE, layers=2, splits=SPLITS, block_n=32, device="cpu")
    for call in pl.launch_calls(chain, block_w, 4, 3, pdl=False):
        call()
    want = chain.output()
    assert want.float().abs().max() > 0
    for _ in range(2):  # the second run on the counters the first one left: each run resets them
        chain.act[chain.hidden:] = 0
        pl.persistent_call(chain, 1, block_w, 4, 3, 0)()  # one program: its grid barriers never wait on another
        assert torch.equal(chain.output(), want)
        assert chain.bar.tolist() == [0, 0, 0] and int(chain.count.sum()) == 0


def test_splits_give_each_linear_a_few_items_a_multiprocessor(pl):
    shapes = [("qkv", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
    splits = pl.default_splits(shapes, 64, 132)
    assert splits == {"qkv": 4, "o_proj": 4, "gate_up": 1, "down": 6}
