"""Frontend and end to end: Mixtral, Qwen2-MoE and Qwen3-MoE capture with one `moe` op per layer and
generate Hugging Face's greedy tokens (reference backend; one decode on the generated kernels)."""
import json
import shutil
from pathlib import Path

import pytest
import torch

import llmc
from llmc.errors import CompileError
from llmc.runtime.llm import LLM, SamplingParams
from tests.conftest import VOCAB, hf_greedy, hf_model, paged_prefill_last_logits, save_random_model

MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]


def make_moe_config(arch: str):
    """Tiny configs: hidden 64, 2 layers, 4 experts, top-2; each arch's own routing flags."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, bos_token_id=0, eos_token_id=0, pad_token_id=0, num_experts_per_tok=2)
    if arch == "mixtral":  # softmax, top-2, always renormalised; fp32 routing weights
        return MixtralConfig(**common, intermediate_size=48, num_local_experts=4, architectures=["MixtralForCausalLM"])
    if arch == "qwen2_moe":  # a sigmoid-gated shared expert, no renormalisation, a dense (mlp-only) layer
        return Qwen2MoeConfig(**common, intermediate_size=80, moe_intermediate_size=48,
                              shared_expert_intermediate_size=72, num_experts=4, norm_topk_prob=False,
                              mlp_only_layers=[1], tie_word_embeddings=True, architectures=["Qwen2MoeForCausalLM"])
    if arch == "qwen3_moe":  # q/k norms, renormalised top-k
        return Qwen3MoeConfig(**common, intermediate_size=80, moe_intermediate_size=48, num_experts=4,
                              norm_topk_prob=True, head_dim=16, architectures=["Qwen3MoeForCausalLM"])
    raise ValueError(arch)


def make_moe_dir(root: Path, arch: str, seed: int = 0) -> Path:
    return save_random_model(root / arch, make_moe_config(arch), seed)


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_art(request, tmp_path_factory):
    path = make_moe_dir(tmp_path_factory.mktemp("moe"), request.param)
    return path, llmc.compile(path, None, verify=True)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_one_moe_op_per_sparse_layer(moe_art):
    path, art = moe_art
    ops = art.graph.op_counts()
    sparse = 1 if path.name == "qwen2_moe" else 2  # qwen2_moe's layer 1 is an mlp-only layer
    assert ops["moe"] == sparse
    moe = next(n for n in art.graph.nodes if n.op == "moe")
    mlp = "model.layers.0.mlp."
    assert [v.name for v in moe.inputs[1:]] == [mlp + "gate.weight", mlp + "experts.gate_up_proj",
                                               mlp + "experts.down_proj"]
    assert moe.attrs == {"top_k": 2, "norm_topk_prob": path.name != "qwen2_moe",
                         "round_weights": path.name != "mixtral", "expert_start": 0}
    assert moe.inputs[2].type.shape == (4, 96, 64) and moe.inputs[3].type.shape == (4, 64, 48)


def test_paged_logits_match_hf(moe_art):
    path, art = moe_art
    m = hf_model(path)
    torch.manual_seed(1)
    a, b = torch.randint(0, VOCAB, (9,)), torch.randint(0, VOCAB, (4,))
    out = paged_prefill_last_logits(art.graph, a, b)
    with torch.no_grad():
        ra, rb = m(input_ids=a[None]).logits[0, -1], m(input_ids=b[None]).logits[0, -1]
    assert rel_err(out[0], ra) <= 1e-4 and rel_err(out[1], rb) <= 1e-4


def test_greedy_tokens_equal_hf(moe_art):
    path, art = moe_art
    m = hf_model(path)
    prompts = [[5, 17, 99, 3, 250, 41], [7, 7, 120]]
    outs = LLM(art, backend="reference", num_blocks=32, block_size=4).generate(
        prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(m, p, 10)


def test_decode_on_generated_kernels_matches_reference(moe_art):
    """A prefill and two decode steps through the triton-interpret backend: the MoE layers run the
    grouped-GEMM kernels and give the reference backend's tokens."""
    from llmc.codegen.lower import Plan
    from tests.codegen.conftest import library_interpreted
    if not library_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)")
    _, art = moe_art
    kernels = {k["op"]: k["kernel"] for k in Plan(art.graph, "meta").kernels()}
    assert kernels["moe"] == "triton:moe_experts"
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = [[11, 42, 7, 300, 8]]
    want = LLM(art, backend="reference", num_blocks=16, block_size=4).generate(prompt, greedy)[0].token_ids
    got = LLM(art, backend="triton-interpret", num_blocks=16, block_size=4).generate(prompt, greedy)[0].token_ids
    assert got == want


def test_unsupported_moe_variant_is_one_line_compile_error(tmp_path_factory):
    src = make_moe_dir(tmp_path_factory.mktemp("moe_bad"), "qwen2_moe")
    bad = src.parent / "qwen2_moe_gelu"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CompileError) as e:
        llmc.compile(bad, None)
    msg = str(e.value)
    assert "\n" not in msg and "Qwen2MoeForCausalLM" in msg and "hidden_act='gelu'" in msg and "silu" in msg
