"""Tiny Llamas with awkward head counts, and a threaded stand-in for a process group.

`ThreadGroup` lets N ranks of a sharded graph run as N threads of one process, each with its own
interpreter, meeting at every collective: the sharding rules are checked on many sizes in
milliseconds, and the spawned-process tests (test_workers.py) only need to cover the real path.
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import VOCAB, build_tokenizer


def make_llama(root: Path, name: str, heads: int, kv_heads: int, tied: bool, vocab: int = VOCAB,
               intermediate: int = 64, layers: int = 2) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    out = root / name
    if (out / "config.json").exists():
        return out
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=8 * heads, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=tied,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked logits: greedy tokens that rounding does not flip
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(str(out))
    build_tokenizer(out, min(vocab, VOCAB))
    return out


@pytest.fixture(scope="session")
def odd_heads_artifact(tmp_path_factory):
    """6 query heads over 3 KV heads (a query group straddles two ranks at TP=2), tied embeddings."""
    import llmc
    root = tmp_path_factory.mktemp("dist")
    return llmc.compile(make_llama(root, "h6-kv3-tied", 6, 3, tied=True), root / "h6-kv3-tied.llmc")


class ThreadGroup:
    """N ranks as threads: `member(r)` is rank r's `Collectives` (llmc/ir/collectives.py)."""

    def __init__(self, size: int):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=30)

    def member(self, rank: int):
        group = self

        class Member:
            size = group.size

            def _exchange(self, t):
                group.slots[rank] = t.clone()
                group.barrier.wait()
                out = list(group.slots)
                group.barrier.wait()
                return out

            def all_reduce(self, t):
                return sum(self._exchange(t))

            def all_gather(self, t, dim):
                return torch.cat(self._exchange(t), dim=dim)
        return Member()


def run_ranks(graphs, inputs_of) -> list:
    """Run graphs[r] on inputs_of(graph) in thread r (interpreters bound to one ThreadGroup); the outputs."""
    from llmc.ir.interpreter import Interpreter
    group, outs, errors = ThreadGroup(len(graphs)), [None] * len(graphs), []

    def run(r):
        try:
            it = Interpreter(graphs[r])
            it.state["process_groups"] = {"tp": group.member(r)}
            outs[r] = it.run(inputs_of(graphs[r]))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            group.barrier.abort()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(graphs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return outs
