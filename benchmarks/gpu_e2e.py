"""End-to-end correctness of the cuda backend on a GPU: greedy tokens against Hugging Face eager.

fp32: the tiny random Llamas and the shipped model must give identical greedy tokens.
bf16: 8 prompts x 64 tokens, at least 99% identical; the first divergence and the logit error are
reported, with the agreement under teacher forcing and against HF fp32, for the tuned artifact
(generated matmuls where they won at compile time) and an untuned one (cuBLAS GEMMs).

Two random Llamas: `tiny-llama-stable` (tests/conftest.py `make_stable_llama`), whose greedy tokens
bf16 rounding does not change, so token agreement in bf16 measures the implementation; and
`tiny-llama` (every matrix of std 0.2), which is chaotic: HF's own bf16 and fp32 part within a few
dozen tokens there, so its bf16 rows show the dtype's noise, not correctness. For both, the
sensitivity table says how far a model with one part broken (attention or MLP zeroed, the two KV
heads swapped) strays from the model's own fp32 tokens: what a bug of that size would cost.
Usage: python benchmarks/gpu_e2e.py [--out DIR] [--only MODEL:DTYPE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# tests.conftest makes a process that has not imported triton yet interpret its kernels (the CPU test
# suite's setting); a benchmark runs them compiled unless TRITON_INTERPRET says otherwise
os.environ.setdefault("TRITON_INTERPRET", "0")
from tests.conftest import CODE_PROMPTS as PROMPTS  # noqa: E402


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


def compare(model_dir: Path, dtype: str, n: int, work: Path, backend: str = "cuda",
            tunes: tuple[bool, ...] = (True,)) -> list[dict]:
    """One row per compile-time tuning choice (tuned: the generated matmuls where they beat cuBLAS;
    untuned: cuBLAS for every GEMM), against the same HF references."""
    import llmc
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from llmc.runtime.llm import LLM, SamplingParams
    from llmc.runtime.executor import StepBatch, StepInput
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    dev = "cuda" if backend == "cuda" else "cpu"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=tdt, attn_implementation="eager").to(dev).eval()
    hf32 = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                attn_implementation="eager").to(dev).eval() if dtype != "float32" else hf
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    refs = [hf_greedy(hf, p, n) for p in ids]
    truth = [hf_greedy(hf32, p, n) for p in ids] if dtype != "float32" else refs
    with torch.no_grad():
        last = [hf(input_ids=torch.tensor([p], device=dev)).logits[0, -1].float() for p in ids]
    rows = []
    for tune in tunes:
        t0 = time.time()
        art = llmc.compile(model_dir, work / f"{model_dir.name}-{dtype}-{tune}.llmc", dtype=dtype, tune=tune)
        compile_s = time.time() - t0
        llm = LLM(art, backend=backend, num_blocks=512)
        runner = llm.engine.executor
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        same = total = tf_same = dec_same = truth_same = 0
        first, errs = None, []
        for i, (p, o, ref) in enumerate(zip(ids, outs, refs)):
            for j, (x, y) in enumerate(zip(o.token_ids, ref)):
                same += x == y
                total += 1
                if x != y and first is None:
                    first = {"prompt": i, "position": j}
            truth_same += sum(x == y for x, y in zip(o.token_ids, truth[i]))
            # teacher-forced: llmc's argmax at every position of HF's own greedy sequence (no
            # compounding), once as one prefill and once token by token through the decode graphs
            seq = p + ref
            table = list(range(64))
            logits = runner.execute(StepBatch([StepInput(seq[:-1], 0, table, n)])).logits
            tf_same += int((logits.argmax(-1).cpu() == torch.tensor(ref)).sum())
            errs.append(((logits[0] - last[i]).abs().max() / last[i].abs().max()).item())
            runner.execute(StepBatch([StepInput(p, 0, table)]))
            for j in range(n - 1):
                dec_same += int(runner.execute(StepBatch([StepInput([ref[j]], len(p) + j, table)], greedy=True)).tokens[0]) == ref[j + 1]
            dec_same += int(logits[0].argmax()) == ref[0]
        rows.append({"model": model_dir.name, "dtype": dtype, "tuned": tune, "agree": same / total,
                     "teacher_forced_agree": tf_same / total, "decode_forced_agree": dec_same / total,
                     "agree_with_hf_fp32": truth_same / total,
                     "hf_vs_hf_fp32_agree": sum(x == y for r, t in zip(refs, truth) for x, y in zip(r, t)) / total,
                     "tokens": total, "first_divergence": first, "max_rel_logit_err": max(errs),
                     "compile_s": round(compile_s, 1)})
        del llm, runner
    return rows


@torch.no_grad()
def sensitivity(model_dir: Path, n: int, backend: str = "cuda") -> dict:
    """Free-running agreement of HF fp32 with broken copies of itself: attention or MLP zeroed in
    every layer, the first two KV heads' keys swapped (a grouped-query mapping bug)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    dev = "cuda" if backend == "cuda" else "cpu"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    load = lambda: AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,  # noqa: E731
                                                        attn_implementation="eager").to(dev).eval()
    truth = [hf_greedy(load(), p, n) for p in ids]
    out = {"model": model_dir.name}
    for name in ("no_attention", "no_mlp", "kv_heads_swapped"):
        m = load()
        for layer in m.model.layers:
            if name == "no_attention":
                layer.self_attn.o_proj.weight.zero_()
            elif name == "no_mlp":
                layer.mlp.down_proj.weight.zero_()
            else:
                w, d = layer.self_attn.k_proj.weight, m.config.head_dim
                w.copy_(torch.cat([w[d:2 * d], w[:d], w[2 * d:]]))
        got = [hf_greedy(m, p, n) for p in ids]
        out[name] = sum(x == y for g, t in zip(got, truth) for x, y in zip(g, t)) / sum(map(len, truth))
    return out


