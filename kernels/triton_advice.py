"""Which Triton a torch release works with, and the one command that installs it (data, tested).

Torch's Linux wheels for NVIDIA bring their Triton; its Windows wheels bring none, and the
community ``triton-windows`` build must match the torch minor version (its README's table). The
pairs below are the Triton each torch release is built and tested with (torch's own binary build
matrix); ``README.md``'s table is checked against them (``tests/kernels/test_triton_advice.py``).
"""

from __future__ import annotations

import re
import sys

#: (torch major, minor) -> (Triton major, minor) it is built with
TORCH_TRITON: dict[tuple[int, int], tuple[int, int]] = {
    (2, 4): (3, 1), (2, 5): (3, 1), (2, 6): (3, 2), (2, 7): (3, 3), (2, 8): (3, 4), (2, 9): (3, 5),
    (2, 10): (3, 6), (2, 11): (3, 6), (2, 12): (3, 7), (2, 13): (3, 7), (2, 14): (3, 8),
}


def triton_for(torch_version: str) -> tuple[int, int] | None:
    """The Triton (major, minor) a torch version string (``"2.11.0+cu130"``) works with, or None for
    one the table does not know."""
    m = re.match(r"(\d+)\.(\d+)", torch_version)
    return TORCH_TRITON.get((int(m[1]), int(m[2]))) if m else None


def install_command(torch_version: str, *, windows: bool, python: str | None = None) -> str | None:
    """The pip command that installs the Triton matching ``torch_version`` into ``python`` (default:
    this interpreter): ``triton-windows<3.N+1`` on Windows, ``triton==3.N.*`` elsewhere; None for a
    torch the table does not know."""
    pair = triton_for(torch_version)
    if pair is None:
        return None
    exe = python or sys.executable
    exe = f'"{exe}"' if " " in exe else exe
    major, minor = pair
    spec = f'"triton-windows<{major}.{minor + 1}"' if windows else f'"triton=={major}.{minor}.*"'
    return f"{exe} -m pip install {spec}"


def advice(torch_version: str, *, windows: bool, python: str | None = None) -> str:
    """One clause for a message about missing Triton: the exact command for this torch, or where to
    look it up when the table does not know this torch."""
    cmd = install_command(torch_version, windows=windows, python=python)
    if cmd is None:
        name = "triton-windows" if windows else "Triton"
        return (f"install the {name} release made for torch {torch_version} (its README lists the pairs) "
                "and restart ComfyUI")
    return f"install it for torch {torch_version}: {cmd}, then restart ComfyUI (README: Triton)"
