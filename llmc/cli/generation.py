"""`llmc run` and `llmc eval`: generate text from an artifact, and score text with it (perplexity)."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import click

from llmc.cli import main, options
from llmc.errors import RequestError


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
    from llmc.evaluate import read_utf8
    path = Path(prompts_file)
    text = read_utf8(path, "--prompts", by_line=True)
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
@click.option("--repetition-penalty", default=1.0, show_default=True, metavar="R",
              help="Divide the positive logits (multiply the negative) of tokens already in the prompt or output by R "
                   "(Hugging Face's rule; 1.0 is off, from 0.001 to 1000).")
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
@options.engine_options()
@options.parallel_options
@options.plugin_option
def run(artifact, prompt, prompts_file, max_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed,
        stop, as_json, stream, backend, device, max_num_seqs, max_num_batched_tokens, max_prefill_tokens,
        block_size, num_blocks, kv_cache_dtype, spec_method, draft_path, spec_tokens, multi_step, overlap, warm_up,
        tensor_parallel_size, pipeline_parallel_size, expert_parallel, plugins):
    """Generate text from ARTIFACT with the paged-KV engine.

    With several prompts (or n > 1), plain-text output puts a `--- prompt N ---` line before each
    completion.
    """
    import llmc
    from llmc.runtime.llm import LLM
    options.check_engine_options(backend, device, {"--max-num-seqs": max_num_seqs, "--block-size": block_size,
                                            "--max-num-batched-tokens": max_num_batched_tokens,
                                            "--max-prefill-tokens": max_prefill_tokens,
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
        options.use_triton_interpreter()
    options.load_plugins(plugins)
    art = llmc.load(artifact, verify="background")  # checked while the engine loads the weights
    _check_tokens(items, params, art)
    llm = LLM(art, speculative=options.speculative_config(spec_method, draft_path, spec_tokens, art.bundled_draft),
              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              max_prefill_tokens=max_prefill_tokens, block_size=block_size, num_blocks=num_blocks,
              kv_cache_dtype=kv_cache_dtype, backend=backend, device=device,
              tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
              expert_parallel=expert_parallel, multi_step=multi_step, overlap=overlap, warm_up=warm_up)
    out = _Printer(items, params, as_json, art.tokenizer_dir is not None)
    requests = [it.text if it.text is not None else it.token_ids for it in items]
    if stream:
        out.stream(llm.stream(requests, params, request_ids=[str(i) for i in range(len(requests))]))
    else:
        out.whole(llm.generate(requests, params, progress=not as_json and sys.stderr.isatty()))
    if not as_json and sys.stderr.isatty():
        click.echo(_stats_line(llm.stats()), err=True)


def _stats_line(st: dict) -> str:
    """The engine's state after `llmc run`, for a terminal: KV blocks, prefix-cache hits, preemptions, and
    what speculation proposed and kept."""
    spec = (f", speculation: {st['spec_accepted_tokens']} of {st['spec_proposed_tokens']} proposed tokens "
            f"accepted ({100 * st['spec_acceptance_rate']:.1f}%) in {st['spec_steps']} steps"
            if st.get("spec_proposed_tokens") else "")
    return (f"[{st['blocks_used']}/{st['blocks_total']} KV blocks in use, {st['prefix_cache_hit_tokens']} prefix-cache "
            f"hit tokens, {st['num_preemptions']} preemptions{spec}]")


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
                   "never saw in training). The default where --text is not given.")
@click.option("--max-tokens", type=int, default=None, metavar="N",
              help="Score only the first N tokens after the text's first (which is only context). Default: all.")
@click.option("--window", type=int, default=None, metavar="N",
              help="Most tokens scored per request, each given the ones before it in its window only. Default: 512 "
                   "(fewer if the model's context is shorter), as in the built-in models' metrics.json.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: perplexity, nll (mean, nats per token), tokens (scored), windows, window, "
                   "artifact, dataset (the name, or the --text file).")
@options.engine_options("Windows batched per step.", speculative=False)
@options.plugin_option
def evaluate(artifact, text_file, dataset, max_tokens, window, as_json, backend, device, max_num_seqs,
             max_num_batched_tokens, max_prefill_tokens, block_size, num_blocks, kv_cache_dtype, plugins):
    """Perplexity of ARTIFACT on a text: exp of the mean negative log-likelihood of its tokens, each given
    the ones before it.

    \b
    llmc eval tiny.llmc --max-tokens 20000          # the shipped held-out text
    llmc eval tiny.llmc --text notes.txt --json

    The text's tokens are cut into windows that fit the model's context; neighbouring windows share
    one token, so every token but the first is scored once. Each window is one request, batched by the
    engine, which returns its prompt's log-probabilities (SamplingParams(prompt_logprobs=0)).
    """
    import llmc
    from llmc.evaluate import dataset_text, perplexity, read_text
    options.check_engine_options(backend, device, {"--max-num-seqs": max_num_seqs, "--block-size": block_size,
                                            "--max-num-batched-tokens": max_num_batched_tokens,
                                            "--max-prefill-tokens": max_prefill_tokens,
                                            "--num-blocks": num_blocks, "--max-tokens": max_tokens,
                                            "--window": window})
    if text_file is not None and dataset is not None:
        raise RequestError("give one of --text FILE or --dataset builtin:heldout, not both")
    if text_file is None and dataset is None:
        dataset = "builtin:heldout"
    text = read_text(text_file) if text_file is not None else dataset_text(dataset)
    if backend == "triton-interpret":
        options.use_triton_interpreter()
    options.load_plugins(plugins)
    art = llmc.load(artifact, verify="background")  # checked while the engine loads the weights
    if art.tokenizer_dir is None:
        raise RequestError(f"{art.path} has no tokenizer (its model had no tokenizer files), so it cannot score "
                           "text; compile the model from a directory with its tokenizer files (an ONNX file: with --tokenizer DIR)")
    longest = art.info.max_model_len - 2
    if window is not None and window > longest:
        raise RequestError(f"--window must be at most {longest} for this model, got {window}: its context is "
                           f"{art.info.max_model_len} tokens, and a window of N scored tokens is a prompt of N + 1 "
                           "with room for one generated token")
    res = perplexity(art, text, max_tokens=max_tokens, window=window, progress=not as_json and sys.stderr.isatty(),
                     backend=backend, device=device, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, max_prefill_tokens=max_prefill_tokens,
                     block_size=block_size, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype)
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
