"""The int4 peer of benchmarks/peer_int4_decode.py computes what it claims: int4 g128 weights with zero points
through torch's int4 kernel (its CPU form here), so that its speed is that of a correct int4 model."""
import torch
from torch import nn

from tests.scripts import BENCHMARKS, load_script


def test_peer_int4_linear_is_the_dequantized_product():
    peer = load_script("peer_int4_decode", BENCHMARKS)
    torch.manual_seed(0)
    lin = nn.Linear(512, 96, bias=False).to(torch.bfloat16)
    q = peer.Int4Linear(lin, group=128, keep_reference=True)
    assert q.check() < 1e-2  # the kernel against x @ dequantized(W).T
    w = lin.weight.float()
    # the dequantized weight is W's min-max int4 rounding: within half a step of each group's scale
    step = (w.reshape(96, 4, 128).amax(-1) - w.reshape(96, 4, 128).amin(-1)) / 15
    err = (q.reference - w).abs().reshape(96, 4, 128).amax(-1)
    assert bool((err <= step / 2 + 1e-3).all())
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    assert q(x).shape == (3, 96)


def test_peer_quantizes_every_linear_the_group_divides():
    peer = load_script("peer_int4_decode", BENCHMARKS)
    model = nn.Sequential(nn.Linear(256, 128, bias=False), nn.Linear(128, 96, bias=False),
                          nn.Linear(96, 64, bias=False)).to(torch.bfloat16)
    count, worst = peer.quantize(model, 128)
    assert count == 2 and worst < 1e-2
    assert isinstance(model[0], peer.Int4Linear) and isinstance(model[2], nn.Linear)
