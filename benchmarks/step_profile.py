"""Where one request's time goes on the GPU: a fresh prompt's prefill (time to first token) and batch-1
decode, each under torch.profiler, as a table of kernels (GPU time per request and per call) beside the
wall time, so that TTFT and decode are set against their floors kernel by kernel.

    python3 benchmarks/step_profile.py --shape 8b --artifact /tmp/art-8b.llmc --out OUT

Writes OUT/step_profile_<shape>.json (the tables) and prints them.
"""
import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bench import shared_artifact  # noqa: E402

sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def kernels(prof, requests: int) -> tuple[list[dict], float]:
    """Every CUDA kernel of a profile (CPU ops where there is no GPU): name, calls and microseconds per
    request; and their sum."""
    per = defaultdict(lambda: [0, 0.0])
    cuda = torch.cuda.is_available()
    for e in prof.events():
        if e.device_type == (torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU):
            per[e.name][0] += 1
            per[e.name][1] += e.device_time if cuda else e.self_cpu_time_total
    rows = [{"kernel": k, "calls": c / requests, "us": us / requests, "us_per_call": us / c}
            for k, (c, us) in per.items()]
    rows.sort(key=lambda r: -r["us"])
    return rows, sum(r["us"] for r in rows)


def profile(llm, prompts: list[list[int]], others: list[list[int]], max_tokens: int) -> dict:
    """Each prompt alone, greedy, `max_tokens` new: the median wall time; then each of `others` (as many, as
    long, none sharing a prefix with `prompts`: a prefix-cache hit would skip the prefill) under the
    profiler (its kernels per request)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import llmc
    sp = llmc.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    walls = []
    for p in prompts:
        sync()
        t = time.perf_counter()
        llm.generate([p], sp)
        sync()
        walls.append(time.perf_counter() - t)
    with torch_profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU],
                       acc_events=True) as prof:
        for p in others:
            llm.generate([p], sp)
        sync()
    rows, busy = kernels(prof, len(prompts))
    return {"wall_ms": statistics.median(walls) * 1e3, "walls_ms": [w * 1e3 for w in walls],
            "gpu_us": busy, "kernels": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--artifact", default=None, help="compile the random model here, or reuse it")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    import llmc
    art = shared_artifact(a.shape, a.artifact)
    llm = llmc.LLM(art.path)
    vocab = 8000  # the text ids of the random models' tokenizer (tiny-py's)
    g = torch.Generator().manual_seed(0)
    fresh = lambda n: [torch.randint(0, vocab, (n,), generator=g).tolist() for _ in range(a.runs)]
    llm.generate(fresh(a.prompt_tokens)[:1], llmc.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    out = {"shape": a.shape, "commit": None,
           "prefill": profile(llm, fresh(a.prompt_tokens), fresh(a.prompt_tokens), 1),
           "decode": profile(llm, fresh(16), fresh(16), a.decode_tokens + 1)}
    try:
        import subprocess
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        pass
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, f"step_profile_{a.shape}.json").write_text(json.dumps(out, indent=1))
    for what, per in (("prefill", 1), ("decode", a.decode_tokens + 1)):
        r = out[what]
        print(f"== {a.shape} {what}: wall {r['wall_ms']:.2f} ms a request (runs {', '.join(f'{w:.2f}' for w in r['walls_ms'])}),"
              f" GPU {r['gpu_us'] / 1e3:.2f} ms; per token (of {per}): wall {r['wall_ms'] / per:.3f} ms,"
              f" GPU {r['gpu_us'] / per / 1e3:.3f} ms")
        for k in r["kernels"][:16]:
            print(f"  {k['us'] / 1e3:8.3f} ms {k['calls']:7.0f} calls {k['us_per_call']:9.2f} us/call  "
                  f"{k['us'] / r['gpu_us']:6.1%}  {k['kernel'][:90]}")


if __name__ == "__main__":
    main()
