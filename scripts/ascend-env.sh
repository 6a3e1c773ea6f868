#!/usr/bin/env bash
# Build the Ascend virtual environment (.venv-ascend): CPU torch + triton-ascend, never upstream
# triton (both install the package `triton`, so they cannot share an environment).
#
# What it holds: torch==2.13.0 (the CPU build; pip's find-links serve the local +cpu wheel),
# triton-ascend==3.2.0 and pybind11 (imported by triton-ascend at load time), the project's
# runtime and test dependencies, and fqr itself in editable mode without dependencies.
#
# Idempotent and quick when done: a stamp file records a hash of this script and pyproject.toml;
# while it matches and the interpreter imports triton's Ascend backend, nothing is reinstalled.
#
# Usage: scripts/ascend-env.sh [VENV_DIR]      (default .venv-ascend; env FQR_ASCEND_PYTHON
#        picks the base interpreter, default python3.11 or python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${FQR_ASCEND_VENV:-$ROOT/.venv-ascend}}"
STAMP="$VENV/.fqr-ascend-env.stamp"
TORCH_SPEC="torch==2.13.0"
TRITON_ASCEND_SPEC="triton-ascend==3.2.0"
# numpy < 2.4: triton-ascend 3.2's interpreter turns 1-element arrays into ints (program ids,
# loop bounds), which numpy 2.4 made an error (deprecated since 1.25).
PACKAGES=(pybind11 "typer>=0.12" "rich>=13" "safetensors>=0.4" "platformdirs>=3" "numpy>=1.24,<2.4" "pytest>=8" "hypothesis>=6")

want="$(cat "${BASH_SOURCE[0]}" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] \
   && "$VENV/bin/python" -c "import triton.backends.ascend, fqr" 2>/dev/null; then
  echo "ascend-env: $VENV is up to date" >&2
  exit 0
fi

start=$(date +%s)
base="${FQR_ASCEND_PYTHON:-$(command -v python3.11 || command -v python3)}"
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "ascend-env: creating $VENV with $base" >&2
  "$base" -m venv "$VENV"
fi
pip_install() {
  # pip warns once per package about find-links folders that do not exist here: not news.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "^WARNING: Location 'file:" || true; }
}

# torch first, alone, so that nothing later can resolve a different (CUDA) build.
pip_install "$TORCH_SPEC"
if [[ "$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda)')" != "None" ]]; then
  echo "ascend-env: a CUDA build of torch was installed; the Ascend env needs the CPU build" >&2
  exit 1
fi
# triton-ascend declares no dependencies; upstream triton must never come in beside it.
if "$VENV/bin/python" -m pip show triton >/dev/null 2>&1; then
  echo "ascend-env: removing upstream triton from $VENV" >&2
  "$VENV/bin/python" -m pip uninstall --quiet -y triton
fi
pip_install "$TRITON_ASCEND_SPEC" "${PACKAGES[@]}"
pip_install --no-deps --no-build-isolation -e "$ROOT"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import triton, triton.backends.ascend  # noqa: F401  (fails loudly when pybind11 etc. are missing)
import fqr  # noqa: F401
dists = {d.metadata["Name"].lower() for d in md.distributions()}
assert "triton" not in dists, "upstream triton is installed in the Ascend env"
print(f"ascend-env: triton-ascend {md.version('triton-ascend')} (triton {triton.__version__}), "
      f"torch {md.version('torch')}", flush=True)
PY
echo "$want" > "$STAMP"
echo "ascend-env: ready in $(( $(date +%s) - start ))s: $VENV" >&2
