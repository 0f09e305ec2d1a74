"""Fusion passes: IR text before ▸ after, and the interpreter gives the same values after as before."""
import pytest
import torch

from llmc.ir.interpreter import run_graph
from llmc.ir.printer import parse_graph
from llmc.passes import PassContext, PassManager
from llmc.passes.fuse_parallel_linears import FuseParallelLinears
from llmc.passes.fuse_add_rmsnorm import FuseAddRmsNorm
from llmc.passes.fuse_elementwise import FuseElementwise
from llmc.passes.fuse_linear_epilogue import FuseLinearEpilogue
from llmc.passes.fuse_linear_prologue import FuseLinearPrologue
QKV = """graph t(%x: f32[T,8]) {
  dims T[1..64]
  param %q.weight: f32[8,8]
  param %k.weight: f32[4,8]
  param %v.weight: f32[4,8]
  %q: f32[T,8] = linear(%x, %q.weight)
  %k: f32[T,4] = linear(%x, %k.weight)
  %v: f32[T,4] = linear(%x, %v.weight)
  %s: f32[T,16] = concat(%q, %k, %v) {dim=1}
  return %s
}
"""
ADDN = """graph t(%a: f32[T,8], %b: f32[T,8]) {
  dims T[1..64]
  param %w: f32[8]
  %h: f32[T,8] = add(%a, %b)
  %n: f32[T,8] = rms_norm(%h, %w) {eps=1e-05, weight_first_cast=true}
  %o: f32[T,8] = mul(%n, %h)
  return %o
}
"""
EW = """graph t(%x: f32[T,8], %y: f32[T,8]) {
  dims T[1..64]
  %c: f32[] = constant() {value=0.5, dtype="f32"}
  %a: f32[T,8] = mul(%x, %c)
  %b: f32[T,8] = silu(%a)
  %d: f32[T,8] = add(%b, %y)
  %e: f32[T,8] = softmax(%d) {dim=-1}
  %f: f32[T,8] = exp(%e)
  %g: f32[T,8] = neg(%f)
  return %g, %b
}
"""
EPI = """graph t(%x: f32[T,8]) {
  dims T[1..64]
  param %w: f32[16,8]
  param %b: f32[16]
  %l: f32[T,16] = linear(%x, %w, %b)
  %s: f32[T,16] = silu(%l)
  return %s
}
"""

QKV_AFTER = """graph t(%x: f32[T,8]) {
  dims T[1..64]
  param %q.fused_weight: f32[16,8]
  %0: f32[T,16] = linear(%x, %q.fused_weight)
  %1: f32[T,8] = slice(%0) {dim=1, start=0, end=8, step=1}
  %2: f32[T,4] = slice(%0) {dim=1, start=8, end=12, step=1}
  %3: f32[T,4] = slice(%0) {dim=1, start=12, end=16, step=1}
  %s: f32[T,16] = concat(%1, %2, %3) {dim=1}
  return %s
}
"""
ADDN_AFTER = """graph t(%a: f32[T,8], %b: f32[T,8]) {
  dims T[1..64]
  param %w: f32[8]
  %0: f32[T,8], %1: f32[T,8] = add_rms_norm(%a, %b, %w) {eps=1e-05, weight_first_cast=true}
  %o: f32[T,8] = mul(%0, %1)
  return %o
}
"""
EW_AFTER = """graph t(%x: f32[T,8], %y: f32[T,8]) {
  dims T[1..64]
  %0: f32[T,8], %1: f32[T,8] = fused(%x, %y) {kind="elementwise", body=[["v0", "constant", [], {"value": 0.5, "dtype": "f32"}], ["v1", "mul", ["in0", "v0"], {}], ["v2", "silu", ["v1"], {}], ["v3", "add", ["v2", "in1"], {}]], outputs=["v2", "v3"]}
  %e: f32[T,8] = softmax(%1) {dim=-1}
  %2: f32[T,8] = fused(%e) {kind="elementwise", body=[["v0", "exp", ["in0"], {}], ["v1", "neg", ["v0"], {}]], outputs=["v1"]}
  return %2, %0
}
"""
EPI_AFTER = """graph t(%x: f32[T,8]) {
  dims T[1..64]
  param %w: f32[16,8]
  param %b: f32[16]
  %0: f32[T,16] = linear_act(%x, %w, %b) {act="silu"}
  return %0
}
"""


