#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment in .venv, PyTorch (the CPU wheel
# unless a torch is already installed there), this package with its test tools, and the
# embedded default model (SmolLM2-135M-Instruct) converted once into the specdecode cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv" >&2
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch 2.13.0" >&2
  pip install -q --disable-pip-version-check torch==2.13.0
fi
if ! python -c "import specdecode, pytest, ruff, scipy" 2>/dev/null || [ pyproject.toml -nt .venv/.specdecode-installed ]; then
  echo "[setup] installing specdecode and its dependencies" >&2
  pip install -q --disable-pip-version-check -e '.[dev]'
  touch .venv/.specdecode-installed
fi
specdecode models install smollm2-135m >/dev/null
specdecode models install mt-bench >/dev/null
specdecode models install humaneval >/dev/null
echo "[setup] ready: . .venv/bin/activate" >&2
