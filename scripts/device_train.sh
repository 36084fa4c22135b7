#!/usr/bin/env bash
# Drafter regeneration + training on a lent GPU (issue: drafters that learn), prepared so a lucky
# session loses no time. The device tool carries at most 64 MiB of working tree per call and
# brings back 8 files of 16 MiB; our tracked tree is ~135 MB (the shipped drafters), the target
# GGUF is 98 MB. So the payload travels in parts while the machine stays warm (30 s after a call):
#
#   here:    bash scripts/device_train.sh prepare      # .device/ (git-ignored): payload-1..3, and
#                                                     # the shipped drafter weights moved to .device/stash
#   device:  run command="bash scripts/device_train.sh receive" carry=[".device/payload-1"]   timeout_s=120
#   device:  run command="bash scripts/device_train.sh receive" carry=[".device/payload-2"]   timeout_s=120
#   device:  run command="bash scripts/device_train.sh train"   carry=[".device/payload-3"]   timeout_s=590
#   here:    bash scripts/device_train.sh restore FILES_AT   # drafter weights back into the tree;
#                                                           # the GPU checkpoints into runs/train/gpu-*
# (`stash` alone moves the drafter weights out, `restore` alone puts them back: any device call,
# scripts/device_check.sh too, needs the tree under 64 MiB.)
#
# Call the three device runs back to back (each within 30 s of the last, or the machine goes back
# and the parts are lost). `train` assembles and checks the GGUF, converts it with transformers
# (the `gguf` wheel travels in the payload: the machine has no network), unpacks the committed
# regenerated data, optionally regenerates more for REGEN_S seconds (resumable, packed back to
# $OUT), then trains METHODS (default dspark,eagle) side by side, warm-started from the
# checkpoints in the payload, for TRAIN_MIN minutes, and splits each checkpoint into <16 MiB parts
# in $OUT. Everything also runs on the CPU (DEVICE=cpu) for a dry run of the plumbing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEV=.device
WORK=${SPECDECODE_DEVICE_WORK:-/root/specdecode-device}
METHODS=${METHODS:-dspark,eagle}
DEVICE=${DEVICE:-cuda}
TRAIN_MIN=${TRAIN_MIN:-6}
REGEN_S=${REGEN_S:-0}
STEPS=${STEPS:-20000}
TOKENS=${TOKENS:-16384}
PART_MB=15  # files back from $OUT: 16 MiB each at most

