"""The `llmc` command line: compile, run, inspect."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import click

from llmc.errors import LLMCError, RequestError
from llmc.runtime.config import EngineConfig

_ENGINE = EngineConfig()  # the defaults of the engine options


class _Group(click.Group):
    """Prints llmc's errors as one line (no traceback) unless --debug is given."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except LLMCError as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:  # output piped into `head` and the like
            sys.stderr.close()
            sys.exit(0)
        except Exception as e:  # a bug in llmc: still no traceback by default, but say how to get one
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: internal error {type(e).__name__}: {e} (rerun with --debug for the traceback)",
                       err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.version_option(package_name="llmc")
@click.pass_context
def main(ctx, debug):
    """llmc: an ahead-of-time compiler and runtime for LLM inference.

    \b
    llmc compile builtin:tiny-py -o tiny.llmc      capture, optimise and save an artifact
    llmc run tiny.llmc --prompt "def add(a, b):"   generate text from an artifact
    llmc inspect tiny.llmc [--ir]                  what an artifact holds
    llmc bench tiny.llmc [--workload decode]       throughput and latency of an artifact
    """
    ctx.ensure_object(dict)["debug"] = debug


def _plugin_option(f):
    return click.option(
        "--plugin", "plugins", multiple=True, type=click.Path(), metavar="FILE.py",
        help="Import this Python file first: it registers the ops (and their lowerings) that a user's pass "
             "put into the graph, so that an artifact using them can be loaded. Repeatable. Only the files "
             "named here are imported; nothing is ever imported from an artifact.")(f)


def _load_plugins(files: tuple[str, ...]) -> None:
    """Import each --plugin file, in order, once, as a uniquely named module (a plugin named json.py
    must not shadow the standard library)."""
    import importlib.util
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise LLMCError(f"--plugin {f}: " + ("no such file" if not path.exists() else "not a file")
                            + "; give the Python file that registers your ops")
        if path.suffix != ".py":
            raise LLMCError(f"--plugin {f}: not a Python file; give the FILE.py that registers your ops")
        name = f"llmc_plugin_{path.stem}_{abs(hash(str(path.resolve())))}"
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise LLMCError(f"--plugin {f}: importing it failed: {type(e).__name__}: {e}") from e


@main.command()
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(), help="Artifact directory to write (NAME.llmc).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True,
              help="Precision of weights and activations.")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "int8", "fp8"]), default="auto", show_default=True,
              help="KV cache storage: the model dtype, or int8/fp8: each entry relative to its block's first, with a scale per token and head.")
@click.option("--pass", "passes", multiple=True, metavar="SPEC",
              help="Add a pass: NAME, NAME{opt=value}, FILE.py:Class or module:Class. Repeatable.")
@click.option("--pass-before", default=None, metavar="NAME", help="Insert --pass passes before this pass.")
@click.option("--pass-after", default=None, metavar="NAME", help="Insert --pass passes after this pass.")
@click.option("--dump-ir", type=click.Path(), default=None, help="Write the IR after every pass into this directory.")
@click.option("--verify/--no-verify", default=True, show_default=True, help="Verify the IR after every pass.")
@click.option("--explain-fusion", is_flag=True, help="Say why each fusion candidate was declined.")
@click.option("--no-fuse", is_flag=True, help="Skip the fusion passes (phase 3).")
@click.option("--tune/--no-tune", default=True, show_default=True,
              help="On a GPU, time generated matmul tiles against cuBLAS per token bucket and keep the winners "
                   "(tuning.json). --no-tune: cuBLAS for every GEMM, as torch runs them.")
@click.option("--batch-invariant/--no-batch-invariant", default=True, show_default=True,
              help="Tune every step of up to 64 tokens to one GEMM choice: where that is the generated kernel, a "
                   "sequence's sums do not depend on the requests it shares steps with (where cuBLAS wins, it picks "
                   "its kernels per size, as under torch). --no-batch-invariant: only steps of up to 4 tokens "
                   "share one (int4 weights may take a GEMV kernel there, where it times faster); larger steps get "
                   "faster tiles of their own.")
@click.option("--tuning-cache/--no-tuning-cache", default=True, show_default=True,
              help="Reuse the tile choices earlier compiles timed on this GPU for the same kernels and shapes "
                   "($LLMC_CACHE_DIR/tuning/, one file per GPU, triton and llmc kernel version), and keep new ones. "
                   "--no-tuning-cache: time every choice again.")
@click.option("--quant", type=click.Choice(["rtn", "gptq", "awq", "smoothquant", "fp8", "mixed"]), default=None,
              help="Quantize the linear layers' weights: rtn (round to nearest), gptq (Hessian error feedback), awq "
                   "(activation-aware scales), smoothquant (int8 weights and activations), fp8 (e4m3 weights and "
                   "activations), mixed (int4/int8/unquantized per layer under --bits-budget). The LM head stays "
                   "unquantized unless --quant-lm-head. `llmc inspect` shows the plan.")
@click.option("--wbits", type=click.Choice(["4", "8"]), default="4", show_default=True,
              help="Weight bits for rtn, gptq and awq.")
@click.option("--group-size", type=int, default=None, metavar="G",
              help="Input columns per scale for int weights (0: per output channel). Default: 128 at 4 bits, per "
                   "channel at 8. A layer whose input size G does not divide falls back to per channel.")
@click.option("--zero-point", is_flag=True, help="Asymmetric int weights with stored zero points.")
@click.option("--calib", default="builtin:heldout", show_default=True, metavar="FILE.txt|builtin:heldout",
              help="Calibration text for gptq, awq, smoothquant and mixed.")
@click.option("--calib-samples", type=int, default=128, show_default=True, metavar="N",
              help="Calibration windows (of 256 tokens).")
