"""Host time of a step's input preparation (`LocalExecutor.build_inputs`: ids, positions, slots, block
tables, logits rows of the paged graph), vectorised over the step's tokens, against the per-token
construction it replaced (the definition tests/runtime/test_step_inputs.py checks it against), side
by side in one run. Eager steps (mixed prefill + decode steps, and any step no CUDA graph covers)
pay this on the host before every launch.

    OMP_NUM_THREADS=1 python3 benchmarks/step_inputs_bench.py [--runs 50]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.runtime.executor import StepInput  # noqa: E402
from tests.runtime.test_step_inputs import _direct, _Inputs  # noqa: E402


def mixed(decodes: int, chunk: int, ctx: int, seed: int = 0) -> list[StepInput]:
    """`decodes` sequences of one new token at contexts U[64, ctx], and one prompt chunk of `chunk` tokens."""
    rng, seqs, nb = random.Random(seed), [], 0
    for _ in range(decodes):
        p = rng.randint(64, ctx)
        seqs.append(StepInput([rng.randrange(8000)], p, list(range(nb, nb + p // 16 + 1)), 1))
        nb += p // 16 + 1
    if chunk:
        seqs.append(StepInput([rng.randrange(8000) for _ in range(chunk)], 128, list(range(nb, nb + (128 + chunk) // 16 + 1)),
                              1, True))
    return seqs


def timed(fn, runs: int) -> float:
    fn()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    a = ap.parse_args()
    ex = _Inputs(16)
    steps = {"127 decodes + a 1,920-token prompt chunk": mixed(127, 1920, 900),
             "256 decodes, contexts up to 1,500": mixed(256, 0, 1500),
             "one 2,048-token prompt chunk": mixed(0, 2048, 0)}
    print(f"{'step':42s} {'per token ms':>12s} {'vectorised ms':>13s} {'x':>6s}")
    for name, seqs in steps.items():
        old, new = timed(lambda: _direct(seqs, 16), a.runs), timed(lambda: ex.build_inputs(seqs), a.runs)
        print(f"{name:42s} {old:12.3f} {new:13.3f} {old / new:6.1f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
