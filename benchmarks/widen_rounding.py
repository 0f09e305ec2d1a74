"""Where the widening's extra bf16 rounding should fall (scripts/widen_model.py, step 7): tiny-py
widened with ``--rounding nearest`` (the norm weights carry sqrt(h/H), q_proj sqrt(D/d), each
rounded to nearest), with ``--rounding feedback`` (the factors move into the linears that read
each norm, rounded with GPTQ's error feedback) and with ``--rounding copies`` (the residual's
padding holds scaled copies of its real dims, so the norms need no factor and only q_proj's
sqrt(D/d) is rounded, with feedback; by default with the logit shift of step 8, ``copies-plain``
without it), measured with Hugging Face transformers against tiny-py fp32
(CPU or GPU; ``--modes`` picks the widenings):

- teacher-forced next-token agreement with tiny-py fp32's argmax over held-out tokens (the first
  400,000 characters of the held-out text, windows of 1024, as benchmarks/widen_check.py), for
  tiny-py bf16 and both widenings; paired counts (positions only one of two models gets right) and
  McNemar's z of each widening against tiny-py bf16 and of feedback against nearest; the logits'
  errors against fp32's (`widen_check.LogitErrors`: centred relative RMS error, KL divergence);
- per linear that reads a norm, for a few layers and the LM head, the relative output error
  ``||Y - Y_exact|| / ||Y_exact||`` of the weights as written (norm weight times linear, in the
  source's coordinates, fp64) on tiny-py fp32's held-out norm outputs: nearest, the factor moved
  into the linear but rounded to nearest (what feedback adds over moving the factor), feedback,
  copies (0 where a linear keeps the source's weights).

The default shape, hidden 1024 with head_dim 128, rounds every weight as the Llama-3-8B shape does
(its factors sqrt(3/8) and sqrt(3)/2 are 8B's sqrt(3/32) and sqrt(3)/4 times 2) at an eighth of the
width, so it runs on a CPU (two cores: ~2 min to build, ~5 s per 1024-token window for the four
models); pass the 8B shape (--hidden 4096 --layers 32 --heads 32 --kv-heads 8 --intermediate 14336)
on a GPU. hidden 1024 leaves room for one copy only, so ``copies`` needs a wider stand-in: the 8B
widths with ``--layers 8`` run on the CPU (~13 min a model for 32,768 tokens) and give the 32-layer
model's logits bit for bit, since its 24 extra layers add exact zeros to the residual. Models are
built under --work (reused when their widen_info.json matches).

    python3 benchmarks/widen_rounding.py [--tokens 16384] [--hidden 1024 --layers 8 --heads 8
        --kv-heads 2 --head-dim 128 --intermediate 2048] [--dtype bfloat16] [--error-layers 0,3,7]
        [--error-tokens 8192] [--work /tmp/widen_rounding] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODES = ("nearest", "feedback", "copies")
# more widenings --modes can name: mode -> (rounding, logit_shift)
VARIANTS = {"copies-plain": ("copies", False)}

from tests.scripts import load_script  # noqa: E402  (after the repository is on sys.path)
from widen_check import LogitErrors, heldout_ids  # noqa: E402  (benchmarks/ is this script's own directory)

wm = load_script("widen_model")


def load(path, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(DEVICE).eval()


@torch.no_grad()
def run_windows(model, ids: torch.Tensor, ref: list | None = None, window: int = 1024):
    """Teacher-forced argmax [T] over windows of `window`; with `ref` (fp32's logits per window),
    also the logits' errors against it (`widen_check.LogitErrors`). Without, returns the logits per
    window."""
    hits, logits, errs = [], [], LogitErrors()
    for k, i in enumerate(range(0, len(ids), window)):
        out = model(ids[i:i + window].to(DEVICE)[None]).logits[0].float()  # [W, V]
        hits.append(out.argmax(-1).cpu())
        if ref is None:
            logits.append(out.cpu())
        else:
            errs.add(out.cpu(), ref[k])
    if ref is None:
        return torch.cat(hits), logits
    return torch.cat(hits), errs.result()


def paired(hits: dict[str, torch.Tensor], a: str, b: str) -> dict:
    """Positions only model a / only model b gets right, and McNemar's z of b against a (> 0: b better)."""
    only_a, only_b = int((hits[a] & ~hits[b]).sum()), int((hits[b] & ~hits[a]).sum())
    return {f"only_{a}_right": only_a, f"only_{b}_right": only_b,
            "mcnemar_z": (only_b - only_a) / max(1.0, (only_a + only_b) ** 0.5)}


def build(src, work: Path, shape: dict, dtype: torch.dtype, mode: str) -> Path:
    rounding, shift = VARIANTS.get(mode, (mode, None))
    out = work / mode
    info = out / "widen_info.json"
    if info.is_file():
        old = json.loads(info.read_text())
        shifted = (rounding == "copies") if shift is None else shift  # widen's default in a 16-bit dtype
        if (old["target_shape"], old.get("rounding"), old["dtype"], bool(old.get("logit_shift"))) == \
                (shape, rounding, str(dtype)[6:], shifted):
            return out
    t0 = time.perf_counter()
    wm.widen(src, out, dtype=dtype, rounding=rounding, logit_shift=shift, **shape)
    print(f"built {mode} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


@torch.no_grad()
def norm_outputs(src, ids: torch.Tensor, layers: list[int]) -> dict[str, torch.Tensor]:
    """tiny-py fp32's output [T, h] (fp64) of the norms of `layers` and the final norm."""
    model = load(src, torch.float32)
    want = {f"model.layers.{k}.{n}" for k in layers for n in wm.NORM_READERS} | {"model.norm"}
    xs: dict[str, list] = {n: [] for n in want}
    for name, module in model.named_modules():
        if name in want:
            module.register_forward_hook(lambda m, a, o, name=name: xs[name].append(o[0].double().cpu()))
    for i in range(0, len(ids), 1024):
        model(ids[i:i + 1024].to(DEVICE)[None])
    return {n: torch.cat(v) for n, v in xs.items()}


def layer_errors(src, dirs: dict[str, Path], x: dict[str, torch.Tensor], layers: list[int],
                 shape: dict, dtype: torch.dtype) -> dict:
    modes = list(dirs)
    """Relative output error of each linear that reads a norm, per rounding (module docstring)."""
    from safetensors import safe_open
    from transformers import LlamaConfig
    cfg = LlamaConfig.from_pretrained(src, local_files_only=True)
    p = wm.make_plan(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                     cfg.head_dim, cfg.intermediate_size, shape["hidden"], shape["layers"], shape["heads"],
                     shape["kv_heads"], shape["head_dim"], shape["intermediate"])
    idx = p.dim_index()
    q_rows = torch.cat([t * p.D + idx for t in p.q_map])  # source q row -> target row
    kv_rows = torch.cat([ts[0] * p.D + idx for ts in p.kv_map])
    c = math.sqrt(p.h / p.H)

    def tensors(path: Path) -> dict:
        where = {}
        for f in sorted(path.glob("*.safetensors")):
            h = safe_open(str(f), framework="pt")
            where.update({k: h for k in h.keys()})
        return where

    src_t, wide = tensors(Path(src)), {m: tensors(p_) for m, p_ in dirs.items()}

    def source(name):
        return src_t[name].get_tensor(name).double()

    infos = {m: json.loads((d / "widen_info.json").read_text()) for m, d in dirs.items()}

    def placed(m, name, rows):  # the written weight, back in the source's coordinates
        where = wide[m]
        if name == "lm_head.weight" and name not in where:
            name = "model.embed_tokens.weight"
        w = where[name].get_tensor(name)
        w = w if rows is None else w[rows]
        if infos[m].get("q_proj_in_two_terms") and name.endswith("q_proj.weight"):  # its second term reads copy 1
            return w[:, :p.h].double() + infos[m]["copy_scales"][0] * w[:, p.h:2 * p.h].double()
        return w[:, :p.h].double()

    jobs = [("lm_head", "model.norm", "lm_head.weight",
             "lm_head.weight" if "lm_head.weight" in src_t else "model.embed_tokens.weight", None, 1.0)]
    for k in layers:
        pre = f"model.layers.{k}."
        for norm, linears in wm.NORM_READERS.items():
            for lin in linears:
                rows = (q_rows if lin.endswith("q_proj") else kv_rows if lin.endswith(("k_proj", "v_proj"))
                        else torch.arange(p.i))
                s = math.sqrt(p.D / p.d) if lin.endswith("q_proj") else 1.0
                jobs.append((f"{k}.{lin.split('.')[1]}", pre + norm, pre + lin + ".weight", pre + lin + ".weight",
                             rows, s))
    out = {}
    for label, norm, name, src_name, rows, s in jobs:
        xn, w = x[norm], source(norm + ".weight")  # [T, h], [h]
        exact = xn @ (s * source(src_name)).T  # [T, N]: what the widened linear should output

        def err(norm_w, lin_w, f=c):  # widened norm output is xn * norm_w / (f * w); copies: f = 1
            ratio = torch.where(w != 0, norm_w / (f * w), torch.ones_like(w))
            return ((xn * ratio) @ lin_w.T - exact).norm().item() / exact.norm().item()

        res = {m: err(wide[m][norm + ".weight"].get_tensor(norm + ".weight")[:p.h].double(),
                      placed(m, name, rows), 1.0 if m.startswith("copies") else c) for m in modes}
        res["moved_nearest"] = err(w, (c * s * source(src_name)).to(dtype).double())
        res.update({f"{m}_over_nearest": res[m] / res["nearest"] for m in modes if m != "nearest" and "nearest" in res})
        out[label] = res
    keys = list(next(iter(out.values())))
    # geometric means over the linears a rounding touches (copies leaves k/v/gate/up exact: error 0)
    out["geomean"] = {k: math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else 0.0
                      for k in keys for vals in [[r[k] for r in out.values() if r[k] > 0]]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--error-layers", default="0,3,7", help="source layers whose linears' output error is reported")
    ap.add_argument("--error-tokens", type=int, default=8192, help="held-out tokens for the output errors")
    ap.add_argument("--work", default="/tmp/widen_rounding", help="where the widened models are built")
    ap.add_argument("--modes", default=",".join(MODES), help="the widenings to build and compare")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    from llmc.models import builtin_dir
    src = builtin_dir("tiny-py")
    dtype = getattr(torch, a.dtype)
    shape = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                 head_dim=a.head_dim, intermediate=a.intermediate)
    dirs = {m: build(src, Path(a.work), shape, dtype, m) for m in a.modes.split(",")}
    ids = heldout_ids()
    res = {"shape": shape, "dtype": a.dtype, "device": DEVICE, "tokens": min(a.tokens, len(ids))}

    layers = [int(k) for k in a.error_layers.split(",") if k]
    t0 = time.perf_counter()
    errs = layer_errors(src, dirs, norm_outputs(src, ids[:a.error_tokens], layers), layers, shape, dtype)
    res["output_error"] = {"tokens": min(a.error_tokens, len(ids)), **errs}
    print(f"output errors in {time.perf_counter() - t0:.0f} s", flush=True)

    ids = ids[:a.tokens]
    t0 = time.perf_counter()
    ref, ref_logits = run_windows(load(src, torch.float32), ids)
    hits, logit_err = {}, {}
    for name, path in (("tiny_py", src), *dirs.items()):
        argmax, logit_err[name] = run_windows(load(path, dtype), ids, ref_logits)
        hits[name] = argmax == ref
    print(f"agreement in {time.perf_counter() - t0:.0f} s", flush=True)
    res["agreement"] = {k: h.float().mean().item() for k, h in hits.items()}
    res["logit_errors"] = logit_err
    res["paired"] = {f"{b}_vs_{a}": paired(hits, a, b) for a, b in
                     [("tiny_py", m) for m in dirs] + [(x, y) for i, x in enumerate(dirs) for y in list(dirs)[i + 1:]]}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "widen_rounding.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
