"""Frontend: a model whose layers are alike is exported with two layers and grown in the IR; the graph
equals the whole model's export (ops, attributes, weights, logits), and models whose layers differ are
exported whole."""
import pytest
import torch

import llmc.frontend.hf as hf
from llmc.frontend.hf import capture_hf
from llmc.frontend.repeat import NotRepeatable, layer_of, repeat_layers
from llmc.ir.interpreter import run_graph
from tests.conftest import _common, save_random_model
from tests.frontend.test_moe import make_moe_config

LAYERS = 4


def config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    if kind == "llama-tied":
        return LlamaConfig(**_common(num_hidden_layers=LAYERS, tie_word_embeddings=True),
                           architectures=["LlamaForCausalLM"])
    if kind == "qwen2":  # biases, every layer full attention
        return Qwen2Config(**_common(num_hidden_layers=LAYERS, tie_word_embeddings=True),
                           architectures=["Qwen2ForCausalLM"])
    if kind == "qwen2-mixed-windows":  # sliding attention from layer 2 on: the layers differ
        return Qwen2Config(**_common(num_hidden_layers=LAYERS, use_sliding_window=True, sliding_window=6,
                                     max_window_layers=2), architectures=["Qwen2ForCausalLM"])
    if kind == "mistral":
        return MistralConfig(**_common(num_hidden_layers=LAYERS, sliding_window=5, head_dim=24),
                             architectures=["MistralForCausalLM"])
    small = make_moe_config(kind.removesuffix("-dense-layer")).to_dict()
    small.pop("layer_types", None)
    small["num_hidden_layers"] = LAYERS
    if "mlp_only_layers" in small:  # one dense layer among sparse ones: the layers differ
        small["mlp_only_layers"] = [2] if kind == "qwen2_moe-dense-layer" else []
    return type(make_moe_config(kind.removesuffix("-dense-layer")))(**small)


ALIKE = ["llama-tied", "qwen2", "mistral", "mixtral", "qwen3_moe", "qwen2_moe"]
UNLIKE = ["qwen2-mixed-windows", "qwen2_moe-dense-layer"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("repeat")
    return {k: save_random_model(root / k, config(k)) for k in ALIKE + UNLIKE}


def captured_both(path, monkeypatch):
    calls = []
    real = hf.repeat_layers
    monkeypatch.setattr(hf, "repeat_layers", lambda *a: calls.append(a[1]) or real(*a))
    whole = capture_hf(path, repeat=False)
    assert not calls
    grown = capture_hf(path)
    return whole, grown, calls


def assert_same_graph(a, b):
    assert [(n.op, n.attrs, [v.type for v in n.outputs]) for n in a.nodes] == \
        [(n.op, n.attrs, [v.type for v in n.outputs]) for n in b.nodes]
    assert [p.name for p in a.params] == [p.name for p in b.params]
    assert all(torch.equal(a.weights[p.name], b.weights[p.name]) for p in a.params)
    # operands in the same places: each node's inputs by (producer position, output index) or param name
    def wiring(g):
        where = {id(v): (i, j) for i, n in enumerate(g.nodes) for j, v in enumerate(n.outputs)}
        return [[where.get(id(v), v.name if v is not None else None) for v in n.inputs] for n in g.nodes]
    assert wiring(a) == wiring(b)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (2, 11))
    pos = torch.arange(11).expand(2, 11).contiguous()
    (la,) = run_graph(a, {"input_ids": ids, "position_ids": pos})
    (lb,) = run_graph(b, {"input_ids": ids, "position_ids": pos})
    assert torch.equal(la, lb)


@pytest.mark.parametrize("kind", ALIKE)
def test_alike_layers_are_exported_twice_and_grown(kind, model_dirs, monkeypatch):
    whole, grown, calls = captured_both(model_dirs[kind], monkeypatch)
    assert calls == ["model.layers"]
    assert_same_graph(whole, grown)
    assert {n.meta.get("layer") for n in grown.nodes} == {None, *range(LAYERS)}


@pytest.mark.parametrize("kind", UNLIKE)
def test_layers_that_differ_are_exported_whole(kind, model_dirs, monkeypatch):
    whole, grown, calls = captured_both(model_dirs[kind], monkeypatch)
    assert not calls
    assert_same_graph(whole, grown)


def test_a_layer_that_does_not_repeat_leaves_the_graph_alone(model_dirs):
    from llmc.frontend.repeat import first_layers, uniform_layers
    from llmc.frontend.torch_export import capture
    model = hf.load_model(model_dirs["llama-tied"])
    prefix, layers = uniform_layers(model)
    ids = torch.randint(0, 300, (2, 7))
    pos = torch.arange(7).expand(2, 7).contiguous()
    with first_layers(model, layers):
        g = capture(hf._Forward(model), (ids, pos), ["input_ids", "position_ids"])
    assert len(model.model.layers) == LAYERS and model.config.num_hidden_layers == LAYERS
    before = [(n.op, n.attrs) for n in g.nodes], [p.name for p in g.params]
    node = next(n for n in g.nodes if n.meta.get("layer") == 1 and n.op == "attention")
    node.attrs = {**node.attrs, "window": 3}
    tensors = dict(model.named_parameters(remove_duplicate=False))
    with pytest.raises(NotRepeatable, match="attention"):
        repeat_layers(g, prefix, LAYERS, tensors)
    node.attrs = dict(before[0][g.nodes.index(node)][1])
    del tensors["model.layers.3.mlp.down_proj.weight"]
    with pytest.raises(NotRepeatable, match="layers.3.mlp.down_proj"):
        repeat_layers(g, prefix, LAYERS, tensors)
    assert ([(n.op, n.attrs) for n in g.nodes], [p.name for p in g.params]) == before


def test_layer_of_reads_the_module_stack():
    stack = {"a": ("m.model", object), "b": ("m.model.layers.12", object), "c": ("m.model.layers.12.mlp", object)}
    assert layer_of(stack) == 12
    assert layer_of({"a": ("m.model.rotary_emb", object)}) is None
    assert layer_of(None) is None
