"""A serving benchmark client: drives an OpenAI-compatible server and measures latency and throughput.

Requests are streamed completions (`/v1/completions`, `stream=True`) sent by the official `openai`
async client, arriving as a Poisson process at a given rate (or all at once). Per request it
measures, on the monotonic clock of this process:

* TTFT: from sending the request to the first streamed chunk that carries text (or token ids);
* ITL: the gaps between consecutive such chunks (a chunk may carry several tokens, e.g. under
  speculative decoding; ITL is what a reader of the stream sees);
* TPOT: (E2E - TTFT) / (output tokens - 1), the mean time per token after the first;
* E2E: from sending the request to the end of its stream.

Output tokens come from the `usage` the server sends at the end of the stream
(`stream_options={"include_usage": True}`), else from the count of chunks carrying text (a lower
bound when a chunk carries several tokens).

Workloads (prompts cut from the shipped held-out text, `llmc.models.heldout_text_path()`, which
the built-in models never saw, so a prompt is a realistic piece of code and not a prefix-cache hit):

* `mixed`: the workload of llmc's throughput figures (`thru` in tools/llmc_bench.py and the HF
  peer in tools/peer_throughput.py): prompt lengths uniform in [64, 1024] tokens, output lengths
  uniform in [64, 512], drawn with `random.Random(seed)` in that order, so seed 0 gives exactly
  their requests' lengths. Prompts are consecutive cuts of the text from a seeded start.
* `short`: 32-token prompts, 32 output tokens: a quick check that a server streams at all.

Outputs have their planned length: requests pass `ignore_eos` (a vLLM-style extension, in
`extra_body`) with `max_tokens`; a server that ignores it ends some outputs early, which the
report counts as `early_stops`.
"""
from __future__ import annotations

import asyncio
import functools
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

from llmc.errors import LLMCError

WORKLOADS = ("mixed", "short")
DEFAULT_NUM_REQUESTS = {"mixed": 256, "short": 32}
PERCENTILES = (50, 90, 99)
MAX_ERRORS_KEPT = 5


class BenchError(LLMCError):
    """The benchmark cannot run: a bad option, or a server that is unreachable or refuses."""


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a workload; `prompt_tokens` counts the prompt with the workload's tokenizer."""

    prompt: str
    prompt_tokens: int
    max_tokens: int


@dataclass
class RequestResult:
    """What one request measured; times in seconds, `None` where the request failed first."""

    planned: PlannedRequest
    ok: bool = False
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server counted them (usage), when it says
    error: str | None = None


# ---------------------------------------------------------------- workloads and arrivals

def workload_lengths(name: str, n: int, seed: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of each request of workload `name`."""
    if name == "mixed":
        rng = random.Random(seed)  # the draw order of tools/llmc_bench.py: seed 0 gives its requests
        return [(rng.randint(64, 1024), rng.randint(64, 512)) for _ in range(n)]
    if name == "short":
        return [(32, 32)] * n
    raise BenchError(f"unknown workload {name!r}; available: {', '.join(WORKLOADS)}")


def resolve_tokenizer(path: str | None) -> Path:
    """The tokenizer.json to cut prompts with: a file, or a directory holding one (an HF model
    directory, an artifact, or its tokenizer/); default the built-in tiny-py's."""
    if path is None:
        from llmc.models import builtin_dir
        return builtin_dir("tiny-py", must_exist=False) / "tokenizer.json"
    p = Path(path)
    for cand in (p, p / "tokenizer.json", p / "tokenizer" / "tokenizer.json"):
        if cand.is_file():
            return cand
    raise BenchError(f"--tokenizer {path}: no tokenizer.json there; give the served model's directory, its "
                     "artifact, or the tokenizer.json file itself")


@functools.lru_cache(maxsize=4)
def _heldout_tokens(tokenizer_json: Path) -> tuple[str, list[tuple[int, int]]]:
    """The held-out text (document separators as newlines) and its tokens' character offsets."""
    from tokenizers import Tokenizer

    from llmc.models import heldout_text_path
    text = heldout_text_path().read_text().replace("<|endoftext|>", "\n")
    enc = Tokenizer.from_file(str(tokenizer_json)).encode(text, add_special_tokens=False)
    return text, enc.offsets


def build_workload(name: str, n: int, seed: int = 0, tokenizer: str | None = None) -> list[PlannedRequest]:
    """The requests of a workload, the same for the same (name, n, seed, tokenizer).

    Args:
        name: one of `WORKLOADS`.
        n: number of requests.
        seed: draws the lengths (mixed) and where in the held-out text the prompts start.
        tokenizer: see `resolve_tokenizer`; prompt lengths are counted in its tokens, so give the
            served model's for exact lengths (another tokenizer gives roughly the same text size).

    Returns:
        `n` planned requests; prompts are consecutive, non-overlapping cuts of the held-out text
        (wrapping to its start when they run past its end).

    Example:
        >>> reqs = build_workload("short", 4, seed=0)
        >>> [(r.prompt_tokens, r.max_tokens) for r in reqs]
        [(32, 32), (32, 32), (32, 32), (32, 32)]
    """
    return cut_prompts(workload_lengths(name, n, seed), seed, tokenizer)


def cut_prompts(lengths: list[tuple[int, int]], seed: int = 0, tokenizer: str | None = None) -> list[PlannedRequest]:
    """Requests of the given (prompt tokens, output tokens): consecutive, non-overlapping cuts of the
    held-out text from a start that `seed` picks (see `build_workload`)."""
    text, offsets = _heldout_tokens(resolve_tokenizer(tokenizer))
    pos = random.Random(f"{seed}/start").randrange(len(offsets))
    out = []
    for plen, olen in lengths:
        if pos + plen > len(offsets):
            pos = 0
        out.append(PlannedRequest(text[offsets[pos][0]:offsets[pos + plen - 1][1]], plen, olen))
        pos += plen
    return out


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of `n` requests arriving as a Poisson process of `rate`
    per second: exponential gaps of mean 1/rate, the first request at 0. `rate=inf`: all at 0.

    Example:
        >>> poisson_arrivals(3, math.inf)
        [0.0, 0.0, 0.0]
    """
    if not rate > 0:
        raise BenchError(f"--request-rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}/arrivals")  # apart from the lengths' stream: a rate change keeps the workload
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), interpolating linearly between order statistics (numpy's
    default); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ---------------------------------------------------------------- driving the server

def _check_url(url: str) -> str:
    """The server's root URL (no trailing slash, no /v1), or a BenchError saying what is wrong."""
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise BenchError(f"--url {url!r} is not an http(s) URL; give the server's address, e.g. "
                         "http://127.0.0.1:8000")
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _client(url: str, api_key: str, timeout: float):
    import openai
    # no retries: a retried request would hide a failure and count its wait as latency
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)


