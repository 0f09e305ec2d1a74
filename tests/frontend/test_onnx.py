"""ONNX frontend: tiny Llama, Qwen2 and Mistral exported with torch.onnx.export compile to the same kind of
graph as their Hugging Face directories, and agree with onnxruntime and with Hugging Face.

Exporter variants (torch 2.13, transformers 5):
- dynamo (torch.export-based), opset 20: attention decomposed (matmul-scale-mask-softmax-matmul), weights
  in an external data file; works for all three.
- dynamo, opset 23: sdpa becomes ONNX's Attention op, RMSNorm and rope RMSNormalization and RotaryEmbedding.
- legacy (TorchScript) exporter, opset 17: works when attention_mask is an input; with position_ids alone
  it fails on aten::diff (transformers' packed-sequence check).
- legacy with past_key_values inputs and present outputs: the cache inputs are removed.
Plus a hand-built graph of onnxruntime's contrib ops (SimplifiedLayerNormalization, RotaryEmbedding,
GroupQueryAttention, MultiHeadAttention), as onnxruntime's model builders write them.
"""
from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest
import torch

import llmc
from llmc.errors import CompileError
from llmc.frontend.onnx import capture_onnx
from llmc.frontend.onnx_check import check_onnxruntime
from llmc.ir.interpreter import Interpreter, run_graph
from llmc.ir.printer import parse_graph
from llmc.passes import PassManager, pipeline
from tests.conftest import VOCAB, hf_greedy, hf_model, make_model_dir
from tests.test_cli import assert_clean_error, cli

class Logits(torch.nn.Module):
    """The forward an export holds: the named inputs -> full-sequence logits."""

    def __init__(self, m, names):
        super().__init__()
        self.m, self.names = m, names

    def forward(self, *args):
        return self.m(**dict(zip(self.names, args)), use_cache=False).logits


class LogitsWithPast(torch.nn.Module):
    """(input_ids, attention_mask, position_ids, past k/v per layer) -> (logits, present k/v per layer)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache
        cache = DynamicCache()
        for i in range(len(past) // 2):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     past_key_values=cache, use_cache=True)
        return (out.logits, *[t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)])


def export(model_dir, out, exporter: str, names=("input_ids", "position_ids"), attn="eager", opset=20):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation=attn).eval()
    ids = torch.randint(0, VOCAB, (2, 7))
    example = {"input_ids": ids, "position_ids": torch.arange(7).expand(2, 7),
               "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    args = tuple(example[n] for n in names)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            B, S = torch.export.Dim("batch"), torch.export.Dim("sequence")
            torch.onnx.export(Logits(m, names), args, str(out), dynamo=True, opset_version=opset, external_data=True,
                              input_names=list(names), output_names=["logits"], verbose=False,
                              dynamic_shapes=(tuple({0: B, 1: S} for _ in names),))
        else:
            axes = {n: {0: "batch", 1: "sequence"} for n in [*names, "logits"]}
            torch.onnx.export(Logits(m, names), args, str(out), dynamo=False, opset_version=opset,
                              input_names=list(names), output_names=["logits"], dynamic_axes=axes)
    return out


def fp32_rotary_frequencies(m) -> None:
    """`.to(bfloat16)` rounds a model's rotary frequencies, which llmc's HF frontend computes in fp32: put
    the fp32 ones back, so that an export holds what the HF directory stands for."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    for mod in m.modules():
        if hasattr(mod, "inv_freq") and hasattr(mod, "rope_type"):
            init = mod.compute_default_rope_parameters if mod.rope_type == "default" else \
                ROPE_INIT_FUNCTIONS[mod.rope_type]
            mod.inv_freq = init(mod.config, mod.inv_freq.device)[0].float()


def export_with_past(model_dir, out):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    c = m.config
    L, P, S, hd = c.num_hidden_layers, 3, 4, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = [f"past_key_values.{i}.{t}" for i in range(L) for t in ("key", "value")]
    names = ["input_ids", "attention_mask", "position_ids", *kv]
    outs = ["logits", *[n.replace("past_key_values", "present") for n in kv]]
    axes = {"input_ids": {0: "batch_size", 1: "sequence_length"},
            "position_ids": {0: "batch_size", 1: "sequence_length"},
            "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
            "logits": {0: "batch_size", 1: "sequence_length"},
            **{n: {0: "batch_size", 2: "past_sequence_length"} for n in kv},
            **{n: {0: "batch_size", 2: "total_sequence_length"} for n in outs[1:]}}
    args = (torch.randint(0, VOCAB, (2, S)), torch.ones(2, P + S, dtype=torch.long),
            torch.arange(P, P + S).expand(2, S), *[torch.randn(2, c.num_key_value_heads, P, hd) for _ in kv])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(LogitsWithPast(m), args, str(out), dynamo=False, opset_version=17, input_names=names,
                          output_names=outs, dynamic_axes=axes)
    return out


