"""The command line: compile / run / inspect, and the errors a user can meet (one line, no traceback)."""
import json
import shutil
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from llmc.cli import main
from tests.conftest import hf_greedy, hf_model

PROMPT = "def add(a, b):"


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
    return res.exit_code, res.output  # click >= 8.2: stdout and stderr interleaved


def assert_clean_error(code, out, *needles):
    assert code != 0, out
    assert "Traceback" not in out, out
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    for n in needles:
        assert n in out, out


@pytest.fixture(scope="module")
def compiled(arch_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / f"{arch_dir.name}.llmc"
    code, text = cli("compile", arch_dir, "-o", out)
    assert code == 0, text
    # the phases' times, in the order they ran (tuning: none without a GPU, still a phase)
    timed = next(ln for ln in text.splitlines() if ln.startswith("compiled in "))
    assert [part.split()[0] for part in timed.split(": ", 1)[1].split(", ")] == ["capture", "passes", "tuning", "write"]
    return arch_dir, out


def test_run_json_greedy_matches_hf_generate(compiled):
    path, art = compiled
    code, out = cli("run", art, "--prompt", PROMPT, "--max-tokens", 32, "--json")
    assert code == 0, out
    res = json.loads(out)
    assert set(res) >= {"text", "token_ids", "finish_reason"}
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(str(path)).encode(PROMPT, add_special_tokens=False)
    assert res["token_ids"] == hf_greedy(hf_model(path), ids, 32)
    assert res["finish_reason"] in ("length", "stop")


def test_inspect_summary_and_ir(compiled):
    _, art = compiled
    code, out = cli("inspect", art)
    assert code == 0 and "attend_paged" in out and "rope_kv_write" in out and "lift_patterns" in out and "f32" in out
    code, ir = cli("inspect", art, "--ir")
    assert code == 0 and ir.startswith("graph ") and "attend_paged(" in ir


def test_inspect_tuning(compiled):
    """`llmc inspect --tuning`: a CPU compile timed nothing; a GPU's choices read per kernel, buckets that share a
    config on one line (the shipped H200 table: the 8B int4 linears on the wgmma GEMV at 1-64 tokens)."""
    from llmc.cli.artifacts import tuning_lines
    from llmc.codegen.autotune import SHIPPED_DIR
    _, art = compiled
    code, out = cli("inspect", art, "--tuning")
    assert code == 0 and "no kernel choices recorded" in out
    table = json.loads(next(SHIPPED_DIR.glob("nvidia-h200-*.json")).read_text())
    lines = tuning_lines(table)
    assert lines[0].startswith("timed on NVIDIA H200, triton 3.6.0")
    at = lines.index("qlinear[w4a16-g128,bf16,bias=0,act=none]N6144K4096")
    assert "int4 wgmma GEMV: 1 warpgroup(s), x copied a group ahead" in lines[at + 1]
    # no 128+ line: that bucket's choices were taken out of the table, so that a compile times the tall form there
    assert [ln.split()[0] for ln in lines[at + 1:at + 4]] == ["1..64", "512+", "1024+"]
    tall = dict(table, kernels={"k": {"128+": {"config": {"WGMMA": True, "XN": 128, "WG": 2, "AHEAD": 1, "SPLIT_K": 4,
                                                         "XASYNC": True}, "triton_ms": 0.04}}})
    assert "int4 wgmma GEMM, 128 rows of x a program: 2 warpgroup(s)" in tuning_lines(tall)[2]
    assert not any(ln.startswith("qgemm_ms") for ln in lines)  # measurements, not choices


def test_bad_model_paths(tmp_path):
    assert_clean_error(*cli("compile", tmp_path / "nope", "-o", tmp_path / "o.llmc"), "does not exist")
    (tmp_path / "empty").mkdir()
    assert_clean_error(*cli("compile", tmp_path / "empty", "-o", tmp_path / "o.llmc"), "no config.json")
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert_clean_error(*cli("compile", gpt, "-o", tmp_path / "o.llmc"), "GPT2LMHeadModel", "not supported")
    assert_clean_error(*cli("compile", "builtin:nonesuch", "-o", tmp_path / "o.llmc"), "nonesuch")


def test_unlowerable_op_names_op_and_model_line(llama_dir, tmp_path, monkeypatch):
    from llmc.frontend import torch_export
    import torch
    monkeypatch.delitem(torch_export.LOWERINGS, torch.ops.aten.rsqrt)
    code, out = cli("compile", llama_dir, "-o", tmp_path / "o.llmc")
    assert_clean_error(code, out, "aten.rsqrt", "modeling_llama.py:", "torch.rsqrt")


def test_artifact_errors(llama_artifact, tmp_path):
    bad = tmp_path / "bad.llmc"
    shutil.copytree(llama_artifact.path, bad)
    w = bad / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[-10] ^= 0xFF
    w.write_bytes(bytes(data))
    assert_clean_error(*cli("run", bad, "--prompt", PROMPT), "weights.safetensors", "corrupted")
    shutil.rmtree(bad)
    shutil.copytree(llama_artifact.path, bad)
    man = json.loads((bad / "manifest.json").read_text())
    man["format_version"] = 99
    (bad / "manifest.json").write_text(json.dumps(man))
    assert_clean_error(*cli("inspect", bad), "format version 99", "recompile the model with llmc")
    assert_clean_error(*cli("inspect", tmp_path), "not an llmc artifact")


def test_prompt_errors(llama_artifact):
    assert_clean_error(*cli("run", llama_artifact.path, "--prompt", ""), "empty")
    long_prompt = "for i in range(10):\n" * 200
    assert_clean_error(*cli("run", llama_artifact.path, "--prompt", long_prompt), "context")
    assert_clean_error(*cli("run", llama_artifact.path, "--prompt", PROMPT, "--top-p", 0), "--top-p must be in (0, 1]")
    assert_clean_error(*cli("run", llama_artifact.path, "--prompt", PROMPT, "--max-tokens", 0), "--max-tokens must be >= 1")


def test_console_script_error_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "llmc.cli", "compile", str(tmp_path / "missing"), "-o",
                        str(tmp_path / "x")], capture_output=True, text=True)
    assert p.returncode == 1
    assert p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "llmc.cli", "--debug", "compile", str(tmp_path / "missing"), "-o",
                        str(tmp_path / "x")], capture_output=True, text=True)
    assert p.returncode != 0 and "Traceback" in p.stderr


