"""Where a tuned artifact's greedy tokens part from Hugging Face on a GPU: each tuned choice checked alone.

For each model (tiny-py and the chaotic tiny Llama of gpu_e2e.py, fp32 and bf16) this compiles a tuned
artifact, then
  1. runs every generated-matmul choice of its tuning.json (the recorded config at the record's N, K) at
     1 to 64 rows against torch, eagerly and replayed in a CUDA graph, and checks that the split-K tile
     counters are back at zero after each;
  2. decodes the code prompts greedily under variants of the artifact's tuning (as compiled; every
     matmul choice with SPLIT_K=1; every matmul choice given to cuBLAS; the attention launches'
     choices dropped) and reports each variant's agreement with HF eager in the same dtype.
A variant that agrees where the compiled choices do not names the faulty kernel.
Usage: python benchmarks/tuned_check.py [--out DIR] [--tokens N]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu_e2e import PROMPTS, hf_greedy, tiny_llama  # noqa: E402

KEY = re.compile(r"^matmul\[(\w+),bias=(\d),epilogue=([^\]]+)\]N(\d+)K(\d+)$")


def kernel_rows(tuning: dict) -> list[dict]:
    """Every recorded generated-matmul choice against torch at its shape (eager and as a CUDA graph)."""
    from llmc.codegen import matmul as mm
    from llmc.codegen.kernels import tile_counters
    from llmc.ir.types import torch_dtype
    rows, seen = [], set()
    for key, by_bucket in tuning.get("kernels", {}).items():
        m = KEY.match(key)
        if not m:
            continue
        dtype, bias, epi, n, k = m.group(1), m.group(2) == "1", m.group(3), int(m.group(4)), int(m.group(5))
        epilogue = () if epi == "none" else tuple(e.split("[")[0] for e in epi.split("+"))
        for bucket, rec in by_bucket.items():
            cfg = rec["config"]
            sig = (key, json.dumps(cfg, sort_keys=True))
            if rec.get("prefer_cublas") or sig in seen:
                continue
            seen.add(sig)
            tdt = torch_dtype(dtype)
            g = torch.Generator(device="cuda").manual_seed(0)
            w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(tdt)
            b = torch.randn(n, device="cuda", generator=g).to(tdt) if bias else None
            worst = {"eager": 0.0, "graph": 0.0}
            for rows_m in (1, 3, 16, 33, 64):
                x = torch.randn(rows_m, k, device="cuda", generator=g).to(tdt)
                want = mm.reference(x.double(), w.double(), None if b is None else b.double(), epilogue).float()
                got = mm.matmul(x, w, b, epilogue, config=cfg).float()
                worst["eager"] = max(worst["eager"], ((got - want).abs().max() / want.abs().max()).item())
                out = torch.empty(rows_m, n, dtype=tdt, device="cuda")
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    mm.matmul(x, w, b, epilogue, config=cfg, out=out)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    mm.matmul(x, w, b, epilogue, config=cfg, out=out)
                out.zero_()
                graph.replay()
                graph.replay()
                torch.cuda.synchronize()
                worst["graph"] = max(worst["graph"], ((out.float() - want).abs().max() / want.abs().max()).item())
            left = int(tile_counters(torch.device("cuda"), 1).abs().sum())
            rows.append({"key": key, "bucket": bucket, "config": cfg, "err_eager": worst["eager"],
                         "err_graph": worst["graph"], "counters_left": left})
    return rows


def variants(tuning: dict) -> dict[str, dict]:
    """The artifact's tuning as compiled and with one family of choices changed."""
    def edit(fn):
        t = copy.deepcopy(tuning)
        for key in list(t.get("kernels", {})):
            fn(t["kernels"], key)
        return t

    def split1(ks, key):
        if key.startswith("matmul["):
            for rec in ks[key].values():
                rec["config"]["SPLIT_K"] = 1

    def cublas(ks, key):
        if key.startswith("matmul["):
            for rec in ks[key].values():
                rec["prefer_cublas"] = True

    def no_attention(ks, key):
        if key.startswith("paged_attention"):
            del ks[key]
    return {"as compiled": tuning, "matmul SPLIT_K=1": edit(split1), "matmul -> cuBLAS": edit(cublas),
            "attention defaults": edit(no_attention)}


