"""The long prefill graphs each way on one artifact: LLMC_LONG_PREFILL_GRAPHS=0 (a lone prompt above 512 tokens
eager) and =1 (the default: up to 2,048 tokens on a step graph). For each, in a fresh process with prefix caching off (every prompt fresh): the greedy tokens of
held-out prompts of 2,048, 1,000 and 300 tokens (fewer where the context is shorter), each alone, compared
with the first's; then the time to first token of a 2,048-token prompt (`llmc.bench`, workload prefill).

    python3 benchmarks/prefill_flags.py ARTIFACT [--rounds 2] [--out DIR]
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import agreement  # noqa: E402
SETTINGS = ("0", "1")
COMBO = """
import json, sys
import llmc
from llmc.bench import bench
from llmc.models import heldout_text_path
llm = llmc.LLM(sys.argv[1], enable_prefix_caching=False)  # every prompt fresh, the bench's and these alike
ids = llm.engine.tokenizer.encode(heldout_text_path().read_text()[:40000])
cap = llm.engine.max_model_len - 32  # room for the new tokens (a small model's context)
prompts = [ids[i * 3000:i * 3000 + min(n, cap)] for i, n in enumerate((2048, 1000, 300))]
outs = [llm.generate([p], llmc.SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0] for p in prompts]
r = bench(llm, "prefill", num_requests=5)
print(json.dumps({"ttft_ms_p50": r["ttft_ms_p50"], "ttft_ms_p99": r["ttft_ms_p99"],
                  "tokens": [o.token_ids for o in outs]}))
"""


def run(cmd: list[str], graphs: str) -> str:
    env = {**os.environ, "LLMC_LONG_PREFILL_GRAPHS": graphs,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    rows, base = [], None
    for r in range(a.rounds):
        for graphs in SETTINGS:
            got = json.loads(run([sys.executable, "-c", COMBO, a.artifact], graphs).strip().splitlines()[-1])
            tokens = got["tokens"]
            base = tokens if base is None else base
            same = agreement(tokens, base)
            row = {"round": r, "long_graphs": graphs, "ttft_ms_p50": got["ttft_ms_p50"],
                   "ttft_ms_p99": got["ttft_ms_p99"], "greedy_same_as_first": same}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, f"prefill_flags_{Path(a.artifact).stem}.json").write_text(json.dumps(rows, indent=1))
    print(f"{'graphs':>7} {'TTFT p50 ms':>12} {'greedy=':>8}")
    for row in rows:
        print(f"{row['long_graphs']:>7} {row['ttft_ms_p50']:12.2f} {row['greedy_same_as_first']:8.4f}")


if __name__ == "__main__":
    main()
