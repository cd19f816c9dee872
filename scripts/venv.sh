# Sourced by demo.sh and test.sh: make ./.venv if needed and install torch plus one requirements file.
# TORCH_SPEC overrides the torch requirement (default torch==2.13.0, a CPU build on the CI machines).
set -euo pipefail
req_file="$1"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q --disable-pip-version-check -r "$req_file"
