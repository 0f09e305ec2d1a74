"""Triton kernels compiled for sm_90 without a GPU, one after another, on threads and on processes: whether
the GIL holds a compile's kernel compiles (the tuning phase warms them up on threads, autotune.run_on_threads).

    python3 benchmarks/compile_threads.py [--workers 2] [--runs 2]
"""
import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = [(16, 64, 128, split_k, m_tiles) for split_k in (1, 2, 4) for m_tiles in (1, 2)]


def compile_one(cfg) -> float:
    """Compile the bf16 generated matmul at one (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, M_TILES); seconds."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from llmc.codegen.kernels import load
    from llmc.codegen.matmul import MatmulSpec
    fn = load(MatmulSpec("bf16", False, ())).matmul_kernel
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "count_ptr": "*i32",
           "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "M": "i32", "N": "i32", "K": "i32",
           "prefetch_k": "i32"}
    consts = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "M_TILES"), cfg))
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    t = time.perf_counter()
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    for run in range(a.runs):
        for how in ("serial", "threads", "processes"):
            os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-")  # every compile from nothing
            t = time.perf_counter()
            if how == "serial":
                [compile_one(c) for c in CONFIGS]
            else:
                pool = ThreadPoolExecutor(a.workers) if how == "threads" else \
                    ProcessPoolExecutor(a.workers, mp_context=mp.get_context("fork"))
                with pool:
                    list(pool.map(compile_one, CONFIGS))
            print(f"run {run} {how:9s} {len(CONFIGS)} kernels {time.perf_counter() - t:6.2f} s", flush=True)


if __name__ == "__main__":
    main()
