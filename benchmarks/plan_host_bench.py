"""Host time of one eager run of a lowered plan (prefills and mixed steps run eagerly; decode steps
replay CUDA graphs): every generated-kernel launch and GEMM replaced by a no-op, so what is timed
is llmc's Python between launches (the plan loop, the buffer plan's views, the kernel wrappers).
Triton's own launch cost comes on top on a GPU. Compare commits side by side on one machine.

    python benchmarks/plan_host_bench.py [--artifact tiny-py.llmc]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are Python objects we can stub
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", default=None, help="a compiled artifact (default: builtin:tiny-py, compiled)")
    ap.add_argument("--runs", type=int, default=200)
    a = ap.parse_args()
    from triton.runtime.interpreter import InterpretedFunction
    InterpretedFunction.__getitem__ = lambda self, grid: (lambda *args, **kw: None)  # launches cost nothing
    import llmc
    import llmc.codegen.matmul as mm
    from llmc.codegen.lower import Plan
    from llmc.artifact import load_artifact
    from llmc.runtime.executor import StepInput, make_executor

    def no_gemm(x, w, b=None, epilogue=(), out=None):
        return out if out is not None else torch.empty(x.shape[:-1] + (w.shape[0],), dtype=x.dtype)
    mm.reference = no_gemm
    art = load_artifact(a.artifact) if a.artifact else llmc.compile("builtin:tiny-py",
                                                                    Path(tempfile.mkdtemp()) / "t.llmc")
    runner = make_executor(art.graph, "triton-interpret", "cpu", num_blocks=256)
    plan = Plan(art.graph, "cpu")

    def inputs(T):
        return runner.build_inputs([StepInput(list(range(1, T + 1)), 0, list(range(-(-T // 16))))]), \
            {"max_seqlen_q": T, "max_seqlen_k": T}
    rows = []
    for label, cases in (("same T=1 every run", [inputs(1)]), ("same T=128 every run", [inputs(128)]),
                         ("a new T every run (100..163)", [inputs(T) for T in range(100, 164)])):
        for i, h in cases[:3]:
            plan.run(i, h)
        n = max(a.runs, len(cases))
        t = time.perf_counter()
        for k in range(n):
            plan.run(*cases[k % len(cases)])
        rows.append((label, (time.perf_counter() - t) / n))
    print(f"{len(plan.steps)} steps per run")
    for label, dt in rows:
        print(f"{label:30s} {dt * 1e3:7.3f} ms per run ({dt * 1e6 / len(plan.steps):5.1f} us per step)")


if __name__ == "__main__":
    main()
