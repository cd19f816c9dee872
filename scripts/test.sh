#!/usr/bin/env bash
# Lint and the test suite. Without CUDA, Triton kernels run under TRITON_INTERPRET=1; GPU tests skip.
# Then, when called without arguments, the real-ComfyUI tests (scripts/test_comfyui.sh: the trees of
# ../shared/comfyui where it exists, else QWEN35_FAST_COMFYUI_TREE=<your ComfyUI folder>, else ComfyUI
# 0.29.0 by git; skipped with one line saying why where none is possible). QWEN35_FAST_COMFYUI_MATRIX=0
# skips them, =1 runs them even with arguments. QWEN35_FAST_CACHE_HOME=<folder> keeps every cache there
# (scripts/cache_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cache_env.sh
source scripts/venv.sh requirements-dev.txt
.venv/bin/python -m ruff check .
matrix="${QWEN35_FAST_COMFYUI_MATRIX:-$([ $# -eq 0 ] && echo 1 || echo 0)}"
if [ "$matrix" != 0 ]; then
  # the ComfyUI trees and their venv build (downloads and unpacking, cached) while the unit tests run;
  # test_comfyui.sh waits for that build (comfyui_trees.sh holds a lock) and shows a failed one's error
  bash scripts/comfyui_trees.sh >/dev/null 2>&1 &
fi
.venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
if [ "$matrix" != 0 ]; then
  bash scripts/test_comfyui.sh
fi
