"""Multi-step decoding (`multi_step=k`) against single steps, and overlapped steps on and off, on a seeded
random model of a shape (default Llama-3-8B), one artifact, one process, side by side in one run.

Rows: k = 1 (the baseline) and each `--ks`, or the `--modes` given (`1-sync`: single steps, each waited
for; `1`: overlapped steps, the default). For each: batch-1 decode tok/s (`llmc bench --workload
decode`), the mixed workload's out tok/s and GPU-busy share (`--workload mixed`, `--n` requests at
once), the engine steps it took, and whether the greedy tokens of `--prompts` held-out prompts x 64
equal k = 1's (they must: a chain replays the same decode graph).

    python3 benchmarks/multi_step_bench.py --shape 8b --ks 4,8 --out OUT           # GPU
    python3 benchmarks/multi_step_bench.py --shape 8b --modes 1-sync,1,1-sync,1 --out OUT  # overlapped steps
    python3 benchmarks/multi_step_bench.py --shape tiny --ks 4 --n 8 --out /tmp/ms  # CPU (reference)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--ks", default="4,8", help="multi_step values beside 1")
    ap.add_argument("--modes", default=None, help="the rows instead, in order, the first the baseline: K "
                    "(multi_step K) or K-sync (overlapped steps off), e.g. 1-sync,1,1-sync,1")
    from decode_bench import add_workload_args, shared_setup
    add_workload_args(ap)
    a = ap.parse_args()
    import torch

    from llmc.bench import bench
    from llmc.runtime.llm import LLM, SamplingParams
    out, art, prompts = shared_setup(a)
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    rows, ref = [], None
    modes = a.modes.split(",") if a.modes else ["1"] + a.ks.split(",")
    for mode in modes:
        k, overlap = int(mode.removesuffix("-sync")), not mode.endswith("-sync")
        with LLM(art, multi_step=k, overlap=overlap, max_num_seqs=min(a.n, 128)) as llm:
            dec = bench(llm, "decode")
            steps = llm.engine.num_steps
            mix = bench(llm, "mixed", num_requests=a.n)
            steps = llm.engine.num_steps - steps
            toks = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        ref = ref or toks
        row = {"mode": mode, "k": k, "overlap": llm.engine.overlap, "decode_tok_s": dec["out_tok_s"],
               "mixed_out_tok_s": mix["out_tok_s"],
               "gpu_busy": mix["gpu_busy"], "mixed_itl_ms_p50": mix["itl_ms_p50"], "mixed_steps": steps,
               "greedy_equal": toks == ref}
        row["decode_x"] = row["decode_tok_s"] / (rows[0] if rows else row)["decode_tok_s"]
        row["mixed_x"] = row["mixed_out_tok_s"] / (rows[0] if rows else row)["mixed_out_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        with (out / "multi_step_bench.partial.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    (out / "multi_step_bench.json").write_text(json.dumps({"shape": a.shape, "gpu": gpu, "rows": rows}, indent=1))
    print(f"# {a.shape}, {gpu}; mixed: {a.n} requests (engine steps include the warm-up run)")
    print(f"{'mode':>6s} {'decode tok/s':>12s} {'x':>5s} {'mixed tok/s':>12s} {'x':>5s} {'busy':>5s} {'steps':>6s}"
          "  greedy = k 1")
    for r in rows:
        busy = f"{r['gpu_busy']:5.2f}" if r["gpu_busy"] is not None else f"{'-':>5s}"
        print(f"{r['mode']:>6s} {r['decode_tok_s']:12.1f} {r['decode_x']:5.2f} {r['mixed_out_tok_s']:12.1f} "
              f"{r['mixed_x']:5.2f} {busy} {r['mixed_steps']:6d}  {'yes' if r['greedy_equal'] else 'NO'}")


if __name__ == "__main__":
    main()
