#!/usr/bin/env bash
# The main job of the README: set up, then pretrain the `tiny` Llama on 2 CPU ranks with the
# recipes' default corpus (recipes/corpus/). Extra arguments go to recipes/pretrain.py (e.g. --steps 20, --optimizer adamw).
# OUT (default runs/tiny) is the run folder; NPROC (default 2) the number of ranks.
# Rerunning it is safe: a finished run in OUT is reported (exit 0); an interrupted one resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NPROC=$NPROC: the number of ranks must be a whole number >= 1, e.g. NPROC=2" >&2
  exit 2
fi
bash scripts/setup.sh
PY=${PYTHON:-python3}
OUT=${OUT:-runs/tiny}
ARGS=(--config recipes/configs/tiny.toml --out "$OUT" "$@")
# (step_N folders only, not a killed save's step_N.tmp; the recipe also checks that the marker is readable)
if compgen -G "$OUT/checkpoints/step_*[0-9]/recipe_done.json" >/dev/null; then
  ARGS+=(--resume)  # an interrupted run continues from its latest complete checkpoint
fi
# Validate the config, data and model once, before any rank starts: one line and exit 2 on an
# error, exit 3 when the run is already finished (reported by the check).
rc=0
msg=$("$PY" recipes/pretrain.py "${ARGS[@]}" --check "$NPROC") || rc=$?
if [ "$rc" -eq 3 ]; then
  echo "$msg"
  exit 0
elif [ "$rc" -ne 0 ]; then
  exit "$rc"
fi
exec "$PY" recipes/launch.py --standalone --nproc_per_node="$NPROC" recipes/pretrain.py "${ARGS[@]}"
