"""`llmc bench ARTIFACT`: the offline benchmark on the shipped tiny-py (reference backend, small N) reports
sane figures, caps prompts to the model's context and says so, takes the engine options, and fails
cleanly on bad input; `llmc bench serve` is still reached by name."""
import json

import pytest

import llmc
from llmc.bench import bench, plan_requests
from tests.test_cli import assert_clean_error, cli

FAST = ("--backend", "reference", "--num-blocks", 160)  # a small KV cache: zeroing the default one takes longer


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return llmc.compile("builtin:tiny-py", tmp_path_factory.mktemp("bench") / "tiny-py.llmc").path


def run_json(*args) -> dict:
    code, out = cli("bench", *args, "--json")
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1])


def check_figures(r: dict) -> None:
    assert r["out_tok_s"] > 0 and r["duration_s"] > 0
    assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"]
    assert 0 < r["itl_ms_p50"] <= r["itl_ms_p99"]
    assert 0 < r["tpot_ms_p50"] <= r["tpot_ms_p99"]
    assert r["gpu_busy"] is None and r["device"] == "cpu"


def test_mixed_streams_every_planned_token_and_caps_to_the_context(art):
    # seed 46 draws (973, 103) and (473, 84): the first does not fit tiny-py's 1024 tokens
    r = run_json(art, "--workload", "mixed", "--num-requests", 2, "--seed", 46, *FAST, "--max-num-seqs", 4)
    check_figures(r)
    assert r["output_tokens"] == 103 + 84 and r["num_requests"] == 2
    assert r["capped_requests"] == 1 and r["max_model_len"] == 1024
    assert r["prompt_tokens"] == (1024 - 103) + 473
    # the step shape it ran with: a CPU compile measured no budget, so the default
    assert r["max_num_seqs"] == 4 and r["max_num_batched_tokens"] == 2048
    assert r["steps"] >= 103 and set(r["host_ms_per_step"]) >= {"schedule", "execute", "update"}


def test_mixed_longest_first_queues_the_longest_output_first(art, monkeypatch):
    # seed 153 draws (566, 102) and (102, 197): one sequence at a time, so the request whose first output the
    # stream yields first is the one served first: the workload's first in its order, the 197-token one when
    # queued longest first (the order itself, not wall times, which a loaded machine blurs)
    from llmc.runtime.llm import LLM
    stream, order, tokens = LLM.stream, [], {}

    def recording(self, *args, **kw):
        for out in stream(self, *args, **kw):
            rid, new = out.request_id, len(out.outputs[0].delta_token_ids)
            if new:  # a prompt chunk that samples nothing is no output yet
                if rid not in tokens:
                    order.append(rid)
                tokens[rid] = tokens.get(rid, 0) + new
            yield out
    monkeypatch.setattr(LLM, "stream", recording)
    for flag in ((), ("--longest-first",)):
        order.clear()
        tokens.clear()
        r = run_json(art, "--workload", "mixed", "--num-requests", 2, "--seed", 153, *FAST, "--max-num-seqs", 1,
                     *flag)
        assert r["output_tokens"] == 102 + 197 and r["longest_first"] is bool(flag)
        served = [tokens[rid] for rid in order[-2:]]  # the timed run's two requests, after the untimed ones
        assert served == ([197, 102] if flag else [102, 197]), (order, tokens)


def test_decode_reports_a_table(art):
    code, out = cli("bench", art, "--workload", "decode", "--num-requests", 1, *FAST)
    assert code == 0, out
    assert "decode: 1 run of batch 1 (128-token prompt, 256 new tokens)" in out
    assert "128 prompt and 256 output tokens" in out and "note:" not in out
    rows = {line[:22].strip(): line[22:].split() for line in out.splitlines() if line[:22].strip()}
    assert float(rows["TTFT (ms)"][0]) <= float(rows["TTFT (ms)"][1])
    assert float(rows["inter-token (ms)"][0]) <= float(rows["inter-token (ms)"][1])
    assert float(rows["per output token (ms)"][0]) <= float(rows["per output token (ms)"][1])
    assert float(rows["output (tok/s)"][0]) > 0 and rows["GPU busy"] == ["n/a"]


def test_prefill_takes_the_engine_options(art):
    # chunks of 256 tokens: outputs of the steps that sample nothing are not a first token
    r = run_json(art, "--workload", "prefill", "--num-requests", 2, *FAST, "--max-num-batched-tokens", 256,
                 "--block-size", 8, "--max-num-seqs", 2, "--kv-cache-dtype", "int8", "--spec", "ngram",
                 "--spec-tokens", 2, "--seed", 3)
    assert r["output_tokens"] == 2 and r["prompt_tokens"] == 2 * 1023 and r["capped_requests"] == 2
    assert r["itl_ms_p50"] is None and 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"]
    # a run ends with its one token: the first token is the last chunk's, not the first one's
    assert r["ttft_ms_p50"] > 0.8 * 1e3 * r["duration_s"] / 2


def test_the_library_call_with_a_progress_bar(art):
    r = bench(art, "prefill", num_requests=1, progress=True, backend="reference", num_blocks=80)
    assert r["output_tokens"] == 1 and r["workload"] == "prefill"


def test_a_ready_llm_is_benched_as_it_is(art):
    from llmc.bench import BenchError
    with llmc.LLM(art, backend="reference", num_blocks=80, block_size=8) as llm:
        r = bench(llm, "decode", num_requests=1)
        assert r["output_tokens"] == 256 and r["artifact"] == str(llm.engine.artifact.path)
        assert llm.engine.block_manager.block_size == 8  # the LLM's own options, not bench's defaults
        with pytest.raises(BenchError, match="where the LLM is made"):
            bench(llm, "decode", num_blocks=40)


def test_prompts_are_fresh_cuts_that_fit():
    planned, capped = plan_requests("decode", 3, 0, 300)
    assert capped == 3 and len(planned) == 3 + 3  # then the warm-up's
    assert [(p, o) for _, p, o in planned] == [(44, 256)] * 3 + [(128, 16)] * 3
    assert len({text for text, _, _ in planned}) == 6  # none is another's prefix-cache hit


@pytest.mark.parametrize("args, needle", [
    (["missing.llmc"], "missing.llmc does not exist"),
    (["{art}", "--workload", "chat"], "--workload 'chat' is not a workload; use one of mixed, decode, prefill"),
    (["{art}", "--num-requests", 0], "--num-requests must be >= 1, got 0"),
    (["{art}", "--max-prefill-tokens", 0], "--max-prefill-tokens must be >= 1, got 0"),
    (["{art}", "--max-num-seqs", 0], "--max-num-seqs must be >= 1, got 0"),
    (["{art}", "--spec", "draft"], "--spec draft needs --draft"),
])
def test_bad_input_is_one_clean_line(art, args, needle):
    assert_clean_error(*cli("bench", *[str(a).format(art=art) for a in args], *FAST), needle)


def test_help_names_both_forms_and_serve_is_still_a_subcommand():
    code, out = cli("bench", "--help")
    assert code == 0 and "llmc bench ARTIFACT" in out and "llmc bench serve --url URL" in out
    code, out = cli("bench", "x.llmc", "--help")
    assert code == 0 and "Usage: main bench [OPTIONS] ARTIFACT" in out and "--workload" in out
    assert "--max-num-batched-tokens" in out and "--spec" in out and "--seed" in out
    code, out = cli("bench", "serve", "--help")
    assert code == 0 and "--url" in out and "--workload" in out
    assert_clean_error(*cli("bench", "serve", "--url", "ftp://x"), "is not an http(s) URL")
