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
# The deployment recipe's gateway (sims/deploy.py) is nginx, from Debian's packages where apt-get is
# at hand (as root); without it the deployment tests are skipped, saying so.
if ! command -v nginx >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light) >/dev/null 2>&1; then
        service nginx stop >/dev/null 2>&1 || true  # the package starts one on port 80; the tests start their own
    else
        echo "setup: nginx could not be installed; the deployment tests will be skipped" >&2
    fi
fi
stamp=.venv/.qpriv-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    pip install --quiet -e ".[dev]"
    touch "$stamp"
fi
