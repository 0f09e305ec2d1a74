"""`llmc bench serve` against a fake OpenAI-compatible server that streams with known delays: the
figures it reports must agree with what the server did; plus the arrival schedule and percentiles."""
import asyncio
import json
import math
import random
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field

import pytest
import uvicorn
from click.testing import CliRunner
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from tokenizers import Tokenizer

from llmc.cli import main
from llmc.serve.bench import (BenchError, build_workload, percentile, poisson_arrivals, resolve_tokenizer,
                              workload_lengths)
from tests.test_cli import assert_clean_error

QUEUE_DELAY = 0.03  # seconds before the response starts: a request waiting in the fake server's "queue"
FIRST_DELAY = 0.06  # then seconds before the first chunk: its "prefill"
GAP = 0.004         # seconds between chunks: its "decode step"


@dataclass
class FakeState:
    """How the fake server behaves, and what it saw."""

    fail_every: int = 0      # answer every k-th completion request with HTTP 500
    models_status: int = 200
    send_usage: bool = True
    bodies: list = field(default_factory=list)
    arrivals: list = field(default_factory=list)  # time.perf_counter() at each completion request


def fake_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        if state.models_status != 200:
            return JSONResponse({"error": {"message": "model registry is down", "type": "server_error"}},
                                status_code=state.models_status)
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "created": 0, "owned_by": "t"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state.arrivals.append(time.perf_counter())
        state.bodies.append(body)
        if state.fail_every and len(state.bodies) % state.fail_every == 0:
            return JSONResponse({"error": {"message": "engine exploded", "type": "server_error"}}, status_code=500)
        await asyncio.sleep(QUEUE_DELAY)
        n = body["max_tokens"]
        usage = body.get("stream_options", {}).get("include_usage") and state.send_usage

        def chunk(text, finish=None, **extra):
            return "data: " + json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": body["model"],
                                          "choices": [{"index": 0, "text": text, "finish_reason": finish,
                                                       "logprobs": None}] if text is not None else [],
                                          **extra}) + "\n\n"

        async def events():
            await asyncio.sleep(FIRST_DELAY)
            for i in range(n):
                if i:
                    await asyncio.sleep(GAP)
                yield chunk(" x", "length" if i == n - 1 else None)
            if usage:
                yield chunk(None, usage={"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server():
    """A fake server on a free port for the module; yields (url, state), the state reset per use."""
    state = FakeState()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(fake_app(state), log_level="error", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not srv.started and time.time() < deadline:
        time.sleep(0.02)
    assert srv.started
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def fresh(**kw):
        state.__init__(**kw)
        return url, state

    yield fresh
    srv.should_exit = True
    thread.join(10)


def bench(*args):
    res = CliRunner().invoke(main, ["bench", "serve", *map(str, args)], catch_exceptions=True)
    return res.exit_code, res.output


def bench_json(*args):
    code, out = bench(*args, "--json")
    assert code == 0, out
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return json.loads(lines[0])


def test_figures_agree_with_the_fake_server(server):
    url, state = server()
    s = bench_json("--url", url, "--workload", "short", "--num-requests", 8, "--request-rate", "inf")
    assert (s["completed"], s["failed"], s["errors"]) == (8, 0, [])
    assert s["model"] == "fake-model" and s["workload"] == "short" and s["request_rate"] == "inf"
    # what was asked: planned lengths, ignore_eos, usage at the end of the stream, the listed model
    assert len(state.bodies) == 8
    for b in state.bodies:
        assert (b["max_tokens"], b["ignore_eos"], b["stream"], b["model"]) == (32, True, True, "fake-model")
        assert b["stream_options"] == {"include_usage": True}
    assert s["total_output_tokens"] == s["planned_output_tokens"] == 8 * 32 and s["early_stops"] == 0
    assert s["total_input_tokens"] == 8 * 7  # the server's count (usage), not the planned 32
    # latency: from sending (so the queueing before the response counts), no faster than the server's
    # delays; the upper bounds leave room for a loaded 2-core machine
    first = QUEUE_DELAY + FIRST_DELAY
    e2e_min = first + 31 * GAP
    assert first * 1e3 <= s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] < first * 1e3 + 5000
    assert 0.8 * GAP * 1e3 <= s["itl_ms"]["p50"] < 500
    assert 0.8 * GAP * 1e3 <= s["tpot_ms"]["p50"] < 500
    assert e2e_min * 1e3 * 0.95 <= s["e2e_ms"]["p50"] <= s["e2e_ms"]["p90"] <= s["e2e_ms"]["p99"]
    assert s["e2e_ms"]["p99"] <= s["duration_s"] * 1e3
    # all sent at once: the run lasts about one request, and throughput is counts over that duration
    assert s["duration_s"] >= e2e_min and s["duration_s"] < e2e_min + 10
    assert s["request_throughput"] == pytest.approx(8 / s["duration_s"])
    assert s["output_throughput"] == pytest.approx(8 * 32 / s["duration_s"])
    assert max(state.arrivals) - min(state.arrivals) < s["duration_s"] / 2  # sent together, not one by one


def test_output_tokens_are_counted_from_chunks_without_usage(server):
    url, _ = server(send_usage=False)
    s = bench_json("--url", url, "--workload", "short", "--num-requests", 3)
    assert s["completed"] == 3 and s["total_output_tokens"] == 3 * 32
    assert s["total_input_tokens"] == 3 * 32  # the planned count when the server gives none


def test_poisson_arrivals_reach_the_server_on_schedule(server):
    url, state = server()
    rate, n = 5.0, 10  # gaps of 0.2 s on average: wide against a loaded machine's delays
    s = bench_json("--url", url, "--workload", "short", "--num-requests", n, "--request-rate", rate, "--seed", 3)
    assert s["completed"] == n and s["request_rate"] == rate
    planned = poisson_arrivals(n, rate, seed=3)
    seen = [t - state.arrivals[0] for t in sorted(state.arrivals)]
    for p, t in zip(planned, seen):
        assert t == pytest.approx(p, abs=0.1)
    assert s["duration_s"] >= planned[-1]


def test_failures_are_counted_with_their_messages(server):
    url, _ = server(fail_every=3)
    s = bench_json("--url", url, "--workload", "short", "--num-requests", 9, "--model", "fake-model")
    assert (s["completed"], s["failed"]) == (6, 3)
    assert len(s["errors"]) == 1 and "500" in s["errors"][0] and "engine exploded" in s["errors"][0]
    assert s["total_output_tokens"] == 6 * 32  # failed requests add no tokens
    assert s["request_throughput"] == pytest.approx(6 / s["duration_s"])


def test_text_report(server):
    url, _ = server()
    code, out = bench("--url", url + "/v1/", "--workload", "short", "--num-requests", 2, "--max-concurrency", 1)
    assert code == 0, out
    for label in ("completed            2", "failed               0", "req/s", "tok/s", "TTFT", "ITL", "E2E",
                  "p99"):
        assert label in out, out


def test_all_failed_prints_the_report_then_fails(server):
    url, _ = server(fail_every=1)
    code, out = bench("--url", url, "--workload", "short", "--num-requests", 2, "--json")
    assert code == 1, out
    report, error = out.strip().splitlines()
    assert json.loads(report)["failed"] == 2
    assert error.startswith("error: all 2 requests failed") and "engine exploded" in error


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_url_is_one_line():
    code, out = bench("--url", f"http://127.0.0.1:{free_port()}", "--workload", "short")
    assert_clean_error(code, out, "cannot reach", "--url")


def test_models_error_is_one_line(server):
    url, _ = server(models_status=503)
    code, out = bench("--url", url, "--workload", "short")
    assert_clean_error(code, out, "/v1/models", "503", "model registry is down")


@pytest.mark.parametrize("args, needle", [
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "fast"], "--request-rate"),
    (["--num-requests", "0"], "--num-requests"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--workload", "huge"], "huge"),
    (["--url", "localhost:8000"], "--url"),
    (["--tokenizer", "/nonexistent"], "--tokenizer"),
])
def test_bad_options_are_one_line(args, needle):
    full = ["--url", "http://127.0.0.1:9", "--workload", "short"]
    for i in range(0, len(args), 2):
        if args[i] in full:
            full[full.index(args[i]) + 1] = args[i + 1]
        else:
            full += args[i:i + 2]
    code, out = bench(*full)
    assert_clean_error(code, out, needle)


def test_poisson_schedule():
    rate = 8.0
    a = poisson_arrivals(4000, rate, seed=1)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert a[0] == 0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.06)
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.08)  # exponential: sd = mean
    assert poisson_arrivals(50, rate, seed=1) == a[:50]
    assert poisson_arrivals(50, rate, seed=2) != a[:50]
    assert poisson_arrivals(5, math.inf) == [0.0] * 5
    with pytest.raises(BenchError):
        poisson_arrivals(5, 0.0)


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    rng = random.Random(0)
    xs = [rng.random() for _ in range(101)]
    assert percentile(xs, 0) == min(xs) and percentile(xs, 100) == max(xs)
    assert percentile(xs, 37) == sorted(xs)[37]  # 101 values: every whole percentile is an order statistic
    np = pytest.importorskip("numpy")
    ys = [rng.random() for _ in range(37)]
    for q in (1, 50, 90, 99):
        assert percentile(ys, q) == pytest.approx(float(np.percentile(ys, q)))


def test_mixed_workload_is_the_projects_throughput_mix_and_repeats():
    # tools/llmc_bench.py's `thru`: random.Random(0), prompt U[64, 1024] then output U[64, 512] per request
    rng = random.Random(0)
    assert workload_lengths("mixed", 256, 0) == [(rng.randint(64, 1024), rng.randint(64, 512)) for _ in range(256)]
    w = build_workload("mixed", 12, seed=5)
    assert w == build_workload("mixed", 12, seed=5)
    assert w != build_workload("mixed", 12, seed=6)
    assert len({r.prompt for r in w}) == 12
    tok = Tokenizer.from_file(str(resolve_tokenizer(None)))
    for r in w:
        assert 64 <= r.prompt_tokens <= 1024 and 64 <= r.max_tokens <= 512
        # the cut, tokenized again, is as long as planned up to its edges (BPE merges across a cut differ)
        assert abs(len(tok.encode(r.prompt, add_special_tokens=False).ids) - r.prompt_tokens) <= 4


def test_unknown_workload():
    with pytest.raises(BenchError, match="unknown workload"):
        workload_lengths("huge", 1, 0)