@click.option("--bits-budget", type=float, default=4.5, show_default=True, metavar="B",
              help="mixed: average bits per quantized weight, scales included.")
@click.option("--act-order", is_flag=True, help="gptq: quantize columns in order of decreasing activation energy.")
@click.option("--quant-lm-head", is_flag=True,
              help="Quantize the LM head with the other linears (its rounding error lands straight on the logits).")
@click.option("--quant-embeddings", type=click.Choice(["int8"]), default=None,
              help="Store the input embedding table as int8 rows with a scale each (with tied embeddings, only "
                   "together with --quant-lm-head: the dense head would still need the table).")
@click.option("--draft", "draft_model", default=None, metavar="DRAFT",
              help="Also compile DRAFT (a local HF directory or builtin:NAME with MODEL's tokenizer) into the "
                   "artifact, for speculative decoding: `llmc run OUT.llmc --spec draft` then needs no --draft.")
@click.option("--tokenizer", "tokenizer", default=None, type=click.Path(), metavar="DIR",
              help="For an ONNX model: the directory with its tokenizer files (and config.json); default: the "
                   ".onnx file's directory.")
@click.option("--check-ort", is_flag=True,
              help="For an ONNX model: run the same token ids through onnxruntime and the compiled graph (llmc's "
                   "interpreter) and report the largest logit difference.")
