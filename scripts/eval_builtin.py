"""Evaluate llmc's built-in models on held-out data and write the report, metrics and README.

Measures, for ``tiny-py`` (target) and ``tiny-py-draft``:

* held-out perplexity per token and per byte, on ``DATA/test.bin`` (the whole held-out split,
  files joined by ``<|endoftext|>``, never trained on), scored as the first ``--max-windows``
  non-overlapping 512-token windows, fp32 (see ``llmc/models/evaluate.py`` for conventions);
* top-1 accuracy against the true next token;
* greedy agreement: the fraction of positions where the draft's argmax equals the target's,
  both teacher-forced on the same windows (a proxy for speculative-decoding acceptance);
* the fixed-slice perplexity (``heldout_slice_perplexity``, fp32 CPU) that the tests re-check.

``--max-windows 64`` (32k tokens) takes about a minute on 2 CPU cores; on CUDA pass
``--max-windows 0`` to score the whole split.

Example::

    python scripts/eval_builtin.py --target llmc/models/tiny-py --draft llmc/models/tiny-py-draft \
        --data .data --out .data/eval_report.json --write-metrics --readme llmc/models/README.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmc.models import evaluate as ev  # noqa: E402


def evaluate_pair(target_dir: Path, draft_dir: Path, data: Path, window: int, max_windows: int | None,
                  device: str, batch_size: int, slice_tokens: int) -> dict:
    """Score both models on the same test.bin windows; returns the JSON report."""
    tokens = np.fromfile(data / "test.bin", dtype=np.uint16)
    windows = ev.make_windows(tokens, window, max_windows)
    tokenizer = ev.load_tokenizer(target_dir)
    byte_lengths = ev.token_byte_lengths(tokenizer)
    report = {
        "data": "test.bin: the held-out split (whole stdlib files never trained on, EOS-joined)",
        "windows": int(windows.shape[0]), "window": window, "device": device, "dtype": "float32",
        "models": {},
    }
    argmaxes = {}
    for role, model_dir in (("target", target_dir), ("draft", draft_dir)):
        t0 = time.time()
        model = ev.load_model(model_dir, device, torch.float32)
        nll, argmax = ev.score_windows(model, windows, batch_size)
        stats = ev.perplexity_stats(nll, windows, byte_lengths)
        stats["top1_accuracy"] = float((argmax == windows[:, 1:]).double().mean())
        stats["params"] = sum(p.numel() for p in model.parameters())
        del model
        stats["heldout_slice"] = {
            "source": "llmc/models/data/heldout.txt",
            "n_tokens": slice_tokens,
            "perplexity": ev.heldout_slice_perplexity(model_dir, n_tokens=slice_tokens, window=window),
        }
        log_path = Path(model_dir) / "train_log.json"
        if log_path.is_file():
            log = json.loads(log_path.read_text())
            stats["training"] = {k: log.get(k) for k in (
                "steps_planned", "steps_fitted", "steps_done", "batch", "ctx", "tokens_seen", "epochs",
                "train_wall_s", "stopped_early", "device", "torch", "final_heldout_loss", "lr", "dropout")}
        stats["eval_seconds"] = round(time.time() - t0, 1)
        report["models"][role] = {"name": Path(model_dir).name, "dir": str(model_dir), **stats}
        argmaxes[role] = argmax
        print(f"{role} {Path(model_dir).name}: ppl/token {stats['perplexity_per_token']:.3f}, "
              f"bits/byte {stats['bits_per_byte']:.4f}, top-1 {stats['top1_accuracy']:.3f}, "
              f"slice ppl {stats['heldout_slice']['perplexity']:.3f} ({stats['eval_seconds']}s)")
    report["draft_target_greedy_agreement"] = ev.agreement_rate(argmaxes["draft"], argmaxes["target"])
    print(f"greedy agreement draft vs target: {report['draft_target_greedy_agreement']:.4f}")
    return report


def write_metrics(report: dict) -> None:
    """``metrics.json`` in each model dir: what the tests compare against."""
    agreement = report["draft_target_greedy_agreement"]
    for role, m in report["models"].items():
        metrics = {
            "model": m["name"],
            "params": m["params"],
            "heldout_slice": m["heldout_slice"],
            "heldout": {k: m[k] for k in ("tokens", "bytes", "nll_per_token", "perplexity_per_token",
                                          "bits_per_byte", "perplexity_per_byte", "top1_accuracy")},
            "heldout_data": report["data"],
            "window": report["window"],
            "draft_target_greedy_agreement": agreement,
        }
        (Path(m["dir"]) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


def write_readme(report: dict, path: Path) -> None:
    """``llmc/models/README.md``: how the models were made and what they measure."""
    rows = []
    for role, m in report["models"].items():
        t = m.get("training", {})
        rows.append(
            f"| `{m['name']}` | {role} | {m['params'] / 1e6:.2f}M | {m['perplexity_per_token']:.3f} | "
            f"{m['bits_per_byte']:.4f} | {m['perplexity_per_byte']:.4f} | {m['top1_accuracy']:.3f} | "
            f"{m['heldout_slice']['perplexity']:.3f} | {t.get('steps_done')} | "
            f"{(t.get('tokens_seen') or 0) / 1e6:.0f}M | {'yes' if t.get('stopped_early') else 'no'} |")
    agreement = report["draft_target_greedy_agreement"]
    tgt = report["models"]["target"].get("training", {})
    text = f"""# Built-in models

