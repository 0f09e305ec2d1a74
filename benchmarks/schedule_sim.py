"""The mixed workload's schedule under a token budget, replayed on the CPU, and its GPU time estimated.

The engine runs with its model replaced by an instant stub (`engine_host_bench.stubbed_engine`, on a tiny random
Llama with a 4,096-token context), so the scheduler makes exactly the steps it would make for `llmc bench
--workload mixed` (the same request lengths: `llmc.serve.bench.workload_lengths`). Each step's tokens, decodes and
K/V contexts are recorded, and a cost model of the 8B (or 1B) shape on an H200 prices them. Requests are queued as
`LLM.generate` queues them (the issue's tool runs the workload through it): longest output first, or with
`--order given` in the workload's order (as `llmc bench`, a stream, does):

- GEMMs: the compile's measured milliseconds of every linear at 256 to 8,192 rows (tuning.json "token_budget",
  `SHAPES`, measured 2026-12-04), linear between sizes; below 256 rows from the weights' read up to the 256-row
  time;
- decode attention: the K/V each decode reads, at `KV_TB_S` (the decode kernel's rate on a 128-sequence ragged
  step, benchmarks/attention_bench.py); prompt attention at `PREFILL_TFLOPS`;
- the rest (norms, rope, elementwise, LM head, sampling): a fixed time a step plus one a token;
- a step with prompt work runs its GEMMs over its token bucket's rows (piecewise graphs pad a step to the
  smallest of 16, 32, ..., 8,192 tokens that holds it), a decode step over its batch bucket's
  ("rows/real": the padded rows of the prompt steps over their real tokens; "unpadded": the estimate without).

It is a model, for comparing schedules: the figures it gives are estimates, not measurements. On 2026-12-04 the
H200 ran the 8B mixed workload in 7.29 s under the measured budget with the per-step budget and 5.57 s at 2,048
tokens a step (benchmarks/RESULTS.md), both with the requests in the workload's order; `--check` prints the
model's figures for those two beside them. The last row is the least time any schedule of the workload can take
under the same model (`bound`): the K/V reads and the prompts' attention are the same in every schedule, and the
GEMMs cost least with the fed tokens spread evenly over as few steps as the longest output allows.

    python3 benchmarks/schedule_sim.py [--shape 8b|1b] [--budgets 1024,2048,4096] [--step-budget] [--check]
                                       [--order longest-first|given] [--prefill-tokens N] [--paced]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from llmc.runtime.piecewise import MIXED_BUCKETS  # noqa: E402
from llmc.runtime.step_graphs import DECODE_BUCKETS  # noqa: E402
from llmc.serve.bench import workload_lengths  # noqa: E402

# per shape: the compile's GEMM milliseconds at M rows (every linear but the LM head; tuning.json "token_budget",
# H200, 2026-12-04), its measured budget and HBM rate, the weights' read (the LM head's included, 4.2 TB/s), the
# attention's dims, the rest of a step (norms, rope, elementwise, LM head, sampling: fixed ms plus us a token,
# from the 8B step's kernels, the 1B's scaled by its width and depth), and the mixed workload's requests
SHAPES = {
    "8b": dict(gemm_ms={256: 5.6544, 512: 9.4168, 1024: 18.1718, 2048: 35.8067, 4096: 71.3627, 8192: 141.2697},
               budget=512, hbm_gb_s=2713.5, weights_ms=3.6, layers=32, heads=32, kv_heads=8, head_dim=128,
               step_ms=0.3, token_us=1.35, requests=128),
    "1b": dict(gemm_ms={256: 0.9848, 512: 1.5608, 1024: 2.6964, 2048: 5.1391, 4096: 10.298, 8192: 20.4234},
               budget=1024, hbm_gb_s=2713.5, weights_ms=0.6, layers=16, heads=32, kv_heads=8, head_dim=64,
               step_ms=0.15, token_us=0.35, requests=256),
}
KV_TB_S = 3.5  # the decode kernel's K/V rate on a 128-sequence ragged step: 82% of the copy bandwidth (4.25 TB/s)
PREFILL_TFLOPS = 300.0
MEASURED = {"8b": {"measured budget + per-step budget": 7.29, "2048": 5.57}, "1b": {}}
STEP_BUDGET = "measured budget + per-step budget"


def gemm_ms(shape: dict, rows: int) -> float:
    pts = sorted(shape["gemm_ms"].items())
    if rows <= pts[0][0]:
        return shape["weights_ms"] + (pts[0][1] - shape["weights_ms"]) * rows / pts[0][0]
    for (m0, t0), (m1, t1) in zip(pts, pts[1:]):
        if rows <= m1:
            return t0 + (t1 - t0) * (rows - m0) / (m1 - m0)
    (m0, t0), (m1, t1) = pts[-2], pts[-1]
    return t1 + (t1 - t0) * (rows - m1) / (m1 - m0)


def padded(entries: list[tuple[int, int]]) -> int:
    """The rows a step's GEMMs run: a step with prompt work runs on the piecewise graphs of the smallest token
    bucket that holds it (llmc/runtime/piecewise.py); decode steps on their decode graph's batch bucket."""
    tokens = sum(n for n, _ in entries)
    buckets = MIXED_BUCKETS if any(n > 1 for n, _ in entries) else DECODE_BUCKETS
    return next((b for b in buckets if b >= tokens), tokens)


