"""`llmc bench ARTIFACT`: an offline benchmark of an artifact through the public API (`llmc.LLM`).

Workloads (prompts are cuts of the shipped held-out text, as in `llmc bench serve`; greedy, ignore_eos):

* `mixed`: N requests at once (default 256), prompt lengths U[64, 1024] and output lengths U[64, 512]
  drawn with `random.Random(seed)` in that order: `llmc.serve.bench.workload_lengths("mixed", ...)`,
  the requests of llmc's throughput figures;
* `decode`: batch 1, a fresh 128-token prompt and 256 new tokens, N times (default 3), one after another;
* `prefill`: a fresh 2048-token prompt and one new token, N times (default 3): time to first token.

A request that would not fit the model's context keeps its output length and has its prompt
shortened to fit (prompt + output <= context); the report says how many were. Before the timed
runs a short warm-up on other prompts of the same lengths compiles and captures what the timed
steps need, so that they time running, not preparing.

Timing follows the streamed outputs (`LLM.stream`) on the host's monotonic clock, per request:

* TTFT: from submitting the run's requests to the step output carrying the request's first token;
* ITL: the gaps between the step outputs carrying its later tokens (an output can carry several
  tokens under speculative decoding; ITL is what a reader of the stream sees);
* out tok/s: output tokens over the wall time of the timed runs (prefill and decode together);
* GPU busy (CUDA only): the time between CUDA events recorded around each step of the model, over
  the wall time; the rest is the host's (scheduling, sampling, detokenizing) or idle. A draft
  model's steps under speculative decoding are not counted. It is an upper bound on the kernels'
  share: a step the host launches piece by piece (a mixed step's attention runs between its
  piecewise graphs) counts the GPU's waits for those launches inside the step as busy. Kernel by
  kernel time comes from the step profiler (`LLMC_PROFILE_DIR`, llmc/runtime/profiling.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.serve.bench import BenchError, cut_prompts, percentile, resolve_tokenizer, workload_lengths

WORKLOADS = ("mixed", "decode", "prefill")
DEFAULT_NUM_REQUESTS = {"mixed": 256, "decode": 3, "prefill": 3}
DECODE_LENGTHS = (128, 256)  # prompt, new tokens
PREFILL_TOKENS = 2048
WARMUP_REQUESTS, WARMUP_TOKENS = 32, 16  # at most: the warm-up's size


@dataclass
class _Run:
    """What one timed run measured: times in seconds."""

    duration: float = 0.0
    output_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)  # per request: time per output token after its first
    busy: float | None = None


def plan_requests(workload: str, n: int, seed: int, max_model_len: int, tokenizer: str | None = None
                  ) -> tuple[list[tuple[str, int, int]], int]:
    """(prompt text, prompt tokens, output tokens) of each timed request of `workload`, capped to fit
    `max_model_len`, then of up to `WARMUP_REQUESTS` warm-up requests of the first ones' lengths (at most
    `WARMUP_TOKENS` new tokens); and how many timed requests were capped."""
    if workload == "mixed":
        lengths = workload_lengths("mixed", n, seed)
    elif workload == "decode":
        lengths = [DECODE_LENGTHS] * n
    elif workload == "prefill":
        lengths = [(PREFILL_TOKENS, 1)] * n
    else:
        raise BenchError(f"unknown workload {workload!r}; available: {', '.join(WORKLOADS)}")
    warm = [(p, min(o, WARMUP_TOKENS)) for p, o in lengths[:WARMUP_REQUESTS]]
    fitted = []
    for p, o in lengths + warm:
        o = min(o, max_model_len - 1)
        fitted.append((min(p, max_model_len - o), o))
    capped = sum(f != l for f, l in zip(fitted, lengths))
    # consecutive cuts: the warm-up's prompts follow the timed ones, so none of them is a prefix-cache hit
    return [(r.prompt, r.prompt_tokens, r.max_tokens) for r in cut_prompts(fitted, seed, tokenizer)], capped


def bench(model, workload: str = "mixed", *, num_requests: int | None = None, seed: int = 0,
          speculative: dict | None = None, progress: bool = False, longest_first: bool = False, **options) -> dict:
    """Benchmark an artifact offline on a workload.

    Args:
        model: an artifact path, a loaded `Artifact`, or an `LLM` to reuse (its engine options then
            stand, and `speculative` and `**options` must be left out).
        workload: one of `WORKLOADS` (see the module docstring).
        num_requests: mixed: requests at once; decode, prefill: runs (default `DEFAULT_NUM_REQUESTS`).
        seed: picks the mixed workload's lengths and where in the held-out text the prompts start.
        speculative: speculative decoding options, as for `llmc.LLM`.
        progress: show a progress bar of output tokens on stderr.
        longest_first: mixed: queue the requests longest output first, as `LLM.generate` does (which
            shortens the run; short requests then wait longer for their first token); default: in the
            workload's order, as a server takes requests that arrive together.
        **options: engine options (`EngineConfig` fields), as for `llmc.LLM`.

    Returns:
        A JSON-ready dict: out_tok_s, ttft_ms_p50/p99, itl_ms_p50/p99 (between streamed outputs; None
        without later tokens), tpot_ms_p50/p99 (per request: time per output token after its first,
        which stays per token where outputs carry several: speculation, multi-step),
        gpu_busy (a fraction, None off CUDA), steps and host_ms_per_step (the engine's host time per step
        of the timed runs, by part, as `LLM.stats()` ms_per_step_*), and the run's settings and totals;
        `format_report` writes it as a table.

    Raises:
        BenchError: a bad workload or count; RequestError / ArtifactError from the engine.

    Example:
        >>> r = bench("tiny-py.llmc", "decode", num_requests=1, backend="reference")  # doctest: +SKIP
        >>> print(format_report(r))                                                     # doctest: +SKIP
    """
    n = DEFAULT_NUM_REQUESTS.get(workload, 0) if num_requests is None else num_requests
    if workload not in WORKLOADS:
        raise BenchError(f"unknown workload {workload!r}; available: {', '.join(WORKLOADS)}")
    if n < 1:
        raise BenchError(f"the number of requests must be >= 1, got {n}")
    if isinstance(model, LLM):
        if speculative is not None or options:
            raise BenchError("bench() was given a ready LLM: set engine and speculative options where the LLM is "
                             "made, not here")
        llm = model
    else:
        llm = LLM(model, speculative=speculative, **options)
    eng = llm.engine
    length = eng.max_model_len
    cut_with = _tokenizer_json(eng.artifact.path) if eng.tokenizer is not None else None
    planned, capped = plan_requests(workload, n, seed, length, cut_with)
    encode = _encoder(eng, cut_with)
    requests = [(encode(text)[:p], o) for text, p, o in planned]
    timed, warm = requests[:n], requests[n:]
    batches = [timed] if workload == "mixed" else [[r] for r in timed]
    _run(llm, warm if workload == "mixed" else warm[:1], None)
    runs, preempted = [], eng.num_preemptions
    steps0, timings0 = eng.num_steps, dict(eng.timings)
    with _TokenProgress(sum(o for _, o in timed), progress) as bar:
        for batch in batches:
            runs.append(_run(llm, batch, bar.advance, longest_first))
    steps = eng.num_steps - steps0
    ttft = [t for r in runs for t in r.ttft]
    itl = [g for r in runs for g in r.itl]
    tpot = [g for r in runs for g in r.tpot]
    duration = sum(r.duration for r in runs)
    out_tokens = sum(r.output_tokens for r in runs)
    busy = None if any(r.busy is None for r in runs) else sum(r.busy for r in runs) / duration

    def ms(values, q):
        v = percentile(values, q)
        return None if v is None else 1e3 * v
    return {
        "workload": workload, "num_requests": n, "seed": seed, "artifact": str(eng.artifact.path),
        "device": str(getattr(eng.executor, "device", "?")), "max_model_len": length, "capped_requests": capped,
        "prompt_tokens": sum(len(ids) for ids, _ in timed), "output_tokens": out_tokens, "duration_s": duration,
        "out_tok_s": out_tokens / duration if duration > 0 else None,
        "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99),
        "itl_ms_p50": ms(itl, 50), "itl_ms_p99": ms(itl, 99), "tpot_ms_p50": ms(tpot, 50),
        "tpot_ms_p99": ms(tpot, 99), "gpu_busy": busy,
        "num_preemptions": eng.num_preemptions - preempted,
        # the engine's host time per step of the timed runs, by part (LLM.stats()' ms_per_step_*): where the host
        # goes when the GPU waits for it; "wait" is the host blocked on the device's tokens
        "steps": steps, "host_ms_per_step": {k: round((v - timings0.get(k, 0.0)) * 1e3 / max(1, steps), 4)
                                             for k, v in eng.timings.items()},
        # the step shape the figures were measured with (the token budget is the compile's measured one
        # unless the engine was given another)
        "max_num_seqs": eng.config.max_num_seqs, "max_num_batched_tokens": eng.config.max_num_batched_tokens,
        "max_prefill_tokens": eng.scheduler.config.max_prefill_tokens,
        "step_budget": eng.scheduler.config.step_budget is not None, "overlap": eng.overlap,
        "pace_prompts": eng.scheduler.config.pace_prompts,
        "longest_first": longest_first,
    }


def _tokenizer_json(artifact_path: Path) -> str | None:
    """The artifact's tokenizer.json to cut prompts with, if it has one (a slow tokenizer has none)."""
    try:
        return str(resolve_tokenizer(str(artifact_path)))
    except BenchError:
        return None


