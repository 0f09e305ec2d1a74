"""The `llmc` command line: compile, run, inspect."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from llmc.errors import LLMCError


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
    """
    ctx.ensure_object(dict)["debug"] = debug


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
                   "its kernels per size, as under torch). --no-batch-invariant: only decode batches of up to 16 "
                   "share one; steps of 17-64 tokens get faster tiles of their own.")
def compile(model, output, dtype, kv_cache_dtype, passes, pass_before, pass_after, dump_ir, verify, explain_fusion,
            no_fuse, tune, batch_invariant):
    """Compile MODEL (a local Hugging Face directory or builtin:NAME) into an artifact."""
    import llmc
    from llmc.passes.manager import parse_pass_spec
    extra = [parse_pass_spec(s) for s in passes]
    art = llmc.compile(model, output, dtype=dtype, kv_cache_dtype=kv_cache_dtype, passes=extra,
                       before=pass_before, after=pass_after, dump_ir=dump_ir, verify=verify,
                       progress=sys.stderr.isatty(), fuse=not no_fuse, tune=tune, batch_invariant=batch_invariant)
    s = art.summary()
    if explain_fusion:
        reasons = art.compile_log.explain if art.compile_log else []
        for r in reasons:
            click.echo(f"fusion: {r}")
        if not reasons:
            click.echo("fusion: no candidate was declined")
    nbytes = sum(s["param_bytes_by_dtype"].values())
    click.echo(f"wrote {art.path}: {s['num_params'] / 1e6:.2f}M params ({nbytes / 2**20:.1f} MiB), "
               f"{sum(s['op_counts'].values())} ops, passes: {', '.join(p.split('{')[0] for p in s['passes'])}")


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--ir", is_flag=True, help="Print the IR text.")
@click.option("--kernels", "kernels", is_flag=True,
              help="List what each node runs on the kernel backends, with the kernel specs.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect(artifact, ir, kernels, as_json):
    """Show what ARTIFACT holds: manifest, passes applied, op counts, parameter bytes."""
    import llmc
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
    for dt, n in s["param_bytes_by_dtype"].items():
        click.echo(f"  {dt:8s} {n:>14,} bytes")
    click.echo("passes")
    for p in art.manifest.get("passes", []):
        stats = ", ".join(f"{k}={v}" for k, v in p.get("stats", {}).items() if v)
        click.echo(f"  {p['name']}" + (f"  [{stats}]" if stats else ""))
    click.echo("ops")
    for op, n in s["op_counts"].items():
        click.echo(f"  {op:18s} {n}")


def _read_prompts(prompt: str | None, prompts_file: str | None) -> list[dict]:
    from llmc.errors import RequestError
    if (prompt is None) == (prompts_file is None):
        raise RequestError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
    if prompt is not None:
        return [{"prompt": prompt}]
    out = []
    for i, line in enumerate(Path(prompts_file).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestError(f"{prompts_file}:{i}: not valid JSON ({e})") from None
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict) or "prompt" not in item:
            raise RequestError(f"{prompts_file}:{i}: each line must be a JSON string or an object with \"prompt\"")
        out.append(item)
    return out


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--prompt", default=None, help="The prompt text.")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A JSONL file: one prompt per line (a string, or an object with \"prompt\" and optional "
                   "sampling fields such as max_tokens, temperature, seed).")
@click.option("--max-tokens", default=64, show_default=True, help="Tokens to generate per prompt.")
@click.option("--temperature", default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", default=0, show_default=True, help="Keep the k most likely tokens (0: off).")
@click.option("--top-p", default=1.0, show_default=True, help="Nucleus sampling mass, in (0, 1].")
@click.option("--min-p", default=0.0, show_default=True, help="Drop tokens below min_p x the top probability.")
@click.option("--repetition-penalty", default=1.0, show_default=True)
@click.option("--seed", default=None, type=int, help="Seed for reproducible sampling.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per prompt.")
@click.option("--backend", type=click.Choice(["auto", "cuda", "triton-interpret", "reference"]), default="auto",
              show_default=True, help="auto: cuda when a GPU is present, else reference (the interpreter).")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when present).")
@click.option("--max-num-seqs", default=64, show_default=True, help="Sequences batched per step.")
@click.option("--max-num-batched-tokens", default=2048, show_default=True, help="Token budget per step.")
@click.option("--block-size", default=16, show_default=True, help="KV cache slots per block.")
@click.option("--num-blocks", default=None, type=int, help="KV cache blocks (default: sized from memory).")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "int8", "fp8"]), default=None,
              help="Override the artifact's KV cache dtype.")
def run(artifact, prompt, prompts_file, max_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed,
        stop, as_json, backend, device, max_num_seqs, max_num_batched_tokens, block_size, num_blocks,
        kv_cache_dtype):
    """Generate text from ARTIFACT with the paged-KV engine."""
    from llmc.runtime.engine import LLM, SamplingParams
    items = _read_prompts(prompt, prompts_file)
    llm = LLM(artifact, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              block_size=block_size, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype, backend=backend,
              device=device)
    base = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repetition_penalty, seed=seed, stop=list(stop))
    from dataclasses import fields
    from llmc.errors import RequestError
    known = {f.name for f in fields(SamplingParams)}
    for i, it in enumerate(items, 1):
        unknown = set(it) - known - {"prompt"}
        if unknown:
            raise RequestError(f"prompt {i}: unknown sampling field(s) {sorted(unknown)}; known: {sorted(known)}")
    params = [SamplingParams(**{**base, **{k: v for k, v in it.items() if k != "prompt"}}) for it in items]
    outs = llm.generate([it["prompt"] for it in items], params, progress=not as_json and sys.stderr.isatty())
    for it, o in zip(items, outs):
        if as_json:
            click.echo(json.dumps({"prompt": it["prompt"], "text": o.text, "token_ids": o.token_ids,
                                   "finish_reason": o.finish_reason,
                                   "num_prompt_tokens": len(o.prompt_token_ids)}))
        else:
            click.echo(it["prompt"] + o.text)
    if not as_json and sys.stderr.isatty():
        st = llm.stats()
        click.echo(f"[{st['blocks_used']}/{st['blocks_total']} KV blocks in use, "
                   f"{st['prefix_cache_hit_tokens']} prefix-cache hit tokens, {st['num_preemptions']} preemptions]",
                   err=True)


if __name__ == "__main__":
    main()
