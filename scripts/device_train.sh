#!/usr/bin/env bash
# Drafter regeneration + training on a lent GPU (issue: drafters that learn), prepared so a lucky
# session loses no time. The device tool carries at most 64 MiB of working tree per call and
# brings back 8 files of 16 MiB; our tracked tree is ~135 MB (the shipped drafters), the target
# GGUF is 98 MB. So the payload travels in parts while the machine stays warm (30 s after a call):
#
#   here:    bash scripts/device_train.sh prepare      # .device/ (git-ignored): payload-1..3, and
#                                                     # the shipped drafter weights and data/regen/*.npz moved to .device/stash
#   device:  run command="bash scripts/device_train.sh receive && bash scripts/device_check.sh"
#                carry=[".device/payload-1"]   timeout_s=420   # the prepared check rides on the first part
#   device:  run command="bash scripts/device_train.sh receive" carry=[".device/payload-2"]   timeout_s=120
#   device:  run command="TRAIN_MIN=N bash scripts/device_train.sh train" carry=[".device/payload-3"]
#                timeout_s=N*60+150                           # N: what the lease's budget_left_s allows
#   here:    bash scripts/device_train.sh restore FILES_AT   # drafter weights back into the tree;
#                                                           # the GPU checkpoints (int8) into runs/train/gpu-*
# (`stash` alone moves the drafter weights out, `restore` alone puts them back: any device call,
# scripts/device_check.sh too, needs the tree under 64 MiB.)
#
# Call the three device runs back to back (each within 30 s of the last, or the machine goes back
# and the parts are lost). `train` assembles and checks the GGUF, converts it with transformers
# (the `gguf` wheel travels in the payload: the machine has no network), unpacks the committed
# regenerated data (every data/regen/*.npz, carried in the payloads), optionally regenerates more for REGEN_S seconds (new
# answers to the committed prompt set under another seed, REGEN_SEED, batch REGEN_BATCH, packed back
# to $OUT as regen-seed<N>.npz and trained on with the rest), then trains METHODS (default dspark,eagle,dflash) side by side,
# warm-started from the checkpoints in the payload, for TRAIN_MIN minutes with the learning rate
# annealed to that limit (the GPU's step rate is not known beforehand), and sends the checkpoints
# back as int8 exports in one tar split into <16 MiB parts in $OUT. The payload also carries the transformers and gguf wheels this
# project pins (the machine's own transformers is another minor, and GGUF loading changes between
# minors). Everything also runs on the CPU (DEVICE=cpu) for a dry run of the plumbing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEV=.device
WORK=${SPECDECODE_DEVICE_WORK:-/root/specdecode-device}
METHODS=${METHODS:-dspark,eagle,dflash}
DEVICE=${DEVICE:-cuda}
TRAIN_MIN=${TRAIN_MIN:-6}
REGEN_S=${REGEN_S:-0}
REGEN_SEED=${REGEN_SEED:-1}  # seed 0 made the committed set: another seed gives new answers
REGEN_BATCH=${REGEN_BATCH:-1024}
STEPS=${STEPS:-10000}  # a ceiling: the schedule ends at TRAIN_MIN (--anneal-to-time-limit)
WARMUP=${WARMUP:-200}
TOKENS=${TOKENS:-16384}
PART_MB=15  # files back from $OUT: 16 MiB each at most