# variant -> (architecture, how it was exported)
VARIANTS = {
    "llama-dynamo": ("llama", dict(exporter="dynamo")),
    "qwen2-dynamo": ("qwen2", dict(exporter="dynamo")),
    "mistral-dynamo": ("mistral", dict(exporter="dynamo")),
    "qwen2-dynamo-opset23": ("qwen2", dict(exporter="dynamo", attn="sdpa", opset=23)),
    "llama-legacy-sdpa": ("llama", dict(exporter="legacy", names=("input_ids", "attention_mask"), attn="sdpa",
                                        opset=17)),
    "qwen2-legacy": ("qwen2", dict(exporter="legacy", names=("input_ids", "attention_mask", "position_ids"),
                                   opset=17)),
    "mistral-legacy": ("mistral", dict(exporter="legacy", names=("input_ids", "attention_mask"), opset=17)),
    "llama-legacy-past": ("llama", None),
}
WINDOWS = {"llama": [0, 0], "qwen2": [0, 6], "mistral": [5, 5]}


@pytest.fixture(scope="module")
def onnx_root(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx")


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request, model_root, onnx_root):
    """(variant, HF model dir, .onnx path); each file in its own directory, no tokenizer beside it."""
    arch, how = VARIANTS[request.param]
    src = make_model_dir(model_root, arch)
    out = onnx_root / request.param / "model.onnx"
    if not out.exists():
        torch.manual_seed(0)
        out.parent.mkdir()
        export_with_past(src, out) if how is None else export(src, out, **how)
    return request.param, src, out


@pytest.fixture(scope="module")
def captured(exported):
    name, src, path = exported
    g, tok = capture_onnx(path)
    return name, src, path, g


def ort_run(path, ids: torch.Tensor) -> torch.Tensor:
    """onnxruntime's logits for a batch of token ids, fed by llmc's contract."""
    from llmc.frontend.onnx_check import _session, ort_logits
    sess = _session(path)
    return torch.stack([ort_logits(sess, row) for row in ids])


def test_logits_match_onnxruntime_and_hf(captured):
    name, src, path, g = captured
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 13))  # longer than the qwen2/mistral sliding windows
    (out,) = Interpreter(g).run(input_ids=ids, position_ids=torch.arange(13).expand(2, 13))
    with torch.no_grad():
        ref = hf_model(src)(input_ids=ids).logits
    assert out.shape == ref.shape
    assert (out - ort_run(path, ids)).abs().max() <= 1e-4
    assert (out - ref).abs().max() <= 1e-4


def test_llm_ops_are_lifted_and_extra_inputs_removed(captured):
    name, src, path, g = captured
    assert [v.name for v in g.inputs] == ["input_ids", "position_ids"] and len(g.outputs) == 1
    windows = [n.attrs["window"] for n in g.nodes if n.op == "attention"]
    assert windows == WINDOWS[name.split("-")[0]]
    assert all(n.attrs["causal"] and n.inputs[1].type.shape[1] == 2 for n in g.nodes if n.op == "attention")  # GQA kept
    lifted = PassManager(pipeline(options={"paged_kv": False, "fuse": False}), verify=True).run(g.clone())
    ops = lifted.op_counts()
    assert ops["attention"] == 2 and ops["rms_norm"] == 5 and ops["rope"] == 4 and ops["silu_mul"] == 2, ops
    assert not {"pow", "rsqrt", "neg", "sigmoid", "softmax", "causal_mask", "matmul"} & set(ops), ops
    assert any(p.name.endswith("mlp.up_proj.weight") for p in g.params)  # weights named after their modules


@pytest.fixture(scope="module")
def artifact(captured, tmp_path_factory):
    name, src, path, _ = captured
    return llmc.compile(path, tmp_path_factory.mktemp("art") / f"{name}.llmc", verify=True, tokenizer=src)


GREEDY = {"llama-dynamo", "qwen2-legacy", "mistral-dynamo", "llama-legacy-past"}  # one export per architecture


