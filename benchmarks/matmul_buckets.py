"""The Llama-3.2-1B linears at every decode bucket: cuBLAS against the generated matmul's candidates.

For each shape and each M of the joint buckets (1..64 tokens, which share one choice so that a
row's sums do not depend on its batch), the cuBLAS time and the best candidate's, then the joint
verdict the tuner makes on the summed times. Each kernel is timed as a CUDA graph with its weight
hot in L2 (as the tuner times it). Usage: PYTHONPATH=. python benchmarks/matmul_buckets.py
"""
import torch

from llmc.codegen.autotune import JOINT_BUCKETS, JOINT_MARGIN, bucket_size, gpu_time_ms
from llmc.codegen.matmul import MatmulSpec, _launch, candidates, reference

torch.manual_seed(0)
DT = torch.bfloat16
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def main():
    spec = MatmulSpec("bf16", False, ())
    cands = candidates("1", True)
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, dtype=DT, device="cuda") * 0.02
        print(f"== {name} N={N} K={K}: weight {N * K * 2 / 1e6:.1f} MB")
        per, cublas = {}, 0.0
        for b in JOINT_BUCKETS:
            m = bucket_size(b)
            xi = torch.randn(m, K, dtype=DT, device="cuda")
            yi = torch.empty(m, N, dtype=DT, device="cuda")
            c = gpu_time_ms(lambda: reference(xi, w, None, (), yi)) * 1e3
            cublas += c
            for i, cfg in enumerate(cands):
                try:
                    per[i, m] = gpu_time_ms(lambda: _launch(spec, xi, w, None, yi, cfg)) * 1e3
                except Exception:  # out of resources for this tile: not a candidate
                    per[i, m] = float("inf")
            best = min(range(len(cands)), key=lambda i: per[i, m])
            print(f"  M={m:3d} cuBLAS {c:7.2f} us  best generated {per[best, m]:7.2f} us  {cands[best]}")
        total = {i: sum(per[i, bucket_size(b)] for b in JOINT_BUCKETS) for i in range(len(cands))}
        i = min(total, key=total.get)
        verdict = "cuBLAS" if total[i] > JOINT_MARGIN * cublas else "generated"  # as Tuner.tune decides
        print(f"  joint (sum over M): cuBLAS {cublas:.1f} us, best generated {total[i]:.1f} us "
              f"({per[i, 1]:.2f} us at M=1): {verdict}")


if __name__ == "__main__":
    main()
