"""The same random model compiled from its Hugging Face directory and from its ONNX export, decoded
side by side in one run; onnxruntime's own decode speed on the export as a peer figure.

- export: `torch.onnx.export(dynamo=True, opset 20, external data)` of the model's full-sequence
  logits (inputs input_ids and position_ids, no cache: llmc adds its own paged cache);
- llmc: batch 1, a fresh 128-token prompt, `--new` greedy tokens, end to end, from each artifact;
  the greedy tokens of the two must be equal;
- onnxruntime (CUDA execution provider when onnxruntime-gpu is installed, else CPU): the export
  has no cache, so each new token runs the whole sequence again; `--ort-new` tokens.

    python3 benchmarks/onnx_bench.py [--shape 8b] [--dtype bfloat16] [--new 256] [--ort-new 16] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, position_ids):
        return self.m(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def export(m, out: Path, vocab: int) -> float:
    t = time.time()
    for mod in m.modules():  # `.to(bfloat16)` rounded the rotary frequencies; llmc's HF frontend computes them
        if getattr(mod, "rope_type", None) == "default" and hasattr(mod, "inv_freq"):  # in fp32: export those
            mod.inv_freq = mod.compute_default_rope_parameters(mod.config, mod.inv_freq.device)[0].float()
    ids = torch.randint(0, vocab, (1, 7), device=m.device)
    args = (ids, torch.arange(7, device=m.device)[None])
    B, S = torch.export.Dim("batch"), torch.export.Dim("sequence")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(Logits(m), args, str(out), dynamo=True, opset_version=20, external_data=True,
                          input_names=["input_ids", "position_ids"], output_names=["logits"],
                          dynamic_shapes=({0: B, 1: S}, {0: B, 1: S}))
    return time.time() - t


def llmc_decode(art, prompt: list[int], new: int, vocab: int) -> tuple[float, list[int], list]:
    from decode_bench import sync
    from llmc.runtime.llm import LLM, SamplingParams
    llm = LLM(art, max_num_seqs=4)
    p = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate([[(t + 7) % vocab for t in prompt]], p)  # warm-up on another prompt
    sync()
    t = time.perf_counter()
    out = llm.generate([prompt], p)[0].outputs[0].token_ids
    sync()
    rate = new / (time.perf_counter() - t)
    # the same prompt again with the top-2 log-probabilities, to place a divergence: a near-tie or a bug
    lp = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=2))[0]
    return rate, list(out), lp.outputs[0].top_logprobs


def ort_decode(path: Path, prompt: list[int], new: int) -> tuple[float, str, list[int]]:
    import numpy as np
    import onnxruntime as ort
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
    sess = ort.InferenceSession(str(path), providers=providers)
    ids = list(prompt)

    def step():
        x = np.array([ids], dtype=np.int64)
        logits = sess.run(["logits"], {"input_ids": x, "position_ids": np.arange(len(ids), dtype=np.int64)[None]})[0]
        return int(np.asarray(logits[0, -1], dtype=np.float32).argmax())

    step()  # warm-up
    t = time.perf_counter()
    out = []
    for _ in range(new):
        out.append(step())
        ids.append(out[-1])
    return new / (time.perf_counter() - t), sess.get_providers()[0], out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--ort-new", type=int, default=16)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    import llmc
    from decode_bench import CUDA, SHAPES
    from transformers import LlamaConfig, LlamaForCausalLM
    work = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[a.shape], architectures=["LlamaForCausalLM"], attn_implementation="eager")
    dt = getattr(torch, a.dtype)
    with torch.device("cuda" if CUDA else "cpu"):
        m = LlamaForCausalLM(cfg).to(dt).eval()
    m.save_pretrained(str(work / "hf"))
    res = {"shape": a.shape, "dtype": a.dtype, "gpu": torch.cuda.get_device_name() if CUDA else "cpu"}
    (work / "onnx").mkdir()
    res["export_s"] = export(m, work / "onnx" / "model.onnx", cfg.vocab_size)
    (work / "onnx" / "config.json").write_text((work / "hf" / "config.json").read_text())
    del m
    torch.cuda.empty_cache() if CUDA else None
    prompt = torch.randint(0, cfg.vocab_size, (128,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = {}
    for name, src in (("hf", work / "hf"), ("onnx", work / "onnx" / "model.onnx")):
        t = time.time()
        art = llmc.compile(src, work / f"{name}.llmc", dtype=a.dtype)
        rows[name] = {"compile_s": time.time() - t}
        rows[name]["tok_s"], rows[name]["tokens"], tops = llmc_decode(art, prompt, a.new, cfg.vocab_size)
        rows[name]["tops"] = tops
        print(name, json.dumps({k: v for k, v in rows[name].items() if k not in ("tokens", "tops")}), flush=True)
    res["llmc"] = {k: {kk: vv for kk, vv in v.items() if kk not in ("tokens", "tops")} for k, v in rows.items()}
    res["greedy_equal"] = rows["hf"]["tokens"] == rows["onnx"]["tokens"]
    for j, (x, y) in enumerate(zip(rows["hf"]["tokens"], rows["onnx"]["tokens"])):
        if x != y:  # the HF-compiled run's top-2 margin there (the export rounds the attention scale to the
            lp = sorted(rows["hf"]["tops"][j].values(), reverse=True)  # model's dtype: near-ties may flip)
            res["first_divergence"] = {"token": j, "margin": lp[0] - lp[1] if len(lp) > 1 else None}
            break
    res["onnx_over_hf"] = rows["onnx"]["tok_s"] / rows["hf"]["tok_s"]
    try:
        tok_s, provider, ort_tokens = ort_decode(work / "onnx" / "model.onnx", prompt, a.ort_new)
        res["onnxruntime"] = {"tok_s": tok_s, "provider": provider, "tokens": a.ort_new,
                              "greedy_equal_first": ort_tokens == rows["hf"]["tokens"][:a.ort_new]}
    except Exception as e:  # the peer is a figure beside llmc's, not a condition of it
        res["onnxruntime"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, f"onnx_bench-{a.shape}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
