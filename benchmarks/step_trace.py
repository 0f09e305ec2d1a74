"""Where a mixed-workload run's wall time goes, step by step: for every launched step, its composition
(decodes, prompt tokens), the GPU's span over its launch (CUDA events at the launch's start and end, so the
span holds the GPU's waits for launches inside a piecewise step), the GPU's idle gap before it (the last
step's end event to this one's start), and the host's time in each engine phase. Steps are grouped by kind
(decode-only by batch size, mixed, prompt-only), so a host-bound kind shows as gaps and a launch-bound one as
spans above its kernels' time.

Then the same workload under cProfile: the host functions that cost most per step.

    python3 benchmarks/step_trace.py --shape 1b --n 256 --max-num-seqs 128 --out OUT   # GPU

Writes OUT/step_trace_<shape>.json (every step) and OUT/step_trace_<shape>_cprofile.txt, and prints the table.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def kind(decodes: int, prompt_tokens: int) -> str:
    if not prompt_tokens:
        for top in (8, 32, 64, 128, 256):
            if decodes <= top:
                return f"decode <= {top}"
        return "decode > 256"
    if not decodes:
        return "prompt only"
    return "mixed, tokens <= 1024" if decodes + prompt_tokens <= 1024 else "mixed, tokens > 1024"


def traced_run(llm, n: int) -> list[dict]:
    """Run the mixed workload (`llmc.bench`, longest first) and return one row per launched step."""
    from llmc.bench import bench
    ex = llm.engine.executor
    rows: list[dict] = []
    cuda = getattr(ex, "device", torch.device("cpu")).type == "cuda"
    wrapped = {name: getattr(ex, name) for name in ("execute", "launch") if hasattr(ex, name)}

    def traced(run):
        def call(batch, *args):
            seqs = batch.seqs if hasattr(batch, "seqs") else []
            decodes = sum(1 for s in seqs if len(s.token_ids) == 1)
            prompt = sum(len(s.token_ids) for s in seqs if len(s.token_ids) != 1)
            t0 = time.perf_counter()
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
            if ev:
                ev[0].record()
            out = run(batch, *args)
            if ev:
                ev[1].record()
            rows.append({"decodes": decodes, "prompt_tokens": prompt, "host_launch_ms": (time.perf_counter() - t0) * 1e3,
                         "t": t0, "ev": ev})
            return out
        return call

    # the bench wraps execute/launch itself (its own events); ours sit inside them
    for name, run in wrapped.items():
        setattr(ex, name, traced(run))
    try:
        r = bench(llm, "mixed", num_requests=n, longest_first=True)
    finally:
        for name, run in wrapped.items():
            setattr(ex, name, run)
    if cuda:
        torch.cuda.synchronize()
    prev_end = None
    for i, row in enumerate(rows):
        ev = row.pop("ev")
        row["wall_ms"] = (rows[i + 1]["t"] - row["t"]) * 1e3 if i + 1 < len(rows) else None
        if ev:
            row["gpu_span_ms"] = ev[0].elapsed_time(ev[1])
            row["gpu_gap_ms"] = prev_end.elapsed_time(ev[0]) if prev_end is not None else 0.0
            prev_end = ev[1]
    for row in rows:
        row.pop("t")
    print(f"# run: {r['out_tok_s']:.0f} out tok/s, {len(rows)} steps, {r['duration_s']:.3f} s", flush=True)
    return rows, r


def table(rows: list[dict]) -> str:
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups[kind(row["decodes"], row["prompt_tokens"])].append(row)
    lines = [f"{'step kind':24s} {'steps':>6s} {'wall ms':>8s} {'sum s':>7s} {'GPU span':>9s} {'GPU gap':>8s} "
             f"{'host launch':>11s}  (means per step)"]
    for k in sorted(groups):
        g = groups[k]
        walls = [r["wall_ms"] for r in g if r["wall_ms"] is not None]
        mean = lambda key: sum(r.get(key) or 0.0 for r in g) / len(g)
        lines.append(f"{k:24s} {len(g):6d} {sum(walls) / max(1, len(walls)):8.3f} {sum(walls) / 1e3:7.3f} "
                     f"{mean('gpu_span_ms'):9.3f} {mean('gpu_gap_ms'):8.3f} {mean('host_launch_ms'):11.3f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--artifact", default=None)
    ap.add_argument("--out", default=".")
    ap.add_argument("--no-cprofile", action="store_true")
    a = ap.parse_args()
    from decode_bench import shared_artifact

    from llmc.bench import bench
    from llmc.runtime.llm import LLM
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    art = shared_artifact(a.shape, a.artifact)
    # no prefix caching: the runs send the workload's same prompts, which a cache would serve from the last run's
    with LLM(art, max_num_seqs=a.max_num_seqs, enable_prefix_caching=False) as llm:
        bench(llm, "mixed", num_requests=a.n, longest_first=True)  # untimed: every step shape met once
        rows, r = traced_run(llm, a.n)
        text = table(rows)
        stats = llm.stats()
        prof_text = ""
        if not a.no_cprofile:
            prof = cProfile.Profile()
            prof.enable()
            rp = bench(llm, "mixed", num_requests=a.n, longest_first=True)
            prof.disable()
            s = io.StringIO()
            ps = pstats.Stats(prof, stream=s).sort_stats("tottime")
            ps.print_stats(45)
            prof_text = f"# under cProfile: {rp['out_tok_s']:.0f} out tok/s\n" + s.getvalue()
            (out / f"step_trace_{a.shape}_cprofile.txt").write_text(prof_text)
    (out / f"step_trace_{a.shape}.json").write_text(json.dumps({"run": r, "stats": stats, "steps": rows}))
    print(prof_text[:6000])
    print(f"# {a.shape}, {a.n} requests, {a.max_num_seqs} at once: {r['out_tok_s']:.0f} out tok/s, "
          f"{r['duration_s']:.3f} s, GPU busy {r.get('gpu_busy')}")
    print(text)


if __name__ == "__main__":
    main()
