"""The public pass API: patterns, the rewrite driver, pattern-by-example, the manager and pipeline."""
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from llmc.errors import CompileError
from llmc.ir.interpreter import run_graph
from llmc.ir.printer import parse_graph
from llmc.passes import (P, Pass, PassContext, PassManager, PassResult, RewriteRule, apply_rewrites,
                         parse_pass_spec, pipeline)
from llmc.passes.by_example import ReplaceByExample, rule_from_example

G = """graph t(%x: f32[T,8], %y: bf16[T,8]) {
  dims T[1..64]
  param %w: f32[8]
  %a: f32[T,8] = mul(%x, %w)
  %b: f32[T,8] = add(%a, %x)
  %c: f32[T,8] = silu(%b)
  %d: bf16[T,8] = silu(%y)
  return %c, %d
}
"""


def values(g):
    return g.values()


def test_op_patterns_capture_and_constrain():
    g = parse_graph(G)
    v = values(g)
    x = P.any("x")
    pat = P.op("add")(P.op("mul")(x, P.param("w")), x)
    m = pat(v["b"])
    assert m is not None and m["x"] is v["x"] and m["w"] is v["w"]
    assert [n.op for n in m.nodes] == ["mul", "add"]
    assert pat(v["c"]) is None
    # the same capture name must bind the same value
    assert P.op("add")(P.op("mul")(x, P.any("w")), P.any("w"))(v["b"]) is None
    # commutative ops match either operand order
    assert P.op("add")(x, P.op("mul").any_args())(v["b"]) is not None
    # alternatives, dtype and attribute/predicate constraints
    silu = P.op("silu")(P.any("s"))
    assert silu.dtype("bf16")(v["d"]) is not None and silu.dtype("bf16")(v["c"]) is None
    assert (P.op("exp")(P.any()) | silu)(v["c"]) is not None
    assert P.op("silu")(P.any().check(lambda t: t.type.dtype == "f32"))(v["c"]) is not None


def test_rewrite_driver_counts_and_guards_loops():
    g = parse_graph(G)
    rule = RewriteRule("silu_to_sigmoid_mul", P.op("silu")(P.any("s")),
                       lambda b, m: b.call("mul", m["s"], b.call("sigmoid", m["s"])))
    xin = {"x": torch.randn(3, 8), "y": torch.randn(3, 8).bfloat16()}
    g.weights["w"] = torch.randn(8)
    ref = run_graph(g, xin)
    stats = apply_rewrites(g, [rule])
    assert stats == {"silu_to_sigmoid_mul": 2}
    assert "silu" not in g.op_counts()
    for a, b in zip(run_graph(g, xin), ref):
        torch.testing.assert_close(a, b)
    # a rule whose result matches itself again never settles: the driver stops it and says so
    loop = RewriteRule("loop", P.op("sigmoid")(P.any("s")), lambda b, m: b.call("sigmoid", b.call("neg", b.call("neg", m["s"]))))
    with pytest.raises(CompileError, match="did not settle"):
        apply_rewrites(g, [loop], max_iterations=5)


def gelu_tanh(x, w):
    return torch.nn.functional.gelu(torch.nn.functional.linear(x, w), approximate="tanh")


def gelu_exact(x, w):
    return torch.nn.functional.gelu(torch.nn.functional.linear(x, w))


def test_pattern_by_example_binds_symbolic_dims():
    g = parse_graph("""graph t(%x: f32[T,8]) {
  dims T[1..64]
  param %w: f32[16,8]
  %l: f32[T,16] = linear(%x, %w)
  %g: f32[T,16] = gelu(%l) {approximate="tanh"}
  %r: f32[T,4,4] = reshape(%g) {shape=["T", 4, -1]}
  return %r
}
""")
    g.weights["w"] = torch.randn(16, 8)
    rule = rule_from_example(gelu_tanh, gelu_exact, (torch.randn(3, 8), torch.randn(6, 8)))
    assert apply_rewrites(g, [rule]) == {"gelu_tanh->gelu_exact": 1}
    assert 'approximate="none"' in str(g)
    x = torch.randn(5, 8)
    torch.testing.assert_close(run_graph(g, {"x": x})[0], gelu_exact(x, g.weights["w"]).reshape(5, 4, 4))

    def scale_then_view(x):
        return (x * 2.0).reshape(x.shape[0], -1, 4)

    def view_then_scale(x):
        return x.reshape(x.shape[0], -1, 4) * 2.0

    h = parse_graph("""graph u(%x: f32[T,16]) {
  dims T[1..64]
  %c: f32[] = constant() {value=2.0, dtype="f32"}
  %m: f32[T,16] = mul(%x, %c)
  %r: f32[T,4,4] = reshape(%m) {shape=["T", -1, 4]}
  return %r
}
""")
    rule = rule_from_example(scale_then_view, view_then_scale, (torch.randn(3, 8),))
    assert sum(apply_rewrites(h, [rule]).values()) == 1
    assert [n.op for n in h.nodes] == ["reshape", "constant", "mul"]
    assert 'shape=["T", -1, 4]' in str(h)  # the example's sizes (3, 8) did not leak into the graph


