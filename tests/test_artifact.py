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


def test_large_files_are_checked_in_pieces_in_parallel(llama_dir, tmp_path, monkeypatch):
    """A file past HASH_CHUNK is recorded piece by piece (hashed on every core), its digest the pieces'
    digest; a load checks the pieces on every core. A changed byte in any piece, a truncated or a grown
    file, a digest that the pieces do not give are each a clear error; a format-2 artifact (whole
    digests) written before pieces were recorded is still checked whole."""
    import shutil

    import llmc.artifact as artifact
    monkeypatch.setattr(artifact, "HASH_CHUNK", 4096)
    art = llmc.compile(llama_dir, tmp_path / "a.llmc")
    manifest = json.loads((art.path / "manifest.json").read_text())
    weights = art.path / "weights.safetensors"
    pieces = manifest["chunks"]["weights.safetensors"]["sha256"]
    assert len(pieces) == -(-weights.stat().st_size // 4096) > 2 and "graph.json" in manifest["files"]
    assert manifest["format_version"] == 3 and [artifact._sha256_range(weights, i * 4096, 4096)
                                                 for i in range(len(pieces))] == pieces
    assert manifest["files"]["weights.safetensors"] == artifact.pieces_digest(pieces)
    artifact.verify_files(art.path, manifest, threads=3)  # intact
    forged = json.loads(json.dumps(manifest))
    forged["files"]["weights.safetensors"] = artifact.sha256_file(weights)  # a whole digest in a v3 manifest
    with pytest.raises(ArtifactError, match="manifest is corrupted"):
        artifact.verify_files(art.path, forged)
    data = weights.read_bytes()
    for broken in (data[:4096 * 2] + bytes([data[4096 * 2] ^ 1]) + data[4096 * 2 + 1:],  # one bit, third piece
                   data[:-1], data + b"\0"):
        weights.write_bytes(broken)
        with pytest.raises(ArtifactError, match="weights.safetensors is corrupted"):
            llmc.load(art.path)
    weights.write_bytes(data)
    old = tmp_path / "old.llmc"  # a format-2 manifest with no pieces: the whole file's digest
    shutil.copytree(art.path, old)
    del manifest["chunks"]
    manifest.update(format_version=2, files={rel: artifact.sha256_file(old / rel) for rel in manifest["files"]})
    (old / "manifest.json").write_text(json.dumps(manifest))
    llmc.load(old)
    (old / "weights.safetensors").write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(ArtifactError, match="corrupted"):
        llmc.load(old)


def test_a_check_in_the_background_is_waited_for_before_an_engine_runs(llama_artifact, tmp_path, monkeypatch):
    """verify="background" returns before the hashes are checked; an engine made from it (or from a path) waits
    for the check, and a file that differs from the manifest fails the engine as a load would."""
    import shutil
    import threading

    import llmc.artifact as artifact
    from llmc.runtime.llm import LLM
    go, seen = threading.Event(), []
    check = artifact.verify_files

    def held(path, manifest, threads=None):
        go.wait(30)
        seen.append(path)
        check(path, manifest, threads)
    monkeypatch.setattr(artifact, "verify_files", held)
    art = llmc.load(llama_artifact.path, verify="background")
    assert not art.verifying.done() and not seen  # loaded, still being checked
    go.set()
    with LLM(art, backend="reference", num_blocks=16, block_size=4) as llm:
        assert seen and art.verifying is None and llm.generate([[5, 6, 7]])[0].token_ids
    bad = tmp_path / "bad.llmc"
    shutil.copytree(llama_artifact.path, bad)
    data = bytearray((bad / "weights.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (bad / "weights.safetensors").write_bytes(bytes(data))
    for model in (bad, llmc.load(bad, verify="background")):  # a path: the engine loads it so itself
        with pytest.raises(ArtifactError, match="weights.safetensors is corrupted"):
            LLM(model, backend="reference", num_blocks=16, block_size=4)


def test_weights_are_written_while_the_compile_tunes(llama_dir, tmp_path, monkeypatch):
    """The weights file is written in a thread from the start of the tuning phase: when tuning ends, the
    weights are on disk already (or being written), and the artifact appears whole only at the end. A
    tuning that fails leaves no partial directory and an earlier artifact at the output path as it was."""
    import time

    import llmc.artifact as artifact
    import llmc.compiler as compiler
    out = tmp_path / "a.llmc"
    old = llmc.compile(llama_dir, out)
    first = (out / "manifest.json").read_text()
    seen = {}

    def tuning(graph, *args):
        weights = out.with_name("a.llmc.partial") / "weights.safetensors"
        deadline = time.monotonic() + 10
        while not weights.exists() and time.monotonic() < deadline:  # the writer runs beside this phase
            time.sleep(0.05)
        seen["weights_during_tuning"] = weights.exists()
        seen["artifact_untouched"] = (out / "manifest.json").read_text() == first
        return {}
    monkeypatch.setattr(compiler, "_autotune", tuning)
    monkeypatch.setattr(compiler.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compiler, "_kernel_listing", lambda graph, tuning: ([], {}))
    art = llmc.compile(llama_dir, out)
    assert seen == {"weights_during_tuning": True, "artifact_untouched": True}
    assert not out.with_name("a.llmc.partial").exists()
    artifact.verify_files(art.path, art.manifest)
    assert llmc.load(out).graph.op_counts() == old.graph.op_counts()

    def failing(graph, *args):
        raise RuntimeError("tuning failed")
    monkeypatch.setattr(compiler, "_autotune", failing)
    before = (out / "manifest.json").read_text()
    with pytest.raises(RuntimeError, match="tuning failed"):
        llmc.compile(llama_dir, out)
    assert not out.with_name("a.llmc.partial").exists() and (out / "manifest.json").read_text() == before


def test_a_failed_weights_write_is_raised_by_finish(llama_artifact, tmp_path, monkeypatch):
    """An error while writing the weights (a full disk) surfaces when the artifact is finished, and nothing
    is left at the output path."""
    import llmc.artifact as artifact

    def no_space(fd, data, offset):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("os.pwrite", no_space)
    w = artifact.ArtifactWriter(llmc.load(llama_artifact.path).graph, tmp_path / "b.llmc")
    with pytest.raises(OSError, match="No space left"):
        w.finish("test", {})
    assert not (tmp_path / "b.llmc").exists() and not (tmp_path / "b.llmc.partial").exists()


def test_weights_files_are_safetensors_hashed_as_written(tmp_path, monkeypatch):
    """llmc writes weights files itself, piece by piece on threads: safetensors reads back every dtype a
    graph holds (strided and empty tensors too), and the pieces' digests it returns are those a load
    reads back from the file (`hash_pieces`), with the header and tensors cut across pieces anywhere."""
    import torch
    from safetensors.torch import load_file

    import llmc.artifact as artifact
    monkeypatch.setattr(artifact, "HASH_CHUNK", 100)
    g = torch.Generator().manual_seed(0)
    tensors = {"w.bf16": torch.randn(9, 7, generator=g).to(torch.bfloat16), "w.t": torch.randn(6, 5, generator=g).t(),
               "codes": torch.randint(-128, 127, (41,), dtype=torch.int8, generator=g), "packed": torch.arange(13, dtype=torch.int32),
               "empty": torch.zeros(0, 3), "fp8": torch.randn(11, generator=g).to(torch.float8_e4m3fn),
               "mask": torch.tensor([True, False, True]), "half": torch.randn(5, generator=g).half()}
    path = tmp_path / "w.safetensors"
    pieces = artifact.write_safetensors(tensors, path, threads=3)
    back = load_file(str(path))
    assert sorted(back) == sorted(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name
    assert len(pieces) > 5 and pieces == artifact.hash_pieces(path, 100)
    with pytest.raises(ArtifactError, match="complex64"):
        artifact.write_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "z.safetensors")


def test_the_weights_file_threads_follow_the_environment(monkeypatch):
    from llmc.artifact import ArtifactWriter
    import os
    monkeypatch.delenv("LLMC_WRITE_THREADS", raising=False)
    assert ArtifactWriter.write_threads() == min(16, os.cpu_count() or 1)
    monkeypatch.setenv("LLMC_WRITE_THREADS", "16")
    assert ArtifactWriter.write_threads() == 16
    monkeypatch.setenv("LLMC_WRITE_THREADS", "0")
    assert ArtifactWriter.write_threads() == 1
    monkeypatch.setenv("LLMC_WRITE_THREADS", "many")
    assert ArtifactWriter.write_threads() == min(16, os.cpu_count() or 1)
