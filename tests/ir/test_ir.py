"""IR: types, printer/parser round trip, JSON, verifier, interpreter, networkx view."""
import pytest
import torch

from llmc.errors import IRError
from llmc.ir.graph import Graph
from llmc.ir.interpreter import run_graph
from llmc.ir.printer import parse_graph, parse_type
from llmc.ir.serialize import graph_from_dict, graph_to_dict
from llmc.ir.types import TensorType, dim_div, dim_mul, make_dim
from llmc.ir.verify import verify


def small_graph() -> Graph:
    g = Graph("small")
    g.add_dim("B", 1, 8)
    g.add_dim("S", 1, None)
    x = g.add_input("x", TensorType(("B", "S", 8), "f32"))
    w = g.add_param("w", torch.randn(16, 8))
    y = g.call("linear", x, w)
    z = g.call("reshape", y, shape=["B", "S", -1, 4])
    e = g.call("constant", value=1e-6)
    g.outputs = [g.call("add", z, e)]
    return g


def test_symbolic_dims_canonicalise():
    assert make_dim("S*B") == make_dim("B*S")
    assert dim_div(dim_mul(make_dim("B"), make_dim("S"), 64), 64) == make_dim("B*S")
    assert dim_mul(2, 3) == 6
    with pytest.raises(IRError):
        dim_div(7, 2)


def test_text_round_trip_and_types():
    g = small_graph()
    text = str(g)
    assert "%1: f32[B,S,4,4] = reshape(%0) {shape=[\"B\", \"S\", -1, 4]}" in text
    assert str(parse_graph(text)) == text
    assert parse_type("bf16[T,4096]<w8>") == TensorType(("T", 4096), "bf16", "w8")


def test_parser_reports_the_bad_line():
    text = str(small_graph()).replace("= linear(%x, %w)", "= linear(%x, %nope)")
    with pytest.raises(IRError, match="undefined value '%nope'"):
        parse_graph(text)


def test_attr_strings_may_hold_delimiters():
    from llmc.ir.ops import register_op
    register_op("test_tag", "unary", ("x",), lambda ts, a: ts[0], lambda x, a, env: x[0], {"tag": ""})
    g = Graph("s")
    x = g.add_input("x", TensorType((2,), "f32"))
    g.outputs = [g.call("test_tag", x, tag="a, b=c} %x = add(")]
    text = str(g)
    g2 = parse_graph(text)
    assert g2.nodes[0].attrs["tag"] == "a, b=c} %x = add("
    assert str(g2) == text


def test_json_round_trip():
    g = small_graph()
    g2 = graph_from_dict(graph_to_dict(g))
    assert str(g2) == str(g)


def test_verifier_catches_a_wrong_type():
    g = small_graph()
    verify(g, check_weights=True)
    g.nodes[0].outputs[0].type = TensorType(("B", "S", 15), "f32")
    with pytest.raises(IRError, match="typed f32\\[B,S,15\\] but linear gives f32\\[B,S,16\\]"):
        verify(g)


def test_type_inference_rejects_bad_shapes():
    g = Graph("bad")
    x = g.add_input("x", TensorType((3, 8), "f32"))
    w = g.add_param("w", torch.randn(4, 7))
    with pytest.raises(IRError, match="does not match weight"):
        g.call("linear", x, w)


def test_interpreter_binds_dims_and_checks_ranges():
    g = small_graph()
    x = torch.randn(2, 3, 8)
    (out,) = run_graph(g, {"x": x})
    ref = (torch.nn.functional.linear(x, g.weights["w"]).reshape(2, 3, 4, 4) + 1e-6)
    torch.testing.assert_close(out, ref)
    with pytest.raises(IRError, match="outside its range"):
        run_graph(g, {"x": torch.randn(9, 3, 8)})


def test_networkx_view():
    g = small_graph()
    G = g.nx()
    import networkx as nx
    assert nx.is_directed_acyclic_graph(G)
    assert G.number_of_edges() == 5


def test_promotion_matches_torch():
    g = Graph("p")
    x = g.add_input("x", TensorType((4,), "bf16"))
    c = g.call("constant", value=2.0)
    y = g.call("mul", x, c)
    assert y.type.dtype == "bf16"  # a 0-d f32 constant does not promote a bf16 tensor, as in torch
    i = g.add_input("i", TensorType((4,), "i64"))
    assert g.call("mul", i, c).type.dtype == "f32"


def test_dim_substitution_is_per_expression_and_mapping():
    """`dim_subs` (memoised per expression and mapping) substitutes base symbols; the same expression under
    another mapping gives that mapping's result, and dims that name none of the symbols stay as they are."""
    from llmc.ir.types import SymDim, dim_subs, make_dim
    bs = make_dim("B*S")
    assert dim_subs(bs, {"B": 1, "S": "T"}) == SymDim("T")
    assert dim_subs(bs, {"B": 2, "S": "T"}) == make_dim("2*T")
    assert dim_subs(bs, {"B": 3, "S": 5}) == 15
    assert dim_subs(make_dim("4*S + 1"), {"S": "T"}) == make_dim("4*T + 1")
    assert dim_subs(make_dim("N"), {"B": 1}) == SymDim("N") and dim_subs(7, {"B": 1}) == 7
