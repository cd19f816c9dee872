#!/usr/bin/env bash
# Lint and the test suite. Without CUDA, Triton kernels run under TRITON_INTERPRET=1; GPU tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh requirements-dev.txt
.venv/bin/python -m ruff check .
exec .venv/bin/python -m pytest -q "$@"
