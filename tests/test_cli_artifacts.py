"""Artifacts at the command line: where `compile -o` may write (checked before capture), models
without a tokenizer, --plugin for ops a user's pass added, and what loading checks (a path that
does not exist, weights that do not match the graph's declared types)."""
import json
import os
import shutil
import textwrap

import pytest

from llmc.artifact import sha256_file
from llmc.cli import main
from tests.test_cli import PROMPT, assert_clean_error, cli

FAST = ("--backend", "reference", "--num-blocks", 64)


@pytest.fixture
def no_capture(monkeypatch):
    """Fail the test if compiling gets as far as capturing the model."""
    from llmc import compiler

    def capture(*args, **kwargs):
        raise AssertionError("capture started before the output path was checked")
    monkeypatch.setattr(compiler, "capture", capture)


def test_compile_output_checked_before_capture(llama_dir, tmp_path, no_capture):
    f = tmp_path / "file.llmc"
    f.write_text("x")
    assert_clean_error(*cli("compile", llama_dir, "-o", f), "file.llmc", "existing file")
    d = tmp_path / "notes"
    d.mkdir()
    (d / "todo.txt").write_text("keep me")
    assert_clean_error(*cli("compile", llama_dir, "-o", d), "non-empty directory", "not an llmc artifact")
    assert (d / "todo.txt").read_text() == "keep me"
    assert_clean_error(*cli("compile", llama_dir, "-o", f / "sub" / "o.llmc"), "file.llmc is a file, not a directory")