def test_compiled_artifact_agrees_with_onnxruntime_and_hf_greedy(captured, artifact):
    name, src, path, _ = captured
    ops = artifact.graph.op_counts()
    assert "attend_paged" in ops and "rope_kv_write" in ops and "add_rms_norm" in ops  # fusion applied unchanged
    rep = check_onnxruntime(path, artifact.graph, lengths=(5, 13))
    assert rep.max_abs_diff <= 1e-4, str(rep)
    assert artifact.info.eos_token_ids == (0,) and artifact.tokenizer_dir is not None
    if name in GREEDY:
        from llmc.runtime.llm import LLM, SamplingParams
        prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
        outs = LLM(artifact, backend="reference", num_blocks=32, block_size=4).generate(
            prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        m = hf_model(src)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == hf_greedy(m, p, 10)


def test_external_data_is_read_and_a_missing_file_is_a_clear_error(onnx_root, model_root, tmp_path):
    path = onnx_root / "llama-dynamo" / "model.onnx"
    if not path.exists():
        export(make_model_dir(model_root, "llama"), path.parent.mkdir() or path, "dynamo")
    data = [f for f in path.parent.iterdir() if f.name != "model.onnx"]
    assert len(data) == 1 and data[0].stat().st_size > 300_000  # the weights (~100k floats) live beside the graph
    lonely = tmp_path / "model.onnx"
    shutil.copy(path, lonely)
    with pytest.raises(CompileError, match="external data file model.onnx.data, which is not beside it"):
        capture_onnx(lonely)


def test_cli_compile_with_check_ort(onnx_root, model_root, tmp_path, monkeypatch):
    path = onnx_root / "qwen2-legacy" / "model.onnx"
    if not path.exists():
        export(make_model_dir(model_root, "qwen2"), path.parent.mkdir() or path, **VARIANTS["qwen2-legacy"][1])
    code, out = cli("compile", path, "-o", tmp_path / "q.llmc", "--tokenizer", model_root / "qwen2", "--check-ort")
    assert code == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("onnxruntime check"))
    assert float(line.split("difference| ")[1].split()[0]) <= 1e-4
    assert "warning" not in out  # the tokenizer was found
    code, out = cli("run", tmp_path / "q.llmc", "--prompt", "def add(a, b):", "--max-tokens", 4)
    assert code == 0, out
    from tests.conftest import build_tokenizer
    build_tokenizer(tmp_path / "big", 1000)  # more tokens than the model's 320
    assert_clean_error(*cli("compile", path, "-o", tmp_path / "b.llmc", "--tokenizer", tmp_path / "big"),
                       "tokens and the model's vocabulary 320", "--tokenizer DIR")
    assert not (tmp_path / "b.llmc").exists()
    # a norm over the sequence instead of the hidden dim mixes tokens outside attention: llmc would compute
    # something else, and the compile refuses it (onnxruntime's check caught it only after the compile)
    import dataclasses

    import onnx
    from onnx import helper

    import llmc.frontend.onnx_check as onnx_check
    m = onnx.load(str(path))
    norm = next(n for n in m.graph.node if n.op_type == "ReduceMean" and "layernorm" in n.name)
    axes = next(a for a in norm.attribute if a.name == "axes")  # opset 17: an attribute
    norm.attribute.remove(axes)
    norm.attribute.append(helper.make_attribute("axes", [1]))
    onnx.save(m, str(tmp_path / "seq.onnx"))
    assert_clean_error(*cli("compile", tmp_path / "seq.onnx", "-o", tmp_path / "s.llmc"), "ReduceMean",
                       "over axis 1, the sequence", "mixes tokens outside attention")
    assert not (tmp_path / "s.llmc").exists()
    # logits further from onnxruntime's than the dtype explains: exit 1, the artifact named as not to be used
    real = onnx_check.check_onnxruntime
    monkeypatch.setattr(onnx_check, "check_onnxruntime",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), max_rel_diff=0.63))
    code, out = cli("compile", path, "-o", tmp_path / "d.llmc", "--tokenizer", model_root / "qwen2", "--check-ort")
    assert code == 1 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1].startswith("error: ") and "does not compute what" in out, out


# ---------------------------------------------------------------------------------------------
# bad files

def _graph(nodes, inputs, outputs, inits=(), opset=20, domains=()):
    from onnx import helper
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]
                             + [helper.make_opsetid(d, 1) for d in domains])


