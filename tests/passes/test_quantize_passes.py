"""Phase 2 (quantization) on a tiny Llama: plans, calibration, each method's pass, folding of input
scales, fusion of quantized linears, the artifact round trip, the CLI, and bad input."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import llmc
from llmc.errors import CompileError
from llmc.runtime.llm import LLM, SamplingParams

CALIB = {"calib_samples": 32, "calib_len": 64}


def _compile(src, out, quant, **kw):
    return llmc.compile(src, out, quant=quant, verify=True, **kw)


def _prompt_logprobs(art, text):
    out = LLM(art, backend="reference").generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor(out.prompt_logprobs[1:])


TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


@pytest.fixture(scope="module")
def dense(llama_dir, tmp_path_factory):
    return _compile(llama_dir, tmp_path_factory.mktemp("q") / "dense.llmc", None)


def test_rtn_int8_fuses_round_trips_and_stays_close(llama_dir, dense, tmp_path):
    art = _compile(llama_dir, tmp_path / "rtn8.llmc", {"method": "rtn", "wbits": 8})
    ops = art.summary()["op_counts"]
    # per layer: q/k/v fused, o, gate/up fused, down; the LM head stays dense
    assert ops["qlinear"] == 2 * 4 and ops.get("linear", 0) == 1
    plan = art.graph.meta["quant_plan"]
    assert plan["method"] == "rtn" and plan["linears"]["lm_head"]["format"] is None
    assert all(e["format"] == {"kind": "int", "bits": 8, "group_size": 0, "has_zeros": False}
               for n, e in plan["linears"].items() if n != "lm_head")
    again = llmc.load(art.path)
    assert again.graph.meta["quant_plan"] == plan
    lp, lp2, ref = _prompt_logprobs(art, TEXT), _prompt_logprobs(again, TEXT), _prompt_logprobs(dense, TEXT)
    assert torch.equal(lp, lp2)
    assert (lp - ref).abs().mean() < 0.1


def test_gptq_output_error_below_rtn(llama_dir, dense, tmp_path):
    ref = _prompt_logprobs(dense, TEXT)
    err = {}
    for m in ("rtn", "gptq"):
        art = _compile(llama_dir, tmp_path / f"{m}.llmc", {"method": m, "wbits": 4, "group_size": 32, **CALIB})
        err[m] = (_prompt_logprobs(art, TEXT) - ref).abs().mean().item()
        assert art.graph.meta["quant_plan"]["linears"]["model.layers.0.mlp.down_proj"]["format"]["group_size"] == 32
    assert err["gptq"] < err["rtn"]


def _first(g, op):
    return next(n for n in g.nodes if n.op == op)


def test_input_scales_fold_exactly(llama_dir, tmp_path):
    """x / s folded into the producer of x (a norm's weight, up_proj's rows) with W * s in its readers
    computes the same function (on the graph as phase 2 sees it: before fusion)."""
    from llmc.passes.quantize.materialize import fold_input_scale, head_tie
    from llmc.runtime.executor import ReferenceExecutor, StepInput
    from llmc.runtime.kv_cache import KVCache
    g = llmc.compile(llama_dir, tmp_path / "unfused.llmc", fuse=False).graph
    ids = list(range(3, 40))

    def logits():
        ex = ReferenceExecutor(g, KVCache(g, torch.device("cpu"), block_size=16, num_blocks=4))
        return ex.plan.run(ex.build_inputs([StepInput(ids, 0, [0, 1, 2])]))[0]
    before = logits()
    torch.manual_seed(0)
    folded = []
    for n in list(g.nodes):
        if n.op not in ("linear",) or n.inputs[0].producer is None:
            continue
        x = n.inputs[0]
        readers = [u for u in g.users()[x] if u.op == "linear"]
        s = torch.rand(x.type.shape[-1]) * 3 + 0.5
        tie = head_tie(g, x)
        s = tie(s) if tie is not None else s  # o_proj's input: one scale per KV head and dim
        if x.producer.op in ("rms_norm", "silu_mul", "mul", "reshape") and fold_input_scale(g, x, readers, s):
            for r in readers:
                g.weights[r.inputs[1].name] = g.weights[r.inputs[1].name] * s
            folded.append(x.producer.op)
    assert "rms_norm" in folded and "reshape" in folded and ({"silu_mul", "mul"} & set(folded))
    torch.testing.assert_close(logits(), before, rtol=1e-4, atol=1e-4)


# bounds on the mean |logprob error| against the dense model (this random model gives 0.63 at RTN int4
# g32 and 0.055 at RTN int8); awq's bound is RTN's own error at the same format
@pytest.mark.parametrize("quant,bound", [({"method": "awq", "wbits": 4, "group_size": 32, **CALIB}, "rtn"),
                                         ({"method": "smoothquant", **CALIB}, 0.15), ({"method": "fp8"}, 0.4),
                                         ({"method": "mixed", "bits_budget": 6.0, **CALIB}, 1.0)])
def test_methods_compile_and_run(llama_dir, dense, tmp_path, quant, bound):
    art = _compile(llama_dir, tmp_path / "q.llmc", quant)
    plan = art.graph.meta["quant_plan"]
    lp, ref = _prompt_logprobs(art, TEXT), _prompt_logprobs(dense, TEXT)
    if bound == "rtn":
        rtn = _compile(llama_dir, tmp_path / "rtn.llmc", {**quant, "method": "rtn"})
        bound = (_prompt_logprobs(rtn, TEXT) - ref).abs().mean()
    assert torch.isfinite(lp).all() and (lp - ref).abs().mean() < bound
    if quant["method"] == "mixed":
        assert plan["avg_bits"] <= 6.0 and any("errors" in e for e in plan["linears"].values())
    if quant["method"] in ("awq", "smoothquant"):
        assert plan["calibration"]["windows"] == 32
        # the input scales went into the norms: they differ from the dense model's
        norm = "rms_norm_quant" if quant["method"] == "smoothquant" else "rms_norm"  # w8a8: codes made by the norm
        name = _first(art.graph, norm).inputs[1].name
        assert not torch.equal(art.graph.weights[name], dense.graph.weights[name])


def test_the_token_budget_times_each_linear_on_inputs_of_its_in_features(llama_dir, tmp_path):
    """The compile's token budget (compiler._budget_linears) calls every linear but the LM head on x of its
    logical in-features: an int4 weight packs two codes a byte, so its codes have half as many columns."""
    from llmc.codegen.autotune import Tuner
    from llmc.compiler import _budget_linears
    bf16 = llmc.compile(llama_dir, tmp_path / "bf16.llmc", dtype="bfloat16")  # fp32 linears are not timed
    int4 = llmc.compile(llama_dir, tmp_path / "rtn4.llmc", dtype="bfloat16",
                        quant={"method": "rtn", "wbits": 4, "group_size": 32})
    for art in (bf16, int4):
        seen = []
        for key, count, K, dtype, run in _budget_linears(art.graph, Tuner(), "cpu"):
            y = run(torch.randn(3, K).to(dtype))
            assert y.shape[0] == 3 and f"x{K}:" in key
            seen.append((key, count))
        # q/k/v fused, o, gate/up fused, down: four shapes, each in every layer (two); never the LM head
        assert len(seen) == 4 and all(c == 2 for _, c in seen), seen
    assert all(k.startswith("qgemm_ms:") for k, _ in seen)


def test_mixed_chooses_under_the_budget():
    from llmc.passes.quantize.mixed import choose
    groups = [{"params": 100, "bits": [4, 8, 16], "error": [10.0, 1.0, 0.0]},
              {"params": 100, "bits": [4, 8, 16], "error": [1.0, 0.5, 0.0]}]
    assert choose(groups, 4.0) == [0, 0]
    assert choose(groups, 6.0) == [1, 0]  # the sensitive group first
    assert choose(groups, 10.0) == [2, 0] or choose(groups, 10.0) == [1, 1]
    assert choose(groups, 16.0) == [2, 2]


def test_group_size_that_does_not_divide_falls_back_per_channel(llama_dir, tmp_path):
    art = _compile(llama_dir, tmp_path / "g.llmc", {"method": "rtn", "group_size": 48})  # 64 and 96 inputs
    e = art.graph.meta["quant_plan"]["linears"]["model.layers.0.self_attn.q_proj"]
    assert e["format"]["group_size"] == 0 and "per channel" in e["note"]
    assert art.graph.meta["quant_plan"]["linears"]["model.layers.0.mlp.down_proj"]["format"]["group_size"] == 48


def test_bad_quant_options_fail_before_writing(llama_dir, tmp_path):
    out = tmp_path / "x.llmc"
    with pytest.raises(CompileError, match="no such file"):
        llmc.compile(llama_dir, out, quant={"method": "gptq", "calib": str(tmp_path / "missing.txt")})
    with pytest.raises(CompileError, match="--wbits"):
        llmc.compile(llama_dir, out, quant={"method": "rtn", "wbits": 3})
    with pytest.raises(CompileError, match="--quant"):
        llmc.compile(llama_dir, out, quant="int3")
    # the kernels take at least 16 input columns per scale (a group of 8 compiled, then failed on them)
    with pytest.raises(CompileError, match="positive multiple of 16"):
        llmc.compile(llama_dir, out, quant={"method": "rtn", "group_size": 8})
    for bad, needle in (({"group_size": 64.0}, "group_size takes an int, not float"),
                        ({"wbits": "4"}, "wbits takes an int, not str"),
                        ({"bits_budget": "5"}, "bits_budget takes a number"),
                        ({"skip": [3]}, "skip takes module names")):
        with pytest.raises(TypeError, match=needle):
            llmc.compile(llama_dir, out, quant={"method": "rtn", **bad})
    assert not out.exists()
    from llmc.passes.quantize.config import QuantConfig
    assert QuantConfig.coerce({"method": "rtn", "skip": "o_proj"}).skip == ("o_proj",)  # one name, not letters
    assert QuantConfig(skip="o_proj").skip == ("o_proj",)


def test_fp8_on_a_gpu_without_fp8_is_a_clear_error(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.raises(CompileError, match="A100 has no FP8"):
        llmc.compile(llama_dir, tmp_path / "f.llmc", quant="fp8")
    assert not (tmp_path / "f.llmc").exists()


def test_cli_compile_quant_and_inspect_plan(llama_dir, tmp_path):
    from llmc.cli import main
    out = tmp_path / "c.llmc"
    r = CliRunner().invoke(main, ["compile", str(llama_dir), "-o", str(out), "--quant", "rtn", "--group-size", "32"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["inspect", str(out), "--plan"])
    assert r.exit_code == 0 and "w4a16-g32" in r.output and "model.layers.1.mlp.down_proj" in r.output
    r = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    s = json.loads(r.output)
    assert s["op_counts"]["qlinear"] == 8 and s["quant_plan"]["method"] == "rtn"
    assert s["quant_plan"]["linears"]["model.layers.1.mlp.down_proj"]["format"]["group_size"] == 32
    r = CliRunner().invoke(main, ["compile", str(llama_dir), "-o", str(tmp_path / "d.llmc"), "--quant", "gptq",
                                  "--calib", str(tmp_path / "nope.txt")])
    assert r.exit_code != 0 and "no such file" in r.output and "Traceback" not in r.output


def test_a_budget_below_int4_and_more_windows_than_the_text_are_noted(llama_dir, tmp_path):
    """--bits-budget 4 cannot be met (int4 g128 costs its scales too): the cheapest plan is used and said so;
    --calib-samples past what the text holds side by side are cut to that, and said so."""
    art = llmc.compile(llama_dir, tmp_path / "m.llmc", quant={"method": "mixed", "bits_budget": 4.0,
                                                             "calib_samples": 100_000, "calib_len": 64})
    notes = "\n".join(art.compile_log.log)
    assert "below the cheapest plan's" in notes and "are used" in notes, notes
    assert art.graph.meta["quant_plan"]["avg_bits"] > 4.0


def test_mixed_offers_int8_where_int4_cannot_take_a_layer(model_root, tmp_path):
    """int4 needs an even number of input features: a down projection over 95 is planned at int8 (mixed then
    weighs int8 against the model dtype for it), and a budget that int4 elsewhere cannot reach is said."""
    from transformers import LlamaConfig

    from tests.conftest import _common, save_random_model
    odd = save_random_model(model_root / "llama-odd-mlp", LlamaConfig(**_common(intermediate_size=95,
                                                                                tie_word_embeddings=False),
                                                                       architectures=["LlamaForCausalLM"]))
    art = llmc.compile(odd, tmp_path / "m.llmc", verify=True,
                       quant={"method": "mixed", "bits_budget": 4.5, "calib_samples": 8, "calib_len": 64})
    plan = art.graph.meta["quant_plan"]
    down = plan["linears"]["model.layers.0.mlp.down_proj"]
    assert down["format"]["bits"] == 8 and "int4" not in down["errors"], down  # no int4 candidate for it
    assert plan["linears"]["model.layers.0.mlp.gate_proj"]["format"]["bits"] == 4
    floor = plan["avg_bits"]
    assert floor > 4.5 and "below the cheapest plan's" in "\n".join(art.compile_log.log)
    roomy = llmc.compile(odd, tmp_path / "r.llmc", quant={"method": "mixed", "bits_budget": 12.0, "calib_samples": 8,
                                                            "calib_len": 64})
    assert floor < roomy.graph.meta["quant_plan"]["avg_bits"] <= 12.0


def test_calibration_windows_fit_the_models_positions(llama_dir, tmp_path):
    """The default 256-token windows on a model of 128 positions are cut to 128 (positions it never runs at
    would skew the statistics), and said."""
    art = llmc.compile(llama_dir, tmp_path / "g.llmc", quant={"method": "gptq", "calib_samples": 4})
    assert art.graph.meta["quant_plan"]["calibration"]["tokens"] == 4 * 128
    assert "longer than the model's 128 positions" in "\n".join(art.compile_log.log)