prepare() {
  . .venv/bin/activate
  rm -rf "$DEV/payload-1" "$DEV/payload-2" "$DEV/payload-3"
  mkdir -p "$DEV"/payload-{1,2,3} "$DEV/stash"
  gguf=$(python -c "from specdecode.assets import get_model_asset, locate; \
a = get_model_asset('smollm2-135m'); print(locate(*a.parts[0]))")
  split -n 3 -d "$gguf" "$DEV/gguf-part-"
  for i in 1 2 3; do mv "$DEV/gguf-part-0$((i - 1))" "$DEV/payload-$i/gguf-part-$i"; done
  python -c "from specdecode.assets import get_model_asset; a = get_model_asset('smollm2-135m'); \
print(a.gguf_name, a.sha256)" > "$DEV/payload-3/gguf.txt"
  pip download gguf --no-deps -q -d "$DEV/payload-1/wheels"
  # warm starts: the best runs here, else the shipped drafters (config + weights, no optimiser)
  i=1
  for m in ${METHODS//,/ }; do
    src=runs/train/$m-best
    [ -f "$src/model.safetensors" ] || src=specdecode/data/drafters/smollm2-135m-$m
    mkdir -p "$DEV/payload-$i/init/$m"
    cp "$src/config.json" "$src/model.safetensors" "$DEV/payload-$i/init/$m/"
    i=$((i % 2 + 1))
  done
  stash
  du -sh "$DEV"/payload-* ; echo "tree without the drafter weights: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1)"
}

stash() {  # the tracked drafter weights stay behind while the tree travels (restore puts them back)
  grep -qx "/$DEV/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$DEV/" >> .git/info/exclude; }
  for f in specdecode/data/drafters/*/model.safetensors; do
    mkdir -p "$DEV/stash/$(dirname "$f")"
    mv "$f" "$DEV/stash/$f"
  done
}

receive() {
  mkdir -p "$WORK"
  for p in "$DEV"/payload-*; do cp -r "$p"/. "$WORK/"; done
  ls -la "$WORK"
}

train() {
  receive
  set -x
  read -r name sha < "$WORK/gguf.txt"
  cat "$WORK"/gguf-part-1 "$WORK"/gguf-part-2 "$WORK"/gguf-part-3 > "$WORK/$name"
  echo "$sha  $WORK/$name" | sha256sum -c -
  python3 -m pip install --no-deps --no-index -q "$WORK"/wheels/*.whl --target "$WORK/pylib" 2>&1 | tail -2
  export PYTHONPATH="$ROOT:$WORK/pylib" PYTHONUNBUFFERED=1
  OUT=${OUT:-$WORK/out}
  mkdir -p "$OUT"
  [ -f "$WORK/model/config.json" ] || python3 -c "from pathlib import Path; from specdecode.assets import convert_gguf; \
convert_gguf(Path('$WORK/$name'), Path('$WORK/model'))"
  python3 -m specdecode.cli data unpack data/regen/smollm2-135m.npz --out "$WORK/regen"
  if [ "$REGEN_S" -gt 0 ]; then
    [ -d "$WORK/prompts" ] || python3 -m specdecode.cli data build --out "$WORK/prompts" --num-prompts 6481
    timeout -s TERM "$REGEN_S" python3 -m specdecode.cli data regen --target "$WORK/model" --data "$WORK/prompts" \
      --out "$WORK/regen" --samples 4 --batch-size 256 --max-new-tokens 256 --seed 0 --device "$DEVICE" || true
    python3 -m specdecode.cli data pack --data "$WORK/regen" --out "$OUT/regen.npz"
  fi
  python3 -m specdecode.cli train "$METHODS" --target "$WORK/model" --data "$WORK/regen" --out "$WORK/train" \
    --device "$DEVICE" --bf16 --steps "$STEPS" --tokens-per-batch "$TOKENS" --warmup-steps 50 --lr 5e-4 \
    --checkpoint-every 200 --eval-prompts 0 --time-limit "$TRAIN_MIN" --init-from "$WORK/init" 2>&1 \
    | tr '\r' '\n' | grep -v '^$' | tail -40 | tee "$OUT/train.log"
  for m in ${METHODS//,/ }; do
    cp "$WORK/train/$m/config.json" "$OUT/$m-config.json"
    split -b "${PART_MB}M" -d "$WORK/train/$m/model.safetensors" "$OUT/$m-model.part-"
  done
  ls -la "$OUT"
}

restore() {
  if [ -d "$DEV/stash/specdecode" ]; then cp -r "$DEV/stash/specdecode/." specdecode/ && rm -rf "$DEV/stash"; fi
  git status --short specdecode/data/drafters | head
  at=${1:-}
  [ -n "$at" ] || return 0
  for m in ${METHODS//,/ }; do
    [ -f "$at/$m-config.json" ] || continue
    dst=runs/train/gpu-$m
    mkdir -p "$dst"
    cat "$at/$m-model.part-"* > "$dst/model.safetensors"
    cp "$at/$m-config.json" "$dst/config.json"
    echo "$m: $dst (serve with --drafter $dst; warm-start CPU training from it)"
  done
  [ -f "$at/regen.npz" ] && echo "more regenerated data: $at/regen.npz (specdecode data unpack it beside runs/data)"
}

"${1:?usage: device_train.sh prepare|stash|receive|train|restore [FILES_AT]}" "${@:2}"
