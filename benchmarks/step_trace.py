"""Where a mixed-workload run's wall time goes, step by step: for every launched step, its composition
(decodes, prompt tokens), the GPU's span over its launch (CUDA events at the launch's start and end, so the
span holds the GPU's waits for launches inside a piecewise step), the GPU's idle gap before it (the last
step's end event to this one's start), and the host's time in the launch call. Steps are grouped by kind
(decode-only by batch size, mixed, prompt-only), so a host-bound kind shows as gaps and a launch-bound one as
spans above its kernels' time.

The workload is the issue's tool's: `LLM.generate` over random prompt ids. Then the same workload under
cProfile: the host functions that cost most per step.

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


def workload(vocab: int, n: int, seed: int, max_len: int) -> tuple[list[list[int]], list]:
    """The issue's mixed workload as its tool sends it: random prompt ids, prompts U[64, 1024] and outputs
    U[64, 512] tokens (seed 0 lengths), greedy, ignore_eos; capped to a context of `max_len` tokens."""
    from llmc import SamplingParams
    from llmc.serve.bench import workload_lengths
    g = torch.Generator().manual_seed(seed)
    lengths = [(min(p, max_len - min(o, max_len - 1)), min(o, max_len - 1))
               for p, o in workload_lengths("mixed", n, 0)]
    return ([torch.randint(0, vocab, (p,), generator=g).tolist() for p, _ in lengths],
            [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in lengths])


def run(llm, n: int, seed: int) -> tuple[float, int]:
    """`LLM.generate` over the workload (longest output first, as it queues): (seconds, output tokens)."""
    prompts, params = workload(llm.engine.info.vocab_size, n, seed, llm.engine.max_model_len)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def traced_run(llm, n: int, seed: int) -> tuple[list[dict], dict]:
    """Run the workload once and return one row per launched step, and the run's totals."""
    ex = llm.engine.executor
    rows: list[dict] = []
    cuda = getattr(ex, "device", torch.device("cpu")).type == "cuda"
    wrapped = {name: getattr(ex, name) for name in ("execute", "launch") if hasattr(ex, name)}

    def traced(fn):
        def call(batch, *args):
            seqs = batch.seqs
            decodes = sum(1 for s in seqs if len(s.token_ids) == 1)
            prompt = sum(len(s.token_ids) for s in seqs if len(s.token_ids) != 1)
            t0 = time.perf_counter()
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
            if ev:
                ev[0].record()
            out = fn(batch, *args)
            if ev:
                ev[1].record()
            rows.append({"decodes": decodes, "prompt_tokens": prompt,
                         "host_launch_ms": (time.perf_counter() - t0) * 1e3, "t": t0, "ev": ev})
            return out
        return call

    for name, fn in wrapped.items():
        setattr(ex, name, traced(fn))
    try:
        seconds, tokens = run(llm, n, seed)
    finally:
        for name, fn in wrapped.items():
            setattr(ex, name, fn)
    prev_end, busy = None, 0.0
    for i, row in enumerate(rows):
        ev = row.pop("ev")
        row["wall_ms"] = (rows[i + 1]["t"] - row["t"]) * 1e3 if i + 1 < len(rows) else None
        if ev:
            row["gpu_span_ms"] = ev[0].elapsed_time(ev[1])
            row["gpu_gap_ms"] = prev_end.elapsed_time(ev[0]) if prev_end is not None else 0.0
            busy += row["gpu_span_ms"]
            prev_end = ev[1]
    for row in rows:
        row.pop("t")
    r = {"out_tok_s": tokens / seconds, "duration_s": seconds, "steps": len(rows),
         "gpu_busy": busy / 1e3 / seconds if cuda else None}
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

    from llmc.runtime.llm import LLM
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    art = shared_artifact(a.shape, a.artifact)
    with LLM(art, max_num_seqs=a.max_num_seqs) as llm:
        run(llm, a.n, 1)  # untimed: every step shape met once (fresh prompts each run: no prefix-cache hit)
        rows, r = traced_run(llm, a.n, 2)
        text = table(rows)
        stats = llm.stats()
        graphs = getattr(llm.engine.executor, "step_graphs", None)
        held = None  # which whole-step graphs the engine holds (decode, prefill, mixed)
        if graphs is not None:
            held = defaultdict(int)
            for key in graphs.graphs:
                held[key[0]] += 1
            held = dict(held)
        prof_text = ""
        if not a.no_cprofile:
            prof = cProfile.Profile()
            prof.enable()
            seconds, tokens = run(llm, a.n, 3)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(45)
            prof_text = f"# under cProfile: {tokens / seconds:.0f} out tok/s\n" + s.getvalue()
            (out / f"step_trace_{a.shape}_cprofile.txt").write_text(prof_text)
    (out / f"step_trace_{a.shape}.json").write_text(json.dumps({"run": r, "stats": stats, "steps": rows}))
    print(prof_text[:6000])
    if held is not None:
        print(f"# step graphs held: {held}; warm-up {stats.get('warm_up_s', 0):.2f} s")
    busy = f"{r['gpu_busy']:.3f}" if r["gpu_busy"] is not None else "n/a"
    print(f"# {a.shape}, {a.n} requests, {a.max_num_seqs} at once (LLM.generate): {r['out_tok_s']:.0f} out tok/s, "
          f"{r['duration_s']:.3f} s, {r['steps']} steps, GPU busy over the launches' spans {busy}")
    print(text)


if __name__ == "__main__":
    main()