def test_bad_files_are_clean_errors(onnx_root, model_root, tmp_path):
    import onnx
    from onnx import TensorProto, helper
    o = tmp_path / "o.llmc"
    text = tmp_path / "notes.onnx"
    text.write_text("these are notes, not a model\n" * 20)
    assert_clean_error(*cli("compile", text, "-o", o), "not a valid ONNX model")
    assert_clean_error(*cli("compile", tmp_path / "missing.onnx", "-o", o), "does not exist")

    path = onnx_root / "mistral-legacy" / "model.onnx"
    if not path.exists():
        export(make_model_dir(model_root, "mistral"), path.parent.mkdir() or path, **VARIANTS["mistral-legacy"][1])
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert_clean_error(*cli("compile", cut, "-o", o), "truncated")

    m = onnx.load(str(path))
    node = next(n for n in m.graph.node if n.op_type == "Sigmoid")
    node.op_type = "HardSigmoid"
    onnx.save(m, str(tmp_path / "op.onnx"))
    assert_clean_error(*cli("compile", tmp_path / "op.onnx", "-o", o), "HardSigmoid", node.name, "@onnx_op",
                       "llmc/frontend/onnx_ops.py")

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])
    onnx.save(_graph([helper.make_node("Relu", ["x"], ["y"])], [x], [y]), str(tmp_path / "mlp.onnx"))
    assert_clean_error(*cli("compile", tmp_path / "mlp.onnx", "-o", o), "no decoder shape", "input_ids")

    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", 8])
    emb = helper.make_tensor("emb", TensorProto.FLOAT, [10, 8], np.zeros(80, dtype=np.float32).tolist())
    gather = helper.make_node("Gather", ["emb", "input_ids"], ["logits"])
    onnx.save(_graph([gather], [ids], [logits], [emb], opset=13), str(tmp_path / "old.onnx"))
    assert_clean_error(*cli("compile", tmp_path / "old.onnx", "-o", o), "opset 13", "opset_version=17")
    onnx.save(_graph([gather], [ids], [logits], [emb]), str(tmp_path / "noattn.onnx"))
    assert_clean_error(*cli("compile", tmp_path / "noattn.onnx", "-o", o), "no attention")
    fixed = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 7])
    onnx.save(_graph([gather], [fixed], [logits], [emb]), str(tmp_path / "fixed.onnx"))
    assert_clean_error(*cli("compile", tmp_path / "fixed.onnx", "-o", o), "fixed sequence length", "dynamic")
    for name, shape, needle in (("noshape", None, "input_ids has no shape"),
                                ("rank1", ["batch"], "input_ids [batch] has rank 1")):
        bad = helper.make_tensor_value_info("input_ids", TensorProto.INT64, shape)
        onnx.save(_graph([gather], [bad], [logits], [emb]), str(tmp_path / f"{name}.onnx"))
        assert_clean_error(*cli("compile", tmp_path / f"{name}.onnx", "-o", o), needle, "input_ids[batch, sequence]")
    # the last position's logits only ([batch, vocab], or a sequence axis of 1): said before the walk, whose
    # slice of the symbolic sequence would fail first with a message about the slice
    for name, shape in (("last2", ["batch", 8]), ("last3", ["batch", 1, 8])):
        out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, shape)
        onnx.save(_graph([helper.make_node("Slice", ["input_ids", "s", "e", "a"], ["logits"])], [ids], [out], [emb]),
                  str(tmp_path / f"{name}.onnx"))
        assert_clean_error(*cli("compile", tmp_path / f"{name}.onnx", "-o", o), "last position",
                           "full-sequence logits")
    (tmp_path / "cfg").mkdir()
    onnx.save(_graph([gather], [ids], [logits], [emb]), str(tmp_path / "cfg" / "model.onnx"))
    (tmp_path / "cfg" / "config.json").write_text('{"max_position_embeddings": 64,\n')
    assert_clean_error(*cli("compile", tmp_path / "cfg" / "model.onnx", "-o", o), "config.json is not valid JSON")
    assert not o.exists()


