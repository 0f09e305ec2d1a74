"""Python's garbage-collector pauses during the mixed workload, with the engine's startup heap frozen
(llmc/runtime/heap.py) or not.

The engine runs the mixed workload's requests (`llmc bench --workload mixed`'s lengths, 128 at once) through
`LLM.generate` with its model replaced by an instant stub (`engine_host_bench.stubbed_engine`, a tiny random
Llama), so every second of a run is host time. Each run counts the collections of each generation and their
milliseconds (`gc.callbacks`). A process imports what an engine on a GPU has loaded (torch, transformers,
triton, llmc's kernel generators), because the pause of a full collection grows with every object tracked.
Each setting runs in fresh processes, alternating, so neither inherits the other's heap.

    python3 benchmarks/gc_pause_bench.py [--rounds 2] [--runs 3] [--requests 256]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(frozen: bool, runs: int, requests: int) -> list[dict]:
    import gc
    import os
    import tempfile
    import time
    from collections import Counter

    sys.path.insert(0, str(HERE))
    sys.path.insert(1, str(HERE.parent))
    os.environ["LLMC_GC_FREEZE"] = "1" if frozen else "0"
    import transformers  # noqa: F401  (what a GPU process has loaded)
    import triton  # noqa: F401

    import llmc.codegen.attention  # noqa: F401
    import llmc.codegen.matmul  # noqa: F401
    from engine_host_bench import stubbed_engine
    from schedule_sim import tiny_artifact

    from llmc.runtime import heap
    from llmc.runtime.llm import LLM, SamplingParams
    from llmc.serve.bench import workload_lengths

    art = tiny_artifact(Path(tempfile.mkdtemp()))
    calls: list[list] = []

    def on_gc(phase, info):
        if phase == "start":
            calls.append([info["generation"], time.perf_counter()])
        else:
            calls[-1][1] = time.perf_counter() - calls[-1][1]

    out = []
    for run in range(runs):
        lengths = workload_lengths("mixed", requests, run)
        blocks = sum(-(-(p + o) // 16) for p, o in lengths) + 64
        eng = stubbed_engine(art, blocks, max_num_seqs=128, enable_prefix_caching=False)
        llm = LLM.__new__(LLM)
        llm.engine = eng
        token = heap.freeze()  # as an engine on a GPU does once it is ready (None with LLMC_GC_FREEZE=0)
        tracked, frozen_count = len(gc.get_objects()), gc.get_freeze_count()
        prompts = [[3 + (i * 7 + j) % 8000 for j in range(p)] for i, (p, _) in enumerate(lengths)]
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in lengths]
        calls.clear()
        gc.callbacks.append(on_gc)
        t = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t
        gc.callbacks.remove(on_gc)
        heap.release(token)
        n, ms = Counter(), Counter()
        for g, d in calls:
            n[g] += 1
            ms[g] += d * 1e3
        out.append({"wall_s": wall, "steps": eng.num_steps, "tracked": tracked, "frozen": frozen_count,
                    "collections": dict(n), "gc_ms": {g: round(v, 1) for g, v in ms.items()}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="fresh processes per setting, alternating")
    ap.add_argument("--runs", type=int, default=3, help="workload runs per process")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--worker", choices=("frozen", "thawed"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker == "frozen", a.runs, a.requests)))
        return
    print(f"{'heap':7s} {'round':>5s} {'run':>3s} {'wall s':>7s} {'steps':>5s} {'tracked':>8s} {'frozen':>8s} "
          f"{'gen 2':>5s} {'gen 2 ms':>8s} {'gen 0+1 ms':>10s}")
    totals: dict[str, list[float]] = {"thawed": [], "frozen": []}
    for rnd in range(a.rounds):
        for mode in ("thawed", "frozen"):
            res = subprocess.run([sys.executable, __file__, "--worker", mode, "--runs", str(a.runs), "--requests",
                                  str(a.requests)], capture_output=True, text=True, check=True)
            for i, r in enumerate(json.loads(res.stdout.strip().splitlines()[-1])):
                ms = {int(g): v for g, v in r["gc_ms"].items()}
                gen2 = r["collections"].get("2", 0)
                print(f"{mode:7s} {rnd:5d} {i:3d} {r['wall_s']:7.3f} {r['steps']:5d} {r['tracked']:8d} "
                      f"{r['frozen']:8d} {gen2:5d} {ms.get(2, 0.0):8.1f} {ms.get(0, 0.0) + ms.get(1, 0.0):10.1f}",
                      flush=True)
                totals[mode].append(r["wall_s"])
    for mode, walls in totals.items():
        print(f"{mode}: mean wall {sum(walls) / len(walls):.3f} s over {len(walls)} runs")


if __name__ == "__main__":
    main()