def test_compile_options_that_cannot_apply_are_refused_before_capture(llama_dir, tmp_path, no_capture):
    """-o naming no file, a --dump-ir that cannot be a directory, quantization options without --quant and
    --pass-before without --pass: one line each, nothing written."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "o.llmc"
    for args, needle in ((("-o", "."), "names no file"),
                         (("-o", out, "--dump-ir", tmp_path / "afile"), "cannot write the IR to --dump-ir"),
                         (("-o", out, "--dump-ir", tmp_path / "afile" / "sub"), "Not a directory"),
                         (("-o", out, "--wbits", "8"), "--wbits goes with --quant METHOD"),
                         (("-o", out, "--group-size", "64", "--calib", "x.txt"), "--group-size, --calib go with --quant"),
                         (("-o", out, "--pass-before", "dead_code"), "give --pass SPEC too"),
                         (("-o", out, "--quant", "fp8", "--wbits", "4"), "--quant fp8 does not use --wbits"),
                         (("-o", out, "--quant", "rtn", "--bits-budget", "6", "--act-order"),
                          "--quant rtn does not use --bits-budget, --act-order")):
        assert_clean_error(*cli("compile", llama_dir, *args), needle)
    assert not out.exists()


def test_an_artifact_whose_tokenizer_was_removed_is_damaged_not_bare(llama_artifact, tmp_path):
    damaged = tmp_path / "damaged.llmc"
    shutil.copytree(llama_artifact.path, damaged)
    shutil.rmtree(damaged / "tokenizer")
    assert_clean_error(*cli("run", damaged, "--prompt", "x", "--max-tokens", "2", *FAST), "is missing tokenizer/",
                       "recompile it")


def test_a_plugin_that_exits_is_an_error_not_an_exit(llama_artifact, tmp_path):
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    assert_clean_error(*cli("inspect", llama_artifact.path, "--plugin", exits), "exits.py", "sys.exit(3)")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only directories")
def test_compile_output_unwritable(llama_dir, tmp_path, no_capture):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert_clean_error(*cli("compile", llama_dir, "-o", ro / "o.llmc"), "not writable")
    finally:
        ro.chmod(0o700)


def test_compile_output_accepts_new_empty_and_artifact_paths(llama_artifact, tmp_path):
    from llmc.compiler import check_output
    (tmp_path / "empty").mkdir()
    for ok in (tmp_path / "new.llmc", tmp_path / "a" / "b" / "new.llmc", tmp_path / "empty", llama_artifact.path):
        check_output(ok)
    assert not (tmp_path / "a").exists()  # checking writes nothing


@pytest.fixture(scope="module")
def untokenized(llama_dir, tmp_path_factory):
    """The tiny Llama without its tokenizer files, compiled at the command line: (artifact, stderr)."""
    from click.testing import CliRunner
    root = tmp_path_factory.mktemp("notok")
    model = root / "model"
    model.mkdir()
    for f in llama_dir.iterdir():
        if f.name in ("config.json", "model.safetensors"):
            shutil.copy(f, model / f.name)
    res = CliRunner().invoke(main, ["compile", str(model), "-o", str(root / "m.llmc")])
    assert res.exit_code == 0, res.output
    return root / "m.llmc", res.stderr


def test_model_without_tokenizer(untokenized, llama_artifact, tmp_path):
    art, stderr = untokenized
    assert stderr.strip().splitlines() == [
        f"warning: {art.parent / 'model'} has no tokenizer files; the artifact will take token ids only "
        "(--prompts with prompt_token_ids)"]
    assert_clean_error(*cli("run", art, "--prompt", PROMPT), "--prompt TEXT needs a tokenizer", "prompt_token_ids")
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt_token_ids": [5, 6, 7], "max_tokens": 4}\n')
    code, out = cli("run", art, "--prompts", f, "--json", *FAST)
    assert code == 0, out
    row = json.loads(out)
    code, same = cli("run", llama_artifact.path, "--prompts", f, "--json", *FAST)  # same weights, with a tokenizer
    assert len(row["token_ids"]) == 4 and row["token_ids"] == json.loads(same)["token_ids"]
    code, plain = cli("run", art, "--prompts", f, *FAST)
    assert code == 0 and plain == "token ids: " + " ".join(map(str, row["token_ids"])) + "\n"
    assert_clean_error(*cli("run", art, "--prompts", f, "--stop", "x"), "--stop", "stop_token_ids")
    f.write_text('"def f():"\n')
    assert_clean_error(*cli("run", art, "--prompts", f), "p.jsonl:1", "needs a tokenizer")


PLUGIN = textwrap.dedent('''
    from dataclasses import dataclass
    from typing import ClassVar

    import torch

    from llmc.ir.ops import register_op
    from llmc.passes import P, Pass, PassResult, RewriteRule, apply_rewrites

    register_op("cli_test_swiglu", "nn", ("gate", "up"), lambda types, attrs: types[0],
                lambda x, attrs, env: torch.nn.functional.silu(x[0]) * x[1])


    @dataclass
    class UseIt(Pass):
        name: ClassVar[str] = "use_cli_test_swiglu"

        def run(self, graph, ctx):
            rule = RewriteRule("swap", P.op("silu_mul")(P.any("g"), P.any("u")),
                               lambda b, m: b.call("cli_test_swiglu", m["g"], m["u"]))
            stats = apply_rewrites(graph, [rule])
            return PassResult(graph, any(stats.values()), stats)
''')


def test_plugin_defines_a_users_op(llama_dir, llama_artifact, tmp_path, monkeypatch):
    from llmc.ir import ops
    plugin = tmp_path / "my_op.py"
    plugin.write_text(PLUGIN)
    art = tmp_path / "custom.llmc"
    code, out = cli("compile", llama_dir, "-o", art, "--pass", f"{plugin}:UseIt", "--pass-before",
                    "fuse_linear_epilogue")
    assert code == 0, out
    monkeypatch.delitem(ops.OPS, "cli_test_swiglu")  # a fresh process: only llmc's own ops
    for cmd in (["run", art, "--prompt", PROMPT], ["inspect", art]):
        assert_clean_error(*cli(*cmd), "'cli_test_swiglu'", "--plugin FILE.py")
    code, out = cli("inspect", art, "--plugin", plugin)
    assert code == 0 and "cli_test_swiglu" in out, out
    code, out = cli("run", art, "--plugin", plugin, "--prompt", PROMPT, "--max-tokens", 5, "--json", *FAST)
    assert code == 0, out
    code, want = cli("run", llama_artifact.path, "--prompt", PROMPT, "--max-tokens", 5, "--json", *FAST)
    assert json.loads(out)["token_ids"] == json.loads(want)["token_ids"]  # the same function, spelled as one op


@pytest.mark.slow
def test_parallel_workers_import_the_users_ops(llama_dir, llama_artifact, tmp_path, monkeypatch):
    """The workers of a parallel run are fresh interpreters: they import the modules that registered the
    artifact's ops of a user's, a --plugin file by its path and a module by its name (from the directory that
    held it), and give one process's tokens."""
    import sys

    from llmc import LLM, SamplingParams
    from llmc.ir import ops
    plugin = tmp_path / "my_op.py"
    plugin.write_text(PLUGIN)
    art = tmp_path / "custom.llmc"
    code, out = cli("compile", llama_dir, "-o", art, "--pass", f"{plugin}:UseIt", "--pass-before",
                    "fuse_linear_epilogue")
    assert code == 0, out
    code, want = cli("run", llama_artifact.path, "--prompt", PROMPT, "--max-tokens", 5, "--json", *FAST)
    code, out = cli("run", art, "--plugin", plugin, "-tp", 2, "--prompt", PROMPT, "--max-tokens", 5, "--json",
                    *FAST)
    assert code == 0, out
    assert json.loads(out)["token_ids"] == json.loads(want)["token_ids"]
    # the same op registered by a module of a package on the caller's path, imported by name
    pkg = tmp_path / "site" / "myops"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "swiglu.py").write_text(PLUGIN)
    monkeypatch.delitem(ops.OPS, "cli_test_swiglu")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "myops.swiglu", raising=False)
    import importlib
    importlib.import_module("myops.swiglu")
    with LLM(str(art), tensor_parallel_size=2, backend="reference", num_blocks=64) as llm:
        got = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5))[0].token_ids
    assert got == json.loads(want)["token_ids"]


