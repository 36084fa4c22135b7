#!/usr/bin/env bash
# The main job on the embedded default model: generate with SmolLM2-135M-Instruct through the
# plain loop (ar) and EAGLE-3 speculation (`--method` picks another); print tau and the speed-up.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/specdecode demo "$@"
