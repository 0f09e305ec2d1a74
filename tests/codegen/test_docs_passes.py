"""docs/passes.md: every worked example runs exactly as written, and does what the guide says.

Examples 1 and 2 run in this process. Example 3 runs as a user would run it: its files (a
`title="..."` on a code block names the file) written into an empty folder, its script in a fresh
Python process without TRITON_INTERPRET (the script sets it itself on a machine without a GPU),
then its command lines.
"""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "passes.md"
TEXT = DOC.read_text()
# (heading number, language, file name or "", code) of every fenced block under a "## N." heading
SECTIONS = {int(n): body for n, body in re.findall(r"^## (\d+)\. .*?\n(.*?)(?=^## |\Z)", TEXT, re.S | re.M)}
BLOCKS = {n: re.findall(r'```(\w+)(?: title="([^"]+)")?\n(.*?)```', body, re.S) for n, body in SECTIONS.items()}


def run_block(n, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (code,) = [c for lang, _, c in BLOCKS[n] if lang == "python"]
    ns = {"__name__": f"docs_passes_example_{n}"}
    exec(compile(code, f"{DOC}:example{n}", "exec"), ns)
    return ns


def test_four_examples_documented():
    assert sorted(BLOCKS) == [1, 2, 3, 4]
    assert [title for _, title, _ in BLOCKS[3]] == ["my_kernels/my_swiglu.py.jinja", "my_swiglu.py", "compare.py", ""]


def test_example_1_activation_by_example(tmp_path, monkeypatch):
    ns = run_block(1, tmp_path, monkeypatch)
    assert ns["stats"] == {"swiglu->geglu": 8}
    assert "silu_mul" not in ns["art"].graph.op_counts() and '"gelu"' in str(ns["art"].graph)
    assert "replace_by_example{swiglu->geglu}" in ns["art"].summary()["passes"]


def test_example_2_fold_scale(tmp_path, monkeypatch):
    ns = run_block(2, tmp_path, monkeypatch)
    assert ns["art"].graph.op_counts() == {"linear": 1}


def test_example_4_own_quantization(tmp_path, monkeypatch):
    ns = run_block(4, tmp_path, monkeypatch)
    assert ns["art"].graph.op_counts() == {"qlinear": 1}
    assert float((ns["y"] - ns["ref"]).norm() / ns["ref"].norm()) < 0.02
    # `llmc inspect` shows the plan of a method that records none, read back from the graph
    from click.testing import CliRunner

    from llmc.cli import main
    r = CliRunner().invoke(main, ["inspect", str(ns["art"].path), "--plan"])
    assert r.exit_code == 0, r.output
    assert "quantization  clipped_int8: 8.125 bits per weight" in r.output, r.output  # fp32 scales
    assert "read from the graph" in r.output and "w8a16-ch" in r.output, r.output


def test_example_3_user_triton_kernel_plugin(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for _, title, code in BLOCKS[3]:
        if title:
            (tmp_path / title).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / title).write_text(code)
    p = subprocess.run([sys.executable, "compare.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True"], p.stdout

    def llmc(args):
        assert args[0] == "llmc"
        return subprocess.run([sys.executable, "-m", "llmc.cli", *args[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True)

    (shell,) = [c for lang, _, c in BLOCKS[3] if lang == "bash"]
    results = [llmc(shlex.split(line, comments=True)) for line in shell.strip().splitlines()]
    for r in results:
        assert r.returncode == 0, r.stderr
    _, inspected, ran = results
    assert "user:lower_my_swiglu" in inspected.stdout
    assert ran.stdout.startswith("def add(a, b):") and len(ran.stdout) > len("def add(a, b):\n")
    kinds = {r["op"]: r["kernel"] for r in json.loads((tmp_path / "tiny-my-swiglu.llmc/manifest.json").read_text())["kernels"]}
    assert kinds["my_swiglu"] == "user:lower_my_swiglu"
    # without the plugin the artifact cannot be loaded, and the error says what to pass
    bare = llmc(["llmc", "run", "tiny-my-swiglu.llmc", "--prompt", "def add(a, b):"])
    assert bare.returncode == 1 and "Traceback" not in bare.stderr, bare.stderr
    assert "'my_swiglu'" in bare.stderr and "--plugin FILE.py" in bare.stderr
