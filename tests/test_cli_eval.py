"""`llmc eval`: the perplexity it prints is exp of the mean NLL that a plain Hugging Face forward gives
over the same windows, --max-tokens and --window cut the text as documented, and bad input is one line."""
import json
import math
import shutil

import pytest
import torch

from llmc.evaluate import windows
from llmc.models import heldout_text_path
from tests.conftest import TOKENIZER_TEXT, hf_model
from tests.test_cli import assert_clean_error, cli

FAST = ("--backend", "reference", "--num-blocks", 64)  # a small KV cache: zeroing the default one takes longer
TEXT = "".join(TOKENIZER_TEXT) * 2  # 276 tokens of the tiny tokenizer


@pytest.fixture(scope="module")
def art(llama_artifact):
    return llama_artifact.path


@pytest.fixture
def text_file(tmp_path):
    f = tmp_path / "code.txt"
    f.write_text(TEXT)
    return f


def eval_json(*args) -> dict:
    code, out = cli("eval", *args, "--json", *FAST)
    assert code == 0, out
    (line,) = out.strip().splitlines()
    return json.loads(line)


def hf_nll(llama_dir, ids: list[int], window: int) -> list[float]:
    """Per scored token, its NLL from one forward per window, computed apart from llmc."""
    model, nll = hf_model(llama_dir), []
    for w in (ids[i:i + window + 1] for i in range(0, len(ids) - 1, window)):
        with torch.no_grad():
            logits = model(torch.tensor([w])).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(w[1:]), reduction="none").tolist()
    return nll


def test_json_perplexity_is_exp_of_the_mean_nll(art, llama_dir, text_file, llama_artifact):
    ids = llama_artifact.tokenizer().encode(TEXT, add_special_tokens=False)
    got = eval_json(art, "--text", text_file, "--window", 40, "--max-tokens", 150, "--max-num-batched-tokens", 32)
    nll = hf_nll(llama_dir, ids[:151], 40)
    assert set(got) >= {"perplexity", "tokens", "nll", "windows", "window", "artifact", "dataset"}
    assert got["tokens"] == len(nll) == 150 and got["windows"] == 4 and got["window"] == 40
    assert got["dataset"] == str(text_file) and got["artifact"] == str(art)
    mean = sum(nll) / len(nll)
    assert got["nll"] == pytest.approx(mean, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(mean), rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(got["nll"]), rel=1e-12)


def test_default_window_and_plain_output(art, text_file):
    """The tiny Llama's context (128 positions) is shorter than the default 512: windows of 126 scored
    tokens (a prompt of 127 and one generated token); the plain output says the same numbers."""
    got = eval_json(art, "--text", text_file)
    assert got["tokens"] == 275 and got["window"] == 126 and got["windows"] == 3
    code, out = cli("eval", art, "--text", text_file, *FAST)
    assert code == 0, out
    assert f"perplexity  {got['perplexity']:.4f}" in out and "275 scored, in 3 windows of up to 126" in out


def test_builtin_heldout_is_the_shipped_text(art):
    got = eval_json(art, "--dataset", "builtin:heldout", "--max-tokens", 40)
    same = eval_json(art, "--text", heldout_text_path(), "--max-tokens", 40)
    assert got["dataset"] == "builtin:heldout" and got["tokens"] == 40
    assert got["perplexity"] == same["perplexity"] and 1 < got["perplexity"]
    assert eval_json(art, "--max-tokens", 40) == got  # the default where no --text is given


def test_windows_score_every_token_but_the_first_once():
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9]]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]]


def test_bad_input_is_one_line(art, text_file, tmp_path):
    empty, short, latin = tmp_path / "empty.txt", tmp_path / "short.txt", tmp_path / "latin.txt"
    empty.write_text("")
    short.write_text("a")
    latin.write_bytes(b"caf\xe9\n")
    for args, needles in [
        (["--text", tmp_path / "missing.txt"], ["--text", "missing.txt: no such file"]),
        (["--text", tmp_path], ["not a file"]),
        (["--text", empty], ["empty.txt is empty"]),
        (["--text", latin], ["not UTF-8", "0xe9"]),
        (["--text", short], ["the text has 1 token", "at least 2"]),
        (["--dataset", "wikitext"], ["unknown dataset 'wikitext'", "builtin:heldout"]),
        (["--dataset", "builtin:heldout", "--text", text_file], ["one of --text FILE or --dataset", "not both"]),
        (["--text", text_file, "--max-tokens", 0], ["--max-tokens must be >= 1, got 0"]),
        (["--text", text_file, "--window", 127], ["--window must be at most 126"]),
        (["--text", text_file, "--window", 0], ["--window must be >= 1"]),
    ]:
        assert_clean_error(*cli("eval", art, *args, *FAST), *needles)
    assert_clean_error(*cli("eval", tmp_path / "nope.llmc", "--text", text_file), "nope.llmc")


def test_artifact_without_a_tokenizer(llama_dir, text_file, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(llama_dir / name, model / name)
    assert cli("compile", model, "-o", tmp_path / "m.llmc")[0] == 0
    assert_clean_error(*cli("eval", tmp_path / "m.llmc", "--text", text_file, *FAST), "has no tokenizer",
                       "cannot score text")


def test_eval_help():
    code, out = cli("eval", "--help")
    assert code == 0
    for needle in ("--text FILE", "--dataset", "builtin:heldout", "--max-tokens", "--window", "--json", "perplexity",
                   "--backend"):
        assert needle in out, needle
