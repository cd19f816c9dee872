"""Argument checks shared by the fused decode ops (``norms``, ``rope``, ``gates``): each raises
ValueError naming the op, the argument and the fix."""

from __future__ import annotations

import torch

from .capabilities import triton_device_reason

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fused_ops_reason(t: torch.Tensor) -> str | None:
    """None when the fused Triton kernels can run on t's device, else why not (one line)."""
    return triton_device_reason(t.device)



def warps_for(block: int) -> int:
    """Warps for a program over ``block`` columns."""
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def require_triton(op: str, t: torch.Tensor) -> None:
    why = fused_ops_reason(t)
    if why is not None:
        raise ValueError(f"{op}: {why}; call {op}_torch instead")


def check_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; expected bfloat16, float16 or float32")


def check_last_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must have a contiguous last dim (stride 1, got strides "
                         f"{tuple(t.stride())}); pass {name}.contiguous()")


def check_same(op: str, tensors: dict[str, torch.Tensor]) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"{op}: {', '.join(tensors)} must be on one device, got {sorted(map(str, devices))}")


def check_weight(op: str, weight: torch.Tensor, n: int, dim: str) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] != n:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{op}: weight must be a float32 tensor of shape [{n}] (the {dim}), got {got}")
    if weight.dtype != torch.float32:
        raise ValueError(f"{op}: weight has dtype {weight.dtype}; expected float32 (the effective weight, "
                         "prepared once by the caller, e.g. (1 + w).float())")


def as_rows(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """t ``[..., N]`` as a ``[M, N]`` view with one row stride (never a copy)."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{op}: the leading dims of {name} (shape {tuple(t.shape)}, strides "
                         f"{tuple(t.stride())}) do not flatten to rows without a copy; pass "
                         f"{name}.contiguous()") from None

