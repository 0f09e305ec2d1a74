"""Check a widened tiny-py (scripts/widen_model.py) on the GPU, with Hugging Face transformers as
the executor (independent of llmc):

- fp32 (`--fp32 DIR`): greedy tokens of the widened model equal tiny-py fp32's on held-out prompts;
  also the largest logit difference relative to the logits' scale;
- bf16 (`--bf16 DIR`): teacher-forced next-token agreement with tiny-py fp32 over held-out text must
  be at least tiny-py bf16's own agreement with tiny-py fp32 (free-running agreement between two
  bf16 roundings is chaotic and says little); beside it McNemar's z of the paired positions and each
  bf16 model's `LogitErrors` against tiny-py fp32 (centred logits' relative RMS error and the
  next-token distributions' KL divergence; their ratios: how much less precise the widening is).

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


def heldout_ids(tokens: int | None = None) -> torch.Tensor:
    """tiny-py's token ids of the held-out text's first 400,000 characters (what the widening checks score;
    calibration reads the text's second half), the first `tokens` of them (None: all)."""
    from transformers import AutoTokenizer

    from llmc.models import builtin_dir, heldout_text_path
    tok = AutoTokenizer.from_pretrained(builtin_dir("tiny-py"), local_files_only=True)
    return torch.tensor(tok.encode(heldout_text_path().read_text()[:400_000], add_special_tokens=False)[:tokens])


def load(path, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(DEVICE).eval()


class LogitErrors:
    """A model's logits against the reference's, in measures that a per-position shift of all logits
    leaves alone (softmax and argmax do not see one; scripts/widen_model.py's logit shift makes one):
    the relative RMS error of the logits centred on each position's mean, and the mean KL divergence
    ``KL(p_ref || p)`` of the next-token distributions (what sampling sees; the centred error is
    mostly the tail's, tokens no sampler draws)."""

    def __init__(self):
        self.sq, self.norm, self.kl, self.n = 0.0, 0.0, 0.0, 0

    def add(self, out: torch.Tensor, ref: torch.Tensor) -> None:
        out, ref = out.double(), ref.double()
        co, cr = out - out.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
        self.sq += (co - cr).square().sum().item()
        self.norm += cr.square().sum().item()
        lp, lq = ref.log_softmax(-1), out.log_softmax(-1)
        self.kl += (lp.exp() * (lp - lq)).sum().item()
        self.n += len(ref)

    def result(self) -> dict:
        return {"logit_rel_rms_error": (self.sq / self.norm) ** 0.5, "kl": self.kl / self.n}


@torch.no_grad()
def against_fp32(ref_model, models, ids: torch.Tensor, window: int = 1024) -> list[tuple[torch.Tensor, dict]]:
    """Per model: where its teacher-forced argmax equals `ref_model`'s [T], and its `LogitErrors`
    against `ref_model`'s over all windows (less noisy than the agreement)."""
    hits, errs = [[] for _ in models], [LogitErrors() for _ in models]
    for i in range(0, len(ids), window):
        chunk = ids[i:i + window].to(DEVICE)[None]
        ref = ref_model(chunk).logits[0].float()
        for k, m in enumerate(models):
            out = m(chunk).logits[0].float()
            hits[k].append((out.argmax(-1) == ref.argmax(-1)).cpu())
            errs[k].add(out, ref)
    return [(torch.cat(h), e.result()) for h, e in zip(hits, errs)]


def compare(own_hit, own_err, wide_hit, wide_err) -> dict:
    """tiny-py bf16 against a widening: agreements, McNemar's z over the positions only one of the two
    gets right, and the ratios of their `LogitErrors`."""
    own, agree = own_hit.float().mean().item(), wide_hit.float().mean().item()
    only_own, only_wide = int((own_hit & ~wide_hit).sum()), int((wide_hit & ~own_hit).sum())
    return {"tiny_py_bf16_agreement": own, "widened_bf16_agreement": agree, "ok": agree >= own,
            "only_tiny_py_bf16_right": only_own, "only_widened_right": only_wide,
            "mcnemar_z": (only_wide - only_own) / max(1.0, (only_own + only_wide) ** 0.5),
            "tiny_py_bf16": own_err, "widened_bf16": wide_err,
            "logit_error_ratio": wide_err["logit_rel_rms_error"] / own_err["logit_rel_rms_error"],
            "kl_ratio": wide_err["kl"] / own_err["kl"]}


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
    from llmc.models import builtin_dir
    src = builtin_dir("tiny-py")
    ids = heldout_ids(a.tokens)
    base32 = load(src, torch.float32)
    res = {"tokens": len(ids)}
    step = len(ids) // (a.prompts + 1)
    prompts = [ids[i * step:i * step + 64].tolist() for i in range(1, a.prompts + 1)]
    if a.fp32:
        ref_greedy = [greedy(base32, p, a.new) for p in prompts]
        wide = load(a.fp32, torch.float32)
        got = [greedy(wide, p, a.new) for p in prompts]
        probe = ids[:512].to(DEVICE)[None]
        with torch.no_grad():  # centred: a widening with the logit shift moves each position's logits
            l0, l1 = (m(probe).logits.float() for m in (base32, wide))
            l0, l1 = l0 - l0.mean(-1, keepdim=True), l1 - l1.mean(-1, keepdim=True)
        res["fp32"] = {"greedy_equal": got == ref_greedy,
                       "greedy_tokens_equal": sum(x == y for g, r in zip(got, ref_greedy) for x, y in zip(g, r)),
                       "greedy_tokens": sum(len(r) for r in ref_greedy),
                       "max_logit_diff_rel": ((l1 - l0).abs().max() / l0.abs().max()).item()}
        del wide
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if a.bf16:
        wide = load(a.bf16, torch.bfloat16)
        (own_hit, own_err), (wide_hit, wide_err) = against_fp32(base32, [load(src, torch.bfloat16), wide], ids)
        res["bf16"] = compare(own_hit, own_err, wide_hit, wide_err)
        info = json.loads(Path(a.bf16, "widen_info.json").read_text())
        if info.get("logit_shift"):  # the same widening without its logit shift (step 8), for comparison
            h = info["source_shape"]["hidden"]
            with torch.no_grad():
                wide.lm_head.weight[:, h:2 * h] = 0
            ((plain_hit, plain_err),) = against_fp32(base32, [wide], ids)
            res["bf16"]["without_logit_shift"] = compare(own_hit, own_err, plain_hit, plain_err)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "widen_check.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
