"""Speculative decoding on one GPU: speedup, acceptance and losslessness against the same engine
without speculation, in the same run.

For each proposer config (none, ngram, draft at fixed k, draft auto, multi): tok/s, acceptance rate,
mean tokens per target step, and the share of greedy tokens equal to decoding without speculation.

- batch 1 (`--batch 1`): prompts one after another, each `--max-tokens` new tokens;
- batch B: all prompts at once with `max_num_seqs=B` (speculation under load);
- `--workload heldout`: 64-token prompts cut from the shipped held-out code text (not trained on);
  `--workload repetitive`: each prompt holds a code snippet and then its first lines again, so
  continuing it means repeating code already in the prompt (what prompt lookup is for).

The shipped pair is launch-bound on a GPU (a target step costs what a draft step costs): the speed
targets need `--target` a widened 8B-shaped tiny-py (scripts/widen_model.py), whose steps cost an
8B step while its tokens stay tiny-py's.

    python3 benchmarks/spec_bench.py [--target builtin:tiny-py|DIR|ART] [--draft builtin:tiny-py-draft]
        [--prompts 16] [--max-tokens 256] [--batch 1] [--workload heldout|repetitive]
        [--configs none,ngram,draft:3,draft:auto] [--dtype float32] [--seeded] [--out DIR]
"""
from __future__ import annotations

import argparse
import gc
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


def heldout_ids(tok) -> list[int]:
    from llmc.models import heldout_text_path
    return tok.encode(heldout_text_path().read_text()[:400_000], add_special_tokens=False)


def heldout_prompts(tok, n: int, length: int = 64) -> list[list[int]]:
    """n prompts of `length` tokens cut from the shipped held-out text, each from a new place."""
    ids = heldout_ids(tok)
    step = len(ids) // (n + 1)
    return [ids[i * step:i * step + length] for i in range(1, n + 1)]