def test_a_symbolic_dim_divided_is_worked_out(onnx_root, model_root, tmp_path):
    """logits reshaped to [B, (2 * S) / 2, -1] (an identity; onnxruntime runs it): the division of the
    sequence dim is worked out symbolically (it was an internal error), and the artifact agrees with
    onnxruntime."""
    import onnx
    from onnx import helper, numpy_helper

    from llmc.frontend.onnx_eval import SYM_BINARY
    from llmc.ir.types import make_dim
    assert str(SYM_BINARY["Div"](make_dim("S"), 2)) == "floor(S/2)"
    assert SYM_BINARY["Div"](SYM_BINARY["Mul"](make_dim("S"), 2), 2) == make_dim("S")
    path = onnx_root / "mistral-legacy" / "model.onnx"
    if not path.exists():
        export(make_model_dir(model_root, "mistral"), path.parent.mkdir() or path, **VARIANTS["mistral-legacy"][1])
    m = onnx.load(str(path))
    g = m.graph
    for n in g.node:
        n.output[:] = ["logits_raw" if o == "logits" else o for o in n.output]
    g.initializer.extend(numpy_helper.from_array(np.array(v, dtype=np.int64), name)
                         for name, v in (("k0", [0]), ("k1", [1]), ("two", [2]), ("m1", [-1])))
    g.node.extend([helper.make_node("Shape", ["logits_raw"], ["shp"]),
                   helper.make_node("Gather", ["shp", "k0"], ["b"], axis=0),
                   helper.make_node("Gather", ["shp", "k1"], ["s"], axis=0),
                   helper.make_node("Mul", ["s", "two"], ["s2"]), helper.make_node("Div", ["s2", "two"], ["s1"]),
                   helper.make_node("Concat", ["b", "s1", "m1"], ["tgt"], axis=0),
                   helper.make_node("Reshape", ["logits_raw", "tgt"], ["logits"])])
    onnx.save(m, str(tmp_path / "div.onnx"))
    art = llmc.compile(tmp_path / "div.onnx", tmp_path / "div.llmc")
    assert check_onnxruntime(tmp_path / "div.onnx", art.graph, lengths=(5,)).max_abs_diff <= 1e-4


# ---------------------------------------------------------------------------------------------
# onnxruntime's contrib ops, as its model builders write them

H, NH, NKV, D, FF, V, MAXPOS = 32, 4, 2, 16, 48, 64, 64


