"""Build the training corpus and tokenizer for llmc's built-in models.

llmc ships two small trained Llama models (``tiny-py`` and ``tiny-py-draft``) so that the
compiler, the runtime and speculative decoding can be tested on real weights with no model hub.
Their corpus must be reproducible from what every machine that runs llmc already has, so it is
the Python standard library's own source, read from this interpreter's ``stdlib`` directory.

Choices (each one deterministic, so two runs on the same Python build give identical bytes):

* Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, sorted by relative POSIX
  path, skipping ``site-packages`` (third-party, differs per machine) and ``__pycache__``.
  The ``test/`` packages are KEPT: the stdlib without them is ~12 MB, with them ~31 MB, which is
  inside the 20-40 MB we want and gives the 15M-parameter model more distinct tokens to learn
  from (it sees the corpus many times over during training, so more distinct data matters more
  than its exact genre). Files that are not valid UTF-8 (a few encoding tests) are skipped,
  since the tokenizer must round-trip text exactly.
* Split: whole files are held out, chosen by a hash of the relative path (about 3%). A file
  hash, not a random draw, keeps the split stable if the file list changes slightly, and whole
  files keep near-duplicate context out of the test set.
* Tokenizer: byte-level BPE (any byte sequence encodes, so indentation, tabs and non-ASCII
  round-trip exactly), 8192 tokens including ``<|endoftext|>``, trained on the train split only.
  ``<|endoftext|>`` is bos, eos and pad; the token stream is ``EOS file EOS file ...`` so
  every file starts after an EOS, which doubles as its BOS.
* Outputs: ``DATA/tokenizer/`` (loads with ``transformers.AutoTokenizer``), ``DATA/train.bin``
  and ``DATA/test.bin`` (uint16 token ids), ``DATA/corpus_stats.json``, and
  ``llmc/models/data/heldout.txt`` (the held-out files, each preceded by ``<|endoftext|>``, so
  that tokenizing the text reproduces ``test.bin`` exactly; capped at 2 MB of whole files).

Usage::

    python scripts/build_corpus.py --data .data
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
import time
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"
VOCAB_SIZE = 8192
HELDOUT_PER_MILLE = 30  # ~3% of files go to the test split
HELDOUT_TEXT_MAX_BYTES = 2 * 1024 * 1024
REPO = Path(__file__).resolve().parent.parent
HELDOUT_TEXT = REPO / "llmc" / "models" / "data" / "heldout.txt"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path) -> list[str]:
    """Relative POSIX paths of the corpus files, sorted so the order never depends on the disk."""
    rels = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if "site-packages" in parts or "__pycache__" in parts or not path.is_file():
            continue
        rels.append(rel)
    return sorted(rels)


def is_heldout(rel: str) -> bool:
    """Whole-file split by path hash: stable across runs and machines with the same stdlib."""
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE


def read_corpus(root: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[str]]:
    """Return (train, test, skipped) with (relpath, text) pairs; text is read as bytes then
    decoded strictly so that no newline translation or lossy decoding alters the source."""
    train, test, skipped = [], [], []
    for rel in list_source_files(root):
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if not text:
            continue
        (test if is_heldout(rel) else train).append((rel, text))
    return train, test, skipped


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` (GPT-2 style pre-tokenizer, no
    normalizer, so encoding is lossless). The special token gets id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_hf_tokenizer(tok, out_dir: Path):
    """Wrap in transformers' fast tokenizer and save the three standard files.

    ``clean_up_tokenization_spaces=False`` matters: the default clean-up rewrites " ." and
    " ," while decoding, which would break exact round-trips of Python source.
    """
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    # transformers 5 writes its internal class name ("TokenizersBackend") and no
    # special_tokens_map.json; the portable name and the map keep 4.x loaders working too.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return hf


def encode_split(tok, texts: list[str]) -> np.ndarray:
    """``EOS file EOS file ...`` as uint16; encode_batch runs on all cores in Rust."""
    eos_id = tok.token_to_id(EOS)
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.array([eos_id] + enc.ids, dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def check_roundtrip(tok, hf_dir: Path, texts: list[str]) -> None:
    """Every file must decode back to the identical string: with the raw tokenizer for the whole
    corpus, and with ``AutoTokenizer`` (what users load) for a sample."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # whole files exceed model_max_length; expected here
    encs = tok.encode_batch(texts, add_special_tokens=False)
    decoded = tok.decode_batch([e.ids for e in encs], skip_special_tokens=False)
    bad = [i for i, (a, b) in enumerate(zip(texts, decoded)) if a != b]
    if bad:
        raise SystemExit(f"tokenizer does not round-trip {len(bad)} files (first index {bad[0]})")
    hf = AutoTokenizer.from_pretrained(str(hf_dir))
    for text in texts[:: max(1, len(texts) // 50)]:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        if hf.decode(ids) != text:
            raise SystemExit("AutoTokenizer decode does not round-trip the source exactly")


def heldout_text(test: list[tuple[str, str]], max_bytes: int = HELDOUT_TEXT_MAX_BYTES) -> str:
    """Whole held-out files in path order, each preceded by EOS, up to ``max_bytes``."""
    chunks, size = [], 0
    for _, text in test:
        chunk = EOS + text
        n = len(chunk.encode("utf-8"))
        if size + n > max_bytes:
            break
        chunks.append(chunk)
        size += n
    return "".join(chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=REPO / ".data", help="output folder (git-ignored)")
    ap.add_argument("--root", type=Path, default=None, help="stdlib folder (default: this Python's)")
    args = ap.parse_args()
    root = args.root or stdlib_root()
    t0 = time.time()

    train, test, skipped = read_corpus(root)
    train_texts = [t for _, t in train]
    test_texts = [t for _, t in test]
    print(f"corpus: {root}: {len(train)} train files, {len(test)} test files, "
          f"{len(skipped)} skipped (not UTF-8)")

    tok = train_tokenizer(train_texts)
    tok_dir = args.data / "tokenizer"
    save_hf_tokenizer(tok, tok_dir)
    print(f"tokenizer: vocab {tok.get_vocab_size()} -> {tok_dir} ({time.time() - t0:.0f}s)")
    check_roundtrip(tok, tok_dir, train_texts + test_texts)
    print("round-trip: all files decode back exactly")

    train_ids = encode_split(tok, train_texts)
    test_ids = encode_split(tok, test_texts)
    train_ids.tofile(args.data / "train.bin")
    test_ids.tofile(args.data / "test.bin")

    held = heldout_text(test)
    HELDOUT_TEXT.parent.mkdir(parents=True, exist_ok=True)
    HELDOUT_TEXT.write_text(held, encoding="utf-8", newline="")

    train_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    test_bytes = sum(len(t.encode("utf-8")) for t in test_texts)
    stats = {
        "stdlib": str(root),
        "python": sysconfig.get_python_version(),
        "vocab_size": tok.get_vocab_size(),
        "eos_token": EOS,
        "eos_id": tok.token_to_id(EOS),
        "train": {"files": len(train), "bytes": train_bytes, "tokens": int(train_ids.size)},
        "test": {"files": len(test), "bytes": test_bytes, "tokens": int(test_ids.size),
                 "files_list": [rel for rel, _ in test]},
        "skipped_not_utf8": skipped,
        "heldout_txt_bytes": len(held.encode("utf-8")),
        "bytes_per_token_train": round(train_bytes / max(1, train_ids.size), 3),
    }
    (args.data / "corpus_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    mb = 1024 * 1024
    print(f"train: {train_bytes / mb:.1f} MB text, {train_ids.size:,} tokens "
          f"({stats['bytes_per_token_train']} bytes/token), train.bin {train_ids.nbytes / mb:.1f} MB")
    print(f"test:  {test_bytes / mb:.2f} MB text, {test_ids.size:,} tokens, "
          f"test.bin {test_ids.nbytes / mb:.2f} MB")
    print(f"heldout.txt: {stats['heldout_txt_bytes'] / mb:.2f} MB -> {HELDOUT_TEXT}")
    print(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
