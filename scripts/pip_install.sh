#!/usr/bin/env bash
# `pip install --quiet` into the interpreter PYTHON for the Makefile's set-up, without pip's
# warnings about configured find-links folders that do not exist on this machine (one per
# package: not news; scripts/ascend-env.sh drops them too). pip's exit status is kept.
# Usage: scripts/pip_install.sh PYTHON PIP-INSTALL-ARGS...
set -euo pipefail
python="$1"
shift
"$python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
  | { grep -v "^WARNING: Location 'file:" || true; }
