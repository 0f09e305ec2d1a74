"""`llmc compile TARGET --draft DRAFT`: the draft compiled into the target's artifact, found by
`--spec draft` and `speculative={"method": "draft"}` without a path; a draft of another vocabulary is
refused before anything is written."""
from __future__ import annotations

import json
import shutil

from click.testing import CliRunner

import llmc
from llmc.cli import main
from llmc.errors import CompileError
from llmc.runtime.llm import LLM, SamplingParams


def test_bundled_draft_is_found_and_lossless(tmp_path):
    out = tmp_path / "t.llmc"
    r = CliRunner().invoke(main, ["compile", "builtin:tiny-py", "-o", str(out), "--draft", "builtin:tiny-py-draft"])
    assert r.exit_code == 0, r.output
    art = llmc.load(out)
    assert art.bundled_draft == out / "draft.llmc" and llmc.load(art.bundled_draft).info.num_layers < art.info.num_layers
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(art).generate(["def fib(n):"], greedy)[0].token_ids
    spec = LLM(art, speculative={"method": "draft", "num_speculative_tokens": 3})
    assert spec.generate(["def fib(n):"], greedy)[0].token_ids == plain
    assert spec.stats()["spec_proposed_tokens"] > 0
    r = CliRunner().invoke(main, ["run", str(out), "--prompt", "def fib(n):", "--max-tokens", "24", "--spec", "draft",
                                  "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["token_ids"] == plain


def test_draft_of_another_vocabulary_is_refused_before_writing(tmp_path, llama_dir):
    out = tmp_path / "t.llmc"
    try:
        llmc.compile("builtin:tiny-py", out, draft=llama_dir)
    except CompileError as e:
        assert "vocabulary" in str(e)
    else:
        raise AssertionError("a draft of another vocabulary compiled")
    assert not out.exists()
    r = CliRunner().invoke(main, ["run", str(shutil.copytree(llmc.compile(llama_dir, tmp_path / "l.llmc").path,
                                                             tmp_path / "l2.llmc")), "--prompt", "x", "--spec", "draft"])
    assert r.exit_code != 0 and "llmc compile TARGET --draft DRAFT" in r.output