def _encoder(eng, cut_with: str | None) -> Callable[[str], list[int]]:
    """text -> token ids: the model's tokenizer, or for a model without one the tokenizer that cut the
    text (the built-in tiny-py's), its ids folded into the model's vocabulary."""
    if eng.tokenizer is not None:
        return lambda text: eng.tokenizer.encode(text, add_special_tokens=False)
    from tokenizers import Tokenizer
    tok, vocab = Tokenizer.from_file(str(resolve_tokenizer(cut_with))), eng.info.vocab_size
    return lambda text: [i % vocab for i in tok.encode(text, add_special_tokens=False).ids]


def _run(llm, requests: list[tuple[list[int], int]], on_tokens: Callable[[int], None] | None,
         longest_first: bool = False) -> _Run:
    """Submit `requests` (prompt ids, output tokens) at once and time their streamed outputs."""
    if not requests:
        return _Run()
    eng, res = llm.engine, _Run()
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in requests]
    events: list | None = None
    ex = eng.executor
    wrapped = {name: getattr(ex, name) for name in ("execute", "launch") if hasattr(ex, name)}
    if getattr(ex, "device", torch.device("cpu")).type == "cuda":
        events = []

        def timed(run):  # CUDA events around the model's step: its time on the GPU
            def call(*args):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = run(*args)
                end.record()
                events.append((start, end))
                return out
            return call
        for name, run in wrapped.items():
            setattr(ex, name, timed(run))
        torch.cuda.synchronize()
    last: dict[str, float] = {}
    first: dict[str, tuple[float, int]] = {}  # request -> (time of its first output, tokens in it)
    later: dict[str, int] = {}  # request -> output tokens after the first output
    try:
        t0 = time.perf_counter()
        for out in llm.stream([p for p, _ in requests], params, longest_first=longest_first):
            new = len(out.outputs[0].delta_token_ids)
            if not new:
                continue  # a prompt chunk that samples nothing
            now = time.perf_counter()
            rid = out.request_id
            if rid in last:
                res.itl.append(now - last[rid])
                later[rid] = later.get(rid, 0) + new
            else:
                res.ttft.append(now - t0)
                first[rid] = (now, new)
            last[rid] = now
            res.output_tokens += new
            if on_tokens is not None:
                on_tokens(new)
        res.duration = time.perf_counter() - t0
        # per token, not per streamed output: speculation and multi-step stream several tokens at once
        res.tpot = [(last[rid] - first[rid][0]) / n for rid, n in later.items()]
    finally:
        if events is not None:
            for name, run in wrapped.items():
                setattr(ex, name, run)
    if events is not None:
        torch.cuda.synchronize()
        res.busy = sum(s.elapsed_time(e) for s, e in events) / 1e3
    return res


