"""Run a Python script or module with ``import triton`` failing, as on a Windows ComfyUI without
triton-windows (torch's Windows wheels ship no Triton).

    python benchmarks/without_triton.py benchmarks/comfy_e2e.py --comfyui ... [args]
    python benchmarks/without_triton.py -m pytest ... [args]

``sys.modules["triton"] = None`` before anything imports torch: then ``import triton`` raises
ImportError and ``importlib.util.find_spec("triton")`` is None, which is what torch and
comfy-kitchen check. ``hidden()`` says whether this process runs so.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

USAGE = "usage: without_triton.py SCRIPT.py [args] | -m MODULE [args]"


def hidden() -> bool:
    """True when ``import triton`` was made to fail in this process (by this wrapper)."""
    return "triton" in sys.modules and sys.modules["triton"] is None


def restart(script: str) -> None:
    """Replace this process (which imported torch, so Triton cannot be hidden in it any more) with
    ``script`` run through this wrapper, with the same arguments."""
    os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()), str(Path(script).resolve()),
                              *sys.argv[1:]])


def main(argv: list[str]) -> None:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(USAGE)
    if "torch" in sys.modules:
        raise SystemExit("without_triton.py: torch was imported before Triton could be hidden")
    sys.modules["triton"] = None
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
