#!/usr/bin/env bash
# Single-GPU optimizer throughput, ours vs torch.optim.Muon's Newton–Schulz and torchao's AdamW8bit
# (see benchmarks/gpu_check.py), then the fully_shard runtime with its side streams on one NCCL rank
# vs FSDP2 (benchmarks/gpu_runtime_check.py). Finishes in under 5 minutes on one GPU; writes
# benchmarks/results/gpu_check.json and gpu_runtime_check.json.
#
#   bash benchmarks/gpu_check.sh            # full sizes on a GPU; tiny CPU sizes (eager) without one
#   bash benchmarks/gpu_check.sh --tiny     # force the CPU smoke sizes
#
# Without a GPU it degrades to a smoke run: tiny sizes on the CPU, torch.compile disabled
# (TORCHDYNAMO_DISABLE=1, both sides eager) so it takes seconds; its JSON says "smoke_run": true.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || [[ " $* " == *" --tiny "* ]]; then
  echo "gpu_check: no CUDA device (or --tiny): CPU smoke run, tiny sizes, eager"
  export TORCHDYNAMO_DISABLE=1
  args=()
  for a in "$@"; do [[ "$a" == --tiny ]] || args+=("$a"); done
  exec timeout 300 "$PY" benchmarks/gpu_check.py --tiny ${args[@]+"${args[@]}"}
fi
timeout 240 "$PY" benchmarks/gpu_check.py "$@"
# The runtime with streams on: one NCCL rank, ours vs FSDP2 (loss, overlap from a CUDA trace, peak memory).
exec timeout 120 "$PY" benchmarks/gpu_runtime_check.py
