"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (Hopper and newer).

A decode step is a chain of ~340 short kernels in which every kernel reads what the one before
wrote. Launched plainly, each waits until its predecessor has finished before it is even scheduled,
so the GPU pays a ramp-up and a drain per kernel. With PDL (``launch_pdl=True``) a kernel may be
scheduled once every program of its predecessor has called ``griddepcontrol.launch_dependents``;
it then runs the part that reads nothing its predecessors write (the DeltaNet step loads the
recurrent state of the previous token) and calls ``griddepcontrol.wait``, which returns when the
predecessor grid has completed and its writes are visible. Since every PDL kernel waits before it
reads or writes anything its predecessors touch, and a kernel completes only after its own wait,
completion is transitive: the chain computes exactly what plain launches compute.

The protocol every kernel compiled with ``PDL=True`` follows:

* small kernels: ``enter(PDL)`` first (let the next kernel launch, then wait);
* the GEMV: wait, then let the next kernel launch (so a product's programs never queue ahead of
  the one streaming); its weights stream evict-first.

No GEMV touches its weights before its wait: prefetching or preloading them there did not pay
(the measurements: ``benchmarks/CHANGELOG.md``, ``benchmarks/README.md``). What does: the product
asking L2 for the next one's weight once its own result is stored (``gemv_group(prefetch=)``).

``launch_args(device)`` gives the launch keywords (``PDL`` and ``launch_pdl``) that
``capabilities.pdl_reason`` allows; elsewhere (interpreter, ROCm, pre-Hopper, Triton < 3.4,
``QWEN35_FAST_PDL=0``) the kernels launch plainly with ``PDL=False`` and compile to what they were.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .capabilities import pdl_reason

__all__ = ["enter", "launch_args", "trigger", "wait"]


@triton.jit
def _gdc_wait():
    # The PTX of Triton 3.6's own ``gdc_wait``. Triton's helpers are not called: Triton 3.4.0's
    # (torch 2.8's) take a ``_builder`` argument its compiler no longer passes, so every kernel
    # calling them failed to compile there (``tests/kernels/test_consumer_gpu.py`` compiles the step under it).
    tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gdc_launch_dependents():
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def enter(PDL: tl.constexpr):
    """A small kernel's first statement: the next kernel may launch; wait for the previous one."""
    if PDL:
        _gdc_launch_dependents()
        _gdc_wait()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait until the previous kernel has completed and its writes are visible."""
    if PDL:
        _gdc_wait()


@triton.jit
def trigger(PDL: tl.constexpr):
    """Let the next kernel launch (it waits for this one before it reads anything)."""
    if PDL:
        _gdc_launch_dependents()


_ON, _OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}


def launch_args(device) -> dict:
    """Launch keywords for a kernel with a ``PDL`` constexpr (pass as ``**launch_args(device)``;
    not to be modified): ``{"PDL": True, "launch_pdl": True}`` where
    ``capabilities.pdl_reason(device)`` is None, else ``{"PDL": False}``."""
    return _ON if pdl_reason(device) is None else _OFF
