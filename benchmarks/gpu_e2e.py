"""End-to-end correctness of the cuda backend on a GPU: greedy tokens against Hugging Face eager.

fp32: a tiny random Llama and the shipped model must give identical greedy tokens.
bf16: 8 prompts x 64 tokens, at least 99% identical; the first divergence and the logit error are
reported. Usage: python benchmarks/gpu_e2e.py [--out DIR]
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

PROMPTS = ["def fibonacci(n):", "import os\n\n", "class Stack:\n    def __init__(self):", "for i in range(",
           "with open(path) as f:", "    def __repr__(self):", "try:\n    import json", "return sorted("]


@torch.no_grad()
def hf_greedy(model, ids, n):
    """HF eager greedy decoding with its own KV cache, never stopping at eos (as ignore_eos)."""
    out = model(input_ids=torch.tensor([ids], device=model.device), use_cache=True)
    toks = [int(out.logits[0, -1].argmax())]
    for _ in range(n - 1):
        out = model(input_ids=torch.tensor([[toks[-1]]], device=model.device), past_key_values=out.past_key_values,
                    use_cache=True)
        toks.append(int(out.logits[0, -1].argmax()))
    return toks


def compare(model_dir: Path, dtype: str, n: int, work: Path, backend: str = "cuda") -> dict:
    import llmc
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from llmc.runtime.engine import LLM, SamplingParams
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    t0 = time.time()
    art = llmc.compile(model_dir, work / f"{model_dir.name}-{dtype}.llmc", dtype=dtype)
    compile_s = time.time() - t0
    llm = LLM(art, backend=backend, num_blocks=512)
    dev = "cuda" if backend == "cuda" else "cpu"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=tdt, attn_implementation="eager").to(dev).eval()
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    same = total = tf_same = floor_same = 0
    first = None
    from llmc.runtime.model_runner import StepInput
    runner = llm.engine.runner
    hf32 = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                attn_implementation="eager").to(dev).eval() if dtype != "float32" else hf
    errs = []
    for i, (p, o) in enumerate(zip(ids, outs)):
        ref = hf_greedy(hf, p, n)
        for j, (x, y) in enumerate(zip(o.token_ids, ref)):
            same += x == y
            total += 1
            if x != y and first is None:
                first = {"prompt": i, "position": j}
        # teacher-forced: llmc's argmax at every position of HF's own greedy sequence (no compounding)
        seq = p + ref
        logits = runner.execute([StepInput(seq[:-1], 0, list(range(64)), n)])
        tf_same += int((logits.argmax(-1).cpu() == torch.tensor(ref)).sum())
        with torch.no_grad():
            hl = hf(input_ids=torch.tensor([p], device=dev)).logits[0, -1].float()
        errs.append(((logits[0] - hl).abs().max() / hl.abs().max()).item())
        # the noise floor: HF in this dtype against HF in fp32, free-running
        floor_same += sum(x == y for x, y in zip(hf_greedy(hf32, p, n), ref))
    return {"model": model_dir.name, "dtype": dtype, "agree": same / total, "teacher_forced_agree": tf_same / total,
            "hf_vs_hf_fp32_agree": floor_same / total, "tokens": total, "first_divergence": first,
            "max_rel_logit_err": max(errs), "compile_s": round(compile_s, 1)}


def tiny_llama(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import build_tokenizer
    cfg = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    out = root / "tiny-llama"
    m.save_pretrained(str(out))
    build_tokenizer(out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    from llmc.models import builtin_dir
    work = Path(tempfile.mkdtemp())
    rows = []
    for d, dt in ((tiny_llama(work), "float32"), (builtin_dir("tiny-py"), "float32"), (tiny_llama(work), "bfloat16"),
                  (builtin_dir("tiny-py"), "bfloat16")):
        try:
            rows.append(compare(Path(d), dt, a.tokens, work))
        except Exception as e:  # report and continue: one failure must not hide the other rows
            rows.append({"model": Path(d).name, "dtype": dt, "error": f"{type(e).__name__}: {e}"[:400]})
        print(json.dumps(rows[-1]), flush=True)
    Path(a.out, "gpu_e2e.json").write_text(json.dumps(rows, indent=1))
    print(f"{'model':14s} {'dtype':9s} {'agree':>7s} {'forced':>7s} {'hf/hf32':>7s} {'tokens':>6s} {'rel logit err':>14s}  first divergence")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:14s} {r['dtype']:9s} ERROR {r['error'][:100]}")
        else:
            print(f"{r['model']:14s} {r['dtype']:9s} {r['agree']:7.4f} {r['teacher_forced_agree']:7.4f} "
                  f"{r['hf_vs_hf_fp32_agree']:7.4f} {r['tokens']:6d} {r['max_rel_logit_err']:14.2e}  {r['first_divergence']}")


if __name__ == "__main__":
    main()
