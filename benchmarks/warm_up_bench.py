"""An engine's first mixed-workload run with and without the load-time warm-up (EngineConfig.warm_up), each
setting in fresh processes that start from the same Triton cache: the one the artifact's compile left
(what a user has after `llmc compile`), copied per process, so no process inherits another's compiles.

Per process: load to ready (the warm-up included), the warm-up's own time, then the mixed workload
(`llmc.bench.bench`, `--n` requests, `--max-num-seqs` at once) twice: the first run is what a user's first
requests see, the second an engine that every step shape has met. Settings alternate, `--repeat` each.

    python3 benchmarks/warm_up_bench.py --shape 1b --n 256 --out OUT      # GPU
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def child(a) -> None:
    import torch

    from llmc.bench import bench
    from llmc.runtime.llm import LLM
    from llmc.runtime.step_graphs import graphs_captured
    compiled, counts = _count_compiles()
    t0 = time.perf_counter()
    profile = cProfile.Profile() if os.environ.get("WARM_UP_PROFILE") == "1" else None
    if profile is not None:
        profile.enable()
    # no prefix caching: the second run sends the first's prompts, which a cache would serve
    llm = LLM(a.artifact, max_num_seqs=a.max_num_seqs, warm_up=a.warm == "1", enable_prefix_caching=False)
    if profile is not None:  # where the load's time goes, by cumulative time (printed into this process's log)
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(45)
    torch.cuda.synchronize()
    row = {"warm_up": a.warm == "1", "load_s": time.perf_counter() - t0, "warm_up_s": llm.stats()["warm_up_s"],
           "load_compiles": _total(compiled, 0), "load_compile_s": _total(compiled, 1),
           "load_cache_hits": counts["hits"], "load_c_builds": counts["c_builds"],
           "load_c_build_s": counts["c_build_s"],
           # a copy: the runs after append to the same entries
           "load_compiled": {k: [n, sec, list(c)]
                             for k, (n, sec, c) in sorted(compiled.items(), key=lambda x: -x[1][1])}}
    for run in ("first", "second"):
        g, before = graphs_captured(), _total(compiled, 0)
        r = bench(llm, "mixed", num_requests=a.n)
        row.update({f"{run}_compiles": _total(compiled, 0) - before,
                    f"{run}_out_tok_s": r["out_tok_s"], f"{run}_gpu_busy": r["gpu_busy"],
                    f"{run}_ttft_ms_p50": r["ttft_ms_p50"], f"{run}_graphs_captured": graphs_captured() - g})
    llm.close()
    print("ROW " + json.dumps(row), flush=True)


def _count_compiles() -> tuple[dict[str, list], dict[str, float]]:
    """From now on, this process's Triton compiles by kernel name ({name: [compiles, seconds, the constexprs of
    each]}; a worker's are not seen) and counts of cache hits and of C modules built with the host compiler
    (launchers, in the Triton versions that build them), with their seconds."""
    import importlib

    import triton.runtime.build as build
    from triton import knobs
    compiled: dict[str, list] = {}
    counts = {"hits": 0, "c_builds": 0, "c_build_s": 0.0}

    def listener(*, src, times, cache_hit, metadata, **_):
        counts["hits"] += cache_hit
        if not cache_hit:
            entry = compiled.setdefault(str(metadata.get("name", "?")), [0, 0.0, []])
            entry[0] += 1
            entry[1] += times.total / 1e6
            entry[2].append(str(getattr(src, "constants", ""))[:300])
    if hasattr(knobs.compilation, "listener"):
        knobs.compilation.listener = listener
    if hasattr(build, "_build"):
        inner = build._build

        def timed_build(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                counts["c_builds"] += 1
                counts["c_build_s"] += time.perf_counter() - t
        build._build = timed_build
        with contextlib.suppress(ImportError):  # a driver that imported the function itself
            driver = importlib.import_module("triton.backends.nvidia.driver")
            if getattr(driver, "_build", None) is inner:
                driver._build = timed_build
    return compiled, counts


def _total(compiled: dict[str, list], field: int) -> float:
    """Compiles (field 0) or their seconds (1) over every kernel of `_count_compiles`'s record."""
    return sum(v[field] for v in compiled.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--settings", default="off,on", help="the rows of each repeat, in order: off (no warm-up), on, "
                    "ahead (on, with LLMC_WARM_UP_AHEAD=1: its kernels compiled on threads first), procs (the same in "
                    "LLMC_TUNE_PROCESSES=16 worker processes)")
    ap.add_argument("--artifact", default=None)
    ap.add_argument("--out", default=".")
    ap.add_argument("--warm", default=None, help=argparse.SUPPRESS)  # a child process's setting
    a = ap.parse_args()
    if a.warm is not None:
        return child(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(f"/tmp/warm-up-triton-{a.shape}")
    art = a.artifact or f"/tmp/art-{a.shape}.llmc"
    if not Path(art).exists():  # compiled here with a Triton cache of its own: what the children start from
        shutil.rmtree(base, ignore_errors=True)
        env = {**os.environ, "TRITON_CACHE_DIR": str(base)}
        subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'benchmarks'); from decode_bench "
                        f"import shared_artifact; shared_artifact({a.shape!r}, {art!r})"], env=env, check=True)
    rows = []
    for i in range(a.repeat):
        for setting in a.settings.split(","):
            warm = "0" if setting == "off" else "1"
            cache = Path(f"/tmp/warm-up-triton-run{i}{setting}")
            shutil.rmtree(cache, ignore_errors=True)
            if base.exists():
                shutil.copytree(base, cache)
            env = {**os.environ, "TRITON_CACHE_DIR": str(cache),
                   "LLMC_WARM_UP_AHEAD": "1" if setting in ("ahead", "procs") else "0",
                   "LLMC_TUNE_PROCESSES": "16" if setting == "procs" else "0"}
            p = subprocess.run([sys.executable, __file__, "--artifact", art, "--n", str(a.n), "--max-num-seqs",
                                str(a.max_num_seqs), "--warm", warm], env=env, capture_output=True, text=True)
            (out / f"warm_up_{i}{setting}.log").write_text(p.stdout[-20000:] + p.stderr[-20000:])
            line = next((x for x in p.stdout.splitlines() if x.startswith("ROW ")), None)
            if line is None:
                print(f"# run {i} {setting} failed (rc {p.returncode}): {p.stderr[-800:]}", flush=True)
                continue
            rows.append({"setting": setting, **json.loads(line[4:])})
            print(json.dumps(rows[-1]), flush=True)
    (out / "warm_up_bench.json").write_text(json.dumps({"shape": a.shape, "n": a.n, "rows": rows}, indent=1))
    print(f"# {a.shape}; mixed workload, {a.n} requests, {a.max_num_seqs} at once; each row a fresh process")
    print(f"{'warm-up':>8s} {'load s':>7s} {'of it warm-up':>13s} {'compiles (s)':>13s} {'1st tok/s':>10s} "
          f"{'1st busy':>8s} {'graphs':>6s} {'compiles':>8s} {'2nd tok/s':>10s} {'graphs':>6s}")
    for r in rows:
        print(f"{r['setting']:>8s} {r['load_s']:7.2f} {r['warm_up_s']:13.2f} "
              f"{r['load_compiles']:5d} ({r['load_compile_s']:5.1f}) "
              f"{r['first_out_tok_s']:10.0f} {r['first_gpu_busy'] or 0:8.2f} {r['first_graphs_captured']:6d} "
              f"{r['first_compiles']:8d} "
              f"{r['second_out_tok_s']:10.0f} {r['second_graphs_captured']:6d}")


if __name__ == "__main__":
    main()
