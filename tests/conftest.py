"""Shared fixtures: tiny models of each supported architecture, saved as local HF directories."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Under pytest-xdist (`-n 2`, the README's command) each worker computes on one thread, it and the processes
# its tests start: two workers of two threads each on a 2-core machine spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Generated kernels run on the CPU under Triton's interpreter: the triton-interpret backend and the
# codegen tests need TRITON_INTERPRET=1 before the process's first `import triton`.
#
# How Triton reads it (triton 3.9: `triton/knobs.py`, `triton/runtime/jit.py`): from `os.environ`,
# each time `triton.knobs.runtime.interpret` is read; `@triton.jit` reads it when it *decorates* a
# function and fixes it there. Triton's own library (`tl.sum`, `tl.zeros`, ...) is decorated when
# `triton` is first imported, so set later, an interpreted kernel calling `tl.sum` fails with "Cannot
# call @triton.jit'd outside of the scope of a kernel". This root conftest is loaded before any test
# module, so before any import of triton; if triton is already imported, the variable is left alone
# and test modules check how the library was decorated (`isinstance(tl.zeros, InterpretedFunction)`),
# running compiled on a GPU or skipping. `setdefault`: `TRITON_INTERPRET=0 pytest` on a GPU machine
# runs the kernel tests compiled. llmc itself never writes the variable (no process-wide side effects).
if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Triton's interpreter swaps `triton.language`'s functions and tensor methods for interpreted ones while a kernel
# runs, and puts them back after; but a library function a kernel calls (`tl.sum`) swaps them again with nothing to
# put them back (triton 3.9: `InterpretedFunction.__call__`). A kernel then compiled for a real GPU in the same
# process (the sm_90 compiles of the Gluon kernels, where Triton's cache does not already hold them) meets
# interpreted arithmetic and fails. So after every test the language modules' functions are put back as first
# imported, and the methods the interpreter added to its tensor classes are taken off.
def _language_state() -> dict:
    import triton.language as tl
    mods = [m for name, m in list(sys.modules.items()) if name.startswith("triton.language") and m is not None]
    return {obj: dict(vars(obj)) for obj in mods + [tl.core.tensor, tl.core.tensor_descriptor_base]}


_LANGUAGE = _language_state()


@pytest.fixture(autouse=True)
def _language_put_back():
    yield
    for obj, state in _LANGUAGE.items():
        for name, value in state.items():
            if vars(obj).get(name, value) is not value:
                setattr(obj, name, value)
        if isinstance(obj, type):
            for name in set(vars(obj)) - set(state):
                delattr(obj, name)


TOKENIZER_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
    "The quick brown fox jumps over the lazy dog. Hello world!",
]
VOCAB = 320
# eight openings of Python code: the prompts of the end-to-end agreement checks and benchmarks
CODE_PROMPTS = ["def fibonacci(n):", "import os\n\n", "class Stack:\n    def __init__(self):", "for i in range(",
                "with open(path) as f:", "    def __repr__(self):", "try:\n    import json", "return sorted("]


def build_tokenizer(out: Path, vocab_size: int = VOCAB) -> None:
    """A byte-level BPE tokenizer trained on a few lines: real, tiny, and built offline in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TOKENIZER_TEXT * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(str(out))


def _common(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=0,
                pad_token_id=0)
    base.update(kw)
    return base


