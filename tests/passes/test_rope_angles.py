"""The rotary angles' concat(f, f) folded into their frequency vector (lift_patterns' `rope_angles` rule): one
elementwise kernel makes cos and sin, with the bits of the unfolded graph."""
from __future__ import annotations

import pytest
import torch

import llmc
import llmc.passes.lift_patterns as lift
from llmc.passes.pattern import P, RewriteRule
from llmc.runtime.llm import LLM, SamplingParams

TEXT = "def add(a, b):\n    return a + b\n"


def _unfolded(monkeypatch):
    monkeypatch.setattr(lift, "rope_angles_rule", lambda: RewriteRule("off", P.op("no_such_op")(), lambda b, m: None))


def _logprobs(art, backend):
    out = LLM(art, backend=backend).generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor(out.prompt_logprobs[1:])


def test_one_kernel_makes_cos_and_sin(llama_dir, monkeypatch):
    art = llmc.compile(llama_dir, None)
    regions = [n for n in art.graph.nodes if n.op == "fused" and {op for _, op, *_ in n.attrs["body"]} >= {"cos", "sin"}]
    assert len(regions) == 1 and len(regions[0].outputs) == 2
    assert not any(n.op in ("concat", "cos", "sin") for n in art.graph.nodes)
    doubled = [p for p in art.graph.params if p.name.endswith("inv_freq.doubled")]
    assert len(doubled) == 1 and not any(p.name.endswith("inv_freq") for p in art.graph.params)
    w = art.graph.weights[doubled[0].name]
    torch.testing.assert_close(w[: w.numel() // 2], w[w.numel() // 2:], rtol=0, atol=0)
    _unfolded(monkeypatch)
    plain = llmc.compile(llama_dir, None)  # the angles' concat between the product and cos, sin: three kernels more
    assert {"concat", "cos", "sin"} <= set(plain.graph.op_counts())
    assert sum(plain.graph.op_counts().values()) == sum(art.graph.op_counts().values()) + 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_folded_angles_give_the_unfolded_bits(llama_dir, monkeypatch, dtype):
    """The prompt's log-probabilities on the kernel backend (Triton's interpreter here) and on the reference
    backend are the unfolded graph's, bit for bit."""
    art = llmc.compile(llama_dir, None, dtype=dtype)
    _unfolded(monkeypatch)
    plain = llmc.compile(llama_dir, None, dtype=dtype)
    for backend in ("reference", "triton-interpret"):
        assert torch.equal(_logprobs(art, backend), _logprobs(plain, backend)), backend