def stable_llama(root: Path) -> Path:
    from tests.conftest import make_stable_llama
    return make_stable_llama(root)


def tiny_llama(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import build_tokenizer
    out = root / "tiny-llama"
    if (out / "config.json").exists():
        return out
    cfg = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    m.save_pretrained(str(out))
    build_tokenizer(out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--only", default="", help="run only the rows whose 'model:dtype' contains this, e.g. tiny-py:bfloat16")
    a = ap.parse_args()
    from llmc.models import builtin_dir
    work = Path(tempfile.mkdtemp())
    rows, sens = [], []
    builtin = lambda w: builtin_dir("tiny-py")  # noqa: E731
    for d, dt, tunes in ((stable_llama, "float32", (True,)), (tiny_llama, "float32", (True,)),
                         (builtin, "float32", (True,)), (stable_llama, "bfloat16", (True, False)),
                         (tiny_llama, "bfloat16", (True, False)), (builtin, "bfloat16", (True, False))):
        d = d(work)
        if a.only not in f"{Path(d).name}:{dt}":
            continue
        try:
            new = compare(Path(d), dt, a.tokens, work, tunes=tunes)
            if dt == "float32" and d != builtin(work):
                sens.append(sensitivity(Path(d), a.tokens))
                print(json.dumps(sens[-1]), flush=True)
        except Exception as e:  # report and continue: one failure must not hide the other rows
            new = [{"model": Path(d).name, "dtype": dt, "error": f"{type(e).__name__}: {e}"[:400]}]
        rows += new
        for r in new:
            print(json.dumps(r), flush=True)
    Path(a.out, "gpu_e2e.json").write_text(json.dumps({"rows": rows, "sensitivity": sens}, indent=1))
    if sens:
        print(f"{'model':18s} {'no attention':>12s} {'no MLP':>8s} {'KV heads swapped':>16s}  "
              "(HF fp32 against its broken copy, free-running)")
        for r in sens:
            print(f"{r['model']:18s} {r['no_attention']:12.4f} {r['no_mlp']:8.4f} {r['kv_heads_swapped']:16.4f}")
    print(f"{'model':18s} {'dtype':9s} {'tuned':5s} {'agree':>6s} {'forced':>6s} {'fdec':>6s} {'vs32':>6s} "
          f"{'hf/32':>6s} {'logit err':>9s}  first divergence")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:18s} {r['dtype']:9s} ERROR {r['error'][:100]}")
        else:
            print(f"{r['model']:18s} {r['dtype']:9s} {str(r['tuned']):5s} {r['agree']:6.4f} "
                  f"{r['teacher_forced_agree']:6.4f} {r['decode_forced_agree']:6.4f} {r['agree_with_hf_fp32']:6.4f} "
                  f"{r['hf_vs_hf_fp32_agree']:6.4f} {r['max_rel_logit_err']:9.2e}  {r['first_divergence']}")
    print("agree: free-running tokens equal to HF eager in the same dtype; forced: argmax on HF's sequence "
          "in one prefill; fdec: the same token by token through the decode graphs; vs32: free-running "
          "against HF fp32; hf/32: HF in this dtype against HF fp32 (the dtype's noise floor)")

if __name__ == "__main__":
    main()
