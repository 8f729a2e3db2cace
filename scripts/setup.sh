#!/usr/bin/env bash
# Idempotent set-up used by every README command: a virtualenv in .venv with this project installed.
# torch is installed first and only when missing, so a GPU user's own CUDA build is kept;
# TORCH_SPEC picks the build on a fresh machine (default: the CPU 2.13.0 wheel these machines carry).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
    pip install --quiet --upgrade pip
    pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
stamp=.venv/.qpriv-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    pip install --quiet -e ".[dev]"
    touch "$stamp"
fi