def test_an_op_of_the_main_script_is_refused_for_parallel_workers(monkeypatch):
    from llmc.errors import LLMCError
    from llmc.ir.graph import Graph
    from llmc.plugins import OP_SOURCES, sources_for
    g = Graph("g")
    g.nodes.append(type("N", (), {"op": "scripted_op"})())
    monkeypatch.setitem(OP_SOURCES, "scripted_op", ("__main__", "/home/me/run.py"))
    with pytest.raises(LLMCError, match="registered by the main script.*move its registration into a module"):
        sources_for(g)
    monkeypatch.setitem(OP_SOURCES, "scripted_op", ("myops.swiglu", "/home/me/site/myops/swiglu.py"))
    assert sources_for(g) == [("myops.swiglu", "/home/me/site/myops/swiglu.py")]


def test_plugin_errors(llama_artifact, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('no GPU here')\n")
    assert_clean_error(*cli("inspect", llama_artifact.path, "--plugin", bad), "--plugin", "bad.py",
                       "RuntimeError: no GPU here")
    assert_clean_error(*cli("inspect", llama_artifact.path, "--plugin", tmp_path / "nope.py"), "nope.py", "no such file")
    (tmp_path / "ops.txt").write_text("")
    assert_clean_error(*cli("inspect", llama_artifact.path, "--plugin", tmp_path / "ops.txt"), "not a Python file")
    for cmd in ("compile", "run", "inspect"):
        code, out = cli(cmd, "--help")
        assert "--plugin FILE.py" in out and "nothing is ever imported from an artifact" in " ".join(out.split())


def _retype_param(path, fix_manifest):
    """Declare the first weight of `path`'s graph.json one row longer; returns its name."""
    g = json.loads((path / "graph.json").read_text())
    p = g["params"][0]
    dtype, dims = p["type"].split("[")
    dims = dims.rstrip("]").split(",")
    dims[0] = str(int(dims[0]) + 1)
    p["type"] = f"{dtype}[{','.join(dims)}]"
    (path / "graph.json").write_text(json.dumps(g))
    if fix_manifest:
        man = json.loads((path / "manifest.json").read_text())
        man["files"]["graph.json"] = sha256_file(path / "graph.json")
        (path / "manifest.json").write_text(json.dumps(man))
    return p["name"], p["type"]


def test_param_types_checked_against_weights(llama_artifact, tmp_path):
    import llmc
    bad = tmp_path / "bad.llmc"
    shutil.copytree(llama_artifact.path, bad)
    name, declared = _retype_param(bad, fix_manifest=True)
    assert_clean_error(*cli("run", bad, "--prompt", PROMPT), f"parameter {name}", declared, "recompile")
    shutil.rmtree(bad)
    shutil.copytree(llama_artifact.path, bad)
    g = json.loads((bad / "graph.json").read_text())
    g["params"][0]["type"] = g["params"][0]["type"].replace("f32", "bf16", 1)
    (bad / "graph.json").write_text(json.dumps(g))
    with pytest.raises(llmc.ArtifactError, match=rf"parameter {g['params'][0]['name']} is declared bf16\[.*\] .* "
                                                 r"holds f32\[.*recompile"):
        llmc.load(bad, verify=False)


def test_nonexistent_artifact(tmp_path):
    import llmc
    nope = tmp_path / "nope.llmc"
    assert_clean_error(*cli("run", nope, "--prompt", PROMPT), "nope.llmc does not exist")
    assert_clean_error(*cli("inspect", nope), "nope.llmc does not exist")
    with pytest.raises(llmc.ArtifactError, match="nope does not exist"):
        llmc.load("nope")
