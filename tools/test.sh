#!/usr/bin/env bash
# The test command: `tools/test.sh` from anywhere.
#  - installs Mesa lavapipe (software Vulkan) when no Vulkan driver is present,
#  - fetches and converts the real Gemma 3 270M model once (cached in models/),
#  - runs every test of the workspace in release mode.
# GPU tests fail (never skip) when no adapter can be found.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/gpu-env.sh
source tools/model-cache.sh
tools/setup-real-model.sh
cargo test --release --workspace "$@"