def contrib_decoder(path, layers=(0, 1, 2)):
    """input_ids, attention_mask, position_ids -> logits over three layers: RotaryEmbedding +
    GroupQueryAttention, GroupQueryAttention with do_rotary and a local window, RotaryEmbedding +
    MultiHeadAttention; norms as (Skip)SimplifiedLayerNormalization; weights random."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def w(name, *shape, scale=0.3):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def const(name, value, dtype=np.int64):
        inits.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name

    def node(op, ins, outs, domain="", **attrs):
        nodes.append(helper.make_node(op, ins, outs if isinstance(outs, list) else [outs], name=f"n{len(nodes)}_{op}",
                                      domain=domain, **attrs))
        return outs

    inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
    ang = np.arange(MAXPOS)[:, None] * inv[None]
    inits += [numpy_helper.from_array(np.cos(ang).astype(np.float32), "cos"),
              numpy_helper.from_array(np.sin(ang).astype(np.float32), "sin")]
    node("ReduceSum", ["attention_mask", const("ax1", [1])], "msum", keepdims=0)
    node("Sub", ["msum", const("one", 1)], "seqlens64")
    node("Cast", ["seqlens64"], "seqlens_k", to=TensorProto.INT32)
    node("Shape", ["attention_mask"], "mshape")
    node("Gather", ["mshape", const("i1", 1)], "total64", axis=0)
    node("Cast", ["total64"], "total", to=TensorProto.INT32)
    h = node("Gather", [w("embed", V, H, scale=1.0), "input_ids"], "h0", axis=0)
    x = node("SimplifiedLayerNormalization", [h, w("ln0", H)], "x0", axis=-1, epsilon=1e-6)
    for i in layers:
        q, k, v = (node("MatMul", [x, w(f"w{t}{i}", H, (NH if t == "q" or i == 2 else NKV) * D)], f"{t}{i}")
                   for t in "qkv")
        if i != 1:
            q = node("RotaryEmbedding", [q, "position_ids", "cos", "sin"], f"qr{i}", "com.microsoft", num_heads=NH)
            k = node("RotaryEmbedding", [k, "position_ids", "cos", "sin"], f"kr{i}", "com.microsoft",
                     num_heads=NH if i == 2 else NKV)
        if i == 2:
            a = node("MultiHeadAttention", [q, k, v], f"a{i}", "com.microsoft", num_heads=NH, unidirectional=1)
        else:
            extra = dict(do_rotary=1, local_window_size=3) if i == 1 else {}
            rot = ["cos", "sin"] if i == 1 else []
            a = node("GroupQueryAttention", [q, k, v, "", "", "seqlens_k", "total", *rot],
                     [f"a{i}", f"pk{i}", f"pv{i}"], "com.microsoft", num_heads=NH, kv_num_heads=NKV, **extra)[0]
        o = node("MatMul", [a, w(f"wo{i}", NH * D, H)], f"o{i}")
        x2, _, _, h = node("SkipSimplifiedLayerNormalization", [o, h, w(f"ln{i}b", H)],
                           [f"x{i}b", "", "", f"h{i}b"], "com.microsoft", epsilon=1e-6)
        g = node("MatMul", [x2, w(f"wg{i}", H, FF)], f"g{i}")
        act = node("Mul", [g, node("Sigmoid", [g], f"sg{i}")], f"act{i}")
        up = node("MatMul", [x2, w(f"wu{i}", H, FF)], f"u{i}")
        down = node("MatMul", [node("Mul", [act, up], f"m{i}"), w(f"wd{i}", FF, H)], f"d{i}")
        h = node("Add", [h, down], f"h{i + 1}")
        x = node("SimplifiedLayerNormalization", [h, w(f"ln{i + 1}", H)], f"x{i + 1}n", axis=-1, epsilon=1e-6)
    node("MatMul", [x, w("head", H, V)], "logits")
    io = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"])
          for n in ("input_ids", "attention_mask", "position_ids")]
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", V])
    onnx.save(_graph(nodes, io, [out], inits, opset=20, domains=["com.microsoft"]), str(path))
    return path


def test_contrib_ops_agree_with_onnxruntime(tmp_path):
    path = contrib_decoder(tmp_path / "contrib.onnx")
    g, _ = capture_onnx(path)
    assert [(n.attrs["window"], n.inputs[1].type.shape[1]) for n in g.nodes if n.op == "attention"] == \
        [(0, NKV), (3, NKV), (0, NH)]
    torch.manual_seed(2)
    ids = torch.randint(0, V, (2, 9))
    (out,) = Interpreter(g).run(input_ids=ids, position_ids=torch.arange(9).expand(2, 9))
    assert (out - ort_run(path, ids)).abs().max() <= 1e-4
    art = llmc.compile(path, None, verify=True)
    assert art.graph.op_counts()["rope_kv_write"] == 3
    assert check_onnxruntime(path, art.graph, lengths=(6, 11)).max_abs_diff <= 1e-4


# ---------------------------------------------------------------------------------------------
# the lifting pass: IR before ▸ after

BEFORE = """
graph attn(%q: f32[B,4,S,8], %k: f32[B,2,S,8], %v: f32[B,2,S,8]) {
  dims B[1..8], S[1..64]
  %u: f32[B,2,1,S,8] = unsqueeze(%k) {dim=2}
  %e: f32[B,2,2,S,8] = expand(%u) {shape=["B", 2, 2, "S", 8]}
  %kr: f32[B,4,S,8] = reshape(%e) {shape=["B", 4, "S", 8]}
  %uv: f32[B,2,1,S,8] = unsqueeze(%v) {dim=2}
  %ev: f32[B,2,2,S,8] = expand(%uv) {shape=["B", 2, 2, "S", 8]}
  %vr: f32[B,4,S,8] = reshape(%ev) {shape=["B", 4, "S", 8]}
  %kt: f32[B,4,8,S] = transpose(%kr) {dim0=2, dim1=3}
  %s: f32[B,4,S,S] = matmul(%q, %kt)
  %c: f32[] = constant() {value=0.5, dtype="f32"}
  %ss: f32[B,4,S,S] = mul(%s, %c)
  %m: f32[S,S] = causal_mask() {shape=["S", "S"], window=3, dtype="f32"}
  %sm: f32[B,4,S,S] = add(%ss, %m)
  %p: f32[B,4,S,S] = softmax(%sm) {dim=3}
  %o: f32[B,4,S,8] = matmul(%p, %vr)
  return %o
}
"""

AFTER = """graph attn(%q: f32[B,4,S,8], %k: f32[B,2,S,8], %v: f32[B,2,S,8]) {
  dims B[1..8], S[1..64]
  %0: f32[B,4,S,8] = attention(%q, %k, %v) {scale=0.5, causal=true, window=3}
  return %0
}
"""


def test_lift_onnx_attention_before_after():
    from llmc.passes.lift_onnx_attention import LiftOnnxAttention
    g = parse_graph(BEFORE)
    torch.manual_seed(0)
    inputs = {v.name: torch.randn(2, *v.type.shape[1:2], 11, 8) for v in g.inputs}
    ref = run_graph(g, inputs)
    out = PassManager([LiftOnnxAttention()], verify=True).run(g)
    assert str(out).strip() == AFTER.strip()
    torch.testing.assert_close(run_graph(out, inputs)[0], ref[0], rtol=1e-5, atol=1e-5)


def test_a_bf16_export_computes_what_its_hf_directory_does(model_root, tmp_path):
    """The same bf16 model compiled from its ONNX export and from its HF directory: the graphs differ only
    where the export itself rounds (the attention scale stored as a bf16 constant, eps as fp32) and in the
    order of the ops inside an elementwise region, and with the scale and eps set to the HF graph's values the
    logits are bit-identical."""
    from transformers import AutoModelForCausalLM

    from llmc.runtime.executor import StepBatch, StepInput, make_executor
    src = make_model_dir(model_root, "llama")
    m = AutoModelForCausalLM.from_pretrained(str(src), attn_implementation="eager").to(torch.bfloat16).eval()
    fp32_rotary_frequencies(m)
    ids = torch.randint(0, VOCAB, (1, 7))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        S = torch.export.Dim("sequence")
        torch.onnx.export(Logits(m, ("input_ids", "position_ids")), (ids, torch.arange(7)[None]),
                          str(tmp_path / "model.onnx"), dynamo=True, opset_version=20, external_data=True,
                          input_names=["input_ids", "position_ids"], output_names=["logits"],
                          dynamic_shapes=(({1: S}, {1: S}),))
    hf = llmc.compile(src, tmp_path / "hf.llmc", dtype="bfloat16").graph
    ox = llmc.compile(tmp_path / "model.onnx", tmp_path / "onnx.llmc", dtype="bfloat16",
                      tokenizer=src).graph

    def by_op(g):  # the computing nodes of each op, in graph order (the two orders interleave ops differently)
        ops: dict[str, list] = {}
        for n in g.nodes:
            if n.op not in ("reshape", "unsqueeze", "transpose", "slice"):
                ops.setdefault(n.op, []).append(n)
        return ops
    a_ops, b_ops = by_op(hf), by_op(ox)
    assert {k: len(v) for k, v in a_ops.items()} == {k: len(v) for k, v in b_ops.items()}
    for op in a_ops:
        for a, b in zip(a_ops[op], b_ops[op]):
            if op == "attend_paged":
                assert b.attrs["scale"] == float(torch.tensor(a.attrs["scale"], dtype=torch.bfloat16))
                b.attrs["scale"] = a.attrs["scale"]
            elif "eps" in a.attrs:
                assert b.attrs["eps"] == float(torch.tensor(a.attrs["eps"], dtype=torch.float32))
                b.attrs["eps"] = a.attrs["eps"]
            elif op == "fused":  # one region each; the export orders cos's cast before sin, HF after it
                ops = lambda n: sorted((e[1], str(e[3])) for e in n.attrs["body"])  # noqa: E731
                assert ops(a) == ops(b) and len(a.outputs) == len(b.outputs), op
            else:
                assert a.attrs == b.attrs, op
    prompt = torch.randint(0, VOCAB, (20,)).tolist()
    logits = [make_executor(g, "reference", num_blocks=8, block_size=8)
              .execute(StepBatch([StepInput(prompt, 0, [0, 1, 2], 20)])).logits for g in (hf, ox)]
    assert torch.equal(*logits)



def test_a_custom_domain_op_takes_a_plugins_rule_and_local_functions_are_named(onnx_root, model_root, tmp_path):
    """An op of a custom domain: without a rule the error says to register one with --plugin; with a rule
    registered outside llmc (as a --plugin file does) it is taken, and the artifact computes what the
    unchanged export does. A model's own local function: the error says to inline it."""
    import onnx
    from onnx import TensorProto, helper

    from llmc.frontend.onnx_ops import ONNX_OPS, onnx_op
    path = onnx_root / "mistral-legacy" / "model.onnx"
    if not path.exists():
        export(make_model_dir(model_root, "mistral"), path.parent.mkdir() or path, **VARIANTS["mistral-legacy"][1])
    m = onnx.load(str(path))
    node = next(n for n in m.graph.node if n.op_type == "Softmax")
    node.op_type, node.domain = "TestOnlySoftmax", "custom.ops"
    m.opset_import.append(helper.make_opsetid("custom.ops", 1))
    onnx.save(m, str(tmp_path / "custom.onnx"))
    with pytest.raises(CompileError, match=r"custom\.ops\.TestOnlySoftmax.*--plugin FILE\.py"):
        llmc.compile(tmp_path / "custom.onnx", tmp_path / "c.llmc")
    onnx_op("TestOnlySoftmax")(ONNX_OPS["Softmax"])  # what a plugin file does
    art = llmc.compile(tmp_path / "custom.onnx", tmp_path / "c.llmc")
    assert check_onnxruntime(path, art.graph, lengths=(5,)).max_abs_diff <= 1e-4

    x = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    y = helper.make_tensor_value_info("logits", TensorProto.INT64, ["batch", "sequence", 1])
    fn = helper.make_function("local.fns", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
                              [helper.make_opsetid("", 20)])
    g = helper.make_graph([helper.make_node("Twice", ["input_ids"], ["t"], domain="local.fns"),
                           helper.make_node("Unsqueeze", ["t", "ax"], ["logits"])], "g", [x], [y],
                          [helper.make_tensor("ax", TensorProto.INT64, [1], [2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("local.fns", 1)],
                              functions=[fn])
    onnx.save(model, str(tmp_path / "fn.onnx"))
    with pytest.raises(CompileError, match="a function the model defines itself.*inline_local_functions"):
        llmc.compile(tmp_path / "fn.onnx", tmp_path / "f.llmc")


def test_an_fp16_export_compiles_in_fp16_and_says_so(model_root, tmp_path):
    """Without --dtype an ONNX file compiles in the precision it was exported in and the artifact records
    that one (it said float32 while computing in fp16); another --dtype is an error naming the right one."""
    from transformers import AutoModelForCausalLM
    src = make_model_dir(model_root, "llama")
    m = AutoModelForCausalLM.from_pretrained(str(src), attn_implementation="eager").to(torch.float16).eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        S = torch.export.Dim("sequence")
        torch.onnx.export(Logits(m, ("input_ids", "position_ids")), (torch.randint(0, VOCAB, (1, 7)),
                          torch.arange(7)[None]), str(tmp_path / "model.onnx"), dynamo=True, opset_version=20,
                          external_data=True, input_names=["input_ids", "position_ids"], output_names=["logits"],
                          dynamic_shapes=(({1: S}, {1: S}),))
    art = llmc.compile(tmp_path / "model.onnx", tmp_path / "a.llmc", tokenizer=src)
    assert llmc.load(art.path).manifest["options"]["dtype"] == "float16"
    assert set(art.summary()["param_bytes_by_dtype"]) <= {"f16", "f32"}
    with pytest.raises(llmc.errors.CompileError, match="exported in float16.*--dtype float16"):
        llmc.compile(tmp_path / "model.onnx", tmp_path / "b.llmc", tokenizer=src, dtype="float32")
    assert not (tmp_path / "b.llmc").exists()


def test_a_learned_position_embedding_is_no_mask_and_a_bias_mask_is_refused(tmp_path):
    """A table looked up by position_ids and added to the token embeddings (GPT-2's learned positions) is a
    runtime operand, not an attention mask (it was refused as "a mask that adds biases"); a bias added to the
    scores (ALiBi-like: relative positions) still is refused as one."""
    import onnx
    from onnx import TensorProto, helper
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    pos = helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "sequence"])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", 8])
    emb = helper.make_tensor("emb", TensorProto.FLOAT, [10, 8], np.ones(80, dtype=np.float32).tolist())
    wpe = helper.make_tensor("wpe", TensorProto.FLOAT, [64, 8], np.ones(512, dtype=np.float32).tolist())
    learned = [helper.make_node("Gather", ["emb", "input_ids"], ["x"]),
               helper.make_node("Gather", ["wpe", "position_ids"], ["pe"]),
               helper.make_node("Add", ["x", "pe"], ["logits"])]
    onnx.save(_graph(learned, [ids, pos], [logits], [emb, wpe]), str(tmp_path / "learned.onnx"))
    with pytest.raises(llmc.errors.CompileError) as e:
        llmc.compile(tmp_path / "learned.onnx", tmp_path / "a.llmc")
    assert "no attention" in str(e.value) and "biases" not in str(e.value), e.value
    scores = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", "sequence"])
    one, two = (helper.make_tensor(n, TensorProto.INT64, [1], [v]) for n, v in (("one", 1), ("two", 2)))
    alibi = [helper.make_node("Gather", ["emb", "input_ids"], ["x"]),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["x", "xt"], ["s"]),
             helper.make_node("Unsqueeze", ["position_ids", "two"], ["pi"]),
             helper.make_node("Unsqueeze", ["position_ids", "one"], ["pj"]),
             helper.make_node("Sub", ["pj", "pi"], ["rel"]),
             helper.make_node("Cast", ["rel"], ["bias"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["s", "bias"], ["logits"])]
    onnx.save(_graph(alibi, [ids, pos], [scores], [emb, one, two]), str(tmp_path / "alibi.onnx"))
    with pytest.raises(llmc.errors.CompileError, match="adds biases"):
        llmc.compile(tmp_path / "alibi.onnx", tmp_path / "b.llmc")
