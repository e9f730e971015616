#!/usr/bin/env bash
# Installs fsdp_optim (editable) and its test dependencies into the current Python.
# torch: an existing install is kept. Otherwise torch==2.13.0 is installed from PyPI, which on Linux
# is the CUDA build (multi-GB; right for GPU machines). For the CPU-only wheel, install it first:
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# Nothing is installed when this checkout's fsdp_optim and every dependency are already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if "$PY" - 2>/dev/null <<'PYEOF'
# Exit 0 (skip installing) only if fsdp_optim resolves to this checkout, every core and dev
# dependency of pyproject.toml is importable (distribution name -> module name: "-" -> "_") and the
# test-only reference below is installed at its pinned version.
import importlib.metadata, importlib.util, os, re, sys
try:
    import tomllib
except ImportError:  # Python 3.10: the tomli backport, if installed; otherwise install (it is a dependency there)
    try:
        import tomli as tomllib
    except ImportError:
        sys.exit(1)
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = project["dependencies"] + project["optional-dependencies"]["dev"]
names = [re.split(r"[<>=!~ \[]", r, maxsplit=1)[0] for r in reqs if ";" not in r]
spec = importlib.util.find_spec("fsdp_optim")  # found, not imported: this check takes milliseconds
ours = spec is not None and os.path.samefile(os.path.dirname(spec.origin), "fsdp_optim")
try:
    reference = importlib.metadata.version("gram-newton-schulz") == "0.1.6"
except importlib.metadata.PackageNotFoundError:
    reference = False
sys.exit(0 if ours and reference and all(importlib.util.find_spec(n.lower().replace("-", "_")) for n in names) else 1)
PYEOF
then
  exit 0
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[dev]"
# The reference the Gram Newton-Schulz / Polar Express tests compare with (tests/optimizers/
# test_orthogonalize.py): the authors' package, pure-torch backend. --no-deps: its declared
# dependencies (quack-kernels, nvidia-cutlass-dsl) are its CUDA kernels, unused by that backend.
"$PY" -m pip install --quiet --no-deps "gram-newton-schulz==0.1.6"
