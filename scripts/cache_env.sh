# Sourced by test.sh, test_comfyui.sh, comfyui_trees.sh and demo.sh (from the clone's root).
# QWEN35_FAST_CACHE_HOME=<folder> keeps every cache the scripts and tests write in that folder
# (relative: inside the clone, e.g. QWEN35_FAST_CACHE_HOME=.cache): pip's downloads, the ComfyUI
# trees and their venv, the random test checkpoints, Triton's kernels, Hugging Face files.
# Unset: each tool's own default (mostly ~/.cache); ./.venv is in the clone either way.
if [ -n "${QWEN35_FAST_CACHE_HOME:-}" ]; then
  mkdir -p "$QWEN35_FAST_CACHE_HOME"
  QWEN35_FAST_CACHE_HOME="$(cd "$QWEN35_FAST_CACHE_HOME" && pwd)"
  export QWEN35_FAST_CACHE_HOME
  export XDG_CACHE_HOME="$QWEN35_FAST_CACHE_HOME"
  export PIP_CACHE_DIR="$QWEN35_FAST_CACHE_HOME/pip"
  export TRITON_CACHE_DIR="$QWEN35_FAST_CACHE_HOME/triton"
  export HF_HOME="$QWEN35_FAST_CACHE_HOME/huggingface"
  export QWEN35_FAST_CI_CACHE="${QWEN35_FAST_CI_CACHE:-$QWEN35_FAST_CACHE_HOME/qwen35-fast-ci}"
  export QWEN35_FAST_CACHE="${QWEN35_FAST_CACHE:-$QWEN35_FAST_CI_CACHE/checkpoints}"
fi
