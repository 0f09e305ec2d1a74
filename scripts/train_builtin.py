"""Train one of llmc's built-in models (``tiny-py`` or ``tiny-py-draft``) from scratch.

Input is the output of ``scripts/build_corpus.py`` (``DATA/train.bin``, ``DATA/test.bin``,
``DATA/tokenizer/``); output is a plain Hugging Face directory with bf16 safetensors, the
tokenizer files and ``train_log.json``.

Design choices, and why:

* Plain ``transformers.LlamaForCausalLM`` with ``attn_implementation="sdpa"``: the models exist
  to exercise llmc's Hugging Face frontend, so they must be exactly what users bring. Grouped-
  query attention and tied embeddings are on because the compiler must handle both.
* The whole token stream lives on the device and batches are random contiguous windows drawn
  with a seeded device generator: no data loader, no host sync per step, reproducible.
* fp32 master weights with bf16 autocast on CUDA; fused AdamW; the loss is computed in fp32
  from the logits (vocab 8192 makes that cheap).
* The cosine schedule is defined over ``--steps``. ``--seconds`` is a hard wall-clock cap
  that stops early (and says so in the log) so a slow machine still produces a model.
  ``--fit-to-seconds`` goes one step further: ``--steps`` becomes a maximum, and every
  ``--fit-every`` steps the measured step time re-plans the total so that the whole cosine
  schedule ends inside ``--seconds``. The plan may grow (up to ``--steps``) only in the first
  30% of the schedule, where the cosine is still flat; later it only shrinks. This matters when
  two trainings share one GPU: the draft finishes early and the target then runs faster than it
  did at the start, and a finished schedule beats one cut off at a high learning rate.
* Residual dropout (``--dropout``) is applied with forward hooks during training only, so the
  saved model stays a stock Llama. It matters because the corpus is small (~8M tokens): the
  target model sees it many times over.
* No torch.compile by default: it is optional (``--compile``) and falls back to eager if the
  first step fails, because a broken compile must not cost the one GPU run.

Example (CPU smoke test)::

    python scripts/train_builtin.py --model tiny-py-draft --steps 4 --batch 2 --device cpu \
        --out /tmp/tiny-py-draft
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

EOS_ID = 0  # <|endoftext|> is the first special token of the tokenizer built by build_corpus.py
VOCAB_SIZE = 8192
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class Preset:
    """Architecture plus default training hyper-parameters of one built-in model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    lr: float
    steps: int
    batch: int
    dropout: float
    max_positions: int = 1024
    warmup: int = 200
    weight_decay: float = 0.1


PRESETS = {
    # 15.7M parameters (3.1M of them the tied embedding): head_dim 64, 3 query heads per KV head.
    "tiny-py": Preset(hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1024,
                      lr=1.5e-3, steps=7000, batch=64, dropout=0.1),
    # 1.9M parameters: head_dim 32, cheap enough to be a useful speculative draft.
    "tiny-py-draft": Preset(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384,
                            lr=3e-3, steps=2500, batch=64, dropout=0.0),
}


def make_config(p: Preset):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        max_position_embeddings=p.max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        attn_implementation="sdpa",
    )