@_plugin_option
def compile(model, output, dtype, kv_cache_dtype, passes, pass_before, pass_after, dump_ir, verify, explain_fusion,
            no_fuse, tune, batch_invariant, tuning_cache, quant, wbits, group_size, zero_point, calib, calib_samples, bits_budget,
            act_order, quant_lm_head, quant_embeddings, draft_model, tokenizer, check_ort, plugins):
    """Compile MODEL (a local Hugging Face directory, builtin:NAME or an ONNX file) into an artifact."""
    import llmc
    from llmc.passes.manager import parse_pass_spec
    from llmc.passes.quantize.config import QuantConfig
    from llmc.compiler import is_onnx
    _load_plugins(plugins)
    if check_ort and not is_onnx(model):
        raise LLMCError("--check-ort compares with onnxruntime and needs an ONNX model (MODEL.onnx)")
    extra = [parse_pass_spec(s) for s in passes]
    if (quant_lm_head or quant_embeddings) and not quant:
        raise LLMCError("--quant-lm-head and --quant-embeddings go with --quant METHOD (e.g. --quant rtn)")
    qcfg = QuantConfig(quant, int(wbits), group_size, zero_point, calib, calib_samples, bits_budget=bits_budget,
                       act_order=act_order, skip=() if quant_lm_head else ("lm_head",),
                       embeddings=quant_embeddings) if quant else None
    art = llmc.compile(model, output, dtype=dtype, kv_cache_dtype=kv_cache_dtype, passes=extra,
                       before=pass_before, after=pass_after, dump_ir=dump_ir, verify=verify,
                       progress=sys.stderr.isatty(), fuse=not no_fuse, tune=tune, batch_invariant=batch_invariant,
                       tuning_cache=tuning_cache, quant=qcfg, draft=draft_model, tokenizer=tokenizer)
    s = art.summary()
    if explain_fusion:
        reasons = art.compile_log.explain if art.compile_log else []
        for r in reasons:
            click.echo(f"fusion: {r}")
        if not reasons:
            click.echo("fusion: no candidate was declined")
    if art.tokenizer_dir is None:
        hint = "; give them with --tokenizer DIR" if is_onnx(model) else ""
        click.echo(f"warning: {model} has no tokenizer files; the artifact will take token ids only "
                   f"(--prompts with prompt_token_ids){hint}", err=True)
    nbytes = sum(s["param_bytes_by_dtype"].values())
    click.echo(f"wrote {art.path}: {s['num_params'] / 1e6:.2f}M params ({nbytes / 2**20:.1f} MiB), "
               f"{sum(s['op_counts'].values())} ops, passes: {', '.join(p.split('{')[0] for p in s['passes'])}"
               + (f"; draft {draft_model} in {art.bundled_draft.name}" if art.bundled_draft else ""))
    t = art.compile_timings
    if t:
        click.echo(f"compiled in {sum(t.values()):.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in t.items()))
    if check_ort:
        from llmc.frontend.onnx_check import check_onnxruntime
        click.echo(str(check_onnxruntime(model, art.graph)))


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--ir", is_flag=True, help="Print the IR text.")
@click.option("--kernels", "kernels", is_flag=True,
              help="List what each node runs on the kernel backends, with the kernel specs.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--plan", "show_plan", is_flag=True,
              help="List the quantization plan per linear: format, bits per weight, measured errors, notes.")
@_plugin_option
def inspect(artifact, ir, kernels, as_json, show_plan, plugins):
    """Show what ARTIFACT holds: manifest, passes applied, op counts, parameter bytes."""
    import llmc
    _load_plugins(plugins)
    art = llmc.load(artifact)
    if ir:
        click.echo(str(art.graph), nl=False)
        return
    if kernels:
        rows = [r for r in art.manifest.get("kernels", []) if r["kernel"] not in ("view", "constant")]
        if not rows:
            click.echo("this artifact has no kernel plan (compiled without the paged_kv pass)")
        for r in rows:
            click.echo(f"{r['node']:>14s}  {r['op']:16s} {r['kernel']:32s} {r.get('spec', '')}")
            for src in r.get("sources", []):
                click.echo(f"{'':>16s}{src}")
        views = sum(1 for r in art.manifest.get("kernels", []) if r["kernel"] == "view")
        click.echo(f"{len(rows)} launches per step, {views} views; sources in {art.path / 'kernels'}")
        return
    s = art.summary()
    if as_json:
        click.echo(json.dumps(s, indent=1))
        return
    click.echo(f"artifact   {s['path']}")
    click.echo(f"format     v{s['format_version']} (llmc {s['llmc_version']}, {s['created']})")
    click.echo(f"source     {s['source']}")
    click.echo(f"options    {', '.join(f'{k}={v}' for k, v in s['options'].items())}")
    click.echo(f"params     {s['num_params']:,}")
    if s.get("token_budget"):
        b = s["token_budget"]
        click.echo(f"tokens     {b['tokens']} per step by default (the fewest at which the GEMMs run within "
                   f"{b['slack']}x of their best time per token, as measured at compile)")
        if b.get("hbm_gb_s"):
            click.echo(f"           more where decodes share a step with prompt work, to spread their K/V reads "
                       f"(HBM measured at {b['hbm_gb_s']:,.0f} GB/s)")
    for dt, n in s["param_bytes_by_dtype"].items():
        click.echo(f"  {dt:8s} {n:>14,} bytes")
    click.echo("passes")
    for p in art.manifest.get("passes", []):
        stats = ", ".join(f"{k}={v}" for k, v in p.get("stats", {}).items() if v)
        click.echo(f"  {p['name']}" + (f"  [{stats}]" if stats else ""))
    click.echo("ops")
    for op, n in s["op_counts"].items():
        click.echo(f"  {op:18s} {n}")
    _echo_quant_plan(art.graph.meta.get("quant_plan"), show_plan)


def _echo_quant_plan(plan: dict | None, per_linear: bool) -> None:
    """The quantization plan: a count per format, or (per_linear) one line per linear."""
    if not plan:
        if per_linear:
            click.echo("quantization: none (compiled without --quant)")
        return
    from llmc.ir.quant import QuantFormat
    label = {n: QuantFormat(**e["format"]).label if e["format"] else "unquantized" for n, e in plan["linears"].items()}
    click.echo(f"quantization  {plan['method']}: {plan['avg_bits']} bits per weight on average"
               + (f", calibrated on {plan['calibration']['tokens']} tokens of {plan['calibration']['source']}"
                  if plan.get("calibration") else ""))
    tables = plan.get("embeddings", {})
    if not per_linear:
        for fmt in sorted(set(label.values())):
            click.echo(f"  {fmt:18s} {sum(1 for v in label.values() if v == fmt)} linears")
        for name, e in tables.items():
            click.echo(f"  {e['format']:18s} embedding table {name}")
        return
    for name, e in plan["linears"].items():
        errs = " ".join(f"{k}={v:.3g}" for k, v in e.get("errors", {}).items())
        click.echo(f"  {name:40s} {label[name]:18s} {e['bits']:7.3f}  {e['note']}" + (f"  [{errs}]" if errs else ""))
    for name, e in tables.items():
        click.echo(f"  {name:40s} {e['format']:18s} {e['bits']:7.3f}  embedding table")


@dataclass
class _Prompt:
    """One request of `llmc run`: text or token ids, its own sampling fields, and where it came from
    (`--prompt` or FILE:LINE) for error messages."""

    where: str
    text: str | None
    token_ids: list[int] | None = None
    fields: dict = field(default_factory=dict)


def _read_prompts(prompt: str | None, prompts_file: str | None) -> list[_Prompt]:
    if (prompt is None) == (prompts_file is None):
        raise RequestError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
    if prompt is not None:
        return [_Prompt("--prompt", prompt)]
    path = Path(prompts_file)
    if not path.is_file():
        raise RequestError(f"--prompts {path}: " + ("no such file" if not path.exists() else "not a file"))
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise RequestError(f"{path}:{line}: not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); save the "
                           "file as UTF-8") from None
    out = []
    for i, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 and friends are JSON string content
        if line.strip():
            out.append(_parse_prompt_line(line, f"{path}:{i}"))
    if not out:
        raise RequestError(f"--prompts {path} holds no prompts (it is empty or blank); write one JSON string, or "
                           "one object with \"prompt\" or \"prompt_token_ids\", per line")
    return out


def _parse_prompt_line(line: str, where: str) -> _Prompt:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise RequestError(f"{where}: not valid JSON ({e})") from None
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict) or ("prompt" in item) == ("prompt_token_ids" in item):
        raise RequestError(f"{where}: each line must be a JSON string, or an object with one of \"prompt\" (text) "
                           "or \"prompt_token_ids\" (a list of token ids)")
    fields = {k: v for k, v in item.items() if k not in ("prompt", "prompt_token_ids")}
    if "prompt" in item:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise RequestError(f"{where}: \"prompt\" must be a non-empty string, got {item['prompt']!r}")
        return _Prompt(where, item["prompt"], fields=fields)
    ids = item["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise RequestError(f"{where}: \"prompt_token_ids\" must be a non-empty list of integers, got {ids!r}")
    return _Prompt(where, None, ids, fields)


def _check_engine_options(backend: str, device: str | None, sizes: dict[str, int | None]) -> None:
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


def _use_triton_interpreter() -> None:
    """--backend triton-interpret: Triton reads TRITON_INTERPRET when it is first imported, and a
    --plugin may import it, so it is set here, first. The CLI owns its process; the library never
    sets process-wide state (if triton is already imported, the engine says what to do)."""
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"


def _sampling_params(items: list[_Prompt], base: dict) -> list:
    """One SamplingParams per prompt: the command line's, overridden by the line's own fields. A bad
    value is named as the user wrote it: `--top-p` for the option, FILE:LINE's `top_p` for a field."""
    from llmc.runtime.engine import SamplingParams
    known = {f.name for f in fields(SamplingParams)}
    out = []
    for it in items:
        unknown = set(it.fields) - known
        if unknown:
            raise RequestError(f"{it.where}: unknown sampling field(s) {sorted(unknown)}; known: {sorted(known)}")
        p = SamplingParams(**{**base, **it.fields})
        try:
            p.validate()
        except RequestError as e:
            name, rest = str(e).split(" ", 1)
            if name in it.fields or name not in base:
                raise RequestError(f"{it.where}: {e}") from None
            raise RequestError(f"--{name.replace('_', '-')} {rest}") from None
        out.append(p)
    return out