def make_config(arch: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    if arch == "llama":  # Llama-3 rope scaling, untied head
        return LlamaConfig(**_common(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                                     tie_word_embeddings=False), architectures=["LlamaForCausalLM"])
    if arch == "qwen2":  # attention biases, tied embeddings, a sliding-window layer
        return Qwen2Config(**_common(tie_word_embeddings=True, use_sliding_window=True, sliding_window=6,
                                     max_window_layers=1, layer_types=["full_attention", "sliding_attention"]),
                           architectures=["Qwen2ForCausalLM"])
    if arch == "mistral":  # sliding window on every layer, head_dim not hidden/heads
        return MistralConfig(**_common(sliding_window=5, head_dim=24), architectures=["MistralForCausalLM"])
    raise ValueError(arch)


def make_model_dir(root: Path, arch: str, seed: int = 0) -> Path:
    return save_random_model(root / arch, make_config(arch), seed)


def save_random_model(out: Path, cfg, seed: int = 0) -> Path:
    """A random HF model of `cfg` saved in `out` with the test tokenizer (kept if already there). Its
    matrices (and stacked expert weights) are drawn with std 0.2, larger than the init: peaked,
    non-degenerate logits (and routing, where Qwen's routers start at zero)."""
    from transformers import AutoModelForCausalLM
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    model.save_pretrained(str(out))
    build_tokenizer(out)
    return out


def make_stable_llama(root: Path, seed: int = 0) -> Path:
    """A tiny random Llama whose greedy decoding is well defined in bf16.

    Random models are usually chaotic: their top logits sit so close that bf16 rounding alone
    changes the greedy sequence (weights of std 0.2 everywhere: HF bf16 and HF fp32 agree on about
    40% of tokens), so comparing two bf16 implementations token by token measures rounding order.
    Here the embeddings have std 1 and the head is the embedding matrix with its rows shuffled, so
    the residual stream points at one successor token by a wide margin; the other matrices have std
    0.1, large enough that every sublayer steers the choice (zeroing attention or the MLP, or
    swapping the two KV heads, changes 30-70% of the greedy tokens) and small enough that rounding
    does not (HF bf16 equals HF fp32 on every token of the 8 x 64 benchmark, seeds 0-4)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    out = root / f"tiny-llama-stable-{seed}"
    if (out / "config.json").exists():
        return out
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0,
                      eos_token_id=0, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
        emb = model.model.embed_tokens.weight
        emb.normal_(0, 1.0)
        model.lm_head.weight.copy_(emb[torch.randperm(VOCAB)])
    model.save_pretrained(str(out))
    build_tokenizer(out)
    return out


ARCHS = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session", params=ARCHS)
def arch_dir(request, model_root) -> Path:
    return make_model_dir(model_root, request.param)


@pytest.fixture(scope="session")
def llama_dir(model_root) -> Path:
    return make_model_dir(model_root, "llama")


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def llama_artifact(llama_dir, tmp_path_factory):
    import llmc
    return llmc.compile(llama_dir, tmp_path_factory.mktemp("art") / "llama.llmc")


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """HF generate(do_sample=False) continuation of `ids`, stopping at eos like llmc does."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="session")
def tiny_py_artifact(tmp_path_factory):
    """The shipped code model, compiled once per test session."""
    import llmc
    from llmc.models import builtin_dir
    try:
        builtin_dir("tiny-py")
    except (ValueError, FileNotFoundError) as e:
        pytest.fail(f"the shipped model is missing: {e}")
    return llmc.compile("builtin:tiny-py", tmp_path_factory.mktemp("tiny") / "tiny-py.llmc")


def prefill_graph_matches_eager(artifact, backend):
    """A prefill graph's padded inputs (tokens past the sequence: no KV write, in no sequence) give
    the eager step's logits: a fresh prompt, then a shorter prefix-hit chunk in the same buffer."""
    from llmc.runtime.executor import StepBatch, StepInput, make_executor
    from llmc.runtime.step_graphs import _StepGraph
    runner = make_executor(artifact.graph, backend, "cpu", block_size=4, num_blocks=64)
    dg = _StepGraph("prefill", 16, 8, torch.device("cpu"))
    run = (lambda inp: runner.plan.run(inp)[0]) if backend == "reference" else \
        (lambda inp: runner.plan.run(inp, {"max_seqlen_q": 16, "max_seqlen_k": 64})[0])
    for s in (StepInput(list(range(3, 14)), 0, [5, 9, 2]), StepInput([40, 41, 42], 8, [5, 9, 2, 7])):
        want = runner.execute(StepBatch([s])).logits
        dg.load([s], 4)
        assert dg.inputs["slot_mapping"][len(s.token_ids):].eq(-1).all()
        got = run({**dg.inputs, **runner.kv}).float()
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def paged_prefill_last_logits(g, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Run a paged graph's interpreter on two prompts (9 and 4 tokens) in one prefill step over 4-slot
    blocks (the first sequence in blocks 0-2, the second in block 3) and return each one's last logits."""
    from llmc.ir.interpreter import Interpreter
    assert (len(a), len(b)) == (9, 4)
    caches = {v.name: torch.zeros(v.type.shape[0], 8, 4, *v.type.shape[3:]) for v in g.inputs
              if v.name.startswith("kv_cache.")}
    (out,) = Interpreter(g).run(
        input_ids=torch.cat([a, b]), positions=torch.cat([torch.arange(9), torch.arange(4)]),
        query_start_loc=torch.tensor([0, 9, 13], dtype=torch.int32), seq_lens=torch.tensor([9, 4], dtype=torch.int32),
        block_tables=torch.tensor([[0, 1, 2], [3, 0, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor(list(range(9)) + list(range(12, 16))),
        logits_indices=torch.tensor([8, 12]), **caches)
    return out