class _TokenProgress:
    """A rich progress bar of output tokens on stderr, or nothing."""

    def __init__(self, total: int, show: bool):
        self.total, self.show = total, show

    def __enter__(self):
        if self.show:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self.bar = Progress(TextColumn("output tokens"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("tokens", total=self.total)
        return self

    def advance(self, n: int) -> None:
        if self.show:
            self.bar.advance(self.task, n)

    def __exit__(self, *exc):
        if self.show:
            self.bar.stop()


def format_report(r: dict) -> str:
    """The report as a small aligned table."""
    def num(v, fmt):
        return f"{'n/a':>9s}" if v is None else format(v, fmt)
    n = r["num_requests"]
    runs = f"{n} run{'s' if n > 1 else ''}"
    order = ", queued longest output first" if r.get("longest_first") else ""
    what = {"mixed": f"{n} request{'s' if n > 1 else ''} at once (prompts U[64, 1024], outputs U[64, 512] "
                     f"tokens{order})",
            "decode": f"{runs} of batch 1 ({DECODE_LENGTHS[0]}-token prompt, {DECODE_LENGTHS[1]} new tokens)",
            "prefill": f"{runs} of one fresh {PREFILL_TOKENS}-token prompt, 1 new token"}
    lines = [
        f"{r['workload']}: {what[r['workload']]}, seed {r['seed']}, greedy, ignore_eos",
        f"{r['artifact']} on {r['device']}: {r['prompt_tokens']:,} prompt and {r['output_tokens']:,} output tokens "
        f"in {r['duration_s']:.2f} s, {r['num_preemptions']} preemptions",
    ]
    if r["capped_requests"]:
        lines.append(f"note: {r['capped_requests']} of {r['num_requests']} prompts shortened to fit the model's "
                     f"{r['max_model_len']}-token context (prompt + output <= {r['max_model_len']})")
    lines += [
        "",
        f"{'':22s} {'p50':>9s} {'p99':>9s}",
        f"{'TTFT (ms)':22s} {num(r['ttft_ms_p50'], '9.1f')} {num(r['ttft_ms_p99'], '9.1f')}",
        f"{'inter-token (ms)':22s} {num(r['itl_ms_p50'], '9.2f')} {num(r['itl_ms_p99'], '9.2f')}",
        f"{'per output token (ms)':22s} {num(r['tpot_ms_p50'], '9.2f')} {num(r['tpot_ms_p99'], '9.2f')}",
        f"{'output (tok/s)':22s} {num(r['out_tok_s'], '9,.1f')}",
        f"{'GPU busy':22s} {num(r['gpu_busy'], '9.1%')}",
    ]
    host = r.get("host_ms_per_step") or {}
    if r.get("steps") and host:  # where the engine's host time per step goes; "wait" is for the device's tokens
        parts = ", ".join(f"{k} {v:.3f}" for k, v in host.items())
        lines.append(f"{r['steps']:,} steps; host ms per step: {parts}")
    return "\n".join(lines)
