#!/usr/bin/env bash
# The test command: `tools/test.sh` from anywhere.
#  - installs Mesa lavapipe (software Vulkan) when no Vulkan driver is present,
#  - fetches and converts the real Gemma 3 270M model once (cached in models/),
#  - installs the pinned `openai` Python client (the server's tests use it),
#  - runs every test of the workspace in release mode (and, without arguments, the batch GEMM's
#    cases again with the f16 GEMM's staging options off, and with 32-token tiles).
# GPU tests fail (never skip) when no adapter can be found.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/gpu-env.sh
source tools/model-cache.sh
# The build (5-9 minutes on 2 cores) runs while the Python client is installed and the real
# model is fetched and converted (mostly downloads and single-threaded Python); its errors, if
# any, are reported by the run below.
mkdir -p target
cargo test --release --workspace --no-run >target/test-build.log 2>&1 &
build=$!
# the official OpenAI client, for the server's tests (tests/server.rs runs tests/openai_client.py)
OPENAI_PKG="openai==3.63.0"
if ! "${PYTHON:-python3}" -c 'import sys; from importlib.metadata import version; sys.exit(version("openai") != sys.argv[1])' "${OPENAI_PKG#*==}" 2>/dev/null; then
  "${PYTHON:-python3}" -m pip install --disable-pip-version-check -q "$OPENAI_PKG"
fi
tools/setup-real-model.sh
wait "$build" || echo "the early build failed (target/test-build.log); building again below"
cargo test --release --workspace "$@"
# the f16 GEMM's staging options (`MARKBASE_COOP_WV`, `_XW`, `_PD`, on by default; and
# `MARKBASE_ROW_MT`: src/gpu/ops/gemm_f16.rs, matmul.rs) turned off, through the batch GEMM's cases
if [ $# -eq 0 ]; then
  MARKBASE_COOP_WV=0 MARKBASE_COOP_XW=0 MARKBASE_COOP_PD=1 cargo test --release --test row_gemm
  # (and their cooperative-matrix variants through naga's validation, which checks the
  # uniformity the products need: the twin above has no products)
  MARKBASE_COOP_WV=0 MARKBASE_COOP_XW=0 MARKBASE_COOP_PD=2 cargo test --release --test naga_targets
  MARKBASE_ROW_MT=1 cargo test --release --test row_gemm
fi
