"""Where tiny-py bf16 loses its agreement with tiny-py fp32: the fp32 model run with its outputs rounded to
bf16 at one kind of site only (the LM head's logits; every other linear; q, k and v; q alone; o_proj; the MLP's
linears; the RMSNorms; each decoder layer's output, i.e. the residual stream), beside the whole model in bf16.
For each: teacher-forced next-token argmax agreement with fp32 over held-out tokens (the first 400,000
characters of the held-out text, windows of 1024, as widen_check.py) and the logits' relative RMS error.
HF transformers on the CPU, about half a minute for 16,384 tokens.

    python3 benchmarks/bf16_rounding_sites.py [--tokens 16384] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SITES = {  # module name (its last part) or class name -> rounded there
    "logits": lambda name, mod: name == "lm_head",
    "linears": lambda name, mod: isinstance(mod, torch.nn.Linear) and name != "lm_head",
    "qkv": lambda name, mod: name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj"),
    "q": lambda name, mod: name.endswith(".q_proj"),
    "o_proj": lambda name, mod: name.endswith(".o_proj"),
    "mlp": lambda name, mod: name.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj"),
    "norms": lambda name, mod: "RMSNorm" in type(mod).__name__,
    "residual": lambda name, mod: type(mod).__name__.endswith("DecoderLayer"),
}


def _round(module, args, out):
    if isinstance(out, tuple):
        return (out[0].bfloat16().float(), *out[1:])
    return out.bfloat16().float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from llmc.models import builtin_dir
    from widen_check import heldout_ids  # this script's own directory
    src = builtin_dir("tiny-py")
    ids = heldout_ids(a.tokens)

    def load(dtype):
        return AutoModelForCausalLM.from_pretrained(src, dtype=dtype, local_files_only=True).eval()

    @torch.no_grad()
    def logits(model):
        return torch.cat([model(ids[i:i + 1024][None]).logits[0].float() for i in range(0, len(ids), 1024)])

    m32 = load(torch.float32)
    ref = logits(m32)
    res = {"tokens": len(ids)}

    def record(name, out):
        res[name] = {"agreement": (out.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                     "logit_rel_rms_error": ((out - ref).norm() / ref.norm()).item()}
        print(f"{name:10s} agreement {res[name]['agreement']:.5f}  logits' error {res[name]['logit_rel_rms_error']:.6f}",
              flush=True)

    record("bf16", logits(load(torch.bfloat16)))
    for site, where in SITES.items():
        hooks = [m.register_forward_hook(_round) for n, m in m32.named_modules() if where(n, m)]
        record(site, logits(m32))
        for h in hooks:
            h.remove()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "bf16_rounding_sites.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
