"""Frontend: GPTQ and AWQ checkpoints import exactly as qlinear nodes and run as their dequantized model.

The checkpoints are written here from known integer codes, zero points and scales, packed by this
file's own packers in each library's documented layout; the dense weights they stand for are
computed from the same codes, and a Hugging Face model holding those weights is the oracle.
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

import llmc
from llmc.errors import CompileError
from llmc.frontend.hf import capture_hf
from llmc.frontend.prequantized import Scheme, gptq_linear, read_prequantized
from llmc.ir.interpreter import Interpreter
from tests.conftest import paged_prefill_last_logits

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its eight
LAYERS = 3  # more than the two layers capture exports: the third is copied in the IR (frontend/repeat.py)
# linears that read the same input share GPTQ's activation order (it sorts by that input's Hessian)
INPUT_OF = {"self_attn.q_proj": "attn", "self_attn.k_proj": "attn", "self_attn.v_proj": "attn",
            "self_attn.o_proj": "o", "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp", "mlp.down_proj": "down"}
CASES = {
    "gptq-v1-g32": dict(quant_method="gptq", bits=4, group_size=32, desc_act=False, sym=False),
    "gptq-v1-actorder-sym": dict(quant_method="gptq", bits=4, group_size=32, desc_act=True, sym=True,
                                 checkpoint_format="gptq"),
    "gptq-v2-w8-channel": dict(quant_method="gptq", bits=8, group_size=-1, desc_act=False, sym=False,
                               checkpoint_format="gptq_v2"),
    "awq-g32": dict(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm"),
}
# biases follow the zero points among a qlinear's operands: one case with zeros, one without
BIASES = {"awq-g32": dict(attention_bias=True), "gptq-v1-actorder-sym": dict(mlp_bias=True)}


def config(case: str):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False,
                       bos_token_id=0, eos_token_id=0, architectures=["LlamaForCausalLM"], **BIASES.get(case, {}))


def int32_words(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits as the int32 tensors a checkpoint stores (two's complement)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> int32 [R*bits/32, C]: word r holds rows r*per..r*per+per-1, the first lowest."""
    per = 32 // bits
    words = torch.zeros(codes.shape[0] // per, codes.shape[1], dtype=torch.int64)
    for j in range(per):
        words |= codes[j::per].long() << (bits * j)
    return int32_words(words)


def pack_cols(codes: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[R, C] codes -> int32 [R, C*bits/32]: bits j*bits.. of word c hold column c*per + order[j]."""
    per = 32 // bits
    order = order or range(per)
    words = torch.zeros(codes.shape[0], codes.shape[1] // per, dtype=torch.int64)
    for j in range(per):
        words |= codes[:, order[j]::per].long() << (bits * j)
    return int32_words(words)


def quantized_linear(qc: dict, n: int, k: int, gen: torch.Generator, order: torch.Tensor | None):
    """Random codes, zeros and scales of one [N, K] linear: (checkpoint tensors, dense fp32 weight)."""
    bits = qc["bits"]
    g = k if qc["group_size"] == -1 else qc["group_size"]
    v1 = qc["quant_method"] == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq"
    q = torch.randint(0, 1 << bits, (k, n), generator=gen)
    if qc.get("sym"):
        z = torch.full((k // g, n), 1 << (bits - 1))
    elif v1:  # real zero points 1..2^bits: classic GPTQ stores each minus one
        z = torch.randint(1, (1 << bits) + 1, (k // g, n), generator=gen)
    else:
        z = torch.randint(0, 1 << bits, (k // g, n), generator=gen)
    s = ((torch.rand(k // g, n, generator=gen) + 0.5) * (0.2 / (1 << (bits - 1)))).half()
    group = torch.arange(k) // g
    if order is not None:  # column order[j] is the j-th quantized: its group is j // g
        group = torch.empty_like(group)
        group[order] = torch.arange(k) // g
    dense = ((q - z[group]).float() * s.float()[group]).t().contiguous()
    if qc["quant_method"] == "awq":
        return {"qweight": pack_cols(q, 4, AWQ_ORDER), "qzeros": pack_cols(z, 4, AWQ_ORDER), "scales": s}, dense
    return {"qweight": pack_rows(q, bits), "qzeros": pack_cols(z - int(v1), bits), "scales": s,
            "g_idx": group.int()}, dense


def write_checkpoint(root, case: str):
    """A tiny Llama in `case`'s format, and the dense state dict its quantized weights stand for."""
    from transformers import LlamaForCausalLM
    qc = CASES[case]
    torch.manual_seed(0)
    sd = LlamaForCausalLM(config(case)).state_dict()
    for k in sd:
        if k.endswith(".bias"):  # initialised to zero: a dropped bias would go unseen
            sd[k] = torch.randn(sd[k].shape) * 0.1
    gen = torch.Generator().manual_seed(1)
    stored = {}
    for layer in range(LAYERS):
        orders = {}
        for lin, inp in INPUT_OF.items():
            name = f"model.layers.{layer}.{lin}"
            n, k = sd[f"{name}.weight"].shape
            order = orders.setdefault(inp, torch.randperm(k, generator=gen)) if qc.get("desc_act") else None
            tensors, sd[f"{name}.weight"] = quantized_linear(qc, n, k, gen, order)
            stored.update({f"{name}.{p}": t for p, t in tensors.items()})
    stored.update({k: v.half() for k, v in sd.items() if not k.endswith("proj.weight")})
    out = root / case
    out.mkdir()
    save_file(stored, str(out / "model.safetensors"))
    cfg = config(case).to_dict()
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    # the oracle's other weights are the stored fp16 ones too
    return out, {k: v if k.endswith("proj.weight") else v.half().float() for k, v in sd.items()}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    path, dense = write_checkpoint(tmp_path_factory.mktemp("prequantized"), request.param)
    return request.param, path, dense


@pytest.fixture(scope="module")
def captured(checkpoint):
    return capture_hf(checkpoint[1])


@pytest.fixture(scope="module")
def oracle(checkpoint):
    from transformers import LlamaForCausalLM
    case, _, dense = checkpoint
    m = LlamaForCausalLM(config(case)).eval()
    m.load_state_dict(dense)
    return m


def test_readers_dequantize_to_the_codes_exactly(checkpoint):
    case, path, dense = checkpoint
    qc = CASES[case]
    ckpt = read_prequantized(path, qc)
    assert sorted(ckpt.linears) == sorted(f"model.layers.{i}.{lin}" for i in range(LAYERS) for lin in INPUT_OF)
    assert not any(k.endswith(("qweight", "qzeros", "scales", "g_idx")) for k in ckpt.tensors)
    for name, lin in ckpt.linears.items():
        want = dense[f"{name}.weight"]
        fmt = lin.weight.fmt
        assert (fmt.kind, fmt.bits, fmt.group_size) == ("int", qc["bits"], max(qc["group_size"], 0))
        assert fmt.has_zeros == (not qc.get("sym")) and lin.weight.scales.dtype == torch.float16
        assert (lin.act_order is not None) == bool(qc.get("desc_act"))
        stored_order = want if lin.act_order is None else want[:, lin.act_order]
        assert torch.equal(lin.weight.dequantize(), stored_order)
        assert torch.equal(lin.dense(), want)


def test_capture_gives_qlinears_over_the_imported_tensors(checkpoint, captured):
    case, path, _ = checkpoint
    g = captured
    ops = g.op_counts()
    assert ops["qlinear"] == 7 * LAYERS and ops["linear"] == 1  # the dense lm_head stays a linear
    # one gather per distinct (input, order): q/k/v share one, gate/up another
    assert ops.get("gather", 0) == (4 * LAYERS if CASES[case].get("desc_act") else 0)
    assert not any(p.name.endswith("proj.weight") for p in g.params)
    ckpt = read_prequantized(path, CASES[case])
    node = next(n for n in g.nodes if n.op == "qlinear" and n.inputs[1].name == "model.layers.1.mlp.up_proj.qweight")
    w = ckpt.linears["model.layers.1.mlp.up_proj"].weight
    assert node.attrs == {**w.fmt.attrs(64), "act": ""}
    for v, t in zip(node.inputs[1:], w.tensors()):
        assert torch.equal(g.weights[v.name], t)


def test_captured_graph_matches_the_dequantized_model(captured, oracle):
    g = captured
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (2, 9))
    (out,) = Interpreter(g).run(input_ids=ids, position_ids=torch.arange(9).expand(2, 9))
    with torch.no_grad():
        ref = oracle(input_ids=ids).logits
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def test_compiled_paged_graph_matches_the_dequantized_model(checkpoint, oracle):
    _, path, _ = checkpoint
    g = llmc.compile(path, None, verify=True).graph
    assert "qlinear" in g.op_counts()
    a, b = torch.randint(0, 128, (9,)), torch.randint(0, 128, (4,))
    out = paged_prefill_last_logits(g, a, b)
    with torch.no_grad():
        ref = torch.stack([oracle(input_ids=a[None]).logits[0, -1], oracle(input_ids=b[None]).logits[0, -1]])
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("source"), "awq-g32")[0]


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization method 'bitsandbytes' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quantization method 'fp8' is not supported"),
    ({"quant_method": "compressed-tensors"}, "quantization method 'compressed-tensors' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ with 3 bits is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "GPTQ checkpoint format 'marlin' is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "AWQ with 8 bits is not supported"),
])
def test_unsupported_formats_name_what_is_supported(awq_dir, tmp_path, qc, message):
    cfg = json.loads((awq_dir / "config.json").read_text())
    cfg["quantization_config"] = qc
    bad = tmp_path / "bad"
    shutil.copytree(awq_dir, bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CompileError) as e:
        llmc.compile(bad, None)
    msg = str(e.value)
    assert message in msg and "llmc imports GPTQ (bits 4 or 8" in msg and "\n" not in msg


