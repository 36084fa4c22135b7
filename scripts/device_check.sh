#!/usr/bin/env bash
# The prepared device check, for a session that is lent a GPU (one call of the device tool,
# well under 8 minutes): the CUDA-marked tests (tiny models the tests build themselves) and a
# step-cost profile of the native runtime with random weights of SmolLM2-135M's and a 7B
# llama's shapes. Nothing large travels: no checkpoint, no GGUF (the SmolLM2 GGUF is 98 MB and
# the device tool carries 64 MiB of working tree; the shipped drafters are not needed here).
# Trained-drafter figures on the GPU need the target's weights: carry a bf16 safetensors copy
# split in two halves over two calls while the machine is warm, or measure them on the CPU.
#
#   here:         bash scripts/device_train.sh stash     # the tracked tree is ~135 MB; the tool carries 64 MiB
#   device tool:  run  command="bash scripts/device_check.sh"  timeout_s=540
#   here:         bash scripts/device_train.sh restore   # the shipped drafter weights back
#
# The machine has its own Python with torch (CUDA), transformers, tokenizers, safetensors,
# scipy and pytest and no network: this package runs from the working tree (PYTHONPATH).
# Everything it reports lands in $OUT (log, junit XML, the profile as .md and .json).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  echo "# device check $(date -u +%FT%TZ) at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
} | tee "$OUT/device-check.log"
timeout 240 python3 -m pytest -q -m cuda tests/gpu -p no:cacheprovider \
  --junitxml "$OUT/cuda-tests.xml" 2>&1 | tee -a "$OUT/device-check.log"
tests_rc=${PIPESTATUS[0]}
timeout 240 python3 benchmarks/bench_device_profile.py --device cuda --out "$OUT" 2>&1 | tee -a "$OUT/device-check.log"
echo "cuda tests exit code: $tests_rc" | tee -a "$OUT/device-check.log"
exit "$tests_rc"
