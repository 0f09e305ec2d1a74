"""Mixed steps eager against piecewise CUDA graphs (llmc/runtime/piecewise.py), one engine, one process,
the switch flipped between runs of the same workload.

`llmc bench --workload mixed` in separate processes varies by 2x here: its short warm-up leaves kernels
of some step shapes to compile (and graph buckets to capture) inside the timed run, and whichever run
comes first pays for them. This runs the whole workload once each way untimed first, then `--repeat`
timed runs of each setting alternating, and reports every run, the medians and their ratio, with the
engine's step counts and host time per step over each run (prefix caching off: the runs send the same
prompts). Last, greedy tokens of `--prompts`
held-out prompts (all admitted at once: their first step is a mixed one) under each setting.

    python3 benchmarks/mixed_graphs_bench.py --shape 1b --n 256 --out OUT     # GPU
    python3 benchmarks/mixed_graphs_bench.py --shape tiny --n 8 --repeat 1 --out /tmp/mg  # CPU (eager both ways)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

KEYS = ("out_tok_s", "gpu_busy", "ttft_ms_p50", "itl_ms_p50", "itl_ms_p99", "duration_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each setting")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    from decode_bench import add_workload_args, shared_setup
    add_workload_args(ap)
    a = ap.parse_args()
    import torch

    from llmc.bench import bench
    from llmc.runtime.llm import LLM, SamplingParams
    out, art, prompts = shared_setup(a)
    rows = []
    # no prefix caching: every run sends the workload's same prompts, which a cache would serve from the
    # previous run's blocks
    with LLM(art, max_num_seqs=a.max_num_seqs, enable_prefix_caching=False) as llm:
        ex = llm.engine.executor
        if getattr(ex, "piecewise", None) is None:
            print("# this executor has no piecewise graphs (no CUDA graphs here): both settings run eagerly")

        def run(on: bool, timed: bool) -> dict:
            ex.mixed_graphs = on
            before = llm.stats()
            r = bench(llm, "mixed", num_requests=a.n, progress=False)
            after = llm.stats()
            steps = after["steps"] - before["steps"]
            row = {"mixed_graphs": on, "timed": timed, **{k: r[k] for k in KEYS}, "steps": steps,
                   **{k: (after[k] * after["steps"] - before.get(k, 0.0) * before["steps"]) / max(1, steps)
                      for k in after if k.startswith("ms_per_step_")}}
            print(json.dumps(row), flush=True)
            with (out / "mixed_graphs_bench.partial.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            return row

        for on in (True, False):  # untimed: every step shape compiled, every bucket captured
            run(on, False)
        for _ in range(a.repeat):
            for on in (False, True):
                rows.append(run(on, True))
        greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        toks = {}
        for on in (False, True):
            ex.mixed_graphs = on
            toks[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    same = sum(x == y for a_, b_ in zip(toks[False], toks[True]) for x, y in zip(a_, b_))
    total = sum(len(t) for t in toks[False])
    med = {on: statistics.median(r["out_tok_s"] for r in rows if r["mixed_graphs"] == on) for on in (False, True)}
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    summary = {"shape": a.shape, "gpu": gpu, "n": a.n, "max_num_seqs": a.max_num_seqs, "rows": rows,
               "median_out_tok_s": {"eager": med[False], "graphs": med[True]}, "ratio": med[True] / med[False],
               "greedy_same_tokens": same, "greedy_tokens": total}
    (out / "mixed_graphs_bench.json").write_text(json.dumps(summary, indent=1))
    print(f"# {a.shape}, {gpu}; mixed workload, {a.n} requests, {a.max_num_seqs} at once; timed runs in order")
    print(f"{'mixed steps':>12s} {'out tok/s':>10s} {'busy':>5s} {'ITL p50':>8s} {'steps':>6s} {'host ms/step':>12s}")
    for r in rows:
        busy = f"{r['gpu_busy']:5.2f}" if r["gpu_busy"] is not None else f"{'-':>5s}"
        host = r.get("ms_per_step_execute", float("nan"))
        print(f"{'graphs' if r['mixed_graphs'] else 'eager':>12s} {r['out_tok_s']:10.0f} {busy} "
              f"{r['itl_ms_p50']:8.2f} {r['steps']:6d} {host:12.2f}")
    print(f"median: eager {med[False]:.0f}, graphs {med[True]:.0f} out tok/s ({summary['ratio']:.2f}x); greedy "
          f"tokens equal under both: {same}/{total}")


if __name__ == "__main__":
    main()