def test_classic_gptq_zero_point_256_is_refused():
    scheme = Scheme("gptq", 8, -1, zeros_minus_one=True)
    zeros = pack_cols(torch.full((1, 8), 255), 8)  # stored 255: a real zero point of 256
    with pytest.raises(CompileError, match="zero point 256 does not fit"):
        gptq_linear(scheme, pack_rows(torch.zeros(8, 8, dtype=torch.long), 8), zeros, torch.ones(1, 8).half(),
                    None, name="lin")


def test_a_group_smaller_than_the_kernels_take_is_refused(awq_dir, tmp_path):
    """Groups of 8 input columns: the reference backend would run them, the kernels not (they take 16 columns per
    scale at least), so the import refuses them up front."""
    cfg = json.loads((awq_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 8}
    bad = tmp_path / "bad"
    shutil.copytree(awq_dir, bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CompileError, match="GPTQ group_size 8 is not supported.*multiple of 16"):
        llmc.compile(bad, None)


def test_quantizing_a_quantized_checkpoint_again_is_refused(awq_dir, tmp_path):
    """--quant on a checkpoint that is quantized already would quantize nothing it holds (it compiled, with a plan
    of the dense LM head alone): refused, nothing written."""
    with pytest.raises(CompileError, match="holds quantized weights already.*without --quant"):
        llmc.compile(awq_dir, tmp_path / "q.llmc", quant="rtn")
    assert not (tmp_path / "q.llmc").exists()


def test_inspect_shows_an_imported_checkpoints_quantization(awq_dir, tmp_path):
    """`llmc inspect --plan` on an imported checkpoint: its linears' formats read back from the graph, under
    "imported", fused projections by their module, and no embedding table among the linears."""
    from click.testing import CliRunner

    from llmc.cli import main
    llmc.compile(awq_dir, tmp_path / "a.llmc")
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "a.llmc"), "--plan"])
    assert r.exit_code == 0, r.output
    assert "quantization  imported" in r.output and "w4a16-g32-zp" in r.output, r.output
    assert "self_attn.fused " in r.output and "embed_tokens" not in r.output, r.output
