"""Host time of the engine's decode steps (scheduler, block manager, stop checks, detokenizer,
outputs) with the model replaced by an instant stub, so only the Python around the model is timed.

At large batches this host time, not the GPU, bounds the engine's throughput: on the H200 a
1B-shape decode step of 64 sequences is a few milliseconds of GPU work. Compare commits side by
side on one machine (absolute times on a shared CPU are noisy; ratios are what to quote).

    python benchmarks/engine_host_bench.py [--artifact tiny-py.llmc] [--batch 8 64 256] [--prompt 64 896]
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(art, batch: int, prompt_len: int, steps: int) -> float:
    from llmc.runtime.engine import LLM, SamplingParams
    from llmc.runtime.executor import StepResult
    llm = LLM(art, num_blocks=batch * (prompt_len + steps + 32) // 16 + 64, max_num_seqs=batch,
              max_num_batched_tokens=max(8192, batch * prompt_len), backend="reference")
    eng = llm.engine
    gen = torch.Generator().manual_seed(0)
    vocab = 8000

    def stub(batch_):  # the model, instantly: random tokens (greedy) or logits
        n = batch_.num_logits
        if batch_.greedy:
            return StepResult(tokens=torch.randint(100, vocab, (n,), generator=gen))
        return StepResult(logits=torch.randn(n, vocab, generator=gen))
    eng.executor.execute = stub
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        eng.add_request([1 + (i * 7 + j) % 4000 for j in range(prompt_len)], params)
    eng.step()  # the prefill
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - t) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", default=None, help="a compiled artifact (default: builtin:tiny-py, compiled)")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--prompt", type=int, nargs="+", default=[64, 896])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--no-gc", action="store_true",
                    help="time with Python's cyclic GC off: its pauses land on whichever step crosses a threshold, "
                         "which makes commits compared side by side differ by chance")
    a = ap.parse_args()
    import llmc
    from llmc.artifact import load_artifact
    art = load_artifact(a.artifact) if a.artifact else llmc.compile("builtin:tiny-py",
                                                                    Path(tempfile.mkdtemp()) / "t.llmc")
    print(f"{'batch':>5s} {'prompt':>6s} {'ms/step':>8s} {'us/seq':>7s}")
    for p in a.prompt:
        for b in a.batch:
            if a.no_gc:
                gc.collect()
                gc.disable()
            dt = measure(art, b, p, a.steps)
            gc.enable()
            print(f"{b:5d} {p:6d} {dt * 1e3:8.2f} {dt * 1e6 / b:7.1f}", flush=True)


if __name__ == "__main__":
    main()
