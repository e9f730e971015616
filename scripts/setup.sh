#!/usr/bin/env bash
# Installs fsdp_optim (editable) with what the README's two commands need into the current Python:
# `.[dev]`, the tests' requirements, which include the recipes' (`.[recipes]`, for scripts/pretrain.sh).
# torch: an existing install is kept. Otherwise torch==2.13.0 is installed from PyPI, which on Linux
# is the CUDA build (multi-GB; right for GPU machines). For the CPU-only wheel, install it first:
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# Nothing is installed when this checkout's fsdp_optim and every dependency are already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if "$PY" - 2>/dev/null <<'PYEOF'
# Exit 0 (skip installing) only if fsdp_optim resolves to this checkout and every requirement of what
# this script installs, `.[dev]` (the core dependencies, the dev extra and the extras it names:
# fsdp_optim[recipes,hf]), is importable (distribution name -> module name: "-" -> "_"), and the
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
extras, todo, reqs = set(), ["dev"], list(project["dependencies"])
while todo:  # the dev extra and every extra it names as fsdp_optim[...]
    extra = todo.pop()
    if extra not in extras:
        extras.add(extra)
        for r in project["optional-dependencies"][extra]:
            if m := re.fullmatch(r"fsdp_optim\[([\w,\s-]+)\]", r.strip()):
                todo += [e.strip() for e in m.group(1).split(",")]
            else:
                reqs.append(r)
names = [re.split(r"[<>=!~ \[]", r, maxsplit=1)[0] for r in reqs if ";" not in r]
# Where the recipes and tests will import it from, not this folder's copy (python - puts the current
# folder first on sys.path; recipes/pretrain.py runs from recipes/): found, not imported (milliseconds).
sys.path = [p for p in sys.path if p != ""]
spec = importlib.util.find_spec("fsdp_optim")
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
