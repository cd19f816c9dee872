#!/usr/bin/env bash
# Main job on an embedded default: see README "Quick start". Extra arguments go to scripts/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cache_env.sh
source scripts/venv.sh requirements.txt
exec .venv/bin/python scripts/demo.py "$@"
