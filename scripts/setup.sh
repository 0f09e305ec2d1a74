#!/usr/bin/env bash
# Install llmc and its dependencies into the current Python environment.
# torch is installed first, pinned, so that pip does not pull a multi-GB CUDA build on a CPU machine;
# a machine that already has torch (for example a GPU machine) keeps its own build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[dev]"
# pyenv exposes new console scripts through shims that only a rehash creates
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
"$PY" -c "import llmc, torch, triton, transformers; print('llmc', llmc.__version__, '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
