"""llmc's built-in trained models, shipped as package data.

Two small Llama models trained on the Python standard library's source, so that every part of
llmc (frontend, passes, kernels, the runtime, speculative decoding) can be tested end to end on
real weights without a model hub:

* ``tiny-py``: the target model (~16M parameters).
* ``tiny-py-draft``: a ~2M-parameter draft model with the same tokenizer, for speculative decoding.

Each lives in ``llmc/models/<name>/`` as a plain Hugging Face directory (``config.json``,
``model.safetensors``, tokenizer files) plus ``train_log.json`` and ``metrics.json``. How they
were built is in ``llmc/models/README.md``.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_MODELS: tuple[str, ...] = ("tiny-py", "tiny-py-draft")
_HERE = Path(__file__).resolve().parent


def builtin_dir(name: str, *, must_exist: bool = True) -> Path:
    """Resolve a built-in model name to its Hugging Face directory inside the package.

    Args:
        name: one of ``BUILTIN_MODELS``.
        must_exist: also check that the weights are there (they are package data, but a source
            checkout made before the models were trained has none).

    Returns:
        The directory ``llmc/models/<name>/``.

    Raises:
        ValueError: the name is not a built-in model, or its files are missing.

    Example:
        >>> from llmc.models import builtin_dir
        >>> builtin_dir("tiny-py", must_exist=False).name
        'tiny-py'
    """
    if name not in BUILTIN_MODELS:
        raise ValueError(
            f"unknown built-in model {name!r}; available: {', '.join(BUILTIN_MODELS)}"
        )
    path = _HERE / name
    if must_exist and not (path / "config.json").is_file():
        raise ValueError(
            f"built-in model {name!r} is not installed at {path}; train it with "
            "scripts/train_builtin.py (see llmc/models/README.md)"
        )
    return path


def heldout_text_path() -> Path:
    """The held-out stdlib source (never trained on) used to measure the built-in models."""
    return _HERE / "data" / "heldout.txt"


__all__ = ["BUILTIN_MODELS", "builtin_dir", "heldout_text_path"]