def agreement(art, tuning: dict, ids, refs, n: int) -> dict:
    from llmc.runtime.llm import LLM, SamplingParams
    art = copy.copy(art)
    art.tuning = tuning
    llm = LLM(art, backend="cuda", num_blocks=512)
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    same = sum(x == y for o, r in zip(outs, refs) for x, y in zip(o.token_ids, r))
    first = next(((i, j) for i, (o, r) in enumerate(zip(outs, refs))
                  for j, (x, y) in enumerate(zip(o.token_ids, r)) if x != y), None)
    eager = LLM(art, backend="cuda", num_blocks=512, cuda_graphs=False)
    outs_e = eager.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    same_e = sum(x == y for o, r in zip(outs_e, refs) for x, y in zip(o.token_ids, r))
    del llm, eager
    return {"agree": same / sum(map(len, refs)), "agree_eager": same_e / sum(map(len, refs)), "first": first}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--models", default="tiny-llama:float32,tiny-py:float32,tiny-py:bfloat16")
    a = ap.parse_args()
    import llmc
    from llmc.models import builtin_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer
    work = Path(tempfile.mkdtemp())
    report = {"kernels": [], "variants": []}
    for spec in a.models.split(","):
        name, dtype = spec.split(":")
        d = builtin_dir("tiny-py") if name == "tiny-py" else tiny_llama(work)
        tdt = getattr(torch, dtype)
        tok = AutoTokenizer.from_pretrained(str(d))
        hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=tdt, attn_implementation="eager").cuda().eval()
        ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
        refs = [hf_greedy(hf, p, a.tokens) for p in ids]
        art = llmc.compile(d, work / f"{name}-{dtype}.llmc", dtype=dtype, tune=True)
        Path(a.out, f"tuning-{name}-{dtype}.json").write_text(json.dumps(art.tuning, indent=1))
        try:
            for r in kernel_rows(art.tuning):
                r["model"] = spec
                report["kernels"].append(r)
                print(json.dumps(r), flush=True)
        except Exception as e:  # noqa: BLE001 - the variants below still say which family is wrong
            print(f"kernel checks of {spec} failed: {type(e).__name__}: {e}", flush=True)
        for label, t in variants(art.tuning).items():
            try:
                r = {"model": spec, "variant": label, **agreement(art, t, ids, refs, a.tokens)}
            except Exception as e:  # noqa: BLE001 - one variant's failure must not hide the others
                r = {"model": spec, "variant": label, "error": f"{type(e).__name__}: {e}"[:300]}
            report["variants"].append(r)
            print(json.dumps(r), flush=True)
    Path(a.out, "tuned_check.json").write_text(json.dumps(report, indent=1))
    print(f"{'model':18s} {'key':52s} {'config':28s} {'eager':>8s} {'graph':>8s} left")
    for r in report["kernels"]:
        c = r["config"]
        cfg = f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} s{c['SPLIT_K']} w{c['num_warps']} st{c['num_stages']}"
        print(f"{r['model']:18s} {r['key'][:52]:52s} {cfg:28s} {r['err_eager']:8.1e} {r['err_graph']:8.1e} "
              f"{r['counters_left']}")
    print(f"{'model':18s} {'variant':20s} {'agree':>6s} {'eager':>6s} first")
    for r in report["variants"]:
        if "error" in r:
            print(f"{r['model']:18s} {r['variant']:20s} ERROR {r['error'][:90]}")
        else:
            print(f"{r['model']:18s} {r['variant']:20s} {r['agree']:6.3f} {r['agree_eager']:6.3f} {r['first']}")


if __name__ == "__main__":
    main()
