"""What can run here: one check per question, read by the engine, the nodes' options and the tests.

* ``interpreting()``: Triton kernels run on the CPU through ``TRITON_INTERPRET=1`` (tests).
* ``triton_reason(device)``: None when Triton kernels can run on ``device``, else why not.
* ``triton_module(name)``: a Triton kernel module of this package, or why it cannot be imported.
* ``say_once(log, msg)``: the warning when a slower path is taken, once per process.

The capability matrix (which backend and path runs where) is in ARCHITECTURE.md.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to run kernels on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_device_reason(device) -> str | None:
    """None when Triton kernels can run on ``device`` (CUDA/ROCm, or the CPU under the interpreter)."""
    kind = torch.device(device).type
    if kind == "cuda" or (kind == "cpu" and interpreting()):
        return None
    return f"Triton needs a CUDA/ROCm device (got {kind}; set TRITON_INTERPRET=1 to test on CPU)"


@functools.lru_cache(maxsize=None)
def triton_module(name: str):
    """``(module, None)`` for ``kernels.<name>`` (a Triton kernel module), or ``(None, reason)``."""
    try:
        return importlib.import_module(f".{name}", __package__), None
    except Exception as exc:  # no Triton wheel for this platform, or a broken install
        return None, f"Triton is not usable here ({type(exc).__name__}: {exc})"


def triton_reason(device, name: str = "attention_triton") -> str | None:
    """None when the Triton kernels of ``kernels.<name>`` import and can run on ``device``."""
    _, why = triton_module(name)
    return why if why is not None else triton_device_reason(device)


_SAID: set[str] = set()


def say_once(log: logging.Logger, msg: str) -> None:
    """Warn about a missing capability (a slower path taken) the first time ``msg`` comes up."""
    if msg not in _SAID:
        _SAID.add(msg)
        log.warning(msg)