def _check_tokens(items: list[_Prompt], params: list, art) -> None:
    """What needs a tokenizer (text prompts, stop strings) against the artifact, and token ids
    against its vocabulary: the engine would fail on them later, or ignore stop strings."""
    vocab = art.info.vocab_size
    for it, p in zip(items, params):
        if art.tokenizer_dir is None and it.text is not None:
            what = "--prompt TEXT" if it.where == "--prompt" else f"{it.where}: a text prompt"
            raise RequestError(f"{what} needs a tokenizer, and {art.path} has none (its model had no tokenizer "
                               "files); pass token ids instead: --prompts FILE.jsonl with lines like "
                               "{\"prompt_token_ids\": [1, 2, 3]}")
        if art.tokenizer_dir is None and p.stop_strings:
            where = it.where if "stop" in it.fields else "--stop"
            raise RequestError(f"{where}: stop strings need a tokenizer, and {art.path} has none; use "
                               "\"stop_token_ids\" in the --prompts file")
        bad = [t for t in it.token_ids or () if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{it.where}: token id {bad[0]} is out of range: the model's vocabulary has ids "
                               f"0 to {vocab - 1}")


def _engine_options(seqs_help: str = "Sequences batched per step.", speculative: bool = True):
    """The engine options that `run`, `eval` and `serve` share: EngineConfig's fields and speculation."""
    opts = [
        click.option("--backend", type=click.Choice(["auto", "cuda", "triton-interpret", "reference"]),
                     default="auto", show_default=True,
                     help="auto: cuda when a GPU is present, else reference (the interpreter). "
                          "triton-interpret: the generated kernels on the CPU (slow; for testing)."),
        click.option("--device", default=None, help="cpu or cuda (default: cuda when present)."),
        click.option("--max-num-seqs", default=_ENGINE.max_num_seqs, show_default=True, help=seqs_help),
        click.option("--max-num-batched-tokens", default=None, type=int,
                     help="Token budget per step (a longer prompt is computed in chunks); fixed when given. "
                          "Default: the budget the compile measured on the GPU (the fewest tokens at which the "
                          "GEMMs reach full speed; `llmc inspect`), 2048 at least for a step with no decode "
                          "waiting, and for a step whose decodes share it with prompt work as many as spread "
                          "their K/V reads and rows over the prompt chunk; else 2048."),
        click.option("--block-size", default=_ENGINE.block_size, show_default=True,
                     help="KV cache slots per block (a power of two on the kernel backends)."),
        click.option("--num-blocks", default=None, type=int, help="KV cache blocks (default: sized from memory)."),
        click.option("--kv-cache-dtype", type=click.Choice(["auto", "int8", "fp8"]), default=None,
                     help="Override the artifact's KV cache dtype."),
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
            click.option("--multi-step", default=_ENGINE.multi_step, show_default=True, type=int, metavar="K",
                         help="Greedy decode steps run back to back on the device per engine step (the host "
                              "schedules and reads tokens back once for the K), while every sequence decodes, "
                              "no request waits for a free slot and all are greedy; the tokens are those of single "
                              "steps. Not with --spec or --pipeline-parallel-size."),
            click.option("--overlap/--no-overlap", default=_ENGINE.overlap, show_default=True,
                         help="Schedule and prepare the next step while the GPU runs the current one, for steps "
                              "whose tokens the GPU can choose (greedy, or sampled without a seed, penalty or "
                              "logprobs); greedy outputs are the same either way, and outputs reach the caller "
                              "one step later. Not with pipeline stages (--pipeline-parallel-size > 1)."),
            click.option("--warm-up/--no-warm-up", "warm_up", default=_ENGINE.warm_up, show_default=True,
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


def _parallel_options(f):
    """--tensor-parallel-size / --pipeline-parallel-size / --expert-parallel (docs/distributed.md), for `run`
    and `serve`."""
    f = click.option("--expert-parallel", "expert_parallel", is_flag=True, help="Spread a mixture-of-experts "
                     "model's experts over the tensor-parallel ranks, whole experts per rank (with -tp N >= 2; "
                     "without it each expert is split over the ranks).")(f)
    f = click.option("--pipeline-parallel-size", "-pp", "pipeline_parallel_size", default=1, show_default=True,
                     type=click.IntRange(min=1), help="Split the layers into this many stages, one worker process "
                     "each (x the tensor parallel size); a step's micro-batches flow through them.")(f)
    return click.option("--tensor-parallel-size", "-tp", "tensor_parallel_size", default=1, show_default=True,
                        type=click.IntRange(min=1), help="Split every layer over this many worker processes (one "
                        "GPU each, NCCL; without GPUs the reference backend over gloo).")(f)


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--prompt", default=None, help="The prompt text.")
@click.option("--prompts", "prompts_file", type=click.Path(), default=None, metavar="FILE.jsonl",
              help="A UTF-8 JSONL file, one prompt per line: a string, or an object with \"prompt\" (text) or "
                   "\"prompt_token_ids\" (a list of ints, for artifacts without a tokenizer) and optional sampling "
                   "fields (max_tokens, temperature, seed, n, logprobs, stop, ...).")
@click.option("--max-tokens", default=64, show_default=True, help="Tokens to generate per prompt.")
@click.option("--temperature", default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", default=0, show_default=True, help="Keep the k most likely tokens (0: off).")
@click.option("--top-p", default=1.0, show_default=True, help="Nucleus sampling mass, in (0, 1].")
@click.option("--min-p", default=0.0, show_default=True, help="Drop tokens below min_p x the top probability.")
@click.option("--repetition-penalty", default=1.0, show_default=True)
@click.option("--seed", default=None, type=int, help="Seed for reproducible sampling.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object per prompt: text, token_ids, finish_reason (and logprobs when a prompt "
                   "asks for them: true or 0 for each chosen token's, k > 0 also its k most likely alternatives as "
                   "top_logprobs, token id -> logprob; and a \"completions\" list of all n when it asks for n > 1).")
@click.option("--stream", is_flag=True,
              help="Print tokens as they are generated. One prompt: its text as it grows. --json: one JSON line "
                   "per new piece ({\"index\": prompt, \"completion\": i, \"delta\": text, \"token_ids\": [...], "
                   "\"finished\": ...}). Several prompts (or n > 1) in plain text: each completion whole as it "
                   "finishes, in the order they finish, under its --- prompt N --- line.")
@_engine_options()
@_parallel_options
@_plugin_option
def run(artifact, prompt, prompts_file, max_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed,
        stop, as_json, stream, backend, device, max_num_seqs, max_num_batched_tokens, block_size, num_blocks,
        kv_cache_dtype, spec_method, draft_path, spec_tokens, multi_step, overlap, warm_up, tensor_parallel_size,
        pipeline_parallel_size, expert_parallel, plugins):
    """Generate text from ARTIFACT with the paged-KV engine.

    With several prompts (or n > 1), plain-text output puts a `--- prompt N ---` line before each
    completion.
    """
    import llmc
    from llmc.runtime.engine import LLM
    _check_engine_options(backend, device, {"--max-num-seqs": max_num_seqs, "--block-size": block_size,
                                            "--max-num-batched-tokens": max_num_batched_tokens,
                                            "--num-blocks": num_blocks, "--max-tokens": max_tokens,
                                            "--multi-step": multi_step})
    items = _read_prompts(prompt, prompts_file)
    base = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repetition_penalty, seed=seed, stop=list(stop))
    params = _sampling_params(items, base)
    for it, p in zip(items, params):
        if p.n > max_num_seqs:
            raise RequestError(f"{it.where}: n={p.n} samples run together and need --max-num-seqs >= {p.n} "
                               f"(it is {max_num_seqs})")
    if backend == "triton-interpret":
        _use_triton_interpreter()
    _load_plugins(plugins)
    art = llmc.load(artifact)
    _check_tokens(items, params, art)
    llm = LLM(art, speculative=_speculative(spec_method, draft_path, spec_tokens, art.bundled_draft),
              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
              num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype, backend=backend, device=device,
              tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
              expert_parallel=expert_parallel, multi_step=multi_step, overlap=overlap, warm_up=warm_up)
    out = _Printer(items, params, as_json, art.tokenizer_dir is not None)
    requests = [it.text if it.text is not None else it.token_ids for it in items]
    if stream:
        out.stream(llm.stream(requests, params, request_ids=[str(i) for i in range(len(requests))]))
    else:
        out.whole(llm.generate(requests, params, progress=not as_json and sys.stderr.isatty()))
    if not as_json and sys.stderr.isatty():
        st = llm.stats()
        click.echo(f"[{st['blocks_used']}/{st['blocks_total']} KV blocks in use, "
                   f"{st['prefix_cache_hit_tokens']} prefix-cache hit tokens, {st['num_preemptions']} preemptions]",
                   err=True)


def _speculative(method: str | None, draft: str | None, tokens: str, bundled: Path | None = None) -> dict | None:
    """The `speculative` option of LLM from --spec / --draft / --spec-tokens (`bundled`: the target's own
    draft, from `llmc compile --draft`, used when --draft is not given)."""
    method = method or ("draft" if draft else "off")
    if method == "off":
        if draft:
            raise RequestError("--draft is given but --spec is off; drop one of them")
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


def _top_json(top: list[dict]) -> list[dict]:
    """Alternatives per token as JSON objects (token id as a string key; -inf, a filtered-out token, as null)."""
    return [{str(t): (v if v != float("-inf") else None) for t, v in d.items()} for d in top]


def _logprobs_json(p, c) -> dict:
    """A completion's logprobs (and, asked for k > 0, its alternatives) for `--json`."""
    if p.num_logprobs is None:
        return {}
    return {"logprobs": c.logprobs, **({"top_logprobs": _top_json(c.top_logprobs)} if p.num_logprobs else {})}


class _Printer:
    """Writes `llmc run`'s results: whole, or streamed (see --stream); JSON or plain text.

    Plain text is the prompt followed by its completion; with several prompts or samples a
    `--- prompt N ---` line goes before each completion. A token-id prompt shows only its
    completion, as token ids when the artifact has no tokenizer to write text with.
    """

    def __init__(self, items: list[_Prompt], params: list, as_json: bool, has_tokenizer: bool):
        self.items, self.params, self.as_json, self.has_tok = items, params, as_json, has_tokenizer
        self.several = len(items) > 1 or params[0].n > 1

    def whole(self, outs) -> None:
        for i, (it, p, o) in enumerate(zip(self.items, self.params, outs)):
            if self.as_json:
                click.echo(json.dumps(self._row(it, p, o)))
                continue
            for c in o.outputs:
                self._header(i, c.index)
                click.echo(self._prefix(it) + self._body(c.text, c.token_ids))

    def stream(self, outs) -> None:
        """Write each output of `LLM.stream` as it comes (click.echo flushes); request ids are the
        prompts' indices."""
        printed: set[tuple[int, int]] = set()
        live = not self.as_json and not self.several
        if live:
            click.echo(self._prefix(self.items[0]), nl=False)
        for o in outs:
            i = int(o.request_id)
            for c in o.outputs:
                done = c.finish_reason is not None
                if live:
                    click.echo(self._body(c.delta_text, c.delta_token_ids), nl=False)
                elif self.as_json and (c.delta_token_ids or c.delta_text or done):
                    row = {"index": i, "completion": c.index, "delta": c.delta_text,
                           "token_ids": list(c.delta_token_ids), "finished": done, "finish_reason": c.finish_reason}
                    if self.params[i].num_logprobs is not None:
                        new = len(c.delta_token_ids)
                        row["logprobs"] = c.logprobs[len(c.logprobs) - new:]
                        if self.params[i].num_logprobs:
                            row["top_logprobs"] = _top_json(c.top_logprobs[len(c.top_logprobs) - new:])
                    click.echo(json.dumps(row))
                elif not self.as_json and done and (i, c.index) not in printed:
                    printed.add((i, c.index))
                    self._header(i, c.index)
                    click.echo(self._prefix(self.items[i]) + self._body(c.text, c.token_ids))
        if live:
            click.echo()

    def _row(self, it: _Prompt, p, o) -> dict:
        row = {"prompt": it.text, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
               "num_prompt_tokens": len(o.prompt_token_ids)}
        if it.token_ids is not None:
            row["prompt_token_ids"] = it.token_ids
        if p.num_logprobs is not None:
            row.update(_logprobs_json(p, o.outputs[0]))
        if p.n > 1:
            row["completions"] = [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                                   "finish_reason": c.finish_reason, **_logprobs_json(p, c)} for c in o.outputs]
        return row

    def _header(self, i: int, j: int) -> None:
        n = self.params[i].n
        if self.several:
            click.echo(f"--- prompt {i + 1}" + (f", completion {j + 1} of {n}" if n > 1 else "") + " ---")

    def _prefix(self, it: _Prompt) -> str:
        return it.text if it.text is not None else ("" if self.has_tok else "token ids:")

    def _body(self, text: str, ids: list[int]) -> str:
        return text if self.has_tok else "".join(f" {t}" for t in ids)


@main.command("eval")
@click.argument("artifact", type=click.Path())
@click.option("--text", "text_file", type=click.Path(), default=None, metavar="FILE",
              help="Score this UTF-8 text file.")
@click.option("--dataset", default=None, metavar="NAME",
              help="Score a shipped text: builtin:heldout (Python standard-library source that the built-in models "
                   "never saw in training).")
@click.option("--max-tokens", type=int, default=None, metavar="N",
              help="Score only the first N tokens after the text's first (which is only context). Default: all.")
@click.option("--window", type=int, default=None, metavar="N",
              help="Most tokens scored per request, each given the ones before it in its window only. Default: 512 "
                   "(fewer if the model's context is shorter), as in the built-in models' metrics.json.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: perplexity, nll (mean, nats per token), tokens (scored), windows, window, "
                   "artifact, dataset (the name, or the --text file).")
@_engine_options("Windows batched per step.", speculative=False)
@_plugin_option
def evaluate(artifact, text_file, dataset, max_tokens, window, as_json, backend, device, max_num_seqs,
             max_num_batched_tokens, block_size, num_blocks, kv_cache_dtype, plugins):
    """Perplexity of ARTIFACT on a text: exp of the mean negative log-likelihood of its tokens, each given
    the ones before it.

    \b
    llmc eval tiny.llmc --dataset builtin:heldout --max-tokens 20000
    llmc eval tiny.llmc --text notes.txt --json

    The text's tokens are cut into windows that fit the model's context; neighbouring windows share
    one token, so every token but the first is scored once. Each window is one request, batched by the
    engine, which returns its prompt's log-probabilities (SamplingParams(prompt_logprobs=0)).
    """
    import llmc
    from llmc.evaluate import dataset_text, perplexity, read_text
    _check_engine_options(backend, device, {"--max-num-seqs": max_num_seqs, "--block-size": block_size,
                                            "--max-num-batched-tokens": max_num_batched_tokens,
                                            "--num-blocks": num_blocks, "--max-tokens": max_tokens,
                                            "--window": window})
    if (text_file is None) == (dataset is None):
        raise RequestError("give exactly one of --text FILE or --dataset builtin:heldout")
    text = read_text(text_file) if text_file is not None else dataset_text(dataset)
    if backend == "triton-interpret":
        _use_triton_interpreter()
    _load_plugins(plugins)
    art = llmc.load(artifact)
    if art.tokenizer_dir is None:
        raise RequestError(f"{art.path} has no tokenizer (its model had no tokenizer files), so it cannot score "
                           "text; compile the model from a directory with its tokenizer files")
    longest = art.info.max_model_len - 2
    if window is not None and window > longest:
        raise RequestError(f"--window must be at most {longest} for this model, got {window}: its context is "
                           f"{art.info.max_model_len} tokens, and a window of N scored tokens is a prompt of N + 1 "
                           "with room for one generated token")
    res = perplexity(art, text, max_tokens=max_tokens, window=window, progress=not as_json and sys.stderr.isatty(),
                     backend=backend, device=device, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, num_blocks=num_blocks,
                     kv_cache_dtype=kv_cache_dtype)
    source = dataset if dataset is not None else str(text_file)
    if as_json:
        click.echo(json.dumps({"artifact": str(art.path), "dataset": source, **res.to_json()}))
        return
    click.echo(f"artifact    {art.path}")
    click.echo(f"text        {source}")
    click.echo(f"tokens      {res.tokens:,} scored, in {res.windows:,} window{'s' if res.windows > 1 else ''} of "
               f"up to {res.window:,}")
    click.echo(f"nll         {res.nll:.4f} nats per token")
    click.echo(f"perplexity  {res.perplexity:.4f}")


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", default=8000, show_default=True, help="TCP port to listen on.")
@click.option("--api-key", default=None, envvar="LLMC_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 (env LLMC_API_KEY). /health and /metrics stay open.")
@click.option("--served-model-name", default=None, metavar="NAME",
              help="The model name clients send and /v1/models lists (default: the artifact's directory name).")
@click.option("--chat-template", "chat_template", type=click.Path(), default=None, metavar="FILE",
              help="A Jinja chat template (over `messages`, `add_generation_prompt`, `bos_token`, `eos_token`) "
                   "replacing the artifact's, or giving one to a model without.")
@click.option("--max-queue", type=int, default=None, metavar="N",
              help="Most requests waiting for the engine; more are answered 503 with Retry-After (default: no limit).")
@click.option("--shutdown-timeout", type=float, default=30.0, show_default=True, metavar="S",
              help="On SIGTERM/SIGINT, seconds to let in-flight requests finish before aborting them.")
@_engine_options()
@_parallel_options
@_plugin_option
def serve(artifact, host, port, api_key, served_model_name, chat_template, max_queue, shutdown_timeout, backend,
          device, max_num_seqs, max_num_batched_tokens, block_size, num_blocks, kv_cache_dtype, spec_method,
          draft_path, spec_tokens, multi_step, overlap, warm_up, tensor_parallel_size, pipeline_parallel_size,
          expert_parallel, plugins):
    """Serve ARTIFACT over HTTP with the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models),
    plus /health and /metrics (Prometheus).

    \b
    llmc serve tiny.llmc --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 16}'

    One engine loop serves every request. SIGTERM or Ctrl-C stops accepting, lets in-flight requests
    finish (up to --shutdown-timeout), aborts the rest and exits 0.
    """
    import llmc
    _check_engine_options(backend, device, {"--max-num-seqs": max_num_seqs, "--block-size": block_size,
                                            "--max-num-batched-tokens": max_num_batched_tokens,
                                            "--num-blocks": num_blocks, "--max-queue": max_queue,
                                            "--multi-step": multi_step})
    if not 0 < port < 65536:
        raise RequestError(f"--port must be in 1-65535, got {port}")
    template = None
    if chat_template is not None:
        path = Path(chat_template)
        if not path.is_file():
            raise RequestError(f"--chat-template {path}: " + ("no such file" if not path.exists() else "not a file"))
        template = path.read_text(encoding="utf-8")
    if backend == "triton-interpret":
        _use_triton_interpreter()
    _load_plugins(plugins)
    from llmc.runtime.async_engine import AsyncLLM
    from llmc.serve.app import create_app
    art = llmc.load(artifact)
    speculative = _speculative(spec_method, draft_path, spec_tokens, art.bundled_draft)
    name = served_model_name or Path(art.path).name.removesuffix(".llmc")
    llm = AsyncLLM(art, speculative=speculative, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, num_blocks=num_blocks,
                   kv_cache_dtype=kv_cache_dtype, backend=backend, device=device,
                   tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                   expert_parallel=expert_parallel, multi_step=multi_step, overlap=overlap, warm_up=warm_up)
    try:
        app = create_app(llm, name, api_key=api_key, chat_template=template, max_queue=max_queue,
                         shutdown_timeout=shutdown_timeout)
    except BaseException:
        llm.shutdown()
        raise
    click.echo(f"serving {art.path} as {name!r} on http://{host}:{port}/v1", err=True)
    if not _run_server(app, host, port, shutdown_timeout):
        llm.shutdown()
        raise LLMCError(f"the server did not start on {host}:{port} (is the port in use?)")


def _run_server(app, host: str, port: int, shutdown_timeout: float) -> bool:
    """Run uvicorn until SIGTERM/SIGINT (a second SIGINT forces the exit); True if it started. uvicorn
    re-raises the caught signal after its graceful shutdown, which would end the process by that
    signal; a graceful shutdown is a success, so the signal is not recorded and the command returns."""
    import signal
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            self.force_exit = self.force_exit or (self.should_exit and sig == signal.SIGINT)
            self.should_exit = True

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                   timeout_graceful_shutdown=shutdown_timeout))
    # The engine thread waits for the GPU without the GIL and needs it back as soon as a step ends;
    # by default the HTTP thread, busy streaming the last step's tokens, keeps it for up to 5 ms.
    sys.setswitchinterval(0.0005)
    server.run()
    return server.started