async def served_model(client, url: str) -> str:
    """The first model that `GET /v1/models` lists, or a BenchError naming what went wrong."""
    import openai
    try:
        page = await client.models.list()
    except openai.APIConnectionError as e:
        why = f"{e.__cause__}" if e.__cause__ else str(e)
        raise BenchError(f"cannot reach {url} ({why}); start the server (llmc serve ARTIFACT) or check --url") \
            from None
    except openai.APIStatusError as e:
        hint = "; pass --api-key" if e.status_code in (401, 403) else ""
        raise BenchError(f"{url}/v1/models answered {_message(e)}{hint}") from None
    ids = [m.id for m in page.data]
    if not ids:
        raise BenchError(f"{url}/v1/models lists no model; give one with --model")
    return ids[0]


def _message(e: Exception) -> str:
    """An exception as one line; for an HTTP error, the status and the server's own message."""
    import openai
    if isinstance(e, openai.APIStatusError):
        body = e.body if isinstance(e.body, dict) else {}
        detail = body.get("message") or body.get("detail") or e.response.text[:200] or e.message
        return f"HTTP {e.status_code}: {detail}"
    if isinstance(e, openai.APIConnectionError) and e.__cause__:
        return f"{type(e).__name__}: {e.__cause__}"
    return f"{type(e).__name__}: {e}"


async def _send(client, model: str, req: PlannedRequest) -> RequestResult:
    """One streamed completion, timed from just before sending to the end of its stream."""
    res = RequestResult(req)
    chunks, usage, last = 0, None, None
    start = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=req.prompt, max_tokens=req.max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
                if any(c.text or getattr(c, "token_ids", None) for c in chunk.choices):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
        res.e2e = time.perf_counter() - start
    except Exception as e:  # any failure of one request is a result, not the end of the benchmark
        res.error = _message(e)
        return res
    if last is None:
        res.error = "the stream ended without any text"
        return res
    res.ok = True
    res.output_tokens = usage.completion_tokens if usage is not None and usage.completion_tokens else chunks
    res.prompt_tokens = usage.prompt_tokens if usage is not None else None
    return res


async def _drive(client, model: str, plan: list[PlannedRequest], arrivals: list[float],
                 max_concurrency: int | None, on_done: Callable[[RequestResult], None]) -> tuple[list, float]:
    """Send each request at its arrival time; returns the results (in plan order) and the duration
    from the first send to the last completion."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(req: PlannedRequest) -> RequestResult:
        if sem is None:
            res = await _send(client, model, req)
        else:
            async with sem:
                res = await _send(client, model, req)
        on_done(res)
        return res

    t0 = time.perf_counter()
    tasks = []
    for req, at in zip(plan, arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


# ---------------------------------------------------------------- the report

def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    return {"mean": 1e3 * sum(values) / len(values), **{f"p{q}": 1e3 * percentile(values, q) for q in PERCENTILES}}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """The figures of a run: counts, throughputs (over the whole run, failures included in its
    duration) and latency statistics in ms over the successful requests (ITL over all their gaps)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.planned.prompt_tokens for r in ok)
    errors: list[str] = []
    for r in results:
        if r.error and r.error not in errors and len(errors) < MAX_ERRORS_KEPT:
            errors.append(r.error)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else None,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "planned_output_tokens": sum(r.planned.max_tokens for r in ok),
        "early_stops": sum(r.output_tokens < r.planned.max_tokens for r in ok),
        "ttft_ms": _stats_ms([r.ttft for r in ok]), "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms([g for r in ok for g in r.itl]), "e2e_ms": _stats_ms([r.e2e for r in ok]),
    }


