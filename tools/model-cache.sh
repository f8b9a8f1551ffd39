# Sourced by the scripts: models/ links to a per-machine cache of the converted
# real model (MARKBASE_MODEL_CACHE, default ~/.cache/markbase/models).
cache="${MARKBASE_MODEL_CACHE:-$HOME/.cache/markbase/models}"
if [ ! -e models ]; then
  mkdir -p "$cache"
  ln -s "$cache" models
fi
