"""The MoE grouped-GEMM kernels against the `moe` op's reference, on ragged shapes: experts that get no
tokens, a single decode token, more tokens than a row block, and a slice of the experts (expert parallel)."""
import pytest
import torch

from llmc.codegen.moe import moe, sort_by_expert
from llmc.ir.moe import moe_ref
from tests.codegen.conftest import library_interpreted

pytestmark = pytest.mark.skipif(not library_interpreted() and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 before triton is imported, or a GPU")
DEVICE = "cpu" if library_interpreted() else "cuda"
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def weights(E, E_local, H, I, seed=0):
    """Router and stacked experts (fp32), and the generator for the tokens."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g)
    gate_up = torch.randn(E_local, 2 * I, H, generator=g) * H ** -0.5
    down = torch.randn(E_local, H, I, generator=g) * I ** -0.5
    return router, gate_up, down, g


def tokens(T, H, router, starved, g):
    """T tokens; the router rows of the `starved` experts point away from all of them, so that no token
    routes there (those experts get no row block, and their weights are never read)."""
    x = torch.randn(T, H, generator=g)
    if starved:
        direction = x.mean(0)
        for e in starved:
            router[e] = -8 * direction / direction.norm()
        x = x + 2 * direction / direction.norm()
    return x


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("T,E,E_local,start,top_k,starved", [
    (1, 8, 8, 0, 2, ()),  # one decode token: 2 of 8 experts run, 6 row blocks exit at once
    (5, 4, 4, 0, 2, (1,)),  # expert 1 gets no token
    (37, 8, 8, 0, 3, (0, 2, 4, 5, 6)),  # five empty experts; the other three fill several 16-row blocks each
    (23, 6, 3, 2, 2, ()),  # experts 2..4 of 6 held here: the others' choices add nothing
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_reference(T, E, E_local, start, top_k, starved, dtype):
    H, I = 64, 48
    router, gate_up, down, g = weights(E, E_local, H, I)
    x = tokens(T, H, router, starved, g)
    if starved:
        _, ids = torch.topk(x @ router.T, top_k, dim=-1)
        assert not any((ids == e).any() for e in starved)
    args = [t.to(DEVICE, dtype) for t in (x, router, gate_up, down)]
    for norm, rounded in ((True, False), (False, True)):
        want = moe_ref(*args, top_k, norm, rounded, start)
        got = moe(*args, top_k, norm, rounded, start)
        assert got.shape == want.shape and got.dtype == dtype
        assert rel_err(got, want) <= TOL[dtype], (norm, rounded)


def test_writes_into_given_output_with_leading_dims():
    H, I, E = 32, 16, 4
    router, gate_up, down, g = weights(E, E, H, I)
    x = torch.randn(1, 7, H, generator=g).to(DEVICE)
    args = [x] + [t.to(DEVICE) for t in (router, gate_up, down)]
    out = torch.full_like(x, float("nan"))
    assert moe(*args, 2, True, out=out) is out
    assert rel_err(out, moe_ref(*args, 2, True)) <= 1e-4


def test_sort_by_expert_groups_and_pads():
    ids = torch.tensor([[3, 0], [0, 5], [3, 2], [0, 3], [4, 1]])  # 5 tokens, top-2, experts 2..4 local
    rows, block_expert = sort_by_expert(ids, expert_start=2, num_local=3, block_m=4)
    A, P = ids.numel(), rows.numel()
    assert P == 4 * -(-(A + 3 * 3) // 4) and block_expert.numel() == P // 4
    flat = ids.reshape(-1)
    blocks = rows.view(-1, 4)
    for b, e in enumerate(block_expert.tolist()):
        real = [r for r in blocks[b].tolist() if r < A]
        if e == 3:  # past the last group: nothing but padding
            assert not real
            continue
        assert all(flat[r] == e + 2 for r in real) and real == sorted(real)
    # every local assignment appears exactly once; the other experts' never
    local = sorted(i for i, e in enumerate(flat.tolist()) if 2 <= e < 5)
    assert sorted(r for r in rows.tolist() if r < A) == local
    assert block_expert.tolist()[:3] == [0, 1, 2]  # expert 2: 1 choice, expert 3: 3, expert 4: 1
