"""Greedy agreement across schedules: does a request's greedy output depend on what shares its steps?

Speculative decoding changes which tokens of a request land in which engine step, and so what else they
share a step with. Where the step's kernels sum each row the same whatever the step holds, greedy output
is the same; where they do not (a step with prefill chunks runs GEMM tiles and an attention kernel of
its own), plain decoding itself varies with the schedule. This runs the same greedy requests under
several schedules and reports each one's token agreement with its reference:

    plain, one wave           32 requests, all prefilled in one step, then decode steps only (reference A)
    ngram:3, one wave         the same with n-gram speculation at k = 3: verify steps among decode steps
    plain, two waves          64 requests at 32 a time: the second wave's prefill chunks share steps
                              with the first wave's decodes (reference B)
    plain, two waves of 16    64 requests at 16 a time: another plain schedule
    ngram:3, two waves        64 requests at 32 a time, speculating
    plain, staggered          64 requests at 32 a time, each asking for 96 to 128 tokens: the first wave
                              ends a request at a time, so the second is prefilled a request at a time,
                              beside decodes (reference C)
    plain, staggered by 16    the same at 16 a time: another plain schedule of staggered prefills
    ngram:3, staggered        the same at 32 a time, speculating

    python3 benchmarks/schedule_agreement.py --target ART [--max-tokens 128] [--out DIR]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import agreement, heldout_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="a compiled artifact")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=".")
    ap.add_argument("--runs", default="all", help="'all'; 'two-waves' or 'staggered': only those runs")
    a = ap.parse_args()
    from llmc.runtime.llm import LLM, SamplingParams
    greedy = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    staggered = [SamplingParams(temperature=0, max_tokens=a.max_tokens - (i * 7) % (a.max_tokens // 4 + 1),
                                ignore_eos=True) for i in range(64)]
    runs = [  # label, requests, max_num_seqs, token budget, speculative, reference label, params
        ("plain, one wave", 32, 32, 4096, None, None, greedy),
        ("ngram:3, one wave", 32, 32, 4096, ngram, "plain, one wave", greedy),
        ("plain, two waves", 64, 32, None, None, None, greedy),
        ("plain, two waves of 16", 64, 16, None, None, "plain, two waves", greedy),
        ("ngram:3, two waves", 64, 32, None, ngram, "plain, two waves", greedy),
        ("plain, staggered", 64, 32, None, None, None, staggered),
        ("plain, staggered by 16", 64, 16, None, None, "plain, staggered", staggered),
        ("ngram:3, staggered", 64, 32, None, ngram, "plain, staggered", staggered),
    ]
    if a.runs == "two-waves":
        runs = [r for r in runs if "two waves" in r[0] and "of 16" not in r[0]]
    elif a.runs == "staggered":
        runs = [r for r in runs if "staggered" in r[0]]
    outs, rows = {}, []
    for label, n, seqs, budget, spec, ref, params in runs:
        opts = {"max_num_batched_tokens": budget} if budget else {}
        llm = LLM(a.target, speculative=spec, max_num_seqs=seqs, **opts)
        prompts = heldout_prompts(llm.engine.tokenizer, n)
        outs[label] = [o.token_ids for o in llm.generate(prompts, params if isinstance(params, SamplingParams)
                                                         else params[:n])]
        row = {"run": label, "requests": n, "max_num_seqs": seqs, "reference": ref,
               "agreement": agreement(outs[label], outs[ref][:n]) if ref else 1.0,
               "spec_steps": llm.stats().get("spec_steps", 0)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "schedule_agreement.json").write_text(json.dumps(rows, indent=1))
    print(f"{'run':<26}{'against':<20}{'agreement':>10}{'spec steps':>12}")
    for r in rows:
        print(f"{r['run']:<26}{r['reference'] or '-':<20}{r['agreement']:>10.4f}{r['spec_steps']:>12}")


if __name__ == "__main__":
    main()
