#!/usr/bin/env bash
# The test command: `tools/test.sh` from anywhere.
#  - installs Mesa lavapipe (software Vulkan) when no Vulkan driver is present,
#  - fetches and converts the real Gemma 3 270M model once (cached in models/),
#  - runs every test of the workspace in release mode.
# GPU tests fail (never skip) when no adapter can be found.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/gpu-env.sh
# The converted real model is cached per machine (models/ links to the cache).
cache="${MARKBASE_MODEL_CACHE:-$HOME/.cache/markbase/models}"
if [ ! -e models ]; then
  mkdir -p "$cache"
  ln -s "$cache" models
fi
tools/setup-real-model.sh
cargo test --release --workspace "$@"
