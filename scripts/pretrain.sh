#!/usr/bin/env bash
# The main job of the README: set up, then pretrain the `tiny` Llama on 2 CPU ranks with the
# embedded default corpus. Extra arguments go to recipes/pretrain.py (e.g. --steps 20, --optimizer adamw).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-runs/tiny}
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc_per_node=2 \
  recipes/pretrain.py --config recipes/configs/tiny.toml --out "$OUT" "$@"
