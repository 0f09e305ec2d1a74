"""A quantized embedding table lowered for the kernel backends (a torch gather-and-scale step) gives
the reference interpreter's tokens."""
import os

import pytest

import llmc
from tests.codegen.test_backend import run_json

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="TRITON_INTERPRET=1 must be set before triton is imported")


def test_qembedding_lowered_matches_reference(llama_dir, tmp_path):
    art = llmc.compile(llama_dir, tmp_path / "e.llmc", quant={"method": "rtn", "wbits": 8, "embeddings": "int8"})
    assert art.summary()["op_counts"]["qembedding"] == 1
    ref = run_json(art.path, "reference", "def add(a, b):", 6)
    got = run_json(art.path, "triton-interpret", "def add(a, b):", 6)
    assert got["token_ids"] == ref["token_ids"] and len(ref["token_ids"]) == 6
