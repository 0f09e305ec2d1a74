"""The generated-kernel backend end to end on the CPU (Triton's interpreter): the same greedy tokens
as the reference interpreter, and every hot op lowered to a generated kernel."""
import json
import os

import pytest
from click.testing import CliRunner

from llmc.cli import main

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="TRITON_INTERPRET=1 must be set before triton is imported "
                                       "(tests/codegen/conftest.py does it when this folder is collected first)")


def run_json(art, backend, prompt="def add(a, b):", n=12, *extra):
    res = CliRunner().invoke(main, ["run", str(art), "--prompt", prompt, "--max-tokens", str(n), "--json",
                                    "--backend", backend, "--num-blocks", "32", "--block-size", "4", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_triton_interpret_backend_matches_reference(llama_artifact):
    ref = run_json(llama_artifact.path, "reference")
    got = run_json(llama_artifact.path, "triton-interpret")
    assert got["token_ids"] == ref["token_ids"] and len(ref["token_ids"]) == 12


def test_int8_cache_kernels_match_reference(llama_artifact):
    """The int8 cache written and read by the kernels (block size 4: blocks start inside the prompt's
    prefill and during decode) gives the golden model's tokens."""
    ref = run_json(llama_artifact.path, "reference", "def add(a, b):", 12, "--kv-cache-dtype", "int8")
    got = run_json(llama_artifact.path, "triton-interpret", "def add(a, b):", 12, "--kv-cache-dtype", "int8")
    assert got["token_ids"] == ref["token_ids"] and len(ref["token_ids"]) == 12


def test_prefill_graph_padding_with_generated_kernels(llama_artifact):
    from tests.conftest import prefill_graph_matches_eager
    prefill_graph_matches_eager(llama_artifact, "triton-interpret")


def test_hot_ops_lower_to_generated_kernels(llama_artifact):
    from llmc.codegen.lower import Plan, kernels_per_layer
    plan = Plan(llama_artifact.graph, "cpu", triton_matmul=True)
    kinds = {k["op"]: k["kernel"] for k in plan.kernels()}
    assert kinds["add_rms_norm"] == "triton:rms_norm+residual"
    assert kinds["rope_kv_write"] == "triton:rope_kv_write"
    assert kinds["attend_paged"] == "triton:paged_attention"
    assert kinds["linear_silu_mul"] == "triton:matmul" and "silu_mul" not in kinds  # the SwiGLU epilogue
    assert kinds["linear"] == "triton:matmul"
    assert kernels_per_layer(plan)["layers"] == 2


def test_inspect_kernels_lists_specs_and_sources(llama_artifact):
    res = CliRunner().invoke(main, ["inspect", str(llama_artifact.path), "--kernels"])
    assert res.exit_code == 0, res.output
    assert "triton:rope_kv_write" in res.output and "rope_kv_write(head_dim=16, num_q_heads=4" in res.output
    assert "paged_attention_decode(" in res.output and "rms_norm(hidden=64" in res.output
    files = sorted(p.name for p in (llama_artifact.path / "kernels").iterdir())
    assert any(f.startswith("paged_attention_prefill_") for f in files)
    src = (llama_artifact.path / "kernels" / next(f for f in files if f.startswith("rms_norm_"))).read_text()
    assert "@triton.jit" in src


def test_kernel_listing_follows_tuning(llama_artifact):
    """With tuning records, `inspect --kernels` says which token buckets run the generated matmul."""
    from llmc.codegen.autotune import Tuner
    from llmc.codegen.lower import Plan
    from llmc.codegen.matmul import MatmulSpec
    g = llama_artifact.graph
    lin = next(n for n in g.nodes if n.op == "linear")
    w = lin.inputs[1].type
    key = MatmulSpec(w.dtype, len(lin.inputs) > 2, ()).key(int(w.shape[0]), int(w.shape[1]))
    rec = lambda cublas: {"config": {}, "triton_ms": 1.0, "cublas_ms": 2.0, "prefer_cublas": cublas}  # noqa: E731
    tuner = Tuner({key: {"1": rec(False), "2": rec(False), "4": rec(True)}}, None)
    rows = {r["node"]: r for r in Plan(g, "meta", tuner).kernels()}
    row = rows["%" + lin.outputs[0].name]
    assert row["kernel"] == "triton:matmul|cublas" and "triton for M<=2, cublas above" in row["spec"]
    assert rows["%" + lin.outputs[0].name] and Plan(g, "meta").kernels()[g.nodes.index(lin)]["kernel"] == "cublas"


@pytest.fixture(scope="module")
def stable_bf16(model_root, tmp_path_factory):
    """A random Llama whose greedy tokens bf16 rounding does not change, compiled in bf16, with its
    prompts and HF eager bf16's greedy continuations of them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import llmc
    from tests.conftest import CODE_PROMPTS, hf_greedy, make_stable_llama
    d = make_stable_llama(model_root)
    tok = AutoTokenizer.from_pretrained(str(d))
    ids = [tok.encode(p, add_special_tokens=False) for p in CODE_PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16, attn_implementation="eager").eval()
    art = llmc.compile(d, tmp_path_factory.mktemp("stable") / "stable-bf16.llmc", dtype="bfloat16")
    return art, ids, [hf_greedy(hf, p, 64) for p in ids]


def greedy(art, backend, ids, n):
    from llmc.runtime.llm import LLM, SamplingParams
    llm = LLM(art, backend=backend, num_blocks=128)
    return [o.token_ids for o in llm.generate(ids, SamplingParams(temperature=0, max_tokens=n))]


def test_bf16_reference_gives_hf_bf16_tokens(stable_bf16):
    """The golden model in bf16: HF eager bf16's greedy tokens, 8 prompts x 64 (eos stops both)."""
    art, ids, want = stable_bf16
    assert sum(map(len, want)) >= 400  # long continuations: a real comparison
    assert greedy(art, "reference", ids, 64) == want


def test_bf16_generated_kernels_give_hf_bf16_tokens(stable_bf16):
    """The generated kernels in bf16 under the interpreter (which needs their dots widened to fp32):
    HF eager bf16's greedy tokens, 2 prompts x 12, through prefill and decode."""
    art, ids, want = stable_bf16
    assert greedy(art, "triton-interpret", ids[:2], 12) == [w[:12] for w in want[:2]]


def test_plan_launches_attention_as_tuning_json_chose(llama_artifact, monkeypatch):
    """Records under the attention shape's keys (buckets "decode" and "prefill") reach the kernel's launch; with
    none, the kernel keeps its defaults; LLMC_PREFILL_TILES=0 keeps the prefill default."""
    import torch

    import llmc.codegen.attention as attention
    from llmc.codegen.autotune import Tuner
    from llmc.codegen.lower import Plan, _tname, attention_types
    g = llama_artifact.graph
    n = next(n for n in g.nodes if n.op in ("attend_paged", "paged_attention"))
    q, cache = attention_types(n)
    keys = {mode: attention.attention_tiles_key(int(q.shape[3]), int(q.shape[1]), int(cache.shape[3]), _tname(q.dtype),
                                                _tname(cache.dtype), bool(n.attrs["window"]), mode)
            for mode in ("decode", "prefill")}
    cfg = {"decode": {"BLOCK_N": 64, "num_stages": 3, "num_warps": 8},
           "prefill": {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2, "num_warps": 8}}
    records = {keys[m]: {m: {"config": cfg[m], "triton_ms": 1.0, "cublas_ms": None, "prefer_cublas": False}}
               for m in keys}
    assert Plan(g, "meta", Tuner(records, None))._attention_tiles(n) == (cfg["decode"], cfg["prefill"])
    assert Plan(g, "meta", Tuner({}, None))._attention_tiles(n) == (None, None)
    assert Plan(g, "meta")._attention_tiles(n) == (None, None)
    monkeypatch.setenv("LLMC_PREFILL_TILES", "0")
    assert Plan(g, "meta", Tuner(records, None))._attention_tiles(n) == (cfg["decode"], None)
    monkeypatch.delenv("LLMC_PREFILL_TILES")
    seen = []
    monkeypatch.setattr(attention, "paged_attention", lambda *a, **kw: seen.append(
        (kw["decode_tiles"], kw["prefill_tiles"])) or torch.zeros(a[0].shape))
    plan = Plan(g, "cpu", Tuner(records, None))
    step = next(s for s in plan.steps if s.node is n)
    T, H, D = 1, int(q.shape[1]), int(q.shape[3])
    x = [torch.zeros(1, H, T, D)] + [torch.zeros(1)] * 8
    step.fn(x, {"max_seqlen_q": 1, "max_seqlen_k": 64})
    assert seen == [(cfg["decode"], cfg["prefill"])]