class _UnnamedContext(click.Context):
    @property
    def command_path(self) -> str:
        return super().command_path.rstrip()


class _UnnamedCommand(click.Command):
    """A group's default command: its usage and hints name the group alone (`llmc bench [OPTIONS] ARTIFACT`)."""

    context_class = _UnnamedContext


class _DefaultGroup(click.Group):
    """A group that runs `default` when its first argument names none of its commands: `llmc bench
    ARTIFACT ...` runs the offline benchmark, `llmc bench serve ...` the serve subcommand."""

    default: click.Command | None = None

    def resolve_command(self, ctx, args):
        if args and self.default is not None and self.get_command(ctx, args[0]) is None:
            return "", self.default, args
        return super().resolve_command(ctx, args)


@main.group(cls=_DefaultGroup, subcommand_metavar="ARTIFACT|serve [ARGS]...")
def bench():
    """Benchmarks of llmc.

    \b
    llmc bench ARTIFACT [--workload mixed|decode|prefill] [--num-requests N] [--json] [engine options]
        an artifact offline, through llmc.LLM: throughput, TTFT and inter-token latency
        (llmc bench ARTIFACT --help lists its options)
    llmc bench serve --url URL [options]
        a running OpenAI-compatible server (llmc serve)
    """


@click.command(cls=_UnnamedCommand)
@click.argument("artifact", type=click.Path())
@click.option("--workload", default="mixed", show_default=True, metavar="mixed|decode|prefill",
              help="mixed: N requests at once, prompts of U[64, 1024] and outputs of U[64, 512] tokens (llmc's "
                   "throughput mix; seed 0 gives its exact requests). decode: batch 1, a fresh 128-token prompt and "
                   "256 new tokens, N runs. prefill: a fresh 2048-token prompt and 1 new token (time to first "
                   "token), N runs. Prompts are cut from the shipped held-out text; greedy, ignore_eos; a prompt "
                   "that does not fit the model's context with its output is shortened.")
