"""What a compile refuses rather than write something wrong: a checkpoint missing a weight (transformers would
leave it random), calibration of a model directory whose only "tokenizer" file is generation_config.json, a pass
that leaves the graph invalid under --no-verify, and a pass file that exits."""
import shutil

import pytest
from safetensors.torch import load_file, save_file

from llmc.errors import CompileError
from tests.test_cli import assert_clean_error, cli


def test_a_checkpoint_missing_a_weight_is_refused(llama_dir, tmp_path):
    import llmc
    d = tmp_path / "missing"
    shutil.copytree(llama_dir, d)
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CompileError, match="the checkpoint has no model.layers.1.mlp.down_proj.weight"):
        llmc.compile(d, tmp_path / "o.llmc")
    assert not (tmp_path / "o.llmc").exists()


def test_calibration_without_tokenizer_files_says_so(llama_dir, tmp_path):
    d = tmp_path / "untokenized"
    shutil.copytree(llama_dir, d)
    for f in d.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            f.unlink()
    assert (d / "generation_config.json").is_file()  # what save_pretrained writes beside the weights
    assert_clean_error(*cli("compile", d, "-o", tmp_path / "o.llmc", "--quant", "gptq", "--calib-samples", "2"),
                       "calibration needs the model's tokenizer")


def test_an_invalid_graph_is_not_written_without_verify(llama_dir, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text(
        "from llmc.passes.manager import Pass, PassResult\n"
        "class DropFirst(Pass):\n"
        "    name = 'drop_first'\n"
        "    def run(self, g, ctx):\n"
        "        g.nodes.remove(next(n for n in g.nodes if n.inputs))\n"
        "        return PassResult(g, True)\n")
    out = tmp_path / "o.llmc"
    code, text = cli("compile", llama_dir, "-o", out, "--no-verify", "--pass", f"{broken}:DropFirst")
    assert code != 0 and "the passes left the graph invalid" in text and "Traceback" not in text
    assert not out.exists()
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    assert_clean_error(*cli("compile", llama_dir, "-o", out, "--pass", f"{exits}:X"), "sys.exit(3)")
