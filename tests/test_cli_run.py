"""`llmc run`: option checks in the user's words, the prompts file (UTF-8, blank, token ids, n,
logprobs), how several completions are told apart, and --stream."""
import json
import os
import subprocess
import sys

import pytest

from tests.test_cli import PROMPT, assert_clean_error, cli


FAST = ("--backend", "reference", "--num-blocks", 64)  # a small KV cache: zeroing the default one takes longer


@pytest.fixture(scope="module")
def art(llama_artifact):
    return llama_artifact.path


def run_json(art, *args):
    code, out = cli("run", art, "--json", *FAST, *args)
    assert code == 0, out
    return [json.loads(line) for line in out.strip().splitlines()]


@pytest.mark.parametrize("args, needle", [
    (["--block-size", 0], "--block-size must be >= 1, got 0"),
    (["--block-size", -4], "--block-size must be >= 1, got -4"),
    (["--max-num-seqs", 0], "--max-num-seqs must be >= 1, got 0"),
    (["--num-blocks", 0], "--num-blocks must be >= 1, got 0"),
    (["--num-blocks", -1], "--num-blocks must be >= 1, got -1"),
    (["--max-num-batched-tokens", 0], "--max-num-batched-tokens must be >= 1, got 0"),
    (["--block-size", 3, "--backend", "triton-interpret"], "--block-size must be a power of two"),
    (["--device", "tpu"], "--device 'tpu' is not a device"),
    (["--repetition-penalty", 0], "--repetition-penalty must be from 0.001 to 1000"),
    (["--temperature", "inf"], "--temperature must be a finite number"),
    (["--seed", 2 ** 64], "--seed must be an int from -2**63 to 2**64 - 1"),
    (["--spec-tokens", 4], "give --spec too"),
    (["--num-blocks", 10 ** 12], "lower --num-blocks or --block-size"),
])
def test_engine_options_are_checked_in_their_cli_names(art, args, needle):
    assert_clean_error(*cli("run", art, "--prompt", PROMPT, *args), needle)


def test_cuda_without_a_gpu(art, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_clean_error(*cli("run", art, "--prompt", PROMPT, "--device", "cuda"), "--device cuda", "no CUDA GPU")
    assert_clean_error(*cli("run", art, "--prompt", PROMPT, "--backend", "cuda"), "--backend cuda", "--backend reference")


def test_n_larger_than_max_num_seqs(art, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "x", "n": 3, "temperature": 1}\n')
    assert_clean_error(*cli("run", art, "--prompts", f, "--max-num-seqs", 2), "p.jsonl:1", "n=3", "--max-num-seqs")


def test_prompts_file_errors(art, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'"def add(a, b):"\n"caf\xe9"\n')  # latin-1, not UTF-8
    assert_clean_error(*cli("run", art, "--prompts", f), "p.jsonl:2", "not UTF-8", "0xe9")
    for blank in ("", "\n \n\t\n"):
        f.write_text(blank)
        assert_clean_error(*cli("run", art, "--prompts", f), "holds no prompts")
    assert_clean_error(*cli("run", art, "--prompts", tmp_path / "missing.jsonl"), "missing.jsonl", "no such file")
    for line, needle in [('{"prompt": "x", "prompt_token_ids": [1]}', "one of"),
                         ('{"prompt_token_ids": []}', "non-empty list of integers"),
                         ('{"prompt_token_ids": [1, "2"]}', "non-empty list of integers"),
                         ('{"prompt_token_ids": [1, 320]}', "token id 320 is out of range"),
                         ('{"prompt": 5}', "\"prompt\" must be a non-empty string"),
                         ('""', "p.jsonl:1: \"prompt\" must be a non-empty string"),
                         ('{"prompt": "x", "logprobs": 21}', "p.jsonl:1: logprobs must be None (off) or an int"),
                         ('{"prompt": "x", "top_p": 0}', "p.jsonl:1: top_p")]:
        f.write_text(line + "\n")
        assert_clean_error(*cli("run", art, "--prompts", f), needle)


def test_plain_text_separates_prompts_and_samples(art, tmp_path):
    code, single = cli("run", art, "--prompt", PROMPT, "--max-tokens", 4, *FAST)
    (row,) = run_json(art, "--prompt", PROMPT, "--max-tokens", 4)
    assert code == 0 and single == PROMPT + row["text"] + "\n"  # one prompt: unchanged, no separator
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(PROMPT) + '\n{"prompt": "class Point:", "n": 2, "temperature": 1.0, "seed": 3}\n')
    code, out = cli("run", art, "--prompts", f, "--max-tokens", 3, *FAST)
    assert code == 0, out
    rows = run_json(art, "--prompts", f, "--max-tokens", 3)
    texts = [c["text"] for c in rows[1]["completions"]]
    assert out == (f"--- prompt 1 ---\n{PROMPT}{rows[0]['text']}\n"
                   f"--- prompt 2, completion 1 of 2 ---\nclass Point:{texts[0]}\n"
                   f"--- prompt 2, completion 2 of 2 ---\nclass Point:{texts[1]}\n")


