"""Tests of the built-in models (``llmc/models``) and of the scripts that build them.

The model tests skip until the trained weights are in the package; the helper and corpus tests
always run. The whole file stays well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llmc.models import BUILTIN_MODELS, builtin_dir, heldout_text_path
from llmc.models import evaluate as ev
from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / ".data"
EOS = "<|endoftext|>"

MISSING = [n for n in BUILTIN_MODELS if not (builtin_dir(n, must_exist=False) / "model.safetensors").is_file()]
needs_models = pytest.mark.skipif(
    bool(MISSING),
    reason=f"built-in model weights not present ({', '.join(MISSING)}); train them with "
    "scripts/train_builtin.py and install with scripts/finish_builtin.sh",
)

SNIPPET = (
    "class Foo(Bar):\n"
    '    """Doc with unicode: é, ü, λ, 😀."""\n'
    "\n"
    "    def method(self, x: int = 0) -> dict[str, int]:\n"
    "\tif x  >=  10:   \n"
    "\t\treturn {'a': x ** 2}\r\n"
    "        return  {}  # trailing spaces  \n\n\n"
)


# --- package helpers -----------------------------------------------------------------------


def test_builtin_dir_resolves_names_inside_the_package():
    for name in BUILTIN_MODELS:
        path = builtin_dir(name, must_exist=False)
        assert path.name == name and path.parent == heldout_text_path().parent.parent


def test_builtin_dir_unknown_name_lists_available():
    with pytest.raises(ValueError) as info:
        builtin_dir("gpt-5")
    assert "gpt-5" in str(info.value)
    for name in BUILTIN_MODELS:
        assert name in str(info.value)
    with pytest.raises(ValueError):
        builtin_dir("data")  # the held-out text folder is not a model


def test_scoring_a_uniform_model_gives_vocab_perplexity():
    """Zero logits mean a uniform distribution: perplexity must be exactly the vocab size, and
    bits per byte must be log2(V) / bytes-per-token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 16
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    torch.nn.init.zeros_(model.lm_head.weight)
    tokens = np.arange(3 * 8 + 5) % vocab
    windows = ev.make_windows(tokens, window=8, max_windows=None)
    assert windows.shape == (3, 9)
    assert torch.equal(windows[1, :], torch.arange(8, 17) % vocab)  # window i starts at i*8
    nll, argmax = ev.score_windows(model, windows, batch_size=2)
    stats = ev.perplexity_stats(nll, windows, np.full(vocab, 2))
    assert math.isclose(stats["perplexity_per_token"], vocab, rel_tol=1e-5)
    assert math.isclose(stats["bits_per_byte"], math.log2(vocab) / 2, rel_tol=1e-5)
    assert ev.agreement_rate(argmax, argmax) == 1.0
    assert ev.agreement_rate(argmax, argmax + 1) == 0.0


# --- corpus and split ------------------------------------------------------------------------


def test_heldout_split_is_deterministic_and_about_three_percent():
    bc = load_script("build_corpus")
    files = bc.list_source_files(bc.stdlib_root())
    assert files == sorted(files) and files and not any("site-packages" in f for f in files)
    held = [f for f in files if bc.is_heldout(f)]
    assert held == [f for f in files if bc.is_heldout(f)]
    assert 0.02 < len(held) / len(files) < 0.05
    # the split depends on the path only, not on the order or company it is listed in
    assert bc.is_heldout(held[0]) and [bc.is_heldout(f) for f in reversed(files)] == [
        f in set(held) for f in reversed(files)]


def test_heldout_text_is_whole_heldout_files():
    bc = load_script("build_corpus")
    raw = heldout_text_path().read_bytes()
    assert 0 < len(raw) <= bc.HELDOUT_TEXT_MAX_BYTES
    text = raw.decode("utf-8")
    assert text.startswith(EOS)
    root = bc.stdlib_root()
    held = [f for f in bc.list_source_files(root) if bc.is_heldout(f)]
    first = text.split(EOS)[1]
    assert first == (root / held[0]).read_bytes().decode("utf-8")


@pytest.mark.skipif(not (DATA / "test.bin").is_file(), reason="no .data/ (run scripts/build_corpus.py)")
def test_heldout_text_tokenizes_to_test_bin():
    tok = ev.load_tokenizer(DATA / "tokenizer")
    ids = tok(heldout_text_path().read_bytes().decode("utf-8"), add_special_tokens=False,
              verbose=False)["input_ids"]
    test_bin = np.fromfile(DATA / "test.bin", dtype=np.uint16)
    assert np.array_equal(np.asarray(ids), test_bin[: len(ids)])


# --- trained models --------------------------------------------------------------------------


@needs_models
def test_models_load_offline_with_transformers():
    code = (
        "import sys\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "for d in sys.argv[1:]:\n"
        "    m = AutoModelForCausalLM.from_pretrained(d)\n"
        "    t = AutoTokenizer.from_pretrained(d)\n"
        "    print(m.config.model_type, t.eos_token_id, sum(p.numel() for p in m.parameters()))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    dirs = [str(builtin_dir(n)) for n in BUILTIN_MODELS]
    out = subprocess.run([sys.executable, "-c", code, *dirs], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split("\n")
    lines = [line.split() for line in out if line.startswith("llama")]
    assert [line[:2] for line in lines] == [["llama", "0"]] * 2
    target, draft = (int(line[2]) for line in lines)
    assert 15e6 <= target <= 20e6 and 1e6 <= draft <= 3e6


@needs_models
@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_config_is_gqa_tied_bf16(name):
    from safetensors import safe_open

    d = builtin_dir(name)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 8192
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"] and cfg["tie_word_embeddings"]
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


@needs_models
@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_tokenizer_round_trips_python_source(name):
    tok = ev.load_tokenizer(builtin_dir(name))
    ids = tok(SNIPPET, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == SNIPPET
    assert tok.convert_tokens_to_ids(EOS) == tok.eos_token_id == tok.bos_token_id == 0


@needs_models
@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_fixed_slice_perplexity_matches_metrics(name):
    d = builtin_dir(name)
    recorded = json.loads((d / "metrics.json").read_text())["heldout_slice"]
    ppl = ev.heldout_slice_perplexity(d, n_tokens=recorded["n_tokens"])
    assert ppl == pytest.approx(recorded["perplexity"], rel=0.02)
    assert ppl < 100, "a trained model should be far better than chance (8192)"
