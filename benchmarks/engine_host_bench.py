"""Host time of the engine's decode steps (scheduler, block manager, stop checks, detokenizer,
outputs) with the model replaced by an instant stub, so only the Python around the model is timed.

At large batches this host time, not the GPU, bounds the engine's throughput: on the H200 a
1B-shape decode step of 64 sequences is a few milliseconds of GPU work. Compare commits side by
side on one machine (absolute times on a shared CPU are noisy; ratios are what to quote).

    python benchmarks/engine_host_bench.py [--artifact tiny-py.llmc] [--batch 8 64 256] [--prompt 64 896]

With `--queued 256 2000`, each figure submits that many requests at once to an engine of
`--max-num-seqs` (256) and reports, per step, the scheduler's host time (`schedule`, as
`LLM.stats()["ms_per_step_schedule"]`) and the whole host step: over `--steps` steps of a full batch
of decodes (the rest of the requests waiting, none finishing), and over the whole run to the last
request (outputs of U[steps + 2, 3 * steps] tokens, seed 0: requests finish and are admitted as it
goes). A scheduler whose per-step work grows with the number of waiting requests shows here.

    python benchmarks/engine_host_bench.py --queued 256 2000 [--max-num-seqs 256] [--steps 64]
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def stubbed_engine(art, num_blocks: int, **options):
    """An engine whose model is instant: random tokens (greedy) or logits."""
    from llmc.runtime.executor import Launched, StepResult
    from llmc.runtime.llm import LLM
    eng = LLM(art, num_blocks=num_blocks, backend="reference", **options).engine
    gen = torch.Generator().manual_seed(0)
    vocab = 8000

    def stub(batch_):
        n = batch_.num_logits
        if batch_.greedy:
            return StepResult(tokens=torch.randint(100, vocab, (n,), generator=gen))
        return StepResult(logits=torch.randn(n, vocab, generator=gen))
    eng.executor.execute = stub
    # overlapped steps: the same tokens, "on the device" (the inputs a Feed would overwrite are not built)
    eng.executor.launch = lambda batch_, *rest: Launched(stub(batch_).tokens)
    return eng


def measure(art, batch: int, prompt_len: int, steps: int, offline: bool = False) -> float:
    """Seconds per decode step of `batch` sequences; `offline`: outputs of finished requests only, as
    `LLM.generate` asks for them (else every request's output each step, as a stream's)."""
    from llmc.runtime.engine import SamplingParams
    eng = stubbed_engine(art, batch * (prompt_len + steps + 32) // 16 + 64, max_num_seqs=batch,
                         max_num_batched_tokens=max(8192, batch * prompt_len))
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        eng.add_request([1 + (i * 7 + j) % 4000 for j in range(prompt_len)], params)
    eng.step(finished_only=offline)  # the prefill
    t = time.perf_counter()
    for _ in range(steps):
        eng.step(finished_only=offline)
    return (time.perf_counter() - t) / steps


def measure_queued(art, queued: int, max_num_seqs: int, prompt_len: int, steps: int) -> dict[str, float]:
    """ms per step of `schedule` and of the whole host step: over `steps` steps of a full batch, then over
    the whole run (see the module docstring)."""
    from llmc.runtime.engine import SamplingParams
    rng = random.Random(0)
    outputs = [rng.randint(steps + 2, 3 * steps) for _ in range(queued)]
    eng = stubbed_engine(art, max_num_seqs * (prompt_len + 3 * steps + 32) // 16 + 64, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max(8192, max_num_seqs * prompt_len))
    for i, m in enumerate(outputs):
        eng.add_request([1 + (i * 7 + j) % 4000 for j in range(prompt_len)],
                        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))

    def timed(n: int | None) -> tuple[float, float, int]:
        sched0, done = eng.timings.get("schedule", 0.0), 0
        t = time.perf_counter()
        while (done < n) if n is not None else eng.has_unfinished():
            eng.step()
            done += 1
        return (time.perf_counter() - t) / done, (eng.timings["schedule"] - sched0) / done, done
    eng.step()  # admission and the prefills
    full, full_sched, _ = timed(steps)
    run, run_sched, run_steps = timed(None)
    total_steps = run_steps + steps + 1
    return {"full": full, "full_sched": full_sched, "run": run, "run_sched": run_sched, "run_steps": total_steps,
            "batch": sum(outputs) / total_steps}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", default=None, help="a compiled artifact (default: builtin:tiny-py, compiled)")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--prompt", type=int, nargs="+", default=[64, 896])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--queued", type=int, nargs="+", default=None, metavar="N",
                    help="submit N requests at once (prompt: the first --prompt) and time host work per step")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the engine's batch for --queued")
    ap.add_argument("--offline", action="store_true",
                    help="outputs of finished requests only, as LLM.generate asks for them (default: every step's, "
                         "as a stream)")
    ap.add_argument("--no-gc", action="store_true",
                    help="time with Python's cyclic GC off: its pauses land on whichever step crosses a threshold, "
                         "which makes commits compared side by side differ by chance")
    a = ap.parse_args()
    import llmc
    from llmc.artifact import load_artifact
    art = load_artifact(a.artifact) if a.artifact else llmc.compile("builtin:tiny-py",
                                                                    Path(tempfile.mkdtemp()) / "t.llmc")
    if a.queued:
        print(f"{'queued':>6s} {'full batch: sched':>17s} {'step':>6s}   {'whole run: sched':>16s} {'step':>6s} "
              f"{'steps':>5s} {'batch':>5s}  (ms per step; batch: mean sequences per step)")
        for q in a.queued:
            if a.no_gc:
                gc.collect()
                gc.disable()
            r = measure_queued(art, q, a.max_num_seqs, a.prompt[0], a.steps)
            gc.enable()
            print(f"{q:6d} {r['full_sched'] * 1e3:17.3f} {r['full'] * 1e3:6.2f}   {r['run_sched'] * 1e3:16.3f} "
                  f"{r['run'] * 1e3:6.2f} {r['run_steps']:5d} {r['batch']:5.0f}", flush=True)
        return
    print(f"{'batch':>5s} {'prompt':>6s} {'ms/step':>8s} {'us/seq':>7s}")
    for p in a.prompt:
        for b in a.batch:
            if a.no_gc:
                gc.collect()
                gc.disable()
            dt = measure(art, b, p, a.steps, a.offline)
            gc.enable()
            print(f"{b:5d} {p:6d} {dt * 1e3:8.2f} {dt * 1e6 / b:7.1f}", flush=True)


if __name__ == "__main__":
    main()