lightest() {  # the payload holding the fewest bytes so far (1, 2 or 3)
  for j in 1 2 3; do echo "$(du -sb "$DEV/payload-$j" | cut -f1) $j"; done | sort -n | head -1 | cut -d' ' -f2
}

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
  pip download gguf==0.19.0 transformers==5.24.0 --no-deps -q -d "$DEV/payload-1/wheels"
  # the prompt set the committed data answers (the device's Python has other stdlib docstrings)
  [ -f runs/data/prompts/stats.json ] || specdecode data build --out runs/data/prompts --num-prompts 6481
  cp -r runs/data/prompts "$DEV/payload-1/prompts"
  # warm starts: the best runs here, else the shipped drafters (config + weights, no optimiser),
  # each into the lightest payload (with the ~14 MB tree each call must stay under 64 MiB)
  for m in ${METHODS//,/ }; do
    src=runs/train/$m-best
    [ -f "$src/model.safetensors" ] || src=specdecode/data/drafters/smollm2-135m-$m
    i=$(lightest)
    mkdir -p "$DEV/payload-$i/init/$m"
    cp "$src/config.json" "$src/model.safetensors" "$DEV/payload-$i/init/$m/"
  done
  # the committed regenerated sets travel in the payloads too (the tree leaves them behind), each
  # into the lightest payload; train unpacks and reads every one of them
  for f in data/regen/*.npz; do
    i=$(lightest)
    mkdir -p "$DEV/payload-$i/regen-npz"
    cp "$f" "$DEV/payload-$i/regen-npz/"
  done
  stash
  du -sh "$DEV"/payload-* ; echo "tree without the drafter weights: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1)"
}

stash() {  # the tracked drafter weights and data sets stay behind while the tree travels (restore puts them back)
  grep -qx "/$DEV/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$DEV/" >> .git/info/exclude; }
  for f in specdecode/data/drafters/*/model.safetensors data/regen/*.npz; do
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
  data=""
  for f in "$WORK"/regen-npz/*.npz; do  # every committed set (data/regen/*.npz)
    python3 -m specdecode.cli data unpack "$f" --out "$WORK/regen-$(basename "$f" .npz)"
    data="$data${data:+,}$WORK/regen-$(basename "$f" .npz)"
  done
  if [ "$REGEN_S" -gt 0 ]; then
    [ -d "$WORK/prompts" ] || python3 -m specdecode.cli data build --out "$WORK/prompts" --num-prompts 6481
    timeout -s TERM "$REGEN_S" python3 -m specdecode.cli data regen --target "$WORK/model" --data "$WORK/prompts" \
      --out "$WORK/regen-seed$REGEN_SEED" --samples 4 --batch-size "$REGEN_BATCH" --max-new-tokens 256 \
      --seed "$REGEN_SEED" --device "$DEVICE" 2>&1 | tr '\r' '\n' | grep -v '^$' | tail -3 || true
    python3 -m specdecode.cli data pack --data "$WORK/regen-seed$REGEN_SEED" --out "$OUT/regen-seed$REGEN_SEED.npz"
    data="$data,$WORK/regen-seed$REGEN_SEED"
  fi
  python3 -m specdecode.cli train "$METHODS" --target "$WORK/model" --data "$data" \
    --out "$WORK/train" --device "$DEVICE" --bf16 --steps "$STEPS" --tokens-per-batch "$TOKENS" \
    --warmup-steps "$WARMUP" --lr 5e-4 --checkpoint-every 500 --eval-prompts 0 --time-limit "$TRAIN_MIN" \
    --anneal-to-time-limit --init-from "$WORK/init" 2>&1 \
    | tr '\r' '\n' | grep -v '^$' | tail -40 | tee "$OUT/train.log"
  # At most 8 files of 16 MiB (64 MiB in all) come back: the checkpoints travel as int8 (the
  # shipped storage, half of bf16) in one tar split in parts; the logs' last records ride in train.log.
  rm -rf "$WORK/back"
  for m in ${METHODS//,/ }; do
    python3 -m specdecode.cli export "$WORK/train/$m" --format specdecode --storage int8 --out "$WORK/back/gpu-$m"
    [ ! -f "$WORK/train/$m/log.jsonl" ] || { echo "== $m log.jsonl"; tail -3 "$WORK/train/$m/log.jsonl"; } >> "$OUT/train.log"
  done
  tar -C "$WORK/back" -cf - . | split -b "${PART_MB}M" -d - "$OUT/drafters.tar.part-"
  ls -la "$OUT"
}

restore() {
  if [ -d "$DEV/stash/specdecode" ]; then
    cp -r "$DEV/stash/specdecode/." specdecode/
    [ ! -d "$DEV/stash/data" ] || cp -r "$DEV/stash/data/." data/
    rm -rf "$DEV/stash"
  fi
  git status --short specdecode/data/drafters data/regen | head
  at=${1:-}
  [ -n "$at" ] || return 0
  ls "$at"/drafters.tar.part-* > /dev/null 2>&1 || return 0
  mkdir -p runs/train
  cat "$at"/drafters.tar.part-* | tar -C runs/train -xf -
  for m in ${METHODS//,/ }; do
    if [ -d "runs/train/gpu-$m" ]; then echo "$m: runs/train/gpu-$m (int8; serve with --drafter runs/train/gpu-$m; warm-start CPU training from it)"; fi
  done
  for f in "$at"/regen-seed*.npz; do
    [ -f "$f" ] || continue
    echo "more regenerated data: $f (specdecode data unpack $f --out runs/data/$(basename "$f" .npz))"
  done
}

"${1:?usage: device_train.sh prepare|stash|receive|train|restore [FILES_AT]}" "${@:2}"
