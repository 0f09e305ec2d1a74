"""`llmc compile` and `llmc inspect`: make an artifact, and say what one holds."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from llmc.cli import main, options
from llmc.errors import LLMCError


@main.command()
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(), help="Artifact directory to write (NAME.llmc).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Precision of weights and activations. Default: float32; for an ONNX file, the precision it "
                   "was exported in (the only one it compiles in).")
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
                   "artifact, for speculative decoding: `llmc run OUT.llmc --spec draft` then needs no --draft. The "
                   "draft stays in --dtype: --quant applies to MODEL only.")
@click.option("--tokenizer", "tokenizer", default=None, type=click.Path(), metavar="DIR",
              help="For an ONNX model: the directory with its tokenizer files (and config.json); default: the "
                   ".onnx file's directory.")
@click.option("--check-ort", is_flag=True,
              help="For an ONNX model: run the same token ids through onnxruntime and the compiled graph (llmc's "
                   "interpreter) and report the largest logit difference.")
@options.plugin_option
def compile(model, output, dtype, kv_cache_dtype, passes, pass_before, pass_after, dump_ir, verify, explain_fusion,
            no_fuse, tune, batch_invariant, tuning_cache, quant, wbits, group_size, zero_point, calib, calib_samples, bits_budget,
            act_order, quant_lm_head, quant_embeddings, draft_model, tokenizer, check_ort, plugins):
    """Compile MODEL (a local Hugging Face directory, builtin:NAME or an ONNX file) into an artifact."""
    import llmc
    from llmc.compiler import is_onnx
    from llmc.passes.manager import parse_pass_spec
    from llmc.passes.quantize.config import QuantConfig
    options.load_plugins(plugins)
    if Path(output).name in ("", ".", ".."):
        raise LLMCError(f"-o names the artifact to write, e.g. -o model.llmc; {output!r} names no file")
    if dump_ir is not None:
        try:
            Path(dump_ir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LLMCError(f"cannot write the IR to --dump-ir {dump_ir}: {e.strerror or e}; give a directory that "
                            "can be created") from None
    if check_ort and not is_onnx(model):
        raise LLMCError("--check-ort compares with onnxruntime and needs an ONNX model (MODEL.onnx)")
    if check_ort:
        from llmc.frontend.onnx_check import require_onnxruntime
        require_onnxruntime()  # before the compile, not after it
    extra = [parse_pass_spec(s) for s in passes]
    if not quant:
        given = options.given_on_command_line("quant_lm_head", "quant_embeddings", *QUANT_OPTIONS)
        if given:
            raise LLMCError(f"{', '.join(given)} go{'es' if len(given) == 1 else ''} with --quant METHOD (e.g. --quant "
                            "rtn); without it nothing is quantized")
    else:
        _check_quant_options(quant)
    if (pass_before or pass_after) and not passes:
        raise LLMCError("--pass-before and --pass-after place the passes given with --pass; give --pass SPEC too")
    qcfg = QuantConfig(quant, int(wbits), group_size, zero_point, calib, calib_samples, bits_budget=bits_budget,
                       act_order=act_order, skip=() if quant_lm_head else ("lm_head",),
                       embeddings=quant_embeddings) if quant else None
    art = llmc.compile(model, output, dtype=dtype, kv_cache_dtype=kv_cache_dtype, passes=extra,
                       before=pass_before, after=pass_after, dump_ir=dump_ir, verify=verify,
                       progress=sys.stderr.isatty(), fuse=not no_fuse, tune=tune, batch_invariant=batch_invariant,
                       tuning_cache=tuning_cache, quant=qcfg, draft=draft_model, tokenizer=tokenizer)
    s = art.summary()
    for line in dict.fromkeys(art.compile_log.log if art.compile_log else ()):  # what a pass did not do, and why
        click.echo(f"note: {line}", err=True)
    if explain_fusion and no_fuse:
        click.echo("fusion: off (--no-fuse): no fusion pass ran")
    elif explain_fusion:
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
        from llmc.frontend.onnx_check import TOLERANCE, check_onnxruntime
        rep = check_onnxruntime(model, art.graph)
        click.echo(str(rep))
        dtype = art.graph.meta["dtype"]  # the file's own precision (frontend/onnx.py, export_precision)
        if quant:
            click.echo("(quantized weights differ from the file's by design: compare perplexities with llmc eval)")
        elif rep.max_rel_diff > TOLERANCE[dtype]:
            raise LLMCError(f"{art.path} does not compute what {model} does: its logits differ from onnxruntime's by "
                            f"{rep.max_rel_diff:.3g} of their scale, above the {TOLERANCE[dtype]:g} that "
                            f"{dtype} rounding explains. Something in the graph mixes tokens in a way llmc does not see "
                            "(outside attention), or a pass changed it: do not use this artifact; run the compile "
                            "with --no-fuse to tell which, and report it with the model file")


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--ir", is_flag=True, help="Print the IR text.")
@click.option("--kernels", "kernels", is_flag=True,
              help="List what each node runs on the kernel backends, with the kernel specs.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON, the quantization plan in it (null: none).")
@click.option("--plan", "show_plan", is_flag=True,
              help="List the quantization plan per linear: format, bits per weight, measured errors, notes.")
@click.option("--tuning", "show_tuning", is_flag=True,
              help="List the kernel choices the compile timed on its GPU (tuning.json), per kernel and token-count "
                   "bucket: which kernel, its tiles, its time.")
@options.plugin_option
def inspect(artifact, ir, kernels, as_json, show_plan, show_tuning, plugins):
    """Show what ARTIFACT holds: manifest, passes applied, op counts, parameter bytes."""
    import llmc
    from llmc.runtime.config import DEFAULT_TOKEN_BUDGET
    options.load_plugins(plugins)
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
    if show_tuning:
        for line in tuning_lines(art.tuning):
            click.echo(line)
        return
    s = art.summary()
    if as_json:
        click.echo(json.dumps({**s, "quant_plan": _quant_plan(art)}, indent=1))
        return
    click.echo(f"artifact   {s['path']}")
    click.echo(f"format     v{s['format_version']} (llmc {s['llmc_version']}, {s['created']})")
    click.echo(f"source     {s['source']}")
    click.echo(f"options    {', '.join(f'{k}={v}' for k, v in s['options'].items())}")
    click.echo(f"params     {s['num_params']:,}")
    if s.get("token_budget"):
        b = s["token_budget"]
        click.echo(f"tokens     {max(b['tokens'], DEFAULT_TOKEN_BUDGET)} per step by default ({b['tokens']}: the fewest at "
                   f"which the GEMMs run within {b['slack']}x of their best time per token, as measured at compile; "
                   f"{DEFAULT_TOKEN_BUDGET} at least)")
    for dt, n in s["param_bytes_by_dtype"].items():
        click.echo(f"  {dt:8s} {n:>14,} bytes")
    click.echo("passes")
    for p in art.manifest.get("passes", []):
        stats = ", ".join(f"{k}={v}" for k, v in p.get("stats", {}).items() if v)
        click.echo(f"  {p['name']}" + (f"  [{stats}]" if stats else ""))
    click.echo("ops")
    for op, n in s["op_counts"].items():
        click.echo(f"  {op:18s} {n}")
    _echo_quant_plan(_quant_plan(art), show_plan)


def tuning_lines(tuning: dict) -> list[str]:
    """`llmc inspect --tuning`: each timed kernel's choices, one line per run of buckets that share a config
    (the measurements the token budget reads, configless, are left out)."""
    kernels = (tuning or {}).get("kernels") or {}
    chosen = {key: recs for key, recs in kernels.items() if any(r.get("config") for r in recs.values())}
    if not chosen:
        return ["no kernel choices recorded: compiled without a GPU or with --no-tune (default tiles and cuBLAS)"]
    from llmc.codegen.autotune import bucket_size
    out = [f"timed on {tuning.get('device', 'an unnamed GPU')}, triton {tuning.get('triton', '?')}; the token-count "
           f"buckets {', '.join(tuning.get('joint_buckets') or [])} share one choice, timed as their sum"]
    order = lambda kv: (0, bucket_size(kv[0])) if kv[0].rstrip("+").isdigit() else (1, 0)  # noqa: E731 - "decode"
    for key in sorted(chosen):
        out.append(key)
        runs: list[tuple[list[str], dict]] = []
        for bucket, rec in sorted(chosen[key].items(), key=order):
            if runs and runs[-1][1] == rec:
                runs[-1][0].append(bucket)
            else:
                runs.append(([bucket], rec))
        for buckets, rec in runs:
            ms = rec.get("triton_ms")
            where = buckets[0] if len(buckets) == 1 else f"{buckets[0]}..{buckets[-1]}"
            out.append(f"  {where:>12s}  {_choice(rec)}" + (f"  ({ms * 1e3:.1f} us)" if ms else ""))
    return out


def _choice(rec: dict) -> str:
    """A recorded choice in words: the kernel family, then its settings."""
    cfg = dict(rec.get("config") or {})
    if rec.get("prefer_cublas"):
        return "cuBLAS (faster than the generated kernel by more than the margin)"
    if cfg.pop("WGMMA", False):
        x = "copied a group ahead" if cfg.get("XASYNC") else "loaded when used"
        form = f"int4 wgmma GEMM, {cfg['XN']} rows of x a program" if cfg.get("XN") else "int4 wgmma GEMV"
        form += ", scales folded into the codes" if cfg.get("FOLD") else ""
        return (f"{form}: {cfg['WG']} warpgroup(s), x {x}, codes {cfg['AHEAD']} group(s) ahead, "
                f"K split {cfg['SPLIT_K']}")
    if "LIBRARY" in cfg:
        return {"dequant": "weight dequantized, then cuBLAS", "scaled_mm": "torch._scaled_mm (FP8)",
                "int_mm": "torch._int_mm (int8)"}.get(cfg["LIBRARY"], f"library {cfg['LIBRARY']}")
    family = "int4 GEMV" if cfg.pop("GEMV", False) else "generated"
    return f"{family}: " + ", ".join(f"{k}={v}" for k, v in cfg.items())


def _quant_plan(art) -> dict | None:
    """The artifact's quantization plan; for one quantized by a pass that records none (a user's own
    method), the plan read back from its graph, under that pass's name."""
    plan = art.graph.meta.get("quant_plan")
    if plan:
        return plan
    from llmc.passes.manager import PASSES
    from llmc.passes.quantize.materialize import plan_from_graph
    applied = [p["name"].split("{")[0] for p in art.manifest.get("passes", [])]  # "name{option=value}"
    own = [n for n in applied if n not in PASSES or not PASSES[n].__module__.startswith("llmc.")]
    plan = plan_from_graph(art.graph, ", ".join(own) or "imported (the checkpoint's own quantization)")
    return plan and {**plan, "from_graph": True}


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
                  if plan.get("calibration") else "")
               + (" (read from the graph: no plan was recorded)" if plan.get("from_graph") else ""))
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


# the options each --quant method reads (the others would be silently ignored)
QUANT_OPTIONS = {"wbits": ("rtn", "gptq", "awq"), "group_size": ("rtn", "gptq", "awq"),
                 "zero_point": ("rtn", "gptq", "awq"), "calib": ("gptq", "awq", "smoothquant", "mixed"),
                 "calib_samples": ("gptq", "awq", "smoothquant", "mixed"), "bits_budget": ("mixed",),
                 "act_order": ("gptq",)}


def _check_quant_options(method: str) -> None:
    """LLMCError naming the options given on the command line that `method` does not read."""
    unread = options.given_on_command_line(*(n for n, methods in QUANT_OPTIONS.items() if method not in methods))
    if unread:
        raise LLMCError(f"--quant {method} does not use {', '.join(unread)}; drop {'it' if len(unread) == 1 else 'them'}, "
                        "or pick a method that does (llmc compile --help)")