def test_json_n_logprobs_and_token_ids(art, tmp_path):
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(str(art / "tokenizer")).encode(PROMPT, add_special_tokens=False)
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": PROMPT, "max_tokens": 4},
        {"prompt_token_ids": ids, "max_tokens": 4},
        {"prompt": PROMPT, "n": 3, "temperature": 1.0, "seed": 7, "logprobs": True, "max_tokens": 5},
        {"prompt": PROMPT, "logprobs": 2, "max_tokens": 3},
    ]) + "\n")
    text, by_ids, sampled, top = run_json(art, "--prompts", f)
    assert len(top["top_logprobs"]) == len(top["logprobs"]) == 3
    for lp, alts, tok in zip(top["logprobs"], top["top_logprobs"], top["token_ids"]):
        assert len(alts) == 2 and max(alts.values()) >= lp and list(alts) == [str(tok), *list(alts)[1:]]
    assert by_ids["token_ids"] == text["token_ids"] and by_ids["prompt_token_ids"] == ids
    assert by_ids["text"] == text["text"] and by_ids["prompt"] is None
    assert "completions" not in text and "logprobs" not in text
    comps = sampled["completions"]
    assert [c["index"] for c in comps] == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in comps}) > 1  # three samples, not one repeated
    for c in comps:
        assert len(c["logprobs"]) == len(c["token_ids"]) == 5 and all(lp <= 0 for lp in c["logprobs"])
        assert set(c) == {"index", "text", "token_ids", "finish_reason", "logprobs"}
    assert sampled["logprobs"] == comps[0]["logprobs"] and sampled["token_ids"] == comps[0]["token_ids"]


def test_stream_one_prompt_plain_equals_whole(art):
    whole = cli("run", art, "--prompt", PROMPT, "--max-tokens", 6, *FAST)
    streamed = cli("run", art, "--prompt", PROMPT, "--max-tokens", 6, *FAST, "--stream")
    assert streamed[0] == 0 and streamed == whole


def test_stream_json_deltas_add_up(art, tmp_path):
    f = tmp_path / "p.jsonl"
    # identical prompts of different lengths: each delta is credited to its own line of the file
    f.write_text(f'{{"prompt": {json.dumps(PROMPT)}, "max_tokens": 2}}\n{{"prompt": {json.dumps(PROMPT)}, '
                 '"max_tokens": 5, "logprobs": true}\n"class Point:"\n')
    whole = run_json(art, "--prompts", f, "--max-tokens", 4)
    deltas = run_json(art, "--prompts", f, "--max-tokens", 4, "--stream")
    for i, w in enumerate(whole):
        mine = [d for d in deltas if d["index"] == i]
        assert all(d["completion"] == 0 for d in mine)
        assert "".join(d["delta"] for d in mine) == w["text"]
        assert [t for d in mine for t in d["token_ids"]] == w["token_ids"]
        assert [d["finished"] for d in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1]["finish_reason"] == w["finish_reason"]
    assert [lp for d in deltas if d["index"] == 1 for lp in d["logprobs"]] == whole[1]["logprobs"]


def test_stream_several_prompts_plain(art, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(f'{json.dumps(PROMPT)}\n{{"prompt": "class Point:", "max_tokens": 2}}\n')
    code, whole = cli("run", art, "--prompts", f, "--max-tokens", 5, *FAST)
    code2, streamed = cli("run", art, "--prompts", f, "--max-tokens", 5, *FAST, "--stream")
    assert code == code2 == 0, streamed

    def blocks(out):
        parts = out.split("--- prompt ")[1:]
        return sorted("--- prompt " + p for p in parts)
    assert len(blocks(streamed)) == 2 and blocks(streamed) == blocks(whole)  # whole, in the order they finish


def test_triton_interpret_backend_needs_no_environment(art):
    """--backend triton-interpret switches Triton's interpreter on itself (the CLI owns its process)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "llmc.cli", "run", str(art), "--prompt", PROMPT, "--max-tokens", "3",
                        "--json", "--backend", "triton-interpret"], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    (ref,) = run_json(art, "--prompt", PROMPT, "--max-tokens", 3)
    assert json.loads(p.stdout)["token_ids"] == ref["token_ids"]


def test_run_help_explains_the_new_options():
    code, out = cli("run", "--help")
    assert code == 0
    for needle in ("--stream", "--plugin", "prompt_token_ids", "completions", "--- prompt N ---", "logprobs"):
        assert needle in out, needle


def test_the_terminal_stats_line_tells_what_speculation_kept(art):
    """After `llmc run` on a terminal: the engine's state in one line, with what speculation proposed and kept
    when it ran (the engine's own stats keys)."""
    from llmc import LLM
    from llmc.cli.generation import _stats_line
    st = LLM(art, backend="reference", num_blocks=64).stats()
    assert _stats_line(st) == "[0/64 KV blocks in use, 0 prefix-cache hit tokens, 0 preemptions]"
    st.update(spec_proposed_tokens=40, spec_accepted_tokens=30, spec_acceptance_rate=0.75, spec_steps=12)
    assert _stats_line(st).endswith(", speculation: 30 of 40 proposed tokens accepted (75.0%) in 12 steps]")
