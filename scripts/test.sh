#!/usr/bin/env bash
# Lint and the test suite. Without CUDA, Triton kernels run under TRITON_INTERPRET=1; GPU tests skip.
# Then, when called without arguments, the real-ComfyUI tests on every supported ComfyUI tree
# (scripts/test_comfyui.sh: 0.29.0 and the two newer stacks in ../shared/comfyui, built and cached
# on first use). QWEN35_FAST_COMFYUI_MATRIX=0 skips them, =1 runs them even with arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh requirements-dev.txt
.venv/bin/python -m ruff check .
.venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
matrix="${QWEN35_FAST_COMFYUI_MATRIX:-$([ $# -eq 0 ] && echo 1 || echo 0)}"
if [ "$matrix" != 0 ]; then
  bash scripts/test_comfyui.sh
fi
