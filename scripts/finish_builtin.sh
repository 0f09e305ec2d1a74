#!/usr/bin/env bash
# Install the built-in models trained on the GPU machine into llmc/models/, then measure them.
#
# Usage: scripts/finish_builtin.sh DIR_WITH_TAR_PARTS
#
# DIR_WITH_TAR_PARTS holds models.tar.aa, models.tar.ab, ... (the GPU machine returns files of at
# most 16 MB, so the tar of both model dirs comes back split). The tar holds only model files;
# the tokenizer files come from .data/tokenizer/ (built here by scripts/build_corpus.py, the same
# tokenizer the GPU run trained with, since .data/ was carried there). Then the evaluation writes
# .data/eval_report.json, <model>/metrics.json and llmc/models/README.md, and the tests run.
set -euo pipefail

parts_dir=${1:?usage: scripts/finish_builtin.sh DIR_WITH_TAR_PARTS}
parts_dir=$(cd "$parts_dir" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

shopt -s nullglob
parts=("$parts_dir"/models.tar.*)
if [ ${#parts[@]} -eq 0 ]; then
    echo "no models.tar.* parts in $parts_dir" >&2
    exit 1
fi
for f in .data/tokenizer/tokenizer.json .data/test.bin; do
    [ -f "$f" ] || { echo "missing $f: run python scripts/build_corpus.py first" >&2; exit 1; }
done

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
# The glob sorts parts as aa, ab, ac..., the order split wrote them.
cat "${parts[@]}" | tar xf - -C "$staging"

for name in tiny-py tiny-py-draft; do
    src="$staging/$name"
    for f in config.json generation_config.json model.safetensors train_log.json; do
        [ -f "$src/$f" ] || { echo "$name: $f missing from the tar (did training fail? see its log)" >&2; exit 1; }
    done
    dst="llmc/models/$name"
    rm -rf "$dst"
    mkdir -p "$dst"
    cp "$src"/{config.json,generation_config.json,model.safetensors,train_log.json} "$dst"/
    cp .data/tokenizer/{tokenizer.json,tokenizer_config.json,special_tokens_map.json} "$dst"/
    chmod 644 "$dst"/*  # save_pretrained writes 0600 safetensors; package data must be readable
    python - "$dst" <<'PY'
import json, sys
log = json.load(open(f"{sys.argv[1]}/train_log.json"))
note = " (STOPPED EARLY by --seconds)" if log["stopped_early"] else ""
print(f"{log['model']}: {log['steps_done']} steps, {log['tokens_seen'] / 1e6:.0f}M tokens, "
      f"{log['epochs']:.1f} epochs, {log['train_wall_s']}s, held-out loss {log['final_heldout_loss']}{note}")
PY
done
cp "$parts_dir"/*.log .data/ 2>/dev/null || true

python scripts/eval_builtin.py \
    --target llmc/models/tiny-py --draft llmc/models/tiny-py-draft --data .data \
    --out .data/eval_report.json --write-metrics --readme llmc/models/README.md
python -m pytest tests/models -q
ls -la llmc/models/tiny-py llmc/models/tiny-py-draft
