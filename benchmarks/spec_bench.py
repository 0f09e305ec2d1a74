"""Speculative decoding on one GPU: the shipped pair (tiny-py target, tiny-py-draft), batch 1.

For each proposer (none, ngram, draft k=3, draft auto): tok/s over held-out code prompts, the
acceptance rate, mean tokens per target step, and how many greedy tokens equal decoding without
speculation (the same engine, same run). Also runs seeded sampled requests with each proposer, to
check that sampling with a seed works on the device (the seed's generator lives on the host).
The shipped pair is launch-bound on a GPU (both are tiny), so the speedups here are not the
issue's targets: those need the widened target.

    python3 benchmarks/spec_bench.py [--prompts 16] [--max-tokens 256] [--dtype float32] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def heldout_prompts(tok, n: int, length: int = 64) -> list[list[int]]:
    """n prompts of `length` tokens cut from the shipped held-out text, each from a new place."""
    from llmc.models import heldout_text_path
    ids = tok.encode(heldout_text_path().read_text()[:400_000], add_special_tokens=False)
    step = len(ids) // (n + 1)
    return [ids[i * step:i * step + length] for i in range(1, n + 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    import llmc
    from llmc.runtime.engine import LLM, SamplingParams
    work = Path(tempfile.mkdtemp())
    target = llmc.compile("builtin:tiny-py", work / "t.llmc", dtype=a.dtype)
    draft = llmc.compile("builtin:tiny-py-draft", work / "d.llmc", dtype=a.dtype)
    prompts = heldout_prompts(target.tokenizer(), a.prompts)
    greedy = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    configs = {"none": None, "ngram": {"method": "ngram"},
               "draft k=3": {"method": "draft", "draft": draft, "num_speculative_tokens": 3},
               "draft auto": {"method": "draft", "draft": draft, "num_speculative_tokens": "auto"}}
    rows, base = [], None
    for name, spec in configs.items():
        llm = LLM(target, speculative=spec, max_num_seqs=8)
        llm.generate([prompts[0]], greedy)  # warm-up: kernels and graphs
        for p in prompts[:2]:
            llm.generate([p], greedy)
        s0 = llm.stats()
        sync()
        t = time.perf_counter()
        outs = [llm.generate([p], greedy)[0].token_ids for p in prompts]  # batch 1, one after another
        sync()
        dt = time.perf_counter() - t
        s1 = llm.stats()
        steps = s1["steps"] - s0["steps"]
        prop = s1["spec_proposed_tokens"] - s0["spec_proposed_tokens"]
        acc = s1["spec_accepted_tokens"] - s0["spec_accepted_tokens"]
        if base is None:
            base = outs
        same = sum(x == y for o, b in zip(outs, base) for x, y in zip(o, b)) / sum(len(b) for b in base)
        seeded = [SamplingParams(temperature=0.8, top_k=40, max_tokens=32, seed=i) for i in range(len(prompts[:4]))]
        r1 = [o.token_ids for o in llm.generate(prompts[:4], seeded)]
        r2 = [o.token_ids for o in llm.generate(prompts[:4], seeded)]
        rows.append({"proposer": name, "tok_s": len(prompts) * a.max_tokens / dt, "steps": steps,
                     "tokens_per_step": len(prompts) * a.max_tokens / max(1, steps),
                     "acceptance": acc / prop if prop else None, "greedy_same_as_none": same,
                     "seeded_sampling_repeats": r1 == r2})
        print(json.dumps(rows[-1]), flush=True)
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    for r in rows:
        r["speedup"] = r["tok_s"] / rows[0]["tok_s"]
    res = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "dtype": a.dtype, "prompts": a.prompts, "max_tokens": a.max_tokens,
           "rows": rows}
    Path(a.out, "spec_bench.json").write_text(json.dumps(res, indent=1))
    print(f"{'proposer':12s} {'tok/s':>8s} {'speedup':>8s} {'tok/step':>9s} {'accept':>7s} {'greedy=':>8s} {'seeded':>7s}")
    for r in rows:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        print(f"{r['proposer']:12s} {r['tok_s']:8.1f} {r['speedup']:8.2f} {r['tokens_per_step']:9.2f} {acc:>7s} "
              f"{r['greedy_same_as_none']:8.4f} {str(r['seeded_sampling_repeats']):>7s}")


if __name__ == "__main__":
    main()
