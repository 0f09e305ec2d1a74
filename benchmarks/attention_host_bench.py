"""Host time of one eager `paged_attention` call (what a mixed step pays per layer), the kernel launch stubbed out.

A mixed step runs attention eagerly between its piecewise graphs, so the wrapper's Python (specs, launch options,
partial buffers, slices) is paid once per layer and step. Timed on the CPU with `compiled()` returning a module
whose kernels do nothing: an 8B-shaped step of 128 decodes and one 512-token chunk, in one launch and with the
decodes split onto the decode kernel (where the tree has that). Compare trees with PYTHONPATH:

    python3 benchmarks/attention_host_bench.py
    PYTHONPATH=/path/to/older/tree python3 benchmarks/attention_host_bench.py
"""
from __future__ import annotations

import inspect
import time

import torch

import llmc.codegen.attention as attention


class _Kernel:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _Module:
    paged_attention_prefill_kernel = paged_attention_decode_kernel = _Kernel()


def main(calls: int = 3000) -> None:
    attention.compiled = lambda spec: _Module()
    T, Hq, Hkv, D, BS, N = 640, 32, 8, 128, 16, 129
    q = torch.randn(T, Hq, D, dtype=torch.bfloat16)
    kv = torch.randn(2, 200, BS, Hkv, D, dtype=torch.bfloat16)
    qsl = torch.tensor([0, *range(1, 129), 640], dtype=torch.int32)
    lens, tables = torch.full((N,), 1024, dtype=torch.int32), torch.zeros(N, 64, dtype=torch.int32)
    out = torch.empty_like(q)
    kw = dict(out=out, max_seqlen_q=512, max_seqlen_k=1024,
              prefill_tiles=dict(BLOCK_M=64, BLOCK_N=64, num_stages=2, num_warps=4),
              decode_tiles=dict(BLOCK_N=64, num_stages=2, num_warps=4))
    splits = "decode_rows" in inspect.signature(attention.paged_attention).parameters
    for name, extra in [("one launch", {}), *([("decodes split", dict(decode_rows=128, context_limit=4096))]
                                              if splits else [])]:
        run = lambda: attention.paged_attention(q, kv, qsl, lens, tables, D ** -0.5, **kw, **extra)  # noqa: E731
        for _ in range(300):
            run()
        t = time.perf_counter()
        for _ in range(calls):
            run()
        print(f"{name:14s} {(time.perf_counter() - t) / calls * 1e6:6.1f} us a call")


if __name__ == "__main__":
    main()