PRO = """graph t(%x: f32[T,8]) {
  dims T[1..64]
  param %wgu: f32[12,8]
  param %w: f32[8,6]
  param %b: f32[8]
  %0: f32[T,12] = linear(%x, %wgu)
  %1: f32[T,6] = slice(%0) {dim=1, start=0, end=6, step=1}
  %2: f32[T,6] = slice(%0) {dim=1, start=6, end=12, step=1}
  %3: f32[T,6] = silu_mul(%1, %2)
  %4: f32[T,8] = linear(%3, %w, %b)
  return %4
}
"""
PRO_AFTER = """graph t(%x: f32[T,8]) {
  dims T[1..64]
  param %wgu: f32[12,8]
  param %w: f32[8,6]
  param %b: f32[8]
  %0: f32[T,12] = linear(%x, %wgu)
  %1: f32[T,6] = slice(%0) {dim=1, start=0, end=6, step=1}
  %2: f32[T,6] = slice(%0) {dim=1, start=6, end=12, step=1}
  %5: f32[T,8] = silu_mul_linear(%1, %2, %w, %b)
  return %5
}
"""


GLU = """graph t(%x: f32[T,8]) {
  dims T[1..64]
  param %wgu: f32[12,8]
  param %bgu: f32[12]
  %0: f32[T,12] = linear(%x, %wgu, %bgu)
  %1: f32[T,6] = slice(%0) {dim=1, start=0, end=6, step=1}
  %2: f32[T,6] = slice(%0) {dim=-1, start=6, end=12, step=1}
  %3: f32[T,6] = silu_mul(%1, %2)
  return %3
}
"""
GLU_AFTER = """graph t(%x: f32[T,8]) {
  dims T[1..64]
  param %wgu: f32[12,8]
  param %bgu: f32[12]
  %4: f32[T,6] = linear_silu_mul(%x, %wgu, %bgu)
  return %4
}
"""


CASES = [("qkv", QKV, QKV_AFTER, FuseParallelLinears), ("add_rmsnorm", ADDN, ADDN_AFTER, FuseAddRmsNorm),
         ("elementwise", EW, EW_AFTER, FuseElementwise), ("epilogue", EPI, EPI_AFTER, FuseLinearEpilogue),
         ("prologue", PRO, PRO_AFTER, FuseLinearPrologue), ("swiglu_epilogue", GLU, GLU_AFTER, FuseLinearEpilogue)]