def step_ms(shape: dict, entries: list[tuple[int, int]], pad: bool = True) -> float:
    """Estimated milliseconds of one step: entries are (new tokens, context after the step) per sequence."""
    tokens = padded(entries) if pad else sum(n for n, _ in entries)
    kv = sum(ctx for n, ctx in entries if n == 1) * kv_bytes_per_token(shape) / (KV_TB_S * 1e12) * 1e3
    per_key = 4 * shape["head_dim"] * shape["heads"] * shape["layers"]
    flops = sum(per_key * sum(ctx - n + i + 1 for i in range(n)) for n, ctx in entries if n > 1)
    return gemm_ms(shape, tokens) + kv + flops / (PREFILL_TFLOPS * 1e12) * 1e3 + shape["step_ms"] + \
        shape["token_us"] * tokens * 1e-3


def bound(shape: dict, lengths: list[tuple[int, int]], slots: int) -> tuple[float, int]:
    """(seconds, steps): the least GPU time any schedule of these requests (prompt, output tokens) can take under
    this cost model, with no padding. What a schedule decides is only how the fed tokens spread over the steps:
    the K/V each decode reads and the prompts' attention are the same in every schedule, a request needs a
    step for its prompt and one for each later output token (so the longest output bounds the steps from below,
    as do the slots: each step holds at most `slots` sequences), and the GEMMs' cost is least with the tokens
    spread evenly (the convex minorant of `gemm_ms`)."""
    kv = sum(p + j for p, o in lengths for j in range(1, o)) * kv_bytes_per_token(shape) / (KV_TB_S * 1e12)
    per_key = 4 * shape["head_dim"] * shape["heads"] * shape["layers"]
    attn = sum(per_key * p * (p + 1) // 2 for p, _ in lengths) / (PREFILL_TFLOPS * 1e12)
    tokens = sum(p + o - 1 for p, o in lengths)
    least = max(max(o for _, o in lengths), -(-sum(o for _, o in lengths) // slots))
    pts = [(1, gemm_ms(shape, 1))] + sorted(shape["gemm_ms"].items())
    hull: list[tuple[int, float]] = []  # the lower convex hull of the GEMM curve's points
    for q in pts:
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (q[0] - hull[-2][0]) >= \
                (q[1] - hull[-2][1]) * (hull[-1][0] - hull[-2][0]):
            hull.pop()
        hull.append(q)

    def convex_ms(rows: float) -> float:
        for (m0, t0), (m1, t1) in zip(hull, hull[1:]):
            if rows <= m1:
                return t0 + (t1 - t0) * (rows - m0) / (m1 - m0)
        (m0, t0), (m1, t1) = hull[-2], hull[-1]
        return t1 + (t1 - t0) * (rows - m1) / (m1 - m0)
    ms, steps = min((n * (convex_ms(tokens / n) + shape["step_ms"]), n) for n in range(least, 4 * least + 1))
    return ms / 1e3 + shape["token_us"] * tokens * 1e-6 + kv + attn, steps


def kv_bytes_per_token(shape: dict) -> int:
    return shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * 2  # K and V, bf16


def tiny_artifact(work: Path):
    """A tiny random Llama with a 4,096-token context, compiled on the CPU (its steps are stubbed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import llmc
    cfg = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(work / "hf")
    return llmc.compile(str(work / "hf"), str(work / "tiny.llmc"))


def run(art, shape: dict, budget: int | None, policy: str = "fixed", longest_first: bool = True,
        prefill_tokens: int | None = None, seed: int = 0) -> list[list[tuple[int, int]]]:
    """Every step's (new tokens, context) per sequence, for the shape's mixed workload (its requests at once,
    queued longest first as `LLM.generate` queues them, or in the workload's order); `prefill_tokens`: the
    engine's max_prefill_tokens (the budget of a step with no decode to run). `policy`: "fixed" (the budget
    every step), or one of the engine's opt-ins with the shape's compile's measurements: "step" (the per-step
    budget, LLMC_STEP_BUDGET=1) or "paced" (LLMC_PACE_PROMPTS=1: steps with decodes at the smallest timed GEMM
    size, grown with the prompts' pace)."""
    from engine_host_bench import stubbed_engine

    from llmc.runtime.config import PACE_PROMPTS, StepBudget, paced_floor
    from llmc.runtime.llm import SamplingParams, longest_first_order
    n = shape["requests"]
    lengths = workload_lengths("mixed", n, seed)
    blocks = sum(-(-(p + o) // 16) for p, o in lengths) + 64
    eng = stubbed_engine(art, blocks, max_num_seqs=min(n, 128), max_num_batched_tokens=budget or shape["budget"],
                         max_prefill_tokens=prefill_tokens, enable_prefix_caching=False)
    if policy != "fixed":  # as the engine's opt-in sets it up (engine.py), a step without decodes at 2,048 at least
        cfg = eng.scheduler.config
        cfg.max_prefill_tokens = max(cfg.max_num_batched_tokens, prefill_tokens or 2048)
        if policy == "paced":
            floor = paced_floor({"token_budget": {"gemm_ms": shape["gemm_ms"]}})
            cfg.max_num_batched_tokens, cfg.pace_prompts = max(floor, eng.config.max_num_seqs), PACE_PROMPTS
        else:
            cfg.step_budget = StepBudget(tuple(sorted(shape["gemm_ms"].items())),
                                         kv_bytes_per_token(shape) / (shape["hbm_gb_s"] * 1e6),
                                         cfg.max_num_batched_tokens)
    steps: list[list[tuple[int, int]]] = []
    schedule = eng.scheduler.schedule

    def recorded():
        out = schedule()
        steps.append([(e.num_new_tokens, e.seq.num_computed_tokens + e.num_new_tokens) for e in out.scheduled])
        return out
    eng.scheduler.schedule = recorded
    order = longest_first_order(lengths, eng.max_model_len) if longest_first else range(n)
    for i in order:
        p, o = lengths[i]
        eng.add_request([3 + (i * 7919 + j * 31) % 8000 for j in range(p)],
                        SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
    while eng.has_unfinished():
        eng.step(finished_only=True)
    return [s for s in steps if s]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="1024,2048,4096,8192", help="fixed budgets to replay (tokens a step)")
    ap.add_argument("--step-budget", action="store_true", help="also the per-step budget over the measured 512")
    ap.add_argument("--check", action="store_true", help="the two measured schedules beside their measurements")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES), help="whose H200 figures price the steps")
    ap.add_argument("--order", default="longest-first", choices=("longest-first", "given"),
                    help="queue order: LLM.generate's (longest output first) or the workload's (--check: given)")
    ap.add_argument("--paced", action="store_true",
                    help="also the engine's paced prompts (LLMC_PACE_PROMPTS=1: SchedulerConfig.pace_prompts)")
    ap.add_argument("--prefill-tokens", type=int, default=None, metavar="N",
                    help="the budget of a step with no decode to run (the engine's max_prefill_tokens; default: "
                         "the budget's)")
    a = ap.parse_args()
    shape, measured_s = SHAPES[a.shape], MEASURED[a.shape]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    art = tiny_artifact(Path(tempfile.mkdtemp()))
    longest_first = a.order == "longest-first" and not a.check
    if a.check:  # the two schedules measured on the H200, both in the workload's order
        cases = [(STEP_BUDGET, None, "step"), ("2048", 2048, "fixed")]
    else:
        cases = [(STEP_BUDGET, None, "step")] if a.step_budget else []
        cases += [(b, int(b), "fixed") for b in a.budgets.split(",") if b]
        if a.paced:
            cases.append(("paced", None, "paced"))
    lengths = workload_lengths("mixed", shape["requests"], 0)
    out_tokens = sum(o for _, o in lengths)
    print(f"queued: {'in the workload order' if not longest_first else 'longest output first'}"
          + (f"; steps without decodes: {a.prefill_tokens} tokens" if a.prefill_tokens and not a.check else ""))
    print(f"{'schedule':36s} {'steps':>5s} {'prompt steps':>12s} {'rows/real':>9s} {'est. s':>7s} {'unpadded':>9s} "
          f"{'est. out tok/s':>14s} {'measured s':>10s}")
    for name, budget, policy in cases:
        steps = run(art, shape, budget, policy, longest_first, None if a.check else a.prefill_tokens)
        est, unpadded = (sum(step_ms(shape, s, pad) for s in steps) / 1e3 for pad in (True, False))
        prompts = [s for s in steps if any(k > 1 for k, _ in s)]
        rows, real = sum(padded(s) for s in prompts), sum(k for s in prompts for k, _ in s)
        measured = f"{measured_s[name]:10.2f}" if name in measured_s and not longest_first else f"{'':>10s}"
        print(f"{name:36s} {len(steps):5d} {len(prompts):12d} {rows / real:9.2f} {est:7.2f} {unpadded:9.2f} "
              f"{out_tokens / est:14,.0f} {measured}")
    least, steps = bound(shape, lengths, min(shape["requests"], 128))
    print(f"{'least under the model (any schedule)':36s} {steps:5d} {'':12s} {'':9s} {least:7.2f} {'':9s} "
          f"{out_tokens / least:14,.0f}")


if __name__ == "__main__":
    main()
