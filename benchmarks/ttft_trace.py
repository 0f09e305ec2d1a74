"""Where a fresh prompt's time to first token goes, on the host and on the GPU, as one timeline.

    python3 benchmarks/ttft_trace.py ARTIFACT --out OUT [--tokens 2048] [--runs 3]

Each run is one fresh prompt (token ids, so no tokenizer time) and one new token through `LLM.generate`,
under torch.profiler with CPU and CUDA activities; the engine's calls (schedule, the executor's step and
its input preparation, the token read-back, outputs) are marked. Prints, per run: the request's wall time,
when the GPU's first kernel starts and its last one ends (from the call's start), the GPU's busy time
(the union of its kernels), the idle gaps inside the GPU span, and the marked calls in order. Writes
OUT/ttft_trace.json (the figures) and, with --chrome, OUT/ttft_trace_run0.json (the first run's Chrome trace).
"""
import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
MARKED = {  # object attribute -> the engine calls marked on the timeline
    "engine": ("step", "_run", "_launch", "_resolve", "_book", "_output", "_batch"),
    "scheduler": ("schedule",),
    "executor": ("execute", "launch", "build_inputs", "_forward", "_token_rows", "_begin"),
}


def mark(obj, names, prefix):
    """Wrap each of `obj`'s methods in `names` (those it has) in a profiler range `prefix.name`."""
    for n in names:
        f = getattr(obj, n, None)
        if f is None or not callable(f):
            continue

        def wrapped(*a, __f=f, __n=f"{prefix}.{n}", **k):
            with torch.profiler.record_function(__n):
                return __f(*a, **k)
        setattr(obj, n, functools.wraps(f)(wrapped))


def union(intervals):
    """Total length of the union of (start, end) intervals, and the gaps between merged ones."""
    total, gaps, cur = 0.0, [], None
    for s, e in sorted(intervals):
        if cur is None:
            cur = [s, e]
        elif s > cur[1]:
            total += cur[1] - cur[0]
            gaps.append((cur[1], s))
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    if cur is not None:
        total += cur[1] - cur[0]
    return total, gaps


def summarise(prof, label="ttft.request"):
    """The run's figures from its profile (microseconds, relative to the marked request's start)."""
    events = list(prof.events())
    req = next(e for e in events if e.name == label)
    t0, t1 = req.time_range.start, req.time_range.end
    gpu = [(e.time_range.start, e.time_range.end) for e in events
           if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    busy, gaps = union(gpu)
    first = min(s for s, _ in gpu) if gpu else t1
    last = max(e for _, e in gpu) if gpu else t1
    marks = sorted(((e.time_range.start - t0, e.time_range.end - e.time_range.start, e.name) for e in events
                    if e.name.startswith(("engine.", "scheduler.", "executor.")) and e.device_type ==
                    torch.autograd.DeviceType.CPU), key=lambda r: r[0])
    big_gaps = sorted(((s - t0, e - s) for s, e in gaps if e - s > 5.0), key=lambda r: -r[1])[:10]
    cpu_ops = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and not e.name.startswith(("engine.", "scheduler.",
                                                                                      "executor.", "ttft.")):
            cpu_ops.setdefault(e.name, [0, 0.0])
            cpu_ops[e.name][0] += 1
            cpu_ops[e.name][1] += e.time_range.end - e.time_range.start
    top_cpu = sorted(((us, c, n) for n, (c, us) in cpu_ops.items()), reverse=True)[:15]
    return {"wall_us": t1 - t0, "first_kernel_us": first - t0, "last_kernel_end_us": last - t0,
            "gpu_busy_us": busy, "gpu_span_us": last - first, "tail_us": t1 - last,
            "gaps_in_span_us": sum(e - s for s, e in gaps), "largest_gaps": big_gaps,
            "marks": [(round(s, 1), round(d, 1), n) for s, d, n in marks],
            "top_cpu_ops": [(round(us, 1), c, n) for us, c, n in top_cpu]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=".")
    ap.add_argument("--chrome", action="store_true", help="also write the first run's Chrome trace")
    a = ap.parse_args()
    import llmc
    from torch.profiler import ProfilerActivity, profile
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = llmc.LLM(a.artifact)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    fresh = lambda: torch.randint(0, 8000, (a.tokens,), generator=g).tolist()  # noqa: E731
    sp = llmc.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(3):  # warm-up: graphs captured, kernels loaded
        llm.generate([fresh()], sp)
    walls = []
    for _ in range(a.runs):  # unprofiled
        p = fresh()
        sync()
        t = time.perf_counter()
        llm.generate([p], sp)
        walls.append((time.perf_counter() - t) * 1e3)
    mark(eng, MARKED["engine"], "engine")
    mark(eng.scheduler, MARKED["scheduler"], "scheduler")
    mark(eng.executor, MARKED["executor"], "executor")
    runs = []
    for i in range(a.runs):
        p = fresh()
        sync()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])) as prof:
            with torch.profiler.record_function("ttft.request"):
                llm.generate([p], sp)
            sync()
        if i == 0 and a.chrome:
            prof.export_chrome_trace(str(out / "ttft_trace_run0.json"))
        runs.append(summarise(prof))
    res = {"artifact": a.artifact, "tokens": a.tokens, "unprofiled_wall_ms": walls,
           "unprofiled_wall_ms_median": statistics.median(walls), "runs": runs}
    (out / "ttft_trace.json").write_text(json.dumps(res, indent=1))
    print(f"unprofiled wall per request: {', '.join(f'{w:.2f}' for w in walls)} ms")
    for i, r in enumerate(runs):
        print(f"run {i}: wall {r['wall_us'] / 1e3:.2f} ms; first kernel at {r['first_kernel_us'] / 1e3:.2f} ms, last "
              f"ends at {r['last_kernel_end_us'] / 1e3:.2f} ms; GPU busy {r['gpu_busy_us'] / 1e3:.2f} ms of a "
              f"{r['gpu_span_us'] / 1e3:.2f} ms span (gaps {r['gaps_in_span_us'] / 1e3:.2f} ms); tail "
              f"{r['tail_us'] / 1e3:.2f} ms")
    r = runs[-1]
    print("marked calls of the last run (start ms, duration ms):")
    for s, d, n in r["marks"]:
        print(f"  {s / 1e3:8.3f} {d / 1e3:8.3f}  {n}")
    print("largest GPU gaps (at ms, us):", [(round(s / 1e3, 3), round(d, 1)) for s, d in r["largest_gaps"]])
    print("top CPU ops (us, calls):")
    for us, c, n in r["top_cpu_ops"]:
        print(f"  {us:9.1f} {c:5d}  {n[:90]}")


if __name__ == "__main__":
    main()