Two small Llama models trained from scratch on the Python standard library's own source, shipped
so that llmc's compiler, runtime and speculative decoding can be tested on real trained weights
without a model hub. Resolve them with `llmc.models.builtin_dir("tiny-py")`.

| model | role | params | ppl/token | bits/byte | ppl/byte | top-1 | slice ppl | steps | tokens | capped |
|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Greedy agreement of the draft with the target (teacher-forced, same windows): **{agreement:.4f}**.

## How they were made

- Corpus (`scripts/build_corpus.py`): every `*.py` of CPython 3.11's stdlib (tests included,
  `site-packages` excluded), sorted; ~3% of whole files held out by a hash of their path.
  Byte-level BPE tokenizer, 8192 tokens, `<|endoftext|>` (id 0) is bos/eos/pad and separates
  files. `data/heldout.txt` is the held-out split as text (each file preceded by the separator).
- Training (`scripts/train_builtin.py`): `LlamaForCausalLM`, GQA, tied embeddings, context 512,
  AdamW (0.9, 0.95, wd 0.1), warmup then cosine to 10% of peak, bf16 autocast, seeded.
  Target: {tgt.get('steps_done')} steps of {tgt.get('batch')}x{tgt.get('ctx')} tokens
  ({tgt.get('epochs') or 0:.1f} epochs) on {tgt.get('device')} in {tgt.get('train_wall_s')} s
  (torch {tgt.get('torch')}). Full logs: `<model>/train_log.json`.
- Evaluation (`scripts/eval_builtin.py`, numbers above): {report['data']}; first
  {report['windows']} non-overlapping {report['window']}-token windows, fp32 on {report['device']}.
  Per-byte numbers count the UTF-8 bytes of predicted tokens (the separator counts as 1 byte).
  "slice ppl" is `llmc.models.evaluate.heldout_slice_perplexity` (fp32 CPU, first
  {report['models']['target']['heldout_slice']['n_tokens']} tokens of `data/heldout.txt`); the tests
  check it against `<model>/metrics.json` within 2%.
"""
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description="Held-out perplexity and draft agreement of the built-in models.")
    ap.add_argument("--target", type=Path, default=REPO / "llmc" / "models" / "tiny-py")
    ap.add_argument("--draft", type=Path, default=REPO / "llmc" / "models" / "tiny-py-draft")
    ap.add_argument("--data", type=Path, default=REPO / ".data")
    ap.add_argument("--window", type=int, default=ev.DEFAULT_WINDOW)
    ap.add_argument("--max-windows", type=int, default=64, help="0 = the whole test split")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--slice-tokens", type=int, default=ev.DEFAULT_SLICE_TOKENS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=REPO / ".data" / "eval_report.json")
    ap.add_argument("--write-metrics", action="store_true", help="write <model>/metrics.json")
    ap.add_argument("--readme", type=Path, default=None, help="also write this README")
    args = ap.parse_args()

    report = evaluate_pair(args.target, args.draft, args.data, args.window, args.max_windows or None,
                           args.device, args.batch_size, args.slice_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report -> {args.out}")
    if args.write_metrics:
        write_metrics(report)
    if args.readme:
        write_readme(report, args.readme)
        print(f"readme -> {args.readme}")


if __name__ == "__main__":
    main()
