"""Host time of a step's inputs over a steady decode, every sequence one position further each step with the same
block-table lists, contexts U[128, 1536] tokens: a decode graph's input load (`step_graphs._StepGraph.load`,
the default), or with `--eager` the inputs of a step no graph covers (`LocalExecutor.build_inputs`, as mixed
steps make them; here without the device copies).

The decode graph's inputs go into one pinned buffer; this times the Python and numpy that fill it, per step.
Compare two trees side by side on one machine (absolute times on a shared CPU are noisy; quote ratios):

    python3 benchmarks/decode_inputs_bench.py                       # this tree
    PYTHONPATH=.bench_base python3 benchmarks/decode_inputs_bench.py  # another tree's llmc/
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: another tree's llmc/ wins


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5, help="the best round is reported")
    ap.add_argument("--eager", action="store_true", help="time LocalExecutor.build_inputs instead")
    a = ap.parse_args()
    import llmc.runtime.step_graphs as step_graphs
    from llmc.runtime.executor import StepInput
    from tests.runtime.test_step_inputs import _Inputs  # build_inputs alone: no graph, no cache
    bs = 16
    print(f"# {step_graphs.__file__}, {'build_inputs' if a.eager else 'decode graph load'}")
    print(f"{'sequences':>9s} {'us per step':>11s}")
    for n in a.batch:
        rng = random.Random(0)
        pos = [rng.randint(128, 1536) for _ in range(n)]
        tables = [rng.sample(range(1 << 20), p // bs + a.steps // bs + 2) for p in pos]
        batches = [[StepInput([5], pos[i] + k, tables[i]) for i in range(n)] for k in range(a.steps)]
        best = float("inf")
        for _ in range(a.rounds):
            g = step_graphs._StepGraph("decode", n, max(len(t) for t in tables), torch.device("cpu"))
            load = _Inputs(bs).build_inputs if a.eager else lambda b: g.load(b, bs)
            t0 = time.perf_counter()
            for batch in batches:
                load(batch)
            best = min(best, (time.perf_counter() - t0) / a.steps)
        print(f"{n:9d} {best * 1e6:11.1f}")


if __name__ == "__main__":
    main()