def add_residual_dropout(model, p: float) -> None:
    """Dropout on each attention and MLP output (what GPT-2 calls resid_pdrop), as hooks so the
    saved config and modules stay stock Llama; the hooks are inert in eval mode."""
    if p <= 0:
        return

    def hook(module, args, out):
        if isinstance(out, tuple):
            return (F.dropout(out[0], p, module.training),) + tuple(out[1:])
        return F.dropout(out, p, module.training)

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def lr_at(step: int, total: int, p: Preset, peak: float) -> float:
    """Linear warmup, then cosine from ``peak`` down to ``peak / 10`` at ``total``."""
    warmup = min(p.warmup, max(1, total // 10))
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def fit_steps(step: int, max_steps: int, dt: float, remaining_s: float, evals_left: int) -> int:
    """Total steps whose remainder fits in ``remaining_s`` at ``dt`` s/step, keeping ~15 s for
    the final eval and saving and ~0.5 s per periodic eval, with a 5% margin."""
    budget = remaining_s - 15.0 - 0.5 * evals_left
    return max(step + 1, min(max_steps, step + int(0.95 * budget / dt)))


class Batches:
    """Random contiguous windows of ``ctx + 1`` tokens from a token stream kept on the device."""

    def __init__(self, tokens: np.ndarray, ctx: int, batch: int, device: torch.device, seed: int):
        self.data = torch.from_numpy(tokens.astype(np.int64)).to(device)
        self.offsets = torch.arange(ctx + 1, device=device)
        self.ctx, self.batch = ctx, batch
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        hi = self.data.numel() - self.ctx - 1
        starts = torch.randint(0, hi, (self.batch,), device=self.data.device, generator=self.gen)
        w = self.data[starts[:, None] + self.offsets]  # w: [B, ctx + 1]
        return w[:, :-1], w[:, 1:]


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (targets are given, so no label shifting)."""
    logits = model(input_ids=x).logits  # logits: [B, S, V]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def heldout_loss(model, tokens: np.ndarray, ctx: int, windows: int, device, autocast: bool) -> float:
    """Mean loss on the first ``windows`` non-overlapping windows of test.bin (a fixed slice)."""
    model.eval()
    n = min(windows, (len(tokens) - 1) // ctx)
    idx = np.arange(n)[:, None] * ctx + np.arange(ctx + 1)[None, :]
    data = torch.from_numpy(tokens.astype(np.int64)[idx]).to(device)
    total = 0.0
    for i in range(0, n, 16):
        w = data[i : i + 16]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            total += lm_loss(model, w[:, :-1], w[:, 1:]).item() * w.shape[0]
    model.train()
    return total / n


def param_groups(model, weight_decay: float):
    """Decay matrices (incl. the tied embedding), not norms: the usual GPT recipe."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def save(model, out: Path, data_dir: Path, log: dict) -> None:
    """bf16 safetensors + configs + tokenizer files + train_log.json."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID, do_sample=False
    )
    model.save_pretrained(str(out))  # transformers >= 5 writes safetensors only
    if not (out / "model.safetensors").is_file():
        raise SystemExit(f"expected {out}/model.safetensors after save_pretrained")
    for name in TOKENIZER_FILES:
        src = data_dir / "tokenizer" / name
        if src.is_file():
            shutil.copy2(src, out / name)
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")


def parse_args():
    ap = argparse.ArgumentParser(description="Train a built-in llmc model (tiny-py, tiny-py-draft).")
    ap.add_argument("--model", choices=sorted(PRESETS), required=True)
    ap.add_argument("--steps", type=int, help="optimizer steps; the cosine schedule spans them")
    ap.add_argument("--batch", type=int, help="sequences per step")
    ap.add_argument("--ctx", type=int, default=512, help="training context length")
    ap.add_argument("--lr", type=float, help="peak learning rate")
    ap.add_argument("--dropout", type=float, help="residual dropout while training")
    ap.add_argument("--seconds", type=float, default=None, help="wall-clock cap; stops early")
    ap.add_argument("--fit-to-seconds", action="store_true",
                    help="treat --steps as a maximum and re-plan the schedule to fit --seconds")
    ap.add_argument("--fit-every", type=int, default=250, help="steps between re-plans")
    ap.add_argument("--data", type=Path, default=Path(".data"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-windows", type=int, default=32, help="windows for periodic held-out loss")
    ap.add_argument("--final-eval-windows", type=int, default=256)
    ap.add_argument("--probe-steps", type=int, default=30, help="steps timed after step 10")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (eager fallback)")
    return ap.parse_args()


def main() -> None:
    t_start = time.time()
    args = parse_args()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    import transformers
    from transformers import LlamaForCausalLM

    preset = PRESETS[args.model]
    steps = args.steps or preset.steps
    batch = args.batch or preset.batch
    peak_lr = args.lr or preset.lr
    dropout = preset.dropout if args.dropout is None else args.dropout
    device = torch.device(args.device)
    use_autocast = device.type == "cuda"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    torch.manual_seed(args.seed)
    train_tokens = np.fromfile(args.data / "train.bin", dtype=np.uint16)
    test_tokens = np.fromfile(args.data / "test.bin", dtype=np.uint16)
    model = LlamaForCausalLM(make_config(preset)).to(device)
    n_params = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    add_residual_dropout(model, dropout)
    model.train()
    opt = torch.optim.AdamW(param_groups(model, preset.weight_decay), lr=peak_lr,
                            betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    batches = Batches(train_tokens, args.ctx, batch, device, args.seed + 1)
    step_fn = torch.compile(lm_loss) if args.compile else lm_loss
    tokens_per_step = batch * args.ctx
    print(f"{args.model}: {n_params / 1e6:.2f}M params, {steps} steps x {tokens_per_step} tokens "
          f"= {steps * tokens_per_step / 1e6:.0f}M tokens "
          f"({steps * tokens_per_step / len(train_tokens):.1f} epochs of {len(train_tokens) / 1e6:.2f}M), "
          f"lr {peak_lr}, dropout {dropout}, device {device}", flush=True)

    log = {"model": args.model, "preset": asdict(preset), "params": n_params, "steps_planned": steps,
           "batch": batch, "ctx": args.ctx, "lr": peak_lr, "dropout": dropout, "seed": args.seed,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
           "torch": torch.__version__, "transformers": transformers.__version__, "compile": args.compile,
           "loss_curve": [], "heldout_curve": [], "fit_history": [], "stopped_early": False}
    probe = (10, 10 + args.probe_steps)  # after CUDA warm-up, early enough to act on
    t_probe = None
    max_steps, t_fit, step_fit = steps, None, 0
    running, running_n = torch.zeros((), device=device), 0
    console = Console()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                        console=console, disable=not console.is_terminal)
    step = 0
    with progress:
        task = progress.add_task(args.model, total=steps, info="")
        while step < steps:
            if args.seconds is not None and time.time() - t_start > args.seconds:
                log["stopped_early"] = True
                print(f"WARNING: --seconds {args.seconds:.0f} cap hit at step {step}/{steps}; "
                      "the cosine schedule did not finish", flush=True)
                break
            lr = lr_at(step, steps, preset, peak_lr)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = batches.next()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                try:
                    loss = step_fn(model, x, y)
                except Exception as exc:  # noqa: BLE001 - any compile failure -> eager
                    if step_fn is lm_loss:
                        raise
                    print(f"torch.compile failed ({type(exc).__name__}: {exc}); using eager", flush=True)
                    step_fn, log["compile"] = lm_loss, False
                    loss = lm_loss(model, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            running += loss.detach()
            running_n += 1
            step += 1

            if step in probe:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if step == probe[0]:
                    t_probe = time.time()
                else:
                    dt = (time.time() - t_probe) / (probe[1] - probe[0])
                    elapsed = time.time() - t_start
                    print(f"throughput: {tokens_per_step / dt:,.0f} tokens/s, {dt * 1e3:.1f} ms/step; "
                          f"{steps} steps need ~{elapsed + (steps - step) * dt:.0f}s", flush=True)
                    log["tokens_per_s_probe"] = tokens_per_step / dt
                    t_fit, step_fit = time.time(), step
            if args.fit_to_seconds and args.seconds and t_fit is not None and (
                    step == probe[1] or step - step_fit >= args.fit_every):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.time()
                if step > step_fit:
                    dt = (now - t_fit) / (step - step_fit)
                new = fit_steps(step, max_steps, dt, args.seconds - (now - t_start),
                                (steps - step) // args.eval_every + 1)
                shrink = new < 0.98 * steps
                grow = step < 0.3 * steps and new > steps and (new > 1.02 * steps or new == max_steps)
                if shrink or grow:
                    print(f"fit-to-seconds: {dt * 1e3:.1f} ms/step, steps {steps} -> {new}", flush=True)
                    log["fit_history"].append({"step": step, "ms_per_step": round(dt * 1e3, 2),
                                               "steps": new})
                    steps = new
                    log["steps_fitted"] = steps
                    progress.update(task, total=steps)
                t_fit, step_fit = now, step

            if step % args.log_every == 0 or step == steps:
                mean = (running / running_n).item()
                running, running_n = torch.zeros((), device=device), 0
                elapsed = time.time() - t_start
                log["loss_curve"].append({"step": step, "loss": round(mean, 4), "lr": lr,
                                          "time_s": round(elapsed, 1)})
                info = f"loss {mean:.3f} lr {lr:.2e}"
                progress.update(task, info=info)
                if not console.is_terminal or step % (args.log_every * 10) == 0:
                    print(f"step {step}/{steps} {info} {elapsed:.0f}s", flush=True)
            if step % args.eval_every == 0 and step < steps:
                h = heldout_loss(model, test_tokens, args.ctx, args.eval_windows, device, use_autocast)
                log["heldout_curve"].append({"step": step, "loss": round(h, 4)})
                print(f"step {step}: held-out loss {h:.3f}", flush=True)
            progress.update(task, completed=step)

    if device.type == "cuda":
        torch.cuda.synchronize()
    train_time = time.time() - t_start
    final = heldout_loss(model, test_tokens, args.ctx, args.final_eval_windows, device, use_autocast)
    log.update(steps_done=step, tokens_seen=step * tokens_per_step,
               epochs=step * tokens_per_step / len(train_tokens), train_wall_s=round(train_time, 1),
               final_heldout_loss=round(final, 4),
               final_heldout_tokens=min(args.final_eval_windows, (len(test_tokens) - 1) // args.ctx) * args.ctx)
    log["heldout_curve"].append({"step": step, "loss": round(final, 4)})
    save(model, args.out, args.data, log | {"wall_s": round(time.time() - t_start, 1)})
    print(f"done: {step} steps, {log['tokens_seen'] / 1e6:.1f}M tokens, held-out loss {final:.3f} "
          f"(ppl {math.exp(final):.2f}), {time.time() - t_start:.0f}s -> {args.out}", flush=True)


if __name__ == "__main__":
    main()
