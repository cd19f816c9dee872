"""Main job on an embedded default (``bash scripts/demo.sh``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.capacity_demo import run  # noqa: E402

if __name__ == "__main__":
    run()
