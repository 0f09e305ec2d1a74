"""Options and checks that several llmc commands share: the engine's, a parallel run's, --plugin and
speculation."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from llmc.errors import RequestError
from llmc.runtime.config import EngineConfig

ENGINE_DEFAULTS = EngineConfig()  # the defaults of the engine options


def plugin_option(f):
    return click.option(
        "--plugin", "plugins", multiple=True, type=click.Path(), metavar="FILE.py",
        help="Import this Python file first: it registers the ops (and their lowerings) that a user's pass "
             "put into the graph, so that an artifact using them can be loaded. Repeatable. Only the files "
             "named here are imported; nothing is ever imported from an artifact.")(f)


def load_plugins(files: tuple[str, ...]) -> None:
    """Import each --plugin file, in order, once (`llmc.plugins.load_plugins`)."""
    from llmc.plugins import load_plugins as load
    load(files)


def check_engine_options(backend: str, device: str | None, sizes: dict[str, int | None]) -> None:
    """The engine options in the user's words (--block-size, not block_size), before loading anything."""
    import torch
    for opt, v in sizes.items():
        if v is not None and v < 1:
            raise RequestError(f"{opt} must be >= 1, got {v}")
    bs = sizes["--block-size"]
    on_kernels = backend in ("cuda", "triton-interpret") or (backend == "auto" and torch.cuda.is_available())
    if on_kernels and bs & (bs - 1):
        raise RequestError(f"--block-size must be a power of two for the generated kernels, got {bs}; use 16, or "
                           "--backend reference")
    if device is not None:
        try:
            dev = torch.device(device)
        except RuntimeError:
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise RequestError(f"--device {device!r} is not a device llmc runs on; use cpu or cuda (cuda:N: GPU N)")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RequestError(f"--device {device}: torch sees no CUDA GPU on this machine; use --device cpu, or "
                               "leave --device out")
        if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
            raise RequestError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                               f"numbered from 0")
    if backend == "cuda" and not torch.cuda.is_available():
        raise RequestError("--backend cuda needs an NVIDIA GPU, and torch sees none on this machine; use --backend "
                           "reference (the interpreter) or triton-interpret (the generated kernels on the CPU)")


def use_triton_interpreter() -> None:
    """--backend triton-interpret: Triton reads TRITON_INTERPRET when it is first imported, and a
    --plugin may import it, so it is set here, first. The CLI owns its process; the library never
    sets process-wide state (if triton is already imported, the engine says what to do)."""
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"


def engine_options(seqs_help: str = "Sequences batched per step.", speculative: bool = True):
    """The engine options that `run`, `eval` and `serve` share: EngineConfig's fields and speculation."""
    opts = [
        click.option("--backend", type=click.Choice(["auto", "cuda", "triton-interpret", "reference"]),
                     default="auto", show_default=True,
                     help="auto: cuda when a GPU is present, else reference (the interpreter). "
                          "triton-interpret: the generated kernels on the CPU (slow; for testing)."),
        click.option("--device", default=None, help="cpu or cuda (default: cuda when present)."),
        click.option("--max-num-seqs", default=ENGINE_DEFAULTS.max_num_seqs, show_default=True, help=seqs_help),
        click.option("--max-num-batched-tokens", default=None, type=int,
                     help="Token budget per step (a longer prompt is computed in chunks). Default: the budget "
                          "the compile measured on the GPU (the fewest tokens at which the GEMMs reach full "
                          "speed; `llmc inspect`), 2048 at least. On a GPU a step with prompt work runs on the "
                          "CUDA graphs of the smallest power of two (16 to 8192) that holds it: a power of two "
                          "wastes no rows."),
        click.option("--max-prefill-tokens", default=None, type=int,
                     help="Token budget of a step that has no decode to run (prompts alone), where it is larger "
                          "than --max-num-batched-tokens: with a small budget for the steps that carry decodes "
                          "(short steps between their tokens), prompts alone still run in large chunks. "
                          "Default: --max-num-batched-tokens."),
        click.option("--block-size", default=ENGINE_DEFAULTS.block_size, show_default=True,
                     help="KV cache slots per block (a power of two on the kernel backends). With an int8 / fp8 "
                          "cache, 64 makes decode about as fast as over a bf16 cache on an H100 (16: about 1.1x "
                          "slower); on an H200 an 8-bit cache in blocks of 64 decodes 1.1-1.3x slower than a bf16 one."),
        click.option("--num-blocks", default=None, type=int, help="KV cache blocks (default: sized from memory)."),
        click.option("--kv-cache-dtype", type=click.Choice(["auto", "int8", "fp8"]), default=None,
                     help="Override the artifact's KV cache dtype. int8 / fp8 hold 1.75x (blocks of 16) to 1.9x (64) "
                          "the tokens of a 16-bit cache at head size 128 (see --block-size for their decode speed)."),
    ]
    if speculative:
        opts += [
            click.option("--spec", "spec_method", type=click.Choice(["off", "ngram", "draft", "multi"]), default=None,
                         help="Speculative decoding: ngram (prompt lookup: propose what followed the last few tokens "
                              "earlier in the text), draft (a small model, --draft) or multi (prompt lookup's guesses "
                              "checked by the draft, then by the target). Verification is lossless: the output is "
                              "what decoding without speculation gives (greedy) or follows the same distribution "
                              "(sampling). Default: draft when --draft is given, else off."),
            click.option("--draft", "draft_path", type=click.Path(), default=None,
                         help="The draft artifact for --spec draft: a compiled model with the same tokenizer."),
            click.option("--spec-tokens", default="auto", show_default=True, metavar="K|auto",
                         help="Tokens proposed per step (1-16), or auto: per sequence from its acceptance so far, "
                              "and none when more than 32 sequences decode at once."),
            click.option("--multi-step", default=ENGINE_DEFAULTS.multi_step, show_default=True, type=int, metavar="K",
                         help="Greedy decode steps run back to back on the device per engine step (the host "
                              "schedules and reads tokens back once for the K), while every sequence decodes, "
                              "no request waits for a free slot and all are greedy; the tokens are those of single "
                              "steps. Not with --spec or --pipeline-parallel-size."),
            click.option("--overlap/--no-overlap", default=ENGINE_DEFAULTS.overlap, show_default=True,
                         help="Schedule and prepare the next step while the GPU runs the current one, for steps "
                              "whose tokens the GPU can choose (greedy, or sampled without a seed, penalty or "
                              "logprobs); greedy outputs are the same either way, and outputs reach the caller "
                              "one step later. Not with pipeline stages (--pipeline-parallel-size > 1)."),
            click.option("--warm-up/--no-warm-up", "warm_up", default=ENGINE_DEFAULTS.warm_up, show_default=True,
                         help="On a GPU, before the first request: capture the decode step graphs up to "
                              "--max-num-seqs and compile the kernels of each mixed step size, so that the first "
                              "requests do not wait for them: a second or two, longer on the first load after a "
                              "compile, while Triton compiles those kernels into its cache."),
        ]

    def apply(f):
        for opt in reversed(opts):
            f = opt(f)
        return f
    return apply