def format_report(s: dict) -> str:
    """The report as aligned text lines."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)
    rate = s["request_rate"] if isinstance(s["request_rate"], str) else f"{s['request_rate']:g}"
    lines = [
        f"{s['workload']}: {s['num_requests']} requests at {rate} req/s (seed {s['seed']}), model {s['model']} "
        f"at {s['url']}",
        f"completed            {s['completed']}",
        f"failed               {s['failed']}",
        f"duration             {s['duration_s']:.2f} s",
        f"request throughput   {num(s['request_throughput'], '.2f')} req/s",
        f"output throughput    {num(s['output_throughput'], ',.1f')} tok/s",
        f"total throughput     {num(s['total_token_throughput'], ',.1f')} tok/s",
        f"tokens               {s['total_input_tokens']:,} in, {s['total_output_tokens']:,} out "
        f"(of {s['planned_output_tokens']:,} planned)",
        f"{'(ms)':20s} {'mean':>9s} " + " ".join(f"{'p' + str(q):>9s}" for q in PERCENTILES),
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        st = s[key]
        lines.append(f"{label:20s} {num(st['mean'], '9.1f')} "
                     + " ".join(num(st[f"p{q}"], "9.1f") for q in PERCENTILES))
    if s["early_stops"]:
        lines.append(f"warning: {s['early_stops']} outputs ended before max_tokens (does the server honour "
                     "ignore_eos?)")
    lines += [f"error: {e}" for e in s["errors"]]
    return "\n".join(lines)


def bench_serve(url: str, workload: str = "mixed", *, num_requests: int | None = None,
                request_rate: float = math.inf, model: str | None = None, api_key: str = "EMPTY", seed: int = 0,
                max_concurrency: int | None = None, tokenizer: str | None = None, timeout: float = 600.0,
                progress: bool = False) -> dict:
    """Benchmark the OpenAI-compatible server at `url` with a workload.

    Args:
        url: the server's root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted).
        workload: one of `WORKLOADS`.
        num_requests: requests to send (default: `DEFAULT_NUM_REQUESTS[workload]`).
        request_rate: mean arrivals per second of a Poisson process; `math.inf` sends all at once.
        model: the model name to request (default: the first that GET /v1/models lists).
        api_key: sent as the bearer token.
        seed: makes the workload and the arrival times repeat.
        max_concurrency: most requests in flight at once (default: no limit); a request waiting
            for a slot is timed from when it is sent.
        tokenizer: counts prompt tokens (see `build_workload`).
        timeout: seconds one request may take before it counts as failed.
        progress: show a progress bar on stderr.

    Returns:
        `summarize`'s figures plus the run's settings (workload, url, model, request_rate (a number or
        "inf"), seed, max_concurrency), all JSON-ready; `format_report` writes them as text.

    Raises:
        BenchError: a bad option, or the server cannot be reached or refuses GET /v1/models.

    Example:
        >>> s = bench_serve("http://127.0.0.1:8000", "short", num_requests=8)  # doctest: +SKIP
        >>> print(format_report(s))  # doctest: +SKIP
    """
    url = _check_url(url)
    n = DEFAULT_NUM_REQUESTS.get(workload, 0) if num_requests is None else num_requests
    workload_lengths(workload, 0, seed)  # an unknown workload fails before the server is asked
    if n < 1:
        raise BenchError(f"--num-requests must be >= 1, got {n}")
    if max_concurrency is not None and max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    if not timeout > 0:
        raise BenchError(f"--timeout must be > 0 seconds, got {timeout}")
    arrivals = poisson_arrivals(n, request_rate, seed)
    tok = resolve_tokenizer(tokenizer)

    async def main() -> dict:
        client = _client(url, api_key, timeout)
        try:
            listed = await served_model(client, url)  # also: an unreachable server fails here, in one line
            name = model or listed
            plan = build_workload(workload, n, seed, str(tok))
            with _Progress(n, progress) as bar:
                results, duration = await _drive(client, name, plan, arrivals, max_concurrency, bar.done)
        finally:
            await client.close()
        rate = "inf" if math.isinf(request_rate) else request_rate  # JSON has no infinity
        return {"workload": workload, "url": url, "model": name, "request_rate": rate, "seed": seed,
                "max_concurrency": max_concurrency, **summarize(results, duration)}

    return asyncio.run(main())


class _Progress:
    """A rich progress bar of completed requests on stderr, or nothing."""

    def __init__(self, total: int, show: bool):
        self.total, self.show, self.failed = total, show, 0

    def __enter__(self):
        if self.show:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self.bar = Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("requests", total=self.total, failed=0)
        return self

    def done(self, res: RequestResult) -> None:
        self.failed += not res.ok
        if self.show:
            self.bar.update(self.task, advance=1, failed=self.failed)

    def __exit__(self, *exc):
        if self.show:
            self.bar.stop()
