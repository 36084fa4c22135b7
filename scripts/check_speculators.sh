#!/usr/bin/env bash
# Conformance of `specdecode` exports with the vLLM `speculators` package (docs/interop.md).
# speculators 0.9.0 pins transformers<=5.19 while specdecode pins 5.24, so it lives in its own
# environment, .venv-speculators (created here on first use, with our torch and --no-deps).
# Usage: scripts/check_speculators.sh [WORK_DIR [dflash=DIR] [dspark=DIR]]  (trained drafters to check;
# default: the shipped ones when they have the published layer, else seeded random ones)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
WORK="${1:-$(mktemp -d)}"
SPEC=.venv-speculators
if [ ! -x "$SPEC/bin/python" ]; then
  python3 -m venv "$SPEC"
  TORCH_REQ="torch==$(.venv/bin/python -c 'import torch; print(torch.__version__)')"
  "$SPEC/bin/pip" install -q "$TORCH_REQ" "transformers==5.19.0" "pydantic>=2" pydantic-settings \
    "loguru==0.7.3" safetensors "numpy<=2.5.4" tqdm huggingface-hub tokenizers jinja2 typer rich \
    pyyaml openai "datasets==5.1.0" "hs-connectors==0.9.0"
  # --no-deps: its torchvision / torchaudio / CUDA requirements are not needed to load and run models
  "$SPEC/bin/pip" install -q --no-deps "speculators==0.9.0"
fi
.venv/bin/python scripts/speculators_conformance.py reference "$WORK" "${@:2}"
"$SPEC/bin/python" scripts/speculators_conformance.py check "$WORK" 2>&1 | grep -E "CONFORMANCE|Error|error"
exit "${PIPESTATUS[0]}"