def parallel_options(f):
    """--tensor-parallel-size / --pipeline-parallel-size / --expert-parallel (docs/distributed.md), for `run`,
    `serve` and `bench`."""
    f = click.option("--expert-parallel", "expert_parallel", is_flag=True, help="Spread a mixture-of-experts "
                     "model's experts over the tensor-parallel ranks, whole experts per rank (with -tp N >= 2; "
                     "without it each expert is split over the ranks).")(f)
    f = click.option("--pipeline-parallel-size", "-pp", "pipeline_parallel_size", default=1, show_default=True,
                     type=click.IntRange(min=1), help="Split the layers into this many stages, one worker process "
                     "each (x the tensor parallel size); a step's micro-batches flow through them.")(f)
    return click.option("--tensor-parallel-size", "-tp", "tensor_parallel_size", default=1, show_default=True,
                        type=click.IntRange(min=1), help="Split every layer over this many worker processes (one "
                        "GPU each, NCCL; without GPUs the reference backend over gloo).")(f)


def given_on_command_line(*names: str) -> list[str]:
    """Of the current command's parameters `names`, the ones the user typed, as their options (--wbits)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return []
    params = {p.name: p for p in ctx.command.params}
    return [params[n].opts[0] for n in names
            if n in params and ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE]


def speculative_config(method: str | None, draft: str | None, tokens: str, bundled: Path | None = None) -> dict | None:
    """The `speculative` option of LLM from --spec / --draft / --spec-tokens (`bundled`: the target's own
    draft, from `llmc compile --draft`, used when --draft is not given)."""
    method = method or ("draft" if draft else "off")
    if method == "off":
        if draft:
            raise RequestError("--draft is given but --spec is off; drop one of them")
        if given_on_command_line("spec_tokens"):
            raise RequestError("--spec-tokens sizes the proposals of --spec ngram|draft|multi; give --spec too")
        return None
    draft = draft or (str(bundled) if bundled is not None and method in ("draft", "multi") else None)
    if method in ("draft", "multi") and not draft:
        raise RequestError(f"--spec {method} needs --draft ART (a compiled draft model with the target's tokenizer), "
                           "or a target compiled with `llmc compile TARGET --draft DRAFT`")
    if method == "ngram" and draft:
        raise RequestError("--draft is for --spec draft, not ngram")
    if tokens != "auto":
        try:
            tokens = int(tokens)
        except ValueError:
            raise RequestError(f"--spec-tokens must be a number 1-16 or auto, not {tokens!r}") from None
        if not 1 <= tokens <= 16:
            raise RequestError(f"--spec-tokens must be 1-16 or auto, not {tokens}")
    if method in ("draft", "multi"):
        import llmc
        draft = llmc.load(draft)
    return {"method": method, "draft": draft, "num_speculative_tokens": tokens}