def test_replace_by_example_pass_and_rank_check():
    g = parse_graph("""graph t(%x: f32[B,T,8]) {
  dims B[1..4], T[1..64]
  param %w: f32[16,8]
  %l: f32[B,T,16] = linear(%x, %w)
  %g: f32[B,T,16] = gelu(%l) {approximate="tanh"}
  return %g
}
""")
    g.weights["w"] = torch.randn(16, 8)
    p = ReplaceByExample(pattern=gelu_tanh, replacement=gelu_exact, example_inputs=(torch.randn(3, 8), torch.randn(6, 8)))
    res = p.run(g, PassContext())
    assert not res.changed  # traced at rank 2, the pattern does not claim a rank-3 input


@dataclass
class Broken(Pass):
    name: ClassVar[str] = "broken"
    mode: str = "raise"

    def run(self, graph, ctx):
        if self.mode == "raise":
            rule = RewriteRule("boom", P.op("silu")(P.any("s")), lambda b, m: 1 / 0)
            apply_rewrites(graph, [rule])
        graph.nodes[0].inputs = graph.nodes[0].inputs[:1]  # leaves mul with one operand
        return PassResult(graph, True)


def test_errors_in_a_users_pass_name_the_pass_and_show_ir():
    g = parse_graph(G)
    with pytest.raises(CompileError) as e:
        PassManager([Broken("raise")], verify=True).run(g)
    msg = str(e.value)
    assert "pass 'broken' raised ZeroDivisionError" in msg and "test_pattern.py" in msg
    assert ">> %c: f32[T,8] = silu(%b)" in msg
    g = parse_graph(G)
    with pytest.raises(CompileError) as e:
        PassManager([Broken("invalid")], verify=True).run(g)
    assert "pass 'broken' left the graph invalid" in str(e.value) and ">> %a" in str(e.value)


def test_pipeline_insertion_and_specs(tmp_path):
    names = [p.name for p in pipeline([parse_pass_spec("dead_code")], after="lift_patterns")]
    assert names[:4] == ["dead_code", "fold_constants", "lift_patterns", "dead_code"]
    assert [p.name for p in pipeline([Broken()], before="paged_kv")].index("broken") == \
        [p.name for p in pipeline()].index("paged_kv")
    p = parse_pass_spec("fuse_elementwise{max_ops=3}")
    assert p.max_ops == 3
    with pytest.raises(CompileError, match="no option"):
        parse_pass_spec("fuse_elementwise{size=3}")
    for bad in ("max_ops=abc", "max_ops=2.5", "max_ops=true"):  # an option takes its default's kind of value
        with pytest.raises(CompileError, match="max_ops takes int values"):
            parse_pass_spec(f"fuse_elementwise{{{bad}}}")
    with pytest.raises(CompileError, match="unknown pass"):
        parse_pass_spec("nonesuch")
    with pytest.raises(CompileError, match="no pass named"):
        pipeline([Broken()], before="nonesuch")


def test_dump_ir_writes_every_pass(llama_dir, tmp_path):
    from click.testing import CliRunner
    from llmc.cli import main
    res = CliRunner().invoke(main, ["compile", str(llama_dir), "-o", str(tmp_path / "a.llmc"),
                                    "--dump-ir", str(tmp_path / "ir")])
    assert res.exit_code == 0, res.output
    files = sorted(f.name for f in (tmp_path / "ir").iterdir())
    assert files[0] == "00-input.ir" and any("paged_kv" in f for f in files) and any("fuse_rope" in f for f in files)
    assert "rope(" in (tmp_path / "ir" / [f for f in files if "lift_patterns" in f][0]).read_text()
