"""An artifact's tokenizer without transformers (llmc/tokenizer.py): on the shipped tokenizers it encodes, decodes
and names its special tokens as transformers' AutoTokenizer does; directories it cannot stand in for load
through AutoTokenizer; running an artifact imports no transformers."""
import json
import random
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from llmc.models import builtin_dir, heldout_text_path
from llmc.runtime.engine import _decoder
from llmc.tokenizer import FastTokenizer, load_tokenizer


@pytest.fixture(scope="module", params=["tiny-py", "tiny-py-draft"])
def pair(request):
    d = builtin_dir(request.param)
    return load_tokenizer(d), AutoTokenizer.from_pretrained(str(d), local_files_only=True)


def texts(n: int = 60) -> list[str]:
    text = heldout_text_path().read_text(encoding="utf-8")
    rng = random.Random(0)
    out = []
    for _ in range(n):
        i = rng.randrange(len(text) - 400)
        out.append(text[i:i + rng.randrange(1, 400)])
    return out + ["", " ", "<|endoftext|>", "a<|endoftext|>b", "  leading", "tabs\t\tand\nnewlines\r\n",
                  "unicode: é ü 中文 🙂 \u200b", "def f(x):\n    return x  # ünïcødé"]


def test_encodes_as_transformers(pair):
    fast, hf = pair
    assert isinstance(fast, FastTokenizer)
    for t in texts():
        for special in (False, True):
            assert fast.encode(t, add_special_tokens=special) == hf.encode(t, add_special_tokens=special), t
        assert fast(t, add_special_tokens=False, verbose=False)["input_ids"] == \
            hf(t, add_special_tokens=False, verbose=False)["input_ids"]


def test_decodes_as_transformers(pair):
    fast, hf = pair
    rng = random.Random(1)
    seqs = [fast.encode(t, add_special_tokens=False) for t in texts(20)]
    seqs += [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    seqs += [[0, 5, 0], [0], []]  # the special token alone, between others
    for ids in seqs:
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
        assert _decoder(fast)(ids) == _decoder(hf)(ids)


def test_names_its_special_tokens_as_transformers(pair):
    fast, hf = pair
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(fast, name) == getattr(hf, name) and getattr(fast, f"{name}_id") == getattr(hf, f"{name}_id")
    assert sorted(fast.all_special_ids) == sorted(hf.all_special_ids)
    assert len(fast) == len(hf) and fast.get_vocab() == hf.get_vocab()
    assert fast.convert_ids_to_tokens([0, 1, 2]) == hf.convert_ids_to_tokens([0, 1, 2])


def edited(tmp_path, change) -> str:
    d = tmp_path / "tok"
    shutil.copytree(builtin_dir("tiny-py"), d, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    change(cfg, d)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("change", [
    lambda cfg, d: cfg.update(tokenizer_class="LlamaTokenizerFast"),  # a model's class may rewrite the pipeline
    lambda cfg, d: cfg.update(clean_up_tokenization_spaces=True),  # transformers' clean-up pass after decoding
    lambda cfg, d: cfg.update(add_bos_token=True),
    lambda cfg, d: cfg.update(added_tokens_decoder={"8192": {"content": "<new>", "special": True}}),  # added at load
    lambda cfg, d: cfg.update(eos_token="<|not-in-the-vocabulary|>"),
    lambda cfg, d: (d / "tokenizer.json").unlink(),
], ids=["model-class", "clean-up", "add-bos", "added-token", "unknown-eos", "no-tokenizer-json"])
def test_what_it_cannot_stand_in_for_loads_through_transformers(tmp_path, change):
    d = edited(tmp_path, change)
    if not (d / "tokenizer.json").exists():  # nothing AutoTokenizer can load either: not a fast tokenizer
        with pytest.raises(Exception):
            load_tokenizer(d)
        return
    assert not isinstance(load_tokenizer(d), FastTokenizer)


def test_running_an_artifact_imports_no_transformers(tmp_path):
    code = ("import sys, llmc\n"
            f"art = llmc.compile('builtin:tiny-py', {str(tmp_path / 'a.llmc')!r})\n"
            "for m in [m for m in sys.modules if m == 'transformers' or m.startswith('transformers.')]:\n"
            "    del sys.modules[m]\n"
            "llm = llmc.LLM(llmc.load(art.path), backend='reference', num_blocks=32)\n"
            "out = llm.generate(['def f(x):'], llmc.SamplingParams(max_tokens=4, temperature=0))[0]\n"
            "assert out.text and len(out.token_ids) == 4, out\n"
            "print('transformers' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "False"
