"""Kernels whose cost follows the filled length, each beside a torch twin with the same semantics.

This is the front module the engine imports: decode attention (``attention.py``: the backend table
and ``decode_attention``; backends in ``attention_triton.py``, ``attention_kitchen.py``,
``attention_torch.py``), the capability checks (``capabilities.py``) and, loaded only where Triton
runs, the fused decode ops (``fused_ops.py``, torch twins ``*_torch`` inside) and the fused
DeltaNet step (``deltanet_step.py``; its torch twin is ``engine.deltanet``).
"""

from . import attention_torch
from .attention import (
    ATTENTION_BACKENDS,
    ATTENTION_CHOICES,
    HEAD_DIMS,
    MAX_DECODE_ROWS,
    AttentionBackend,
    backend_for,
    backend_reason,
    decode_attention,
    resolve_backend,
)
from .attention_torch import bucket_end
from .capabilities import interpreting, say_once, triton_device_reason, triton_module, triton_reason

__all__ = [
    "ATTENTION_BACKENDS",
    "ATTENTION_CHOICES",
    "attention_torch",
    "HEAD_DIMS",
    "MAX_DECODE_ROWS",
    "AttentionBackend",
    "backend_for",
    "backend_reason",
    "bucket_end",
    "decode_attention",
    "interpreting",
    "resolve_backend",
    "say_once",
    "triton_device_reason",
    "triton_module",
    "triton_reason",
]