@click.option("--num-requests", type=int, default=None, metavar="N",
              help="mixed: requests (default 256); decode, prefill: runs (default 3).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seeds the workload: the mixed lengths and where the prompts start in the text.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: out_tok_s, ttft_ms_p50, ttft_ms_p99, itl_ms_p50, itl_ms_p99, tpot_ms_p50, "
                   "tpot_ms_p99 (time per output token after the first, per request), gpu_busy "
                   "(null off CUDA), duration_s, token totals and the settings.")
@_engine_options()
@_plugin_option
def bench_artifact(artifact, workload, num_requests, seed, as_json, backend, device, max_num_seqs,
                   max_num_batched_tokens, block_size, num_blocks, kv_cache_dtype, spec_method, draft_path,
                   spec_tokens, multi_step, overlap, warm_up, plugins):
    """Benchmark ARTIFACT offline through llmc.LLM: output tokens per second, time to first token and
    inter-token latency (p50/p99, from the streamed outputs of every request), and on CUDA the fraction
    of the time the GPU spends in the model's steps.

    \b
    llmc bench tiny.llmc
    llmc bench tiny.llmc --workload decode --json
    llmc bench tiny.llmc --workload prefill --num-requests 5 --spec ngram
    """
    import llmc
    from llmc import bench as offline
    _check_engine_options(backend, device, {"--max-num-seqs": max_num_seqs, "--block-size": block_size,
                                            "--max-num-batched-tokens": max_num_batched_tokens,
                                            "--num-blocks": num_blocks, "--num-requests": num_requests,
                                            "--multi-step": multi_step})
    if workload not in offline.WORKLOADS:
        raise offline.BenchError(f"--workload {workload!r} is not a workload; use one of "
                                 f"{', '.join(offline.WORKLOADS)}")
    if backend == "triton-interpret":
        _use_triton_interpreter()
    _load_plugins(plugins)
    art = llmc.load(artifact)
    res = offline.bench(art, workload, num_requests=num_requests, seed=seed,
                        speculative=_speculative(spec_method, draft_path, spec_tokens, art.bundled_draft),
                        progress=sys.stderr.isatty(), max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, num_blocks=num_blocks,
                        kv_cache_dtype=kv_cache_dtype, backend=backend, device=device, multi_step=multi_step,
                        overlap=overlap, warm_up=warm_up)
    click.echo(json.dumps(res) if as_json else offline.format_report(res))


