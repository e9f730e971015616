#!/usr/bin/env bash
# The test command of the README: set up, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -x -q "$@"
