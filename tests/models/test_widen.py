"""Tests of ``scripts/widen_model.py``: a function-preserving widening of a Llama HF model.

``builtin:tiny-py`` (hidden 384, 8 layers, 6 q / 2 kv heads of dim 64, intermediate 1024) is
widened to hidden 768, 10 layers, 8 q / 4 kv heads of dim 128, intermediate 2048: every step of the
construction (zero-padded residual with rescaled norms and eps, head_dim x2 with RoPE dims
respaced and q rescaled, a GQA group size 3 -> 2 that needs each source KV head copied into two
target KV heads, MLP padding, 2 appended zero-output layers) is exercised. fp32 on CPU, ~15 s.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from llmc.models import builtin_dir

REPO = Path(__file__).resolve().parents[2]
SRC = builtin_dir("tiny-py", must_exist=False)
pytestmark = pytest.mark.skipif(not (SRC / "model.safetensors").is_file(),
                                reason="tiny-py weights not present")

SHAPE = dict(hidden=768, layers=10, heads=8, kv_heads=4, intermediate=2048, head_dim=128)
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n",
    "for i in range(10):\n    print(",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__,",
]


def _load_script():
    spec = importlib.util.spec_from_file_location("widen_model", REPO / "scripts" / "widen_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while it executes
    spec.loader.exec_module(module)
    return module


wm = _load_script()


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoTokenizer

    out = wm.widen(SRC, tmp_path_factory.mktemp("wide"), **SHAPE)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    return _load(SRC), _load(out), tok, out


def test_config_and_files(models):
    _, wide, _, out = models
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (
        768, 10, 8, 4, 128, 2048)
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5 * 384 / 768)
    assert cfg["vocab_size"] == 8192 and cfg["tie_word_embeddings"] is True
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / f).read_bytes() == (SRC / f).read_bytes()
    n_wide = sum(p.numel() for p in wide.parameters())
    assert n_wide > 4 * 15_000_000  # really larger: every matrix is wider


def test_logits_match_and_padding_stays_zero(models):
    src, wide, tok, _ = models
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            a = src(ids).logits
            o = wide(ids, output_hidden_states=True)
            rel = ((a - o.logits).abs().max() / a.abs().max()).item()
            assert rel < 1e-4, (prompt, rel)
            # the residual stream's padded dims are exactly zero after every layer
            for hs in o.hidden_states:
                assert hs[..., 384:].abs().max().item() == 0.0


def test_greedy_tokens_identical(models):
    src, wide, tok, _ = models
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            a = src.generate(ids, **kw)
            b = wide.generate(ids, **kw)
        assert a.shape[1] == ids.shape[1] + 32
        assert torch.equal(a, b), (prompt, tok.decode(a[0]), tok.decode(b[0]))


def test_cli_sharded_default_head_dim(tmp_path):
    """CLI path with head_dim = hidden // heads, group size 3 -> 3 and several shards."""
    out = tmp_path / "cli"
    rc = wm.main([str(SRC), str(out), "--hidden", "768", "--layers", "9", "--heads", "6",
                  "--kv-heads", "2", "--intermediate", "1536", "--shard-gb", "0.05"])
    assert rc == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    info = json.loads((out / "widen_info.json").read_text())
    assert info["target_shape"]["head_dim"] == 128
    assert info["q_head_map"] == [0, 1, 2, 3, 4, 5] and info["kv_head_map"] == [[0], [1]]
    src, wide = _load(SRC), _load(out)
    ids = torch.tensor([[0, 17, 345, 999, 4000, 12, 8191, 77]])
    with torch.no_grad():
        a, b = src(ids).logits, wide(ids).logits
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-4


def test_8b_head_mapping():
    p = wm.make_plan(384, 8, 6, 2, 64, 1024, 4096, 32, 32, 8, 128, 14336)
    assert p.q_map == [0, 1, 2, 4, 5, 6] and p.kv_map == [[0], [1]]
    idx = p.dim_index()
    assert idx[:4].tolist() == [0, 2, 4, 6] and idx[32:34].tolist() == [64, 66]
    # each source dim keeps its RoPE inverse frequency
    f_src = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    f_dst = 1.0 / (10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
    assert torch.equal(f_dst[idx[:32]], f_src)  # dim j (< D/2) rotates at inv_freq[j]


@pytest.mark.parametrize("kw, match", [
    (dict(head_dim=96), "not an integer multiple"),
    (dict(hidden=256, head_dim=64), "smaller"),
    (dict(layers=4), "smaller"),
    (dict(heads=4, head_dim=192), "smaller"),
    (dict(intermediate=512), "smaller"),
    (dict(heads=6, kv_heads=3), "not enough target KV heads"),
    (dict(heads=8, kv_heads=3), "not divisible"),
])
def test_bad_shapes_raise(tmp_path, kw, match):
    args = {**SHAPE, **kw}
    with pytest.raises(ValueError, match=match):
        wm.widen(SRC, tmp_path / "bad", **args)
    assert not (tmp_path / "bad").exists()
