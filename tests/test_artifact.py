"""The artifact as the compile/run contract: the typed ModelInfo it carries, read back at load."""
import json

import pytest

import llmc
from llmc.artifact import ModelInfo
from llmc.errors import ArtifactError


def test_model_info_describes_the_model(llama_artifact, llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    info = llmc.load(llama_artifact.path).info
    assert info == ModelInfo.from_json(json.loads(json.dumps(info.to_json())))
    assert (info.vocab_size, info.max_model_len, info.num_layers) == \
        (cfg["vocab_size"], cfg["max_position_embeddings"], cfg["num_hidden_layers"])
    assert (info.num_heads, info.num_kv_heads) == (cfg["num_attention_heads"], cfg["num_key_value_heads"])
    assert info.head_dim == cfg["hidden_size"] // cfg["num_attention_heads"]
    assert info.eos_token_ids == (cfg["eos_token_id"],) and info.kv_cache_dtype == "auto" and info.dtype == "f32"


def test_chat_template_travels_with_the_tokenizer(llama_dir, tmp_path):
    import shutil
    src = tmp_path / "m"
    shutil.copytree(llama_dir, src)
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    art = llmc.compile(src, tmp_path / "m.llmc")
    assert llmc.load(art.path).info.chat_template.startswith("{% for m in messages %}")


def test_model_info_missing_fields_is_an_artifact_error():
    with pytest.raises(ArtifactError, match="recompile"):
        ModelInfo.from_json({"vocab_size": 3})
