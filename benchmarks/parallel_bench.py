"""Tensor and pipeline parallelism against one process, through the public API (`llmc.bench`), on a
seeded random model of a shape (default Llama-3-8B), one artifact for every layout (sharded at load).

Rows: one process, TP=2, PP=2 (and more with `--layouts`: `TPxPP`, with a trailing `e` the steps run
eagerly, without CUDA graphs, with `n` every all_reduce goes through NCCL (LLMC_TP_ALLREDUCE=nccl), with
`s` each step is waited for (overlapped steps off), with `mK` K decode steps per engine step (multi-step);
`--expert-parallel` splits a MoE shape's experts over the TP ranks). For each: batch-1 decode tok/s (`llmc
bench --workload decode`: a fresh 128-token prompt, 256 new tokens, median of the runs) and its ratio
to one process; the mixed workload's out tok/s (`--workload mixed`, `--n` requests at once) and the
scaling efficiency (out tok/s over `processes x` one process's); and whether the greedy tokens of
`--prompts` held-out prompts x 64 equal one process's, with the first divergence and one process's
top-2 logit margin there (a near-tie flipped by the other summation order, or a bug).

    python3 benchmarks/parallel_bench.py --shape 8b --out OUT                     # nvidia-h200-x2
    python3 benchmarks/parallel_bench.py --shape mixtral-8l --layouts 1x1,2x1 --expert-parallel --out OUT
    python3 benchmarks/parallel_bench.py --shape tiny --n 8 --prompts 2 --out /tmp/pb   # CPU, gloo
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def greedy(llm, prompts: list[str]) -> list:
    """(token ids, top-2 logprobs per position) of each prompt's 64 greedy tokens."""
    from llmc.runtime.engine import SamplingParams
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2))
    return [(o.outputs[0].token_ids, o.outputs[0].top_logprobs) for o in outs]


def step_breakdown(llm) -> dict:
    """Milliseconds per engine step of a closed LLM: the driver's phases (engine.timings; with workers
    also its broadcasts and its waits for results) and each worker's (waiting for the step, decoding
    it, running it, returning the result)."""
    eng = llm.engine
    n = max(1, eng.num_steps)
    out = {k: 1e3 * v / n for k, v in eng.timings.items()}
    t = getattr(eng.executor, "timings", None)
    if t is not None:
        out.update(driver_send=1e3 * t["send_s"] / n, driver_receive=1e3 * t["receive_s"] / n)
        for r, w in enumerate(t["workers"]):
            out.update({f"w{r}_{k[:-2]}": 1e3 * w[k] / max(1, w["steps"]) for k in w if k.endswith("_s")})
    return {k: round(v, 3) for k, v in out.items()}


PROFILE_DIR = os.environ.get("LLMC_PROFILE_DIR")


def profile(layout: str, phase: str) -> None:
    """With LLMC_PROFILE_DIR set (llmc/runtime/profiling.py), each layout's and phase's engine and workers write
    their profiles into a folder of their own under it."""
    if PROFILE_DIR:
        os.environ["LLMC_PROFILE_DIR"] = str(Path(PROFILE_DIR) / f"{layout}-{phase}")