USER_PASS = textwrap.dedent('''
    from dataclasses import dataclass
    from typing import ClassVar
    from llmc.passes import P, Pass, PassResult, RewriteRule, apply_rewrites

    @dataclass
    class UnfuseSwiGLU(Pass):
        """Spell silu_mul(g, u) as mul(silu(g), u) again."""
        name: ClassVar[str] = "unfuse_swiglu"
        scale: float = 1.0

        def run(self, graph, ctx):
            rule = RewriteRule("unfuse", P.op("silu_mul")(P.any("g"), P.any("u")),
                               lambda b, m: b.call("mul", b.call("silu", m["g"]), m["u"]))
            stats = apply_rewrites(graph, [rule])
            return PassResult(graph, any(stats.values()), stats)
''')


def test_custom_pass_shows_in_inspect_and_ir(llama_dir, tmp_path):
    f = tmp_path / "my_pass.py"
    f.write_text(USER_PASS)
    out = tmp_path / "custom.llmc"
    code, text = cli("compile", llama_dir, "-o", out, "--pass", f"{f}:UnfuseSwiGLU{{scale=2.0}}",
                     "--pass-before", "fuse_linear_epilogue")
    assert code == 0, text
    code, summary = cli("inspect", out)
    assert "unfuse_swiglu{scale=2.0}" in summary and "unfuse=2" in summary
    code, ir = cli("inspect", out, "--ir")
    assert "silu_mul(" not in ir and '["v0", "silu", ["in0"], {}], ["v1", "mul", ["v0", "in1"], {}]' in ir
    code, res = cli("run", out, "--prompt", PROMPT, "--max-tokens", 4, "--json")
    assert code == 0, res
    assert_clean_error(*cli("compile", llama_dir, "-o", out, "--pass", f"{f}:UnfuseSwiGLU{{bogus=1}}"), "bogus")
    assert_clean_error(*cli("compile", llama_dir, "-o", out, "--pass", f"{f}:Nope"), "Nope")


def test_prompts_jsonl_batch_and_errors(llama_artifact, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('"def add(a, b):"\n{"prompt": "class Point:", "max_tokens": 3}\n')
    code, out = cli("run", llama_artifact.path, "--prompts", f, "--max-tokens", 5, "--json")
    assert code == 0, out
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [5, 3] and rows[1]["prompt"] == "class Point:"
    f.write_text('{"prompt": "x", "tempature": 1}\n')
    assert_clean_error(*cli("run", llama_artifact.path, "--prompts", f), "tempature")
    f.write_text('{"text": "x"}\n')
    assert_clean_error(*cli("run", llama_artifact.path, "--prompts", f), "p.jsonl:1")


def test_compile_tuning_flags_reach_the_compiler(llama_dir, tmp_path, monkeypatch):
    """--no-tune, --no-batch-invariant and --no-tuning-cache are passed through (tuning itself only
    runs on a GPU); --tune, --batch-invariant and --tuning-cache are the defaults."""
    import llmc
    seen = []
    real = llmc.compile

    def spy(*args, **kwargs):
        seen.append((kwargs.get("tune"), kwargs.get("batch_invariant"), kwargs.get("tuning_cache")))
        return real(*args, **kwargs)
    monkeypatch.setattr(llmc, "compile", spy)
    for i, (flag, want) in enumerate((("--no-tune", (False, True, True)), ("--no-batch-invariant", (True, False, True)),
                                      ("--no-tuning-cache", (True, True, False)), (None, (True, True, True)))):
        args = ["compile", llama_dir, "-o", tmp_path / f"{i}.llmc"] + ([flag] if flag else [])
        code, text = cli(*args)
        assert code == 0, text
        assert seen[-1] == want
