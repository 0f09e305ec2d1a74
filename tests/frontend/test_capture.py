"""Frontend: captured graphs of Llama, Qwen2 and Mistral match Hugging Face eager."""
import pytest
import torch

import llmc
from llmc.errors import CompileError
from llmc.frontend.hf import capture_hf
from llmc.ir.interpreter import Interpreter, run_graph
from llmc.ir.printer import parse_graph
from llmc.ir.verify import verify
from llmc.passes import PassManager, pipeline
from tests.conftest import hf_model, paged_prefill_last_logits


@pytest.fixture(scope="module")
def captured(arch_dir):
    g = capture_hf(arch_dir)
    return arch_dir, PassManager(pipeline(options={"paged_kv": False, "fuse": False}), verify=True).run(g)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_logits_match_hf_at_two_lengths(captured):
    path, g = captured
    m = hf_model(path)
    torch.manual_seed(1)
    it = Interpreter(g)
    for S in (5, 13):  # longer than the sliding windows of the qwen2/mistral fixtures
        ids = torch.randint(0, 320, (2, S))
        pos = torch.arange(S).expand(2, S)
        (out,) = it.run(input_ids=ids, position_ids=pos)
        with torch.no_grad():
            ref = m(input_ids=ids).logits
        assert out.shape == ref.shape
        assert rel_err(out, ref) <= 1e-4


def test_llm_ops_are_lifted(captured):
    _, g = captured
    ops = g.op_counts()
    assert ops["attention"] == 2 and ops["rms_norm"] == 5 and ops["rope"] == 4 and ops["silu_mul"] == 2
    assert "pow" not in ops and "rsqrt" not in ops and "neg" not in ops


def test_ir_text_round_trips(captured):
    _, g = captured
    text = str(g)
    assert str(parse_graph(text)) == text


def test_sliding_window_is_captured(captured):
    path, g = captured
    windows = [n.attrs["window"] for n in g.nodes if n.op == "attention"]
    expected = {"llama": [0, 0], "qwen2": [0, 6], "mistral": [5, 5]}[path.name]
    assert windows == expected


def test_nodes_keep_their_source_location(captured):
    _, g = captured
    lin = next(n for n in g.nodes if n.op == "linear")
    assert "modeling_" in lin.meta["source"]


def test_paged_graph_matches_hf_for_two_sequences(arch_dir):
    art = llmc.compile(arch_dir, None, verify=True)
    g = art.graph
    m = hf_model(arch_dir)
    a, b = torch.randint(0, 320, (9,)), torch.randint(0, 320, (4,))
    out = paged_prefill_last_logits(g, a, b)
    with torch.no_grad():
        ra, rb = m(input_ids=a[None]).logits[0, -1], m(input_ids=b[None]).logits[0, -1]
    assert rel_err(out[0], ra) <= 1e-4 and rel_err(out[1], rb) <= 1e-4


class TopK(torch.nn.Module):
    def forward(self, x):
        return torch.topk(x, 2).values  # no llmc lowering for topk


def test_unsupported_op_names_op_and_source_line():
    with pytest.raises(CompileError) as e:
        llmc.compile(TopK(), None, example_inputs=(torch.randn(3, 5),))
    msg = str(e.value)
    assert "aten.topk" in msg and "test_capture.py" in msg and "torch.topk(x, 2)" in msg


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(16, 16)
        self.kv = torch.nn.Linear(16, 32, bias=False)

    def forward(self, x):  # x: [B, S, 16]
        B, S, _ = x.shape
        q = self.q(x).view(B, S, 2, 8).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 4, 8).transpose(1, 2).chunk(2, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.nn.functional.gelu(o.transpose(1, 2).reshape(B, S, 16))


def test_plain_module_with_sdpa_and_dynamic_dims():
    m = Block().eval()
    x = torch.randn(2, 6, 16)
    art = llmc.compile(m, None, example_inputs=(x,), dynamic={"x": {0: ("B", 1, 8), 1: ("S", 1, 64)}},
                       paged_kv=False, verify=True)
    g = art.graph
    verify(g, check_weights=True)
    assert g.op_counts()["attention"] == 1
    for shape in ((2, 6, 16), (3, 11, 16)):
        x = torch.randn(*shape)
        (out,) = run_graph(g, {"x": x})
        torch.testing.assert_close(out, m(x), rtol=1e-4, atol=1e-5)


class TinyLM(torch.nn.Module):
    """input_ids -> embedding -> one attention (causal or not) -> head: the least a paged-KV compile takes."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.emb = torch.nn.Embedding(32, 16)
        self.qkv = torch.nn.Linear(16, 48, bias=False)
        self.head = torch.nn.Linear(16, 32, bias=False)

    def forward(self, input_ids, position_ids):
        x = self.emb(input_ids)
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 2, 24).transpose(1, 2).split(8, dim=-1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.head(o.transpose(1, 2).reshape(B, S, 16))


def test_attention_that_is_not_causal_is_refused_on_the_paged_cache(tmp_path):
    """A token of a bidirectional model depends on the tokens after it, which a KV cache cannot give: the
    paged-KV compile says so (it ran with the mask dropped and generated other tokens), and nothing is
    written; the causal twin compiles."""
    ids, pos = torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None]
    dyn = {"input_ids": {1: ("S", 1, 64)}, "position_ids": {1: ("S", 1, 64)}}
    with pytest.raises(CompileError, match="the attention is not causal.*is_causal=True.*paged_kv=False"):
        llmc.compile(TinyLM(False).eval(), tmp_path / "enc.llmc", example_inputs=(ids, pos), dynamic=dyn)
    assert not (tmp_path / "enc.llmc").exists()
    assert llmc.compile(TinyLM(True).eval(), tmp_path / "dec.llmc", example_inputs=(ids, pos),
                        dynamic=dyn).graph.meta["paged"]
