"""Kernels compiled on the tuning's warm-up threads (autotune.run_on_threads) with programmatic dependent
launch on and off: each setting in a fresh process with an empty Triton cache, the generated matmul at the
8B qkv shape for the decode buckets, first on threads (failures printed), then each call again on the main
thread (seconds: what the threads left to compile).

    python3 benchmarks/pdl_threads.py
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r'''
import functools, logging, time, torch
logging.basicConfig(level=logging.DEBUG, format="%(name)s %(message)s")
for name in ("torch", "triton"):
    logging.getLogger(name).setLevel(logging.WARNING)
from llmc.codegen import matmul as mm
from llmc.codegen.autotune import run_on_threads
w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16)
xs = [torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) for m in (1, 2, 4, 8, 16, 32, 64)]
t = time.perf_counter()
run_on_threads([functools.partial(mm.matmul, x, w) for x in xs])
threads = time.perf_counter() - t
t = time.perf_counter()
for x in xs:
    mm.matmul(x, w)
torch.cuda.synchronize()
print(f"RESULT threads {threads:.2f} s, then the main thread {time.perf_counter() - t:.2f} s")
'''


def main():
    root = Path(__file__).resolve().parents[1]
    for pdl in ("0", "1"):
        env = {**os.environ, "LLMC_PDL": pdl, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-"),
               "LLMC_CACHE_DIR": tempfile.mkdtemp(prefix="llmc-"), "PYTHONPATH": str(root)}
        r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
        lines = (r.stdout + r.stderr).splitlines()
        print(f"LLMC_PDL={pdl} rc {r.returncode}")
        for line in [l for l in lines if "failed" in l or "RESULT" in l or "Error" in l][:12]:
            print("   ", line[:300])


if __name__ == "__main__":
    main()
