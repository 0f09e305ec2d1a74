"""An artifact's tokenizer: the Rust `tokenizers` library over its tokenizer.json where that is all that
transformers would run, else transformers' AutoTokenizer.

Importing transformers and building its tokenizer takes about 1.3 s on a 2-core machine, against 15 ms for
the `tokenizers` library alone; for a short `llmc run` that was two fifths of the command's time. transformers'
generic fast tokenizer (`tokenizer_class` PreTrainedTokenizerFast, or TokenizersBackend as transformers 5 writes
it) runs the tokenizer.json as it is: encoding without special tokens and decoding are the Rust library's own
calls, with no clean-up pass unless `clean_up_tokenization_spaces` asks for one. `load_tokenizer` takes the
fast path only for such a directory, and only when every added token of tokenizer_config.json is in
tokenizer.json with the same id and the same special flag (transformers would add the others at load).
Other tokenizers (a model-specific class, which may change the pipeline at load; sentencepiece or vocab files
without a tokenizer.json) load through AutoTokenizer as before.

`FastTokenizer` offers the part of transformers' tokenizer interface that llmc uses: `encode`, `decode`,
`__call__` (input_ids only), the special tokens and their ids, `all_special_ids`, `get_vocab`, `len`, and
`backend_tokenizer`. tests/test_tokenizer.py checks it against AutoTokenizer on the shipped tokenizers.

Example:
    >>> from llmc.models import builtin_dir
    >>> tok = load_tokenizer(builtin_dir("tiny-py"))
    >>> type(tok).__name__, tok.decode(tok.encode("def f(x):", add_special_tokens=False))
    ('FastTokenizer', 'def f(x):')
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# tokenizer_config.json keys with which transformers rewrites the pipeline it loads (a prefix space, the
# post-processor's special tokens): such a directory loads through transformers
REWRITING_KEYS = ("add_prefix_space", "add_bos_token", "add_eos_token", "legacy", "from_slow")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_tokenizer(directory: str | Path):
    """The tokenizer of a directory of tokenizer files: a `FastTokenizer` where it gives what transformers would,
    else transformers' AutoTokenizer (see the module docstring)."""
    directory = Path(directory)
    fast = _fast(directory)
    if fast is not None:
        return fast
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _fast(directory: Path) -> "FastTokenizer | None":
    path, cfg_path = directory / "tokenizer.json", directory / "tokenizer_config.json"
    if not path.is_file() or not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or cfg.get("tokenizer_class") not in GENERIC_CLASSES or \
            cfg.get("clean_up_tokenization_spaces") or any(k in cfg for k in REWRITING_KEYS):
        return None
    from tokenizers import Tokenizer
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception:  # a file the Rust library cannot read: transformers says why
        return None
    added = backend.get_added_tokens_decoder()
    for i, tok in (cfg.get("added_tokens_decoder") or {}).items():
        have = added.get(int(i)) if str(i).isdigit() else None
        if not isinstance(tok, dict) or have is None or have.content != tok.get("content") or \
                bool(have.special) != bool(tok.get("special")):
            return None  # transformers would add or change it
    names = {n: _content(cfg.get(n)) for n in SPECIAL_NAMES}
    if any(v is not None and backend.token_to_id(v) is None for v in names.values()):
        return None  # a special token the vocabulary lacks: transformers would add it
    return FastTokenizer(backend, names)


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's fields."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


class FastTokenizer:
    """The part of transformers' tokenizer interface llmc uses, over a `tokenizers.Tokenizer`."""

    clean_up_tokenization_spaces = False

    def __init__(self, backend, special: dict[str, str | None]):
        self.backend_tokenizer = backend
        for name in SPECIAL_NAMES:
            token = special.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", backend.token_to_id(token) if token is not None else None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True, **_) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def all_special_ids(self) -> list[int]:
        """The special tokens' ids: the named ones (bos, eos, unk, pad), then the other added tokens marked
        special."""
        ids = [getattr(self, f"{n}_id") for n in SPECIAL_NAMES]
        ids = list(dict.fromkeys(i for i in ids if i is not None))
        extra = sorted(i for i, t in self.backend_tokenizer.get_added_tokens_decoder().items() if t.special)
        return ids + [i for i in extra if i not in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def check_text(text: str, what: str = "the text") -> str:
    """`text` where it can be encoded as UTF-8 (what a tokenizer takes); else RequestError naming the first
    character that cannot: a lone UTF-16 surrogate, which JSON's "\\ud800" escapes can spell."""
    from llmc.errors import RequestError
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{what} holds {text[e.start]!r} at character {e.start}, a lone UTF-16 surrogate that "
                           "is no Unicode character; send valid UTF-8 text") from None
    return text


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character a byte-level BPE vocabulary writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """The bytes each token id stands for, where a token may be part of a UTF-8 character (its text, decoded alone,
    is then U+FFFD): byte-level BPE vocabularies (GPT-2's alphabet), SentencePiece byte fallback (`<0xE2>`, `▁`
    for a space), else the token's decoded text. Added (special) tokens are their content's UTF-8.

    Example:
        >>> from llmc.models import builtin_dir
        >>> tb = TokenBytes(load_tokenizer(builtin_dir("tiny-py")))
        >>> tok = load_tokenizer(builtin_dir("tiny-py"))
        >>> b"".join(tb(t) for t in tok.encode("€ = 1", add_special_tokens=False)).decode()
        '€ = 1'
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
        kinds = json.dumps(decoder or {})
        self.byte_level = '"ByteLevel"' in kinds
        self.byte_fallback = '"ByteFallback"' in kinds
        self.alphabet = _byte_level_decoder() if self.byte_level else {}
        added = backend.get_added_tokens_decoder() if backend is not None else {}
        self.added = {i: t.content for i, t in added.items()}

    def __call__(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self.byte_level and all(c in self.alphabet for c in piece):
            return bytes(self.alphabet[c] for c in piece)
        if self.byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if self.byte_fallback or "▁" in piece:
            return piece.replace("▁", " ").encode()
        return self.tokenizer.decode([token_id]).encode()
