"""One decode step at batch B and context C, alone: its GPU time (wall time over back-to-back replays of the engine's
decode step, as the engine runs it: a captured graph on a GPU) against the bound of reading the weights and the K/V
once, and its kernels under torch.profiler.

    python3 benchmarks/decode_step_profile.py --shape 1b --batches 64,128 --contexts 512,1024 --out OUT   # GPU

Writes OUT/decode_step_profile_<shape>.json and prints a table per (B, C) point.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def step_batch(batch: int, context: int, block_size: int, num_blocks: int):
    """`batch` decodes at position context - 1, each on its own blocks (wrapping over the cache)."""
    from llmc.runtime.executor import StepBatch, StepInput
    per = -(-context // block_size)
    seqs = [StepInput([1 + i % 100], context - 1, [(i * per + j) % (num_blocks - 1) + 1 for j in range(per)])
            for i in range(batch)]
    return StepBatch(seqs, greedy=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--artifact", default=None)
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--contexts", default="512,1024")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    from decode_bench import bandwidth, shared_artifact
    from step_profile import kernels
    from torch.profiler import ProfilerActivity, profile

    from llmc.runtime.llm import LLM
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    art = shared_artifact(a.shape, a.artifact)
    bw = bandwidth()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results = []
    with LLM(art, max_num_seqs=max(int(b) for b in a.batches.split(","))) as llm:
        ex = llm.engine.executor
        params = getattr(ex.plan, "params", {})
        untied = any("lm_head" in n for n in params)  # then the embedding is gathered, not read whole
        weight_bytes = sum(t.numel() * t.element_size() for n, t in params.items()
                           if not (untied and "embed" in n))
        kv_token = ex.kv_bytes / (ex.num_blocks * ex.block_size)
        for b in (int(x) for x in a.batches.split(",")):
            for c in (int(x) for x in a.contexts.split(",")):
                sb = step_batch(b, c, ex.block_size, ex.num_blocks)
                for _ in range(3):
                    ex.execute(sb)
                sync()
                t = time.perf_counter()
                for _ in range(a.replays):
                    ex.execute(sb)
                sync()
                ms = (time.perf_counter() - t) * 1e3 / a.replays
                with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                    for _ in range(5):
                        ex.execute(sb)
                    sync()
                rows, busy = kernels(prof, 5)
                kv = kv_token * b * c
                bound = (weight_bytes + kv) / bw * 1e3
                results.append({"batch": b, "context": c, "ms": ms, "kernels_us": busy, "bound_ms": bound,
                                "weight_bytes": weight_bytes, "kv_bytes": kv, "kernels": rows[:24]})
                print(f"== {a.shape} decode step, batch {b}, context {c}: {ms:.3f} ms a step (kernels "
                      f"{busy / 1e3:.3f} ms); bound {bound:.3f} ms (weights {weight_bytes / 1e9:.2f} GB, "
                      f"K/V {kv / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s): {bound / ms:.0%}", flush=True)
                for k in rows[:12]:
                    print(f"  {k['us'] / 1e3:8.3f} ms {k['calls']:6.0f} calls {k['us_per_call']:8.2f} us/call "
                          f"{k['us'] / busy:6.1%}  {k['kernel'][:100]}")
    (out / f"decode_step_profile_{a.shape}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
