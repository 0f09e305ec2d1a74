"""Check a widened tiny-py (scripts/widen_model.py) on the GPU, with Hugging Face transformers as
the executor (independent of llmc):

- fp32 (`--fp32 DIR`): greedy tokens of the widened model equal tiny-py fp32's on held-out prompts;
  also the largest logit difference relative to the logits' scale;
- bf16 (`--bf16 DIR`): teacher-forced next-token agreement with tiny-py fp32 over held-out text must
  be at least tiny-py bf16's own agreement with tiny-py fp32 (free-running agreement between two
  bf16 roundings is chaotic and says little); beside it McNemar's z of the paired positions and each
  bf16 model's logits' relative RMS error against tiny-py fp32 (their ratio: how much less precise
  the widening is).

    python3 benchmarks/widen_check.py [--fp32 DIR] [--bf16 DIR] [--tokens 16384] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the GPU for the record; the CPU to try it


def load(path, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(DEVICE).eval()


@torch.no_grad()
def against_fp32(ref_model, models, ids: torch.Tensor, window: int = 1024) -> list[tuple[torch.Tensor, float]]:
    """Per model: where its teacher-forced argmax equals `ref_model`'s [T], and its logits' relative RMS
    error against `ref_model`'s over all windows (the less noisy of the two measures)."""
    hits, err, norm = [[] for _ in models], [0.0] * len(models), 0.0
    for i in range(0, len(ids), window):
        chunk = ids[i:i + window].to(DEVICE)[None]
        ref = ref_model(chunk).logits[0].float()
        norm += ref.square().sum().item()
        for k, m in enumerate(models):
            out = m(chunk).logits[0].float()
            hits[k].append((out.argmax(-1) == ref.argmax(-1)).cpu())
            err[k] += (out - ref).square().sum().item()
    return [(torch.cat(h), (e / norm) ** 0.5) for h, e in zip(hits, err)]


@torch.no_grad()
def greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=DEVICE)
    out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fp32")
    ap.add_argument("--bf16")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    from transformers import AutoTokenizer
    from llmc.models import builtin_dir, heldout_text_path
    src = builtin_dir("tiny-py")
    tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
    ids = torch.tensor(tok.encode(heldout_text_path().read_text()[:400_000], add_special_tokens=False)[:a.tokens])
    base32 = load(src, torch.float32)
    res = {"tokens": len(ids)}
    step = len(ids) // (a.prompts + 1)
    prompts = [ids[i * step:i * step + 64].tolist() for i in range(1, a.prompts + 1)]
    if a.fp32:
        ref_greedy = [greedy(base32, p, a.new) for p in prompts]
        wide = load(a.fp32, torch.float32)
        got = [greedy(wide, p, a.new) for p in prompts]
        probe = ids[:512].to(DEVICE)[None]
        with torch.no_grad():
            l0, l1 = base32(probe).logits.float(), wide(probe).logits.float()
        res["fp32"] = {"greedy_equal": got == ref_greedy,
                       "greedy_tokens_equal": sum(x == y for g, r in zip(got, ref_greedy) for x, y in zip(g, r)),
                       "greedy_tokens": sum(len(r) for r in ref_greedy),
                       "max_logit_diff_rel": ((l1 - l0).abs().max() / l0.abs().max()).item()}
        del wide
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if a.bf16:
        (own_hit, own_err), (wide_hit, wide_err) = against_fp32(base32, [load(src, torch.bfloat16),
                                                                         load(a.bf16, torch.bfloat16)], ids)
        own, agree = own_hit.float().mean().item(), wide_hit.float().mean().item()
        # paired counts: positions only one of the two bf16 models gets right (McNemar's test)
        only_own, only_wide = int((own_hit & ~wide_hit).sum()), int((wide_hit & ~own_hit).sum())
        z = (only_wide - only_own) / max(1.0, (only_own + only_wide) ** 0.5)
        res["bf16"] = {"tiny_py_bf16_agreement": own, "widened_bf16_agreement": agree, "ok": agree >= own,
                       "only_tiny_py_bf16_right": only_own, "only_widened_right": only_wide, "mcnemar_z": z,
                       "tiny_py_bf16_logit_rel_rms_error": own_err, "widened_bf16_logit_rel_rms_error": wide_err,
                       "logit_error_ratio": wide_err / own_err}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "widen_check.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
