#!/usr/bin/env bash
# The test command: set-up (idempotent), lint, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check specdecode tests benchmarks
pytest -q "$@"