bench.default = bench_artifact


@bench.command("serve")
@click.option("--url", required=True, metavar="URL",
              help="The OpenAI-compatible server's root, e.g. http://127.0.0.1:8000 (`llmc serve`).")
@click.option("--workload", default="mixed", show_default=True, metavar="mixed|short",
              help="mixed: prompts of U[64, 1024] and outputs of U[64, 512] tokens (llmc's throughput mix; seed 0 "
                   "gives its exact requests), cut from the shipped held-out text. short: 32-token prompts, "
                   "32 output tokens.")
@click.option("--request-rate", default="inf", show_default=True, metavar="R|inf",
              help="Requests per second, arriving as a Poisson process; inf: all at once.")
@click.option("--num-requests", type=int, default=None, metavar="N", help="Default: 256 (mixed), 32 (short).")
@click.option("--max-concurrency", type=int, default=None, metavar="N",
              help="Most requests in flight at once (default: no limit).")
@click.option("--model", default=None, help="Model name to request (default: the first in GET /v1/models).")
@click.option("--api-key", default="EMPTY", show_default=True, help="Bearer token for the server.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the workload and the arrival times.")
@click.option("--tokenizer", default=None, metavar="PATH",
              help="Count prompt lengths in this tokenizer (a tokenizer.json, or a model or artifact directory); "
                   "default: the built-in tiny-py's.")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds one request may take before it counts as failed.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: counts, errors, duration_s, request/output/total throughput, token "
                   "totals, and mean/p50/p90/p99 of ttft_ms, tpot_ms, itl_ms, e2e_ms.")
