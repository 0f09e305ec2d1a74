"""`llmc serve` against the same engine offline, on one GPU at a model shape (default Llama-3-8B,
random bf16 weights, tiny-py's tokenizer): how much of the engine's throughput the server keeps, and
its latency below saturation.

Steps, each appended to OUT/serve_bench.partial.jsonl as it finishes (a run cut off keeps them):

1. offline: `LLM.generate` on the mixed workload (`llmc bench serve`'s, N requests, seed 0: the same
   prompts as text and the same output lengths, ignore_eos, greedy), out tok/s;
2. saturation: the server started as a subprocess (`python3 -m llmc serve`, the same engine options)
   and `llmc bench serve` sending all N requests at once; its out tok/s against offline's;
3. half: Poisson arrivals at half the saturating request rate (N requests): TTFT and ITL p99;
4. many: `--many` requests (default 2000) at once: every one must complete;
5. light: a quarter of the saturating rate (N/2 requests);
then the server's /metrics counters against the requests made, and SIGTERM: it must exit 0.

    python3 benchmarks/serve_bench.py [--shape 8b] [--n 256] [--many 2000] [--out DIR]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, limit: float = 300.0) -> None:
    t = time.time()
    while time.time() - t < limit:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server was not ready after {limit:.0f} s")


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--n", type=int, default=256, help="requests of the offline, saturation and half-rate runs")
    ap.add_argument("--many", type=int, default=2000, help="requests of the run that must lose none")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    import llmc
    from decode_bench import SHAPES
    from transformers import LlamaConfig, LlamaForCausalLM
    from llmc.frontend.hf import TOKENIZER_FILES
    from llmc.models import builtin_dir
    from llmc.runtime.llm import LLM, SamplingParams
    from llmc.serve.bench import bench_serve, build_workload, format_report
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "serve_bench.partial.jsonl"
    res: dict = {"shape": a.shape, "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "n": a.n, "max_num_seqs": a.max_num_seqs}

    def record(step: str, row: dict) -> None:
        res[step] = row
        with partial.open("a") as f:
            f.write(json.dumps({"step": step, **row}) + "\n")
        brief = {k: v for k, v in row.items() if not isinstance(v, (dict, list))}
        print(step, json.dumps(brief), flush=True)

    work = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    shape = {**SHAPES[a.shape], "max_position_embeddings": 4096}
    shape["vocab_size"] = max(shape["vocab_size"], 8192)  # tiny-py's tokenizer's ids
    cfg = LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
    with torch.device(DEVICE):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    # greedy decoding must stay inside the tokenizer's vocabulary, or most tokens stream as empty
    # text: zero LM-head rows give logit 0 there, below the largest random logit of the rest
    # (the head keeps its full size and cost)
    from transformers import AutoTokenizer
    text_vocab = len(AutoTokenizer.from_pretrained(builtin_dir("tiny-py"), local_files_only=True))
    head = m.lm_head.weight if not cfg.tie_word_embeddings else None
    if head is not None:
        with torch.no_grad():
            head[text_vocab:] = 0
    m.save_pretrained(str(work / "hf"))
    del m
    empty_cache()
    for f in TOKENIZER_FILES:  # text in, text out: tiny-py's tokenizer (its ids are below any vocab here)
        if (builtin_dir("tiny-py") / f).is_file():
            (work / "hf" / f).write_bytes((builtin_dir("tiny-py") / f).read_bytes())
    t = time.time()
    art = llmc.compile(str(work / "hf"), str(work / "m.llmc"), dtype="bfloat16")
    record("compile", {"seconds": time.time() - t})

    # 1. offline, the same requests
    plan = build_workload("mixed", a.n, 0, str(art.path))
    llm = LLM(art, max_num_seqs=a.max_num_seqs)
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in plan]
    llm.generate([r.prompt for r in plan[:8]], params[:8])  # kernels and graphs
    sync()
    t = time.perf_counter()
    outs = llm.generate([r.prompt for r in plan], params)
    sync()
    dt = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    record("offline", {"seconds": dt, "output_tokens": tokens, "output_throughput": tokens / dt,
                       "preemptions": llm.stats()["num_preemptions"]})
    del llm, outs
    gc.collect()
    empty_cache()

    # 2-5. the server
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (out / "serve_bench.server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "llmc", "serve", str(art.path), "--port", str(port),
                             "--max-num-seqs", str(a.max_num_seqs), "--max-queue", str(4 * a.many)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_ready(url, proc)
        tok = str(art.path)
        bench_serve(url, "mixed", num_requests=8, tokenizer=tok, seed=1)  # warm-up
        sat = bench_serve(url, "mixed", num_requests=a.n, tokenizer=tok)
        sat["of_offline"] = sat["output_throughput"] / res["offline"]["output_throughput"]
        record("saturation", sat)
        rate = sat["request_throughput"]
        half = bench_serve(url, "mixed", num_requests=a.n, request_rate=rate / 2, tokenizer=tok)
        record("half_rate", half)
        many = bench_serve(url, "mixed", num_requests=a.many, tokenizer=tok, seed=2)
        record("many", many)
        light = bench_serve(url, "mixed", num_requests=a.n // 2, request_rate=rate / 4, tokenizer=tok, seed=3)
        record("light", light)
        sent = 8 + 2 * a.n + a.many + a.n // 2  # warm-up, saturation, half, many, light
        got = metrics(url)
        finished = sum(v for k, v in got.items() if k.startswith("llmc_request_finished_total"))
        record("metrics", {"requests_sent": sent, "finished_counter": finished,
                           "counters": {k: v for k, v in got.items() if k.endswith("_total")}})
    finally:
        t = time.time()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed after 60 s"
        record("sigterm", {"exit_code": rc, "seconds": time.time() - t})
    (out / "serve_bench.json").write_text(json.dumps(res, indent=1))
    for step in ("saturation", "half_rate", "many", "light"):
        if step in res:
            print(f"== {step}\n{format_report(res[step])}")
    off = res["offline"]["output_throughput"]
    print(f"# {a.shape}, {res['gpu']}: offline {off:.0f} out tok/s")
    print(f"{'run':11s} {'rate':>7s} {'reqs':>5s} {'failed':>6s} {'out tok/s':>9s} {'of off':>6s} "
          f"{'TTFT p50':>8s} {'TTFT p99':>8s} {'ITL p50':>7s} {'ITL p99':>7s}")
    for step in ("saturation", "half_rate", "many", "light"):
        r = res.get(step)
        if r is None:
            continue
        rate = r["request_rate"] if r["request_rate"] == "inf" else f"{r['request_rate']:.2f}"
        print(f"{step:11s} {rate:>7s} {r['num_requests']:5d} {r['failed']:6d} {r['output_throughput']:9.0f} "
              f"{r['output_throughput'] / off:6.2f} {r['ttft_ms']['p50']:8.0f} {r['ttft_ms']['p99']:8.0f} "
              f"{r['itl_ms']['p50']:7.1f} {r['itl_ms']['p99']:7.1f}")


if __name__ == "__main__":
    main()
