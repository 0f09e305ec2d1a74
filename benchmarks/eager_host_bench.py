"""The host's own cost of an eager mixed step (what a GPU waits for when mixed steps are not graphed),
measured on the CPU with every Triton launch a no-op.

    TRITON_INTERPRET=1 python3 benchmarks/eager_host_bench.py [--layers 16] [--steps 8] [--profile]

A random Llama of `--layers` small layers is compiled and run by the triton-interpret backend, with its plan
relowered to take cuBLAS for linears (as a GPU's mixed steps of more than 64 tokens do), the interpreter's
kernel launch and the library GEMM each replaced by a no-op: what remains of `Plan.run` is llmc's own Python
per step (argument checks, specs and their module lookups, grids, views, the arena) and the few torch ops it
runs itself. `--piecewise` times `PiecewiseGraphs.run` instead, each captured piece's replay a no-op. Each timed step carries 100 decoding sequences and one fresh 600-token prompt. Prints the median
`Plan.run` and engine-step milliseconds and the kernel launches a step; `--profile` adds the llmc functions by
their own time. Compare trees side by side on one machine.
"""
import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--piecewise", action="store_true", help="the step on piecewise graphs (llmc/runtime/piecewise.py) "
                    "instead, each captured piece's replay a no-op: the host's cost around the pieces (the attention "
                    "launches between them, the padded inputs, the eager tail)")
    a = ap.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from triton.runtime.interpreter import InterpretedFunction

    import llmc
    from llmc.codegen import matmul as mm
    from llmc.codegen.lower import Plan
    work = tempfile.mkdtemp()
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=a.layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(work)
    llmc.compile(work, f"{work}/m.llmc", dtype="float32")
    llm = llmc.LLM(f"{work}/m.llmc", backend="triton-interpret", max_num_seqs=128, max_num_batched_tokens=1024)
    eng, ex = llm.engine, llm.engine.executor
    ex.plan = Plan(ex.plan.graph, ex.plan.device, ex.plan.tuner, triton_matmul=False)
    launches = [0]

    def no_launch(self, *args, **kwargs):
        launches[0] += 1
    InterpretedFunction.run = no_launch

    def no_gemm(x, w, b=None, epilogue=(), out=None, up=None):  # cuBLAS's launch, without the CPU's matmul
        launches[0] += 1
        return out if out is not None else x.new_empty((*x.shape[:-1], w.shape[0]))
    mm.reference = no_gemm
    if a.piecewise:
        from types import SimpleNamespace

        from llmc.runtime.piecewise import PiecewiseGraphs

        def capture(fn):  # the pieces' launches are no-ops: a capture runs them once, a replay does nothing
            fn()
            return SimpleNamespace(replay=lambda: None), None
        ex.piecewise = PiecewiseGraphs(ex.plan, lambda fn: fn(), capture)
        ex.use_cuda_graphs = ex.mixed_graphs = True
    plan_ms = []
    run = ex.plan.run if not a.piecewise else ex.piecewise.run

    def timed_run(*args, **kwargs):
        t = time.perf_counter()
        out = run(*args, **kwargs)
        plan_ms.append((time.perf_counter() - t) * 1e3)
        return out
    if a.piecewise:
        ex.piecewise.run = timed_run
    else:
        ex.plan.run = timed_run
    rng = random.Random(0)
    for _ in range(100):
        eng.add_request([rng.randrange(500) for _ in range(20)],
                        llmc.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for _ in range(3):
        eng.step()

    def steps(n):
        walls = []
        for _ in range(n):
            eng.add_request([rng.randrange(500) for _ in range(600)],
                            llmc.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            launches[0] = 0
            t = time.perf_counter()
            eng.step()
            walls.append((time.perf_counter() - t) * 1e3)
        return walls
    steps(2)
    plan_ms.clear()
    walls = steps(a.steps)
    print(f"{a.layers} layers, a 600-token chunk beside 100 decodes: Plan.run {statistics.median(plan_ms):.2f} ms, "
          f"engine step {statistics.median(walls):.2f} ms (medians of {a.steps}), {launches[0]} launches "
          f"a step (kernels and GEMMs, each a no-op)")
    if a.profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        steps(a.steps)
        pr.disable()
        pstats.Stats(pr).sort_stats(os.environ.get("SORT", "tottime")).print_stats("llmc/", int(os.environ.get("ROWS", "25")))


if __name__ == "__main__":
    main()
