"""What can run here: one check per question, read by the engine, the nodes' options and the tests.

* ``interpreting()``: Triton kernels run on the CPU through ``TRITON_INTERPRET=1`` (tests).
* ``triton_reason(device)``: None when Triton kernels can run on ``device``, else why not.
* ``triton_module(name)``: a Triton kernel module of this package, or why it cannot be imported.
* ``pdl_reason(device)``: None when the decode kernels may launch with programmatic dependent
  launch (Hopper+: a kernel starts while its predecessor finishes; ``kernels/pdl.py``), else why not
  (``triton_pdl_reason()``: the part that is this Triton's).
* ``device_record(device)``: a CUDA device's name, compute capability, SM count, shared memory a
  block may opt in to and L2 size (None elsewhere: the interpreter has no limits), what the launch
  tables (``kernels/launch.py``) read. ``simulate(record)`` makes every device that record: a GPU
  this machine does not have, for compiling the kernels for it (``tests/kernels/consumer_step.py``).
* ``say_once(log, msg)``: the warning when a slower path is taken, once per process.
* ``QUANT_DTYPES`` / ``fp8_reason(device)``: the weight dtypes the weight-only GEMV widens in
  registers (int8, fp8 e4m3fn / e5m2), and None when fp8 weights can be read on ``device``, else why not.

The capability matrix (which backend and path runs where) is in ARCHITECTURE.md.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from dataclasses import dataclass

import torch


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to run kernels on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class DeviceRecord:
    """What launch settings depend on: ``name`` as torch reports it (``"NVIDIA H200"``), ``arch`` the
    compute capability as major * 10 + minor (90), ``sms`` multiprocessors, ``shared`` bytes of shared
    memory a block may opt in to, ``l2`` bytes of L2 cache."""

    name: str
    arch: int
    sms: int
    shared: int
    l2: int


_SIMULATED: list[DeviceRecord] = []


def simulate(record: DeviceRecord | None) -> None:
    """Treat every device as ``record`` (None: stop): CPU tensors go to Triton compiled for that GPU,
    and every launch pick and capability check reads it. For compiling the kernels for a GPU that
    is not there (``tests/kernels/fake_gpu.py`` makes Triton's driver that GPU); never in the pack."""
    _SIMULATED[:] = [record] if record is not None else []
    _device_pdl_reason.cache_clear()


def simulated() -> DeviceRecord | None:
    """The record ``simulate`` set, or None."""
    return _SIMULATED[0] if _SIMULATED else None


def device_record(device) -> DeviceRecord | None:
    """``device``'s record: the simulated one when set, a CUDA device's own, else None (the CPU or
    the interpreter: no limits)."""
    if _SIMULATED:
        return _SIMULATED[0]
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_record(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_record(device_index: int) -> DeviceRecord:
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    return DeviceRecord(props.name, props.major * 10 + props.minor, props.multi_processor_count, smem,
                        int(getattr(props, "L2_cache_size", 0) or 0))


def compiled(device) -> bool:
    """True where Triton compiles kernels for ``device`` (a CUDA device without the interpreter, or a
    simulated GPU), False where it interprets them."""
    return bool(_SIMULATED) or (torch.device(device).type == "cuda" and not interpreting())


def triton_device_reason(device) -> str | None:
    """None when Triton kernels can run on ``device`` (CUDA/ROCm, or the CPU under the interpreter)."""
    kind = torch.device(device).type
    if kind == "cuda" or (kind == "cpu" and (interpreting() or _SIMULATED)):
        return None
    return f"Triton needs a CUDA/ROCm device (got {kind}; set TRITON_INTERPRET=1 to test on CPU)"


@functools.lru_cache(maxsize=None)
def triton_module(name: str):
    """``(module, None)`` for ``kernels.<name>`` (a Triton kernel module), or ``(None, reason)``."""
    try:
        return importlib.import_module(f".{name}", __package__), None
    except Exception as exc:  # no Triton wheel for this platform, or a broken install
        return None, unusable_reason(exc)


def unusable_reason(exc: BaseException) -> str:
    """Why Triton kernels cannot be imported (``exc``), with the command that installs the Triton
    matching this torch (``triton_advice``; on Windows the ``triton-windows`` build)."""
    from .triton_advice import advice

    windows = sys.platform == "win32"
    return f"Triton is not usable here ({type(exc).__name__}: {exc}); {advice(torch.__version__, windows=windows)}"


def triton_reason(device, name: str = "attention_triton") -> str | None:
    """None when the Triton kernels of ``kernels.<name>`` import and can run on ``device``."""
    _, why = triton_module(name)
    return why if why is not None else triton_device_reason(device)


#: Weight dtypes read by the weight-only GEMV (``kernels/gemv.py``) with a float32 scale.
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
FP8_DTYPES = QUANT_DTYPES[1:]


def fp8_reason(device) -> str | None:
    """None when the GEMV can widen fp8 weights on ``device`` (NVIDIA compute capability 8.9+, the
    fp8 conversions Triton emits, or the CPU interpreter), else why not (one line)."""
    device = torch.device(device)
    if _SIMULATED and device.type == "cpu":
        arch = _SIMULATED[0].arch
        return None if arch >= 89 else f"fp8 weights are read in place on compute capability 8.9+ (this is {arch})"
    if device.type != "cuda":
        return None if interpreting() else f"fp8 weights are read in place on CUDA GPUs, not {device.type}"
    if torch.version.hip:
        return "fp8 weights are read in place on NVIDIA GPUs only (this is ROCm)"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return (f"fp8 weights are read in place on Ada, Hopper or newer GPUs (compute capability 8.9+; "
                f"this one is {cap[0]}.{cap[1]})")
    return None


#: Set to "0" to launch every kernel plainly (benchmarks compare the two).
PDL_ENV = "QWEN35_FAST_PDL"


@functools.lru_cache(maxsize=None)
def triton_pdl_reason() -> str | None:
    """None when this Triton can launch kernels with programmatic dependent launch (its launcher
    takes ``launch_pdl``: Triton 3.4+; the kernels' ``griddepcontrol`` instructions are the pack's
    own, ``kernels/pdl.py``), else why not."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception as exc:  # no Triton, or no NVIDIA backend
        return f"this Triton has no programmatic dependent launch ({type(exc).__name__}: {exc}; Triton 3.4+ has it)"
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return "this Triton's launcher takes no launch_pdl (Triton 3.4+ does)"
    return None


@functools.lru_cache(maxsize=None)
def _device_pdl_reason(device: torch.device) -> str | None:
    if _SIMULATED:
        arch = _SIMULATED[0].arch
        return triton_pdl_reason() if arch >= 90 else f"needs compute capability 9.0+; this GPU is {arch / 10}"
    if device.type != "cuda" or interpreting():
        return f"needs a CUDA device without TRITON_INTERPRET (got {device.type})"
    if torch.version.hip is not None:
        return "ROCm has no programmatic dependent launch"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"needs compute capability 9.0+ (Hopper or newer); this GPU is {major}.{minor}"
    return triton_pdl_reason()


def pdl_reason(device) -> str | None:
    """None when Triton kernels on ``device`` may launch with programmatic dependent launch, else
    why not (one line). Off on the interpreter, ROCm, GPUs before Hopper, Triton before 3.4, and
    with ``QWEN35_FAST_PDL=0``. Plain launches are the same kernels without the overlap."""
    if os.environ.get(PDL_ENV) == "0":
        return f"{PDL_ENV}=0"
    dev = device if isinstance(device, torch.device) else torch.device(device)  # called per kernel launch
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _device_pdl_reason(dev)


_SAID: set[str] = set()


def say_once(log: logging.Logger, msg: str) -> None:
    """Warn about a missing capability (a slower path taken) the first time ``msg`` comes up."""
    if msg not in _SAID:
        _SAID.add(msg)
        log.warning(msg)