def repetitive_prompts(tok, n: int, lines: int = 12, again: int = 2, copies: int = 2) -> list[list[int]]:
    """n prompts: `lines` lines of one held-out file from a top-level line on, `copies` times with a
    blank line between, then the snippet's first `again` lines once more: the natural continuation
    repeats the snippet (what a request to extend code already in the prompt looks like)."""
    from llmc.models import heldout_text_path
    docs = [d.split("\n") for d in heldout_text_path().read_text().split("<|endoftext|>")]
    docs = [d for d in docs if len(d) > 4 * lines]
    out = []
    for i in range(n):
        text = docs[i * len(docs) // n]
        at = len(text) // 3
        while at < len(text) - lines and (not text[at].strip() or text[at].startswith((" ", "\t", "#"))):
            at += 1  # start at a top-level line
        snippet = text[at:at + lines]
        block = "\n".join(snippet) + "\n\n"
        out.append(tok.encode(block * copies + "\n".join(snippet[:again]) + "\n", add_special_tokens=False))
    return out


def agreement(outs, base) -> float:
    """The share of the reference's greedy tokens that a run reproduced at the same position."""
    return sum(x == y for o, b in zip(outs, base) for x, y in zip(o, b)) / sum(len(b) for b in base)


def spec_config(name: str, draft) -> dict | None:
    """`none`, `ngram[:K]`, `draft:K|auto`, `multi:K|auto` -> the LLM's speculative= argument."""
    method, _, k = name.partition(":")
    if method == "none":
        return None
    k = k or "auto"
    cfg = {"method": method, "num_speculative_tokens": k if k == "auto" else int(k)}
    if method in ("draft", "multi"):
        cfg["draft"] = draft
    return cfg


def load(model: str, work: Path, name: str, dtype: str):
    """An artifact directory as is; anything else (builtin:NAME, an HF directory) compiled here."""
    import llmc
    from llmc.artifact import MANIFEST, load_artifact
    if Path(model, MANIFEST).is_file():
        return load_artifact(model)
    t = time.time()
    art = llmc.compile(model, work / f"{name}.llmc", dtype=dtype)
    print(f"compiled {model} in {time.time() - t:.0f}s", flush=True)
    return art


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="builtin:tiny-py")
    ap.add_argument("--draft", default="builtin:tiny-py-draft")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--workload", choices=["heldout", "repetitive"], default="heldout")
    ap.add_argument("--configs", default="none,ngram,draft:3,draft:auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per config; the median counts")
    ap.add_argument("--warmup-runs", type=int, default=0,
                    help="untimed runs of the whole workload first (default: one short batch): the graphs and "
                         "kernel variants that speculation's step shapes need are then built before the timing")
    ap.add_argument("--seeded", action="store_true", help="also check that seeded sampling repeats")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    from llmc.runtime.llm import LLM, SamplingParams
    work = Path(tempfile.mkdtemp())
    target = load(a.target, work, "target", a.dtype)
    names = a.configs.split(",")
    draft = load(a.draft, work, "draft", a.dtype) if any(n.split(":")[0] in ("draft", "multi") for n in names) else None
    make = heldout_prompts if a.workload == "heldout" else repetitive_prompts
    prompts = make(target.tokenizer(), a.prompts)
    greedy = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    rows, base = [], None
    for name in names:
        opts = {"num_blocks": a.num_blocks} if a.num_blocks else {}
        llm = LLM(target, speculative=spec_config(name, draft), max_num_seqs=max(8, a.batch), **opts)
        warm = prompts[:min(len(prompts), max(2, a.batch))]
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))  # kernels, graphs

        def run_all():  # the workload once: its greedy tokens per prompt
            if a.batch == 1:
                return [llm.generate([p], greedy)[0].token_ids for p in prompts]
            return [o.token_ids for o in llm.generate(prompts, greedy)]
        for _ in range(a.warmup_runs):
            run_all()
        s0 = llm.stats()
        times = []
        for _ in range(a.repeat):  # the median of a few runs: one short run is at the mercy of the host
            sync()
            t = time.perf_counter()
            outs = run_all()
            sync()
            times.append(time.perf_counter() - t)
        dt = sorted(times)[len(times) // 2]
        s1 = llm.stats()
        steps = s1["steps"] - s0["steps"]
        prop = s1["spec_proposed_tokens"] - s0["spec_proposed_tokens"]
        acc = s1["spec_accepted_tokens"] - s0["spec_accepted_tokens"]
        vsteps = s1["spec_steps"] - s0["spec_steps"]
        base = base if base is not None else outs
        same = agreement(outs, base)
        row = {"proposer": name, "tok_s": len(prompts) * a.max_tokens / dt, "seconds": dt,
               "runs_s": [round(x, 4) for x in times], "steps": steps // a.repeat,
               "tokens_per_step": a.repeat * len(prompts) * a.max_tokens / max(1, steps),
               "preemptions": s1["num_preemptions"] - s0["num_preemptions"], "blocks_total": s1["blocks_total"],
               "acceptance": acc / prop if prop else None,
               "accepted_per_verify_step": acc / vsteps if vsteps else None,
               "spec_steps_share": vsteps / max(1, steps), "greedy_same_as_none": same}
        if a.seeded:
            seeded = [SamplingParams(temperature=0.8, top_k=40, max_tokens=32, seed=i) for i in range(4)]
            r1 = [o.token_ids for o in llm.generate(prompts[:4], seeded)]
            r2 = [o.token_ids for o in llm.generate(prompts[:4], seeded)]
            row["seeded_sampling_repeats"] = r1 == r2
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm
        gc.collect()  # the next engine sizes its KV cache from free memory: this one must be gone
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    for r in rows:
        r["speedup"] = r["tok_s"] / rows[0]["tok_s"]
    res = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "target": a.target,
           "draft": a.draft, "dtype": a.dtype, "prompts": a.prompts, "max_tokens": a.max_tokens, "batch": a.batch,
           "workload": a.workload, "rows": rows}
    tag = f"{a.workload}-b{a.batch}"
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, f"spec_bench-{tag}.json").write_text(json.dumps(res, indent=1))
    print(f"# {tag}: {a.prompts} prompts x {a.max_tokens} tokens, {a.target}")
    print(f"{'proposer':12s} {'tok/s':>8s} {'speedup':>8s} {'tok/step':>9s} {'accept':>7s} {'acc/vstep':>9s} "
          f"{'greedy=':>8s}")
    for r in rows:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        apv = f"{r['accepted_per_verify_step']:.2f}" if r["accepted_per_verify_step"] is not None else "-"
        print(f"{r['proposer']:12s} {r['tok_s']:8.1f} {r['speedup']:8.2f} {r['tokens_per_step']:9.2f} {acc:>7s} "
              f"{apv:>9s} {r['greedy_same_as_none']:8.4f}")


if __name__ == "__main__":
    main()
