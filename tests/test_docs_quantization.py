"""docs/quantization.md: its first run works as written (two compiles, two evals, the plan), and every option
it names is one that `llmc compile`, `llmc eval` or `llmc inspect` takes."""
import re
import shlex
from pathlib import Path

from tests.test_cli import cli

DOC = Path(__file__).resolve().parents[1] / "docs" / "quantization.md"


def first_run() -> list[list[str]]:
    text = DOC.read_text()
    block = text.split("## A first run", 1)[1].split("```", 2)[1]
    return [shlex.split(line)[1:] for line in block.strip().splitlines() if line.startswith("llmc ")]


def test_the_first_run_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    commands = first_run()
    assert [c[0] for c in commands] == ["compile", "compile", "eval", "eval", "inspect"]
    outputs = []
    for args in commands:
        code, out = cli(*args)
        assert code == 0, (args, out)
        outputs.append(out)
    ppl = [float(re.search(r"perplexity\s+([0-9.]+)", out).group(1)) for out in outputs[2:4]]
    assert 1 < ppl[0] < ppl[1] < ppl[0] * 1.2, ppl  # GPTQ int4 costs a little perplexity, not much
    # int4 g128 by default, and the LM head (tied to the embedding here) left unquantized, as the page says
    assert "w4a16-g128" in outputs[4] and "skipped (lm_head)" in outputs[4], outputs[4]


def test_every_option_the_page_names_exists():
    helps = "".join(cli(command, "--help")[1] for command in ("compile", "eval", "inspect"))
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", DOC.read_text()))
    assert named and not {o for o in named if o not in helps}, sorted(o for o in named if o not in helps)