def bench_serve(url, workload, request_rate, num_requests, max_concurrency, model, api_key, seed, tokenizer,
                timeout, as_json):
    """Measure a running OpenAI-compatible server: streamed completions at a request rate; reports
    throughput and TTFT / TPOT / ITL / end-to-end latency percentiles.

    \b
    llmc bench serve --url http://127.0.0.1:8000 --workload short
    llmc bench serve --url http://127.0.0.1:8000 --request-rate 8 --num-requests 200 --json
    """
    import math

    from llmc.serve import bench as sb
    try:
        rate = float(request_rate)
    except ValueError:
        raise sb.BenchError(f"--request-rate must be a number of requests per second or inf, not "
                            f"{request_rate!r}") from None
    if math.isnan(rate):
        raise sb.BenchError("--request-rate must be a number of requests per second or inf, not nan")
    res = sb.bench_serve(url, workload, num_requests=num_requests, request_rate=rate, model=model, api_key=api_key,
                         seed=seed, max_concurrency=max_concurrency, tokenizer=tokenizer, timeout=timeout,
                         progress=sys.stderr.isatty())
    click.echo(json.dumps(res) if as_json else sb.format_report(res))
    if not res["completed"]:
        raise sb.BenchError(f"all {res['failed']} requests failed; the first: {res['errors'][0]}")


if __name__ == "__main__":
    main()