@pytest.mark.parametrize("name,before,after,cls", CASES, ids=[c[0] for c in CASES])
def test_fusion_before_after(name, before, after, cls):
    g = parse_graph(before)
    torch.manual_seed(0)
    for v in g.params:
        g.weights[v.name] = torch.randn(*v.type.shape)
    inputs = {v.name: torch.randn(5, *v.type.shape[1:]) for v in g.inputs}
    ref = run_graph(g, inputs)
    out = PassManager([cls()], verify=True).run(g, PassContext())
    assert str(out) == after
    for a, b in zip(run_graph(out, inputs), ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("old,new,why", [
    ("  return %3", "  %9: f32[T,12] = neg(%0)\n  return %3, %9", "other users"),  # the projection read elsewhere
    ("  return %3", "  return %3, %1", "other users"),  # a half is a graph output
    ("start=6, end=12", "start=5, end=11", None),  # not the two halves: no SwiGLU of a gate/up projection
])
def test_the_swiglu_epilogue_declines(old, new, why):
    """The SwiGLU product moves into the projection's epilogue only where nothing else reads the projection or
    its halves, and only for the projection's two halves."""
    g = parse_graph(GLU.replace(old, new))
    ctx = PassContext()
    out = PassManager([FuseLinearEpilogue()], verify=True).run(g, ctx)
    assert "linear_silu_mul" not in str(out)
    if why:
        assert any(why in r for r in ctx.explain)


def test_a_view_between_two_elementwise_readers_of_one_value_does_not_split_their_region():
    """cos, its cast and its view, then sin of the same angles (an exporter's order): the view moves down to its
    reader, so one kernel makes both."""
    g = parse_graph("""graph t(%x: f32[T,8]) {
  dims T[1..64]
  %a: f32[T,8] = mul(%x, %x)
  %c: f32[T,8] = cos(%a)
  %cv: f32[1,T,8] = unsqueeze(%c) {dim=0}
  %s: f32[T,8] = sin(%a)
  %sv: f32[1,T,8] = unsqueeze(%s) {dim=0}
  %o: f32[1,T,8] = add(%cv, %sv)
  %r: f32[1,T,8] = softmax(%o) {dim=-1}
  return %r
}
""")
    x = torch.randn(5, 8)
    (ref,) = run_graph(g, {"x": x})
    out = PassManager([FuseElementwise()], verify=True).run(g, PassContext())
    fused = [n for n in out.nodes if n.op == "fused"]
    assert len(fused) == 1 and {e[1] for e in fused[0].attrs["body"]} == {"mul", "cos", "sin"}
    torch.testing.assert_close(run_graph(out, {"x": x})[0], ref, rtol=0, atol=0)


def test_elementwise_explains_a_closed_region():
    g = parse_graph(EW)
    ctx = PassContext()
    PassManager([FuseElementwise()], verify=True).run(g, ctx)
    assert not ctx.explain  # the softmax splits the chain but declines nothing that could have joined
    g = parse_graph(EW.replace("%d: f32[T,8] = add(%b, %y)", "%d: f32[T,8] = add(%b, %y)\n  %z: f32[T,8] = softmax(%a) {dim=-1}\n  %d2: f32[T,8] = add(%d, %a)").replace("return %g, %b", "return %g, %b, %z, %d2"))
    ctx = PassContext()
    PassManager([FuseElementwise()], verify=True).run(g, ctx)
    assert any("used before it" in r for r in ctx.explain)


def test_whole_model_fused_equals_unfused(llama_dir):
    import llmc
    from llmc.runtime.llm import LLM, SamplingParams
    fused = llmc.compile(llama_dir, None, verify=True)
    plain = llmc.compile(llama_dir, None, verify=True, fuse=False)
    per_layer = lambda a: {op: n for op, n in a.graph.op_counts().items()}
    assert per_layer(fused)["linear"] == 2 * 3 + 1 and per_layer(plain)["linear"] == 2 * 7 + 1
    assert per_layer(fused)["linear_silu_mul"] == 2 and "silu_mul" not in per_layer(fused)
    assert "rope_kv_write" in per_layer(fused) and "paged_attention" not in per_layer(fused)
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
    a = LLM(fused, num_blocks=32, block_size=4).generate(prompts, p)
    b = LLM(plain, num_blocks=32, block_size=4).generate(prompts, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


ROPE_ATTN = """graph t(%q: f32[1,4,T,8], %k: f32[1,2,T,8], %v: f32[1,2,T,8], %cos: f32[1,1,T,8], %sin: f32[1,1,T,8], %kv_cache.0: f32[2,NB,BS,2,8], %query_start_loc: i32[N + 1], %seq_lens: i32[N], %block_tables: i32[N,M], %slot_mapping: i64[T]) {
  dims T[1..64], N[1..], M[1..], NB[1..], BS[1..]
  %qr: f32[1,4,T,8] = rope(%q, %cos, %sin)
  %kr: f32[1,2,T,8] = rope(%k, %cos, %sin)
  %o: f32[1,4,T,8] = paged_attention(%qr, %kr, %v, %kv_cache.0, %query_start_loc, %seq_lens, %block_tables, %slot_mapping) {scale=0.35, causal=true, window=0}
  return %o
}
"""
ROPE_ATTN_AFTER = """graph t(%q: f32[1,4,T,8], %k: f32[1,2,T,8], %v: f32[1,2,T,8], %cos: f32[1,1,T,8], %sin: f32[1,1,T,8], %kv_cache.0: f32[2,NB,BS,2,8], %query_start_loc: i32[N + 1], %seq_lens: i32[N], %block_tables: i32[N,M], %slot_mapping: i64[T]) {
  dims T[1..64], N[1..], M[1..], NB[1..], BS[1..]
  %0: f32[1,4,T,8] = rope_kv_write(%q, %k, %v, %cos, %sin, %kv_cache.0, %slot_mapping)
  %1: f32[1,4,T,8] = attend_paged(%0, %kv_cache.0, %query_start_loc, %seq_lens, %block_tables) {scale=0.35, causal=true, window=0}
  return %1
}
"""


def test_rope_kv_write_before_after_and_same_cache():
    from llmc.passes.fuse_rope_kv_write import FuseRopeKVWrite
    g = parse_graph(ROPE_ATTN)
    torch.manual_seed(0)
    T = 7  # two sequences: 4 new tokens after 2 cached, and 3 new tokens
    pos = torch.tensor([2, 3, 4, 5, 0, 1, 2])
    ang = pos[:, None].float() * torch.rand(8)[None]
    inputs = {"q": torch.randn(1, 4, T, 8), "k": torch.randn(1, 2, T, 8), "v": torch.randn(1, 2, T, 8),
              "cos": ang.cos()[None, None], "sin": ang.sin()[None, None],
              "query_start_loc": torch.tensor([0, 4, 7], dtype=torch.int32),
              "seq_lens": torch.tensor([6, 3], dtype=torch.int32),
              "block_tables": torch.tensor([[0, 1], [2, 0]], dtype=torch.int32),
              "slot_mapping": torch.tensor([2, 3, 4, 5, 8, 9, 10])}
    cache = torch.randn(2, 3, 4, 2, 8)
    ref_cache = cache.clone()
    (ref,) = run_graph(g, {**inputs, "kv_cache.0": ref_cache})
    out = PassManager([FuseRopeKVWrite()], verify=True).run(g, PassContext())
    assert str(out) == ROPE_ATTN_AFTER
    got_cache = cache.clone()
    (got,) = run_graph(out, {**inputs, "kv_cache.0": got_cache})
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(got_cache, ref_cache)