def divergence(ref: list, got: list) -> dict:
    """Equal, or the first (prompt, position) where the tokens differ and the reference's top-2 margin there."""
    for i, ((a, tops), (b, _)) in enumerate(zip(ref, got)):
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                lp = sorted(tops[j].values(), reverse=True)
                return {"equal": False, "prompt": i, "position": j, "margin": lp[0] - lp[1] if len(lp) > 1 else None}
    return {"equal": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--layouts", default="1x1,2x1,1x2",
                    help="TPxPP layouts, the first the baseline; a trailing e: no CUDA graphs (2x1e); n: every "
                         "all_reduce through NCCL, not symmetric memory (2x1n); s: overlapped steps off (2x1s); "
                         "mK: multi-step K (2x1m8)")
    ap.add_argument("--expert-parallel", action="store_true", help="MoE experts split by expert over TP ranks")
    ap.add_argument("--decode-only", action="store_true", help="batch-1 decode and its step breakdown only "
                    "(no mixed workload, no greedy comparison)")
    ap.add_argument("--backend", default="auto")
    from decode_bench import add_workload_args, shared_setup
    add_workload_args(ap, prompts_help="held-out prompts for the greedy comparison")
    a = ap.parse_args()
    import torch

    from llmc.bench import bench
    from llmc.runtime.llm import LLM
    out, art, prompts = shared_setup(a)
    rows, ref, errors = [], None, []
    for layout in a.layouts.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)(e?)(n?)(s?)(?:m(\d+))?", layout)
        if m is None:
            raise SystemExit(f"--layouts: {layout!r} is not TPxPP[e][n][s][mK] (2x1, 2x1e, 2x1n, 2x1s, 2x1m8)")
        os.environ["LLMC_TP_ALLREDUCE"] = "nccl" if m[4] else "auto"  # the workers inherit it
        tp, pp = int(m[1]), int(m[2])
        opts = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "backend": a.backend,
                "cuda_graphs": not m[3], "expert_parallel": a.expert_parallel and tp > 1,
                "overlap": not m[5], "multi_step": int(m[6] or 1)}
        t = time.time()
        try:
            profile(layout, "decode")
            with LLM(art, max_num_seqs=min(a.n, 128), **opts) as llm:
                load_s = time.time() - t
                dec = bench(llm, "decode")
            per_step = step_breakdown(llm)  # the decode runs' steps alone: where a batch-1 step's time goes
            mix, toks = {"out_tok_s": float("nan"), "ttft_ms_p99": None}, []
            if not a.decode_only:
                profile(layout, "mixed")
                with LLM(art, max_num_seqs=min(a.n, 128), **opts) as llm:
                    mix = bench(llm, "mixed", num_requests=a.n)
                    toks = greedy(llm, prompts)
        except Exception as e:  # noqa: BLE001 - a layout that fails is reported; the others still run
            errors.append({"layout": layout, "error": f"{type(e).__name__}: {e}"[:400]})
            print(json.dumps(errors[-1]), flush=True)
            continue
        finally:
            llm = None  # one process's KV cache and graphs go before the next layout takes the GPUs
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        ref = ref or toks
        row = {"layout": layout, "tp": tp, "pp": pp, "decode_tok_s": dec["out_tok_s"],
               "mixed_out_tok_s": mix["out_tok_s"],
               "mixed_ttft_ms_p99": mix["ttft_ms_p99"], "gpu_busy": mix.get("gpu_busy"), "load_s": load_s,
               "decode_step_ms": per_step,
               "greedy": divergence(ref, toks)}
        base = rows[0] if rows else row
        row["decode_x"] = row["decode_tok_s"] / base["decode_tok_s"]
        row["mixed_efficiency"] = row["mixed_out_tok_s"] / (tp * pp * base["mixed_out_tok_s"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        with (out / "parallel_bench.partial.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    summary = {"shape": a.shape, "gpu": gpu, "rows": rows, "errors": errors}
    (out / "parallel_bench.json").write_text(json.dumps(summary, indent=1))
    print(f"# {a.shape}, {gpu}")
    print(f"{'TPxPP':7s} {'decode tok/s':>12s} {'x':>5s} {'mixed tok/s':>12s} {'efficiency':>10s}  greedy = 1 process")
    for r in rows:
        g = r["greedy"]
        same = "-" if a.decode_only else "yes" if g["equal"] else \
            f"no: prompt {g['prompt']} token {g['position']}, margin {g['margin']:.3g}"
        print(f"{r['layout']:7s} {r['decode_tok_s']:12.1f} {r['decode_x']:5.2f} {r['mixed_out_tok_s']:12.1f} "
              f"{r['mixed_efficiency']:10.2f}  {same}")
    for e in errors:
        print(f"{e['layout']:7s} error: {e['error']}")
    print("# batch-1 decode, ms per engine step (driver phases; w<rank>_: each worker's)")
    for r in rows:
        print(f"{r['layout']:7s} " + " ".join(f"{k}={v}" for k, v in r["decode_step_ms"].items()))


if __name__ == "__main__":
    main()
