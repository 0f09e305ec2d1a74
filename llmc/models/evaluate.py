"""Held-out evaluation of the built-in models: perplexity and draft/target agreement.

Shared by ``scripts/eval_builtin.py`` (the full report written after training) and the tests
(a fixed-slice perplexity that must reproduce the number recorded in ``metrics.json``, which
catches a corrupted or swapped weight file, and a tokenizer or loader that changed behaviour).

Conventions, chosen so the numbers are comparable between models and runs:

* Text is cut into non-overlapping windows of ``window`` predicted tokens; each window is
  scored on its own (no carried-over context), as in the usual "chunked" perplexity. This is a
  little pessimistic next to a sliding window, but it is cheap and it is exactly what the
  training loss measures.
* Per-byte numbers divide the summed NLL by the UTF-8 bytes of the predicted tokens; the
  ``<|endoftext|>`` separator counts as one byte (it stands for a file boundary), which keeps
  per-byte numbers finite and tokenizer-independent.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

DEFAULT_SLICE_TOKENS = 2048
DEFAULT_WINDOW = 512
_SLICE_TEXT_CHARS = 200_000  # enough text for any slice we score; keeps tokenizing fast


def load_model(model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Load a causal LM from a local directory only (no hub), in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, local_files_only=True, attn_implementation="sdpa"
    )
    return model.to(device).eval()


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character of each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_byte_lengths(tokenizer) -> np.ndarray:
    """Bytes each token id stands for (byte-level BPE); special tokens count as one byte."""
    decoder = _byte_decoder()
    special = set(tokenizer.all_special_ids)
    vocab = tokenizer.get_vocab()
    lengths = np.ones(max(vocab.values()) + 1, dtype=np.int64)
    for piece, idx in vocab.items():
        if idx not in special:
            lengths[idx] = sum(1 for ch in piece if ch in decoder)
    return lengths


def make_windows(tokens: np.ndarray, window: int = DEFAULT_WINDOW, max_windows: int | None = None):
    """Non-overlapping windows ``[N, window + 1]``: inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
    n = (len(tokens) - 1) // window
    if max_windows is not None:
        n = min(n, max_windows)
    if n <= 0:
        raise ValueError(f"need at least {window + 1} tokens, got {len(tokens)}")
    idx = np.arange(n)[:, None] * window + np.arange(window + 1)[None, :]
    return torch.from_numpy(np.asarray(tokens, dtype=np.int64)[idx])


@torch.no_grad()
def score_windows(model, windows: torch.Tensor, batch_size: int = 8, autocast: bool = False):
    """Teacher-forced scoring. Returns (nll, argmax), both ``[N, window]`` on the CPU.

    Logits never leave the batch loop: at vocab 8192 they are the largest tensor by far.
    """
    device = next(model.parameters()).device
    nlls, argmaxes = [], []
    for start in range(0, windows.shape[0], batch_size):
        chunk = windows[start : start + batch_size].to(device)
        x, y = chunk[:, :-1], chunk[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x).logits
        logits = logits.float()  # logits: [b, W, V]
        nll = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
        nlls.append(nll.cpu())
        argmaxes.append(logits.argmax(-1).cpu())
    return torch.cat(nlls), torch.cat(argmaxes)


def perplexity_stats(nll: torch.Tensor, windows: torch.Tensor, byte_lengths: np.ndarray) -> dict:
    """Per-token and per-byte perplexity from per-position NLL (nats)."""
    targets = windows[:, 1:].numpy()
    total_nll = float(nll.double().sum())
    n_tokens = int(nll.numel())
    n_bytes = int(byte_lengths[targets].sum())
    return {
        "tokens": n_tokens,
        "bytes": n_bytes,
        "nll_per_token": total_nll / n_tokens,
        "perplexity_per_token": math.exp(total_nll / n_tokens),
        "bits_per_byte": total_nll / n_bytes / math.log(2),
        "perplexity_per_byte": math.exp(total_nll / n_bytes),
    }


def agreement_rate(draft_argmax: torch.Tensor, target_argmax: torch.Tensor) -> float:
    """Fraction of positions where the draft's greedy token equals the target's: an upper-bound
    proxy for the per-token acceptance rate of greedy speculative decoding."""
    return float((draft_argmax == target_argmax).double().mean())


def heldout_slice_tokens(tokenizer, n_tokens: int = DEFAULT_SLICE_TOKENS) -> np.ndarray:
    """The first ``n_tokens + 1`` tokens of the shipped ``heldout.txt``: the fixed test slice."""
    from llmc.models import heldout_text_path

    # Bytes, not read_text: universal newlines would turn the corpus's "\r\n" files into "\n".
    text = heldout_text_path().read_bytes().decode("utf-8")[:_SLICE_TEXT_CHARS]
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if len(ids) < n_tokens + 1:
        raise ValueError(f"heldout.txt gives {len(ids)} tokens, fewer than {n_tokens + 1}")
    return np.asarray(ids[: n_tokens + 1], dtype=np.int64)


def heldout_slice_perplexity(
    model_dir: str | Path, n_tokens: int = DEFAULT_SLICE_TOKENS, window: int = DEFAULT_WINDOW
) -> float:
    """Per-token perplexity, fp32 on the CPU, on a fixed slice of ``heldout.txt``.

    Args:
        model_dir: a Hugging Face directory with the model and its tokenizer.
        n_tokens: predicted tokens; a multiple of ``window``.
        window: tokens per independently scored window (<= max_position_embeddings).

    Returns:
        ``exp(mean NLL)`` over the slice. A few seconds for ``tiny-py``.

    Example:
        >>> from llmc.models import builtin_dir
        >>> from llmc.models.evaluate import heldout_slice_perplexity
        >>> ppl = heldout_slice_perplexity(builtin_dir("tiny-py"))  # doctest: +SKIP
    """
    if n_tokens % window:
        raise ValueError(f"n_tokens ({n_tokens}) must be a multiple of window ({window})")
    tokens = heldout_slice_tokens(load_tokenizer(model_dir), n_tokens)
    windows = make_windows(tokens, window)
    model = load_model(model_dir, "cpu", torch.float32)
    nll, _ = score_windows(model, windows, batch_size=windows.shape[0])
    return math.exp(float(nll.double().mean()))
