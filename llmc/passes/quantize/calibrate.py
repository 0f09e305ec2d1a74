"""Phase 2, second pass: run the model on calibration text and collect, for the input of every
planned linear, what the methods need: per-channel mean |x| (AWQ), max |x| (SmoothQuant) and the
Gram matrix X^T X over every calibration token (GPTQ's Hessian, AWQ's output error; mixed).

The graph runs as it is at this point (paged, token-flattened) through the IR interpreter (the
golden model) over a KV cache, one calibration window per sequence, on the GPU when there is one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from llmc.errors import CompileError
from llmc.passes.manager import Pass, PassContext, PassResult, register_pass
from llmc.passes.quantize.config import QuantConfig
from llmc.passes.quantize.materialize import planned

STATS = "calibration"


@dataclass
class InputStats:
    """Statistics of one linear input x [tokens, K] over the calibration tokens."""

    k: int
    hessian: bool
    tokens: int = 0
    abs_sum: torch.Tensor | None = None
    abs_max: torch.Tensor | None = None
    xtx: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, self.k).float()
        a = x.abs()
        self.abs_sum = a.sum(0) if self.abs_sum is None else self.abs_sum + a.sum(0)
        self.abs_max = a.amax(0) if self.abs_max is None else torch.maximum(self.abs_max, a.amax(0))
        if self.hessian:
            xtx = x.t() @ x
            self.xtx = xtx if self.xtx is None else self.xtx + xtx
        self.tokens += x.shape[0]

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum.cpu() / max(1, self.tokens)

    def gram(self) -> torch.Tensor:
        """X^T X / tokens [K, K] fp32, on the CPU."""
        return (self.xtx / max(1, self.tokens)).cpu()

    def gptq_hessian(self) -> torch.Tensor:
        """H = 2 X^T X / tokens (GPTQ's scaling; any positive multiple gives the same result)."""
        return 2 * self.gram()


def calibration_windows(ctx: PassContext, cfg: QuantConfig, context: int | None = None) -> list[list[int]]:
    """`calib_samples` windows of `calib_len` tokens (at most `context`, the model's positions), evenly spread
    over the calibration text."""
    tok_dir = ctx.state.get("tokenizer_dir")
    if tok_dir is None:
        raise CompileError("calibration needs the model's tokenizer: compile a Hugging Face directory (with its "
                           "tokenizer files) or give an ONNX file's with --tokenizer DIR, or quantize with --quant "
                           "rtn or fp8, which need no calibration")
    from llmc.tokenizer import load_tokenizer
    tok = load_tokenizer(tok_dir)
    if hasattr(tok, "model_max_length"):  # the text is cut into windows here: no "longer than the maximum" warning
        tok.model_max_length = 1 << 62
    if cfg.calib == "builtin:heldout":
        from llmc.models import heldout_text_path
        text = heldout_text_path().read_text()
        text = text[len(text) // 2:]  # the second half: `llmc eval --dataset builtin:heldout` reads the first
    else:
        try:
            text = open(cfg.calib, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise CompileError(f"--calib {cfg.calib}: cannot read it as UTF-8 text ({e})") from None
    ids = tok.encode(text, add_special_tokens=False)
    n, length = cfg.calib_samples, cfg.calib_len
    if context is not None and length > context:  # positions the model never runs at would skew the statistics
        ctx.note(f"calibrate: windows of {length} tokens are longer than the model's {context} positions; "
                 f"windows of {context} are used")
        length = context
    if len(ids) < length:
        raise CompileError(f"--calib {cfg.calib}: {len(ids)} tokens, fewer than one calibration window of {length}")
    if n > len(ids) // length:  # more windows than the text holds side by side: they would mostly repeat it
        ctx.note(f"calibrate: --calib-samples {n} asks for more windows of {length} tokens than the {len(ids):,} "
                 f"tokens of the calibration text hold without overlapping; {len(ids) // length} are used")
        n = len(ids) // length
    step = max(1, (len(ids) - length) // max(1, n - 1)) if n > 1 else 1
    return [ids[i * step:i * step + length] for i in range(n) if i * step + length <= len(ids)]


@register_pass
@dataclass
class Calibrate(Pass):
    name: ClassVar[str] = "calibrate"
    config: QuantConfig = QuantConfig()
    batch: int = 8  # windows per forward

    def run(self, g, ctx: PassContext):
        cfg = self.config
        items = planned(g)
        if not cfg.needs_calibration or not items:
            return PassResult(g, False)
        from llmc.runtime.executor import ReferenceExecutor, StepInput
        from llmc.runtime.kv_cache import KVCache
        context = g.meta.get("max_position_embeddings")
        windows = calibration_windows(ctx, cfg, int(context) if context else None)
        hessian = cfg.method in ("gptq", "mixed", "awq")
        stats = {n.inputs[0].name: InputStats(int(n.inputs[0].type.shape[-1]), hessian) for n, _ in items}
        readers = {id(n): n.inputs[0].name for n, _ in items}
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        block = 16
        per_seq = -(-max(map(len, windows)) // block)
        ex = ReferenceExecutor(g, KVCache(g, device, block_size=block, num_blocks=per_seq * self.batch))
        seen: set[str] = set()

        def observe(node, args):
            name = readers.get(id(node))
            if name is not None and name not in seen:  # parallel linears read one x: count it once
                seen.add(name)
                stats[name].add(args[0])

        advance = _progress(ctx, len(windows))
        with torch.inference_mode():
            for i in range(0, len(windows), self.batch):
                chunk = windows[i:i + self.batch]
                seqs = [StepInput(w, 0, list(range(j * per_seq, (j + 1) * per_seq))) for j, w in enumerate(chunk)]
                seen.clear()
                ex.plan.run(ex.build_inputs(seqs), observe=observe)
                advance(len(chunk))
        ctx.state[STATS] = stats
        g.meta["quant_plan"]["calibration"] = {"source": cfg.calib, "windows": len(windows),
                                              "tokens": sum(map(len, windows))}
        return PassResult(g, False, {"windows": len(windows), "inputs": len(stats)})


def _progress(ctx: PassContext, total: int):
    """Advance the compile's progress line ("calibrating 8/32 windows") when it shows one."""
    status = ctx.state.get("status")
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        if status is not None:
            status(f"calibrating: {done[0]}/{total} windows")
    return advance
