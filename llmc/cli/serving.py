"""`llmc serve` and `llmc bench`: an OpenAI-compatible server, and the throughput and latency of an
artifact or of a running server."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from llmc.cli import main, options
from llmc.errors import LLMCError, RequestError


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
@options.engine_options()
@options.parallel_options
@options.plugin_option
def serve(artifact, host, port, api_key, served_model_name, chat_template, max_queue, shutdown_timeout, backend,
          device, max_num_seqs, max_num_batched_tokens, max_prefill_tokens, block_size, num_blocks, kv_cache_dtype,
          spec_method, draft_path, spec_tokens, multi_step, overlap, warm_up, tensor_parallel_size,
          pipeline_parallel_size, expert_parallel, plugins):
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
    options.check_engine_options(backend, device, {"--max-num-seqs": max_num_seqs, "--block-size": block_size,
                                            "--max-num-batched-tokens": max_num_batched_tokens,
                                            "--max-prefill-tokens": max_prefill_tokens,
                                            "--num-blocks": num_blocks, "--max-queue": max_queue,
                                            "--multi-step": multi_step})
    if not 0 < port < 65536:
        raise RequestError(f"--port must be in 1-65535, got {port}")
    _check_port(host, port)
    template = None
    if chat_template is not None:
        path = Path(chat_template)
        if not path.is_file():
            raise RequestError(f"--chat-template {path}: " + ("no such file" if not path.exists() else "not a file"))
        template = path.read_text(encoding="utf-8")
    if backend == "triton-interpret":
        options.use_triton_interpreter()
    options.load_plugins(plugins)
    from llmc.runtime.async_engine import AsyncLLM
    from llmc.serve.app import create_app
    art = llmc.load(artifact, verify="background")  # checked while the engine loads the weights
    speculative = options.speculative_config(spec_method, draft_path, spec_tokens, art.bundled_draft)
    name = served_model_name or Path(art.path).name.removesuffix(".llmc")
    llm = AsyncLLM(art, speculative=speculative, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, max_prefill_tokens=max_prefill_tokens,
                   block_size=block_size, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype, backend=backend,
                   device=device,
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


def _check_port(host: str, port: int) -> None:
    """RequestError, before the model loads, where the server could not listen on host:port (a port in use, an
    address not of this machine), as uvicorn binds it (SO_REUSEADDR)."""
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise RequestError(f"--host {host}: {e.strerror}; give an address or name of this machine") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            raise RequestError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port or stop what "
                               "holds it") from None


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
                   "(null off CUDA), steps, host_ms_per_step (the engine's host time per step by part), duration_s, "
                   "token totals and the settings.")
@click.option("--longest-first", is_flag=True,
              help="mixed: queue the requests longest output first, as llmc.LLM.generate does (fewer steps, "
                   "later first tokens for short requests); default: in the workload's order, as a server takes "
                   "requests that arrive together.")
@options.engine_options()
@options.parallel_options
@options.plugin_option
def bench_artifact(artifact, workload, num_requests, seed, as_json, longest_first, backend, device, max_num_seqs,
                   max_num_batched_tokens, max_prefill_tokens, block_size, num_blocks, kv_cache_dtype, spec_method,
                   draft_path, spec_tokens, multi_step, overlap, warm_up, tensor_parallel_size, pipeline_parallel_size,
                   expert_parallel, plugins):
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
    options.check_engine_options(backend, device, {"--max-num-seqs": max_num_seqs, "--block-size": block_size,
                                            "--max-num-batched-tokens": max_num_batched_tokens,
                                            "--max-prefill-tokens": max_prefill_tokens,
                                            "--num-blocks": num_blocks, "--num-requests": num_requests,
                                            "--multi-step": multi_step})
    if workload not in offline.WORKLOADS:
        raise offline.BenchError(f"--workload {workload!r} is not a workload; use one of "
                                 f"{', '.join(offline.WORKLOADS)}")
    if backend == "triton-interpret":
        options.use_triton_interpreter()
    options.load_plugins(plugins)
    art = llmc.load(artifact, verify="background")  # checked while the engine loads the weights
    res = offline.bench(art, workload, num_requests=num_requests, seed=seed,
                        speculative=options.speculative_config(spec_method, draft_path, spec_tokens, art.bundled_draft),
                        progress=sys.stderr.isatty(), longest_first=longest_first, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, max_prefill_tokens=max_prefill_tokens,
                        block_size=block_size, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype, backend=backend,
                        device=device, multi_step=multi_step, overlap=overlap, warm_up=warm_up,
                        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                        expert_parallel=expert_parallel)
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
