"""Split kernels on a GPU: one launch, deterministic, batch-invariant.

Split-K matmul and split-context decode attention combine their partials in the program that
arrives last (an arrival counter per output tile). This checks, on real hardware where programs
do race:
  - every one of `--repeat` launches gives bitwise the same output (no lost or stale partial);
  - the output matches the reference (cuBLAS / torch attention);
  - a row's output is bitwise the same alone and inside a batch (matmul: with the same config;
    attention: the partition does not depend on the batch);
  - the counters are back at zero afterwards.

    python scripts/gpu_check_split.py [--repeat 200]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.codegen.attention import paged_attention  # noqa: E402
from llmc.codegen.kernels import tile_counters  # noqa: E402
from llmc.codegen.matmul import _cfg, matmul, reference  # noqa: E402

ROWS = []


def record(kind, case, ok_repeat, err, tol, ok_batch):
    ok = ok_repeat and err <= tol and ok_batch
    ROWS.append(ok)
    print(f"{kind:9s} {case:44s} repeat {'same' if ok_repeat else 'DIFF'}  err {err:.2e} (tol {tol:.0e})  "
          f"alone==batched {ok_batch}  {'ok' if ok else 'BAD'}", flush=True)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def check_matmul(repeat: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for (N, K) in ((3072, 2048), (2048, 2048), (2048, 8192), (16384, 2048), (128256, 2048)):
        w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
        for split in (1, 2, 4, 8):
            cfg = _cfg(16, 64, 128, split, 4, 4)
            x = torch.randn(64, K, device="cuda", generator=g).to(torch.bfloat16)
            first = matmul(x, w, config=cfg)  # 4 row tiles in each program
            same = all(torch.equal(matmul(x, w, config=cfg), first) for _ in range(repeat))
            err = rel(first, reference(x, w))
            alone = all(torch.equal(matmul(x[i:i + 1], w, config=cfg)[0], first[i]) for i in (0, 7, 15, 40, 63))
            alone &= torch.equal(matmul(x[:8], w, config=cfg), first[:8])
            alone &= torch.equal(matmul(x[:20], w, config=cfg), first[:20])  # 2 row tiles
            record("matmul", f"N={N} K={K} M=64 split-K {split}", same, err, 1e-2, alone)


def make_decode(ctx, Hq, Hkv, D, BS, dtype, g):
    N = len(ctx)
    per = [-(-c // BS) for c in ctx]
    NB = sum(per) + 4
    perm = torch.randperm(NB, device="cuda", generator=g).to(torch.int32)
    bt = torch.zeros(N, max(per), dtype=torch.int32, device="cuda")
    i0 = 0
    for i, nb in enumerate(per):
        bt[i, :nb] = perm[i0:i0 + nb]
        i0 += nb
    cache = torch.randn(2, NB, BS, Hkv, D, device="cuda", generator=g).to(dtype)
    q = torch.randn(N, Hq, D, device="cuda", generator=g).to(dtype)
    return q, cache, torch.arange(N + 1, dtype=torch.int32, device="cuda"), torch.tensor(ctx, dtype=torch.int32,
                                                                                          device="cuda"), bt


def torch_decode(q, cache, lens, bt, scale):
    out = []
    Hq, Hkv = q.shape[1], cache.shape[3]
    for i, L in enumerate(lens.tolist()):
        kv = cache[:, bt[i].long()].flatten(1, 2)[:, :L].float()  # [2, L, Hkv, D]
        k, v = (t.repeat_interleave(Hq // Hkv, dim=1) for t in kv)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i].float(), k) * scale, -1)
        out.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(out).to(q.dtype)


def check_attention(repeat: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    for ctx, max_k in (([4000, 37, 1300, 2048, 9000, 256, 257, 5], 32768), ([130, 700], 2048)):
        q, cache, qsl, lens, bt = make_decode(ctx, 32, 8, 64, 16, torch.bfloat16, g)
        kw = dict(max_seqlen_q=1, max_seqlen_k=max_k)
        first = paged_attention(q, cache, qsl, lens, bt, 64 ** -0.5, **kw)
        same = all(torch.equal(paged_attention(q, cache, qsl, lens, bt, 64 ** -0.5, **kw), first)
                   for _ in range(repeat))
        err = rel(first, torch_decode(q, cache, lens, bt, 64 ** -0.5))
        one = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
        alone = all(torch.equal(paged_attention(q[i:i + 1], cache, one, lens[i:i + 1], bt[i:i + 1], 64 ** -0.5,
                                                **kw)[0], first[i]) for i in range(len(ctx)))
        record("attention", f"decode B={len(ctx)} ctx {min(ctx)}..{max(ctx)} (max {max_k})", same, err, 2e-2, alone)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200)
    a = ap.parse_args()
    check_matmul(a.repeat)
    check_attention(a.repeat)
    torch.cuda.synchronize()
    zero = int(tile_counters(torch.device("cuda"), 1).abs().sum()) == 0
    print(f"counters back at zero: {zero}")
    print(f"{sum(ROWS)}/{len(ROWS)} split checks passed")
    sys.exit(0 if all(ROWS) and zero else 1)


if __name__ == "__main__":
    main()
