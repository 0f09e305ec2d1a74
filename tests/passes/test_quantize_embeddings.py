"""Quantized embedding tables (`qembedding`, passes/quantize/embedding.py) and a quantized LM head:
the op's reference, the pass on untied and tied models, the artifact's size and round trip, the CLI."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import llmc
from llmc.cli import main
from llmc.ir.quant import qembedding_ref, quantize_rows_int8
from llmc.runtime.llm import LLM, SamplingParams

from tests.conftest import make_model_dir

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


def _prompt_logprobs(art):
    out = LLM(art, backend="reference").generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor(out.prompt_logprobs[1:])


def _weight_bytes(art) -> int:
    return sum(p.stat().st_size for p in art.path.glob("*.safetensors"))


def test_int8_rows_round_within_half_a_code():
    w = torch.randn(50, 64) * torch.rand(50, 1) * 3
    q, s = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and s.shape == (50,)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    got = qembedding_ref(q, s, ids, torch.float32)
    want = w[ids]
    assert got.shape == (2, 3, 64)
    bound = (w.abs().amax(1) / 127 / 2)[ids][..., None] + 1e-6
    assert ((got - want).abs() <= bound).all()


def test_untied_table_becomes_int8_rows(llama_dir, tmp_path):
    base = llmc.compile(llama_dir, tmp_path / "rtn8.llmc", quant={"method": "rtn", "wbits": 8})
    art = llmc.compile(llama_dir, tmp_path / "rtn8e.llmc", verify=True,
                       quant={"method": "rtn", "wbits": 8, "embeddings": "int8"})
    ops = art.summary()["op_counts"]
    assert ops["qembedding"] == 1 and "embedding" not in ops
    assert "model.embed_tokens.weight" not in art.graph.weights
    emb = art.graph.meta["quant_plan"]["embeddings"]["model.embed_tokens"]
    v, h = base.graph.weights["model.embed_tokens.weight"].shape
    assert emb["params"] == v * h
    saved = _weight_bytes(base) - _weight_bytes(art)
    table = base.graph.weights["model.embed_tokens.weight"]
    assert saved >= v * h * (table.element_size() - 1) - v * 4 - 4096  # int8 codes + one fp32 scale per row
    lp, ref = _prompt_logprobs(art), _prompt_logprobs(base)
    assert (lp - ref).abs().mean() < 0.05
    again = llmc.load(art.path)
    assert torch.equal(_prompt_logprobs(again), lp)


def test_tied_table_needs_the_head_quantized_too(model_root, tmp_path):
    qwen = make_model_dir(model_root, "qwen2")  # tied embeddings
    # the head dense: no table could be quantized, so the option would do nothing: an error, nothing written
    with pytest.raises(llmc.errors.CompileError, match="tied to the LM head.*--quant-lm-head"):
        llmc.compile(qwen, tmp_path / "none.llmc", quant={"method": "rtn", "wbits": 8, "embeddings": "int8"})
    assert not (tmp_path / "none.llmc").exists()
    kept = llmc.compile(qwen, tmp_path / "kept.llmc", quant={"method": "rtn", "wbits": 8})
    ops = kept.summary()["op_counts"]
    assert ops.get("qembedding", 0) == 0 and ops["embedding"] == 1 and ops["linear"] == 1  # the dense tied head
    both = llmc.compile(qwen, tmp_path / "both.llmc", verify=True,
                        quant={"method": "rtn", "wbits": 8, "embeddings": "int8", "skip": []})
    ops = both.summary()["op_counts"]
    assert ops["qembedding"] == 1 and ops.get("linear", 0) == 0 and ops.get("embedding", 0) == 0
    assert both.graph.meta["quant_plan"]["linears"]["model.embed_tokens"]["format"]["bits"] == 8  # the tied head
    w, table = both.graph.weights, kept.graph.weights["model.embed_tokens.weight"]
    vocab_wide = [n for n in w if w[n].shape == table.shape]
    assert vocab_wide and all(not w[n].dtype.is_floating_point for n in vocab_wide)  # head and table: int8 only
    assert _weight_bytes(both) < _weight_bytes(kept)
    lp, ref = _prompt_logprobs(both), _prompt_logprobs(kept)
    assert (lp - ref).abs().mean() < 0.05


def test_cli_flags(llama_dir, tmp_path):
    res = CliRunner().invoke(main, ["compile", str(llama_dir), "-o", str(tmp_path / "x.llmc"),
                                    "--quant-embeddings", "int8"])
    assert res.exit_code != 0 and "--quant METHOD" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["compile", str(llama_dir), "-o", str(tmp_path / "y.llmc"), "--quant", "rtn",
                                    "--wbits", "8", "--quant-lm-head", "--quant-embeddings", "int8"])
    assert res.exit_code == 0, res.output
    plan = llmc.load(tmp_path / "y.llmc").graph.meta["quant_plan"]
    assert plan["linears"]["lm_head"]["format"] is not None and "model.embed_tokens" in plan["embeddings"]
    res = CliRunner().invoke(main, ["inspect", str(tmp_path / "y.llmc"), "--plan"])
    assert res.exit_code == 0 and "model.embed_tokens" in res.output and "int8 rows" in res.output, res.output


def test_a_tied_table_that_cannot_be_quantized_is_an_error_at_the_command_line(model_root, tmp_path):
    qwen = make_model_dir(model_root, "qwen2")  # tied embeddings: without --quant-lm-head the table stays
    res = CliRunner().invoke(main, ["compile", str(qwen), "-o", str(tmp_path / "t.llmc"), "--quant", "rtn",
                                    "--quant-embeddings", "int8"])
    assert res.exit_code != 0 and "--quant-lm-head" in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "t.llmc").exists()


def test_bad_embeddings_option(llama_dir, tmp_path):
    with pytest.raises(llmc.errors.CompileError, match="int8"):
        llmc.compile(llama_dir, tmp_path / "z.llmc", quant={"method": "rtn", "embeddings": "int4"})
