"""ConvRot's rotation in plain torch (no Triton needed): the matrix (``hadamard_cached``: built once
per group, device and dtype), and the torch twin of the rotation.

ComfyUI's int8_tensorwise ConvRot weights are stored rotated per group of G input features
(``W_rot = W @ H.T``, H the normalized regular Hadamard matrix of size G); a product with them
needs the input rotated the same way (``x_g @ H``). ``convrot_triton.hadamard_rotate`` is the Triton
version of ``hadamard_rotate_torch``.
"""

from __future__ import annotations

import torch


def convrot_group_ok(size: int) -> bool:
    """True for a ConvRot group size ``hadamard`` builds (a power of 4, at least 4)."""
    return size >= 4 and not size & (size - 1) and not (size.bit_length() - 1) % 2


def hadamard(size: int, *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The normalized regular Hadamard matrix ``[size, size]`` of ConvRot (size a power of 4):
    ``kron`` powers of ``[[1,1,1,-1],[1,1,-1,1],[1,-1,1,1],[-1,1,1,1]] / 2``; symmetric and orthogonal."""
    if not convrot_group_ok(size):
        raise ValueError(f"ConvRot group size must be a power of 4 (>= 4), got {size}")
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)
    h = h4
    while h.shape[0] < size:
        h = torch.kron(h, h4)
    return (h / size ** 0.5).to(dtype=dtype, device=device)


def hadamard_rotate_torch(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x ``[..., K]`` with every group of ``G = h.shape[0]`` features times ``h``: float32 products,
    one rounding to x's dtype. Same math as ``convrot_triton.hadamard_rotate``."""
    g = h.shape[0]
    return (x.reshape(-1, g).float() @ h.to(device=x.device, dtype=torch.float32)).to(x.dtype).reshape(x.shape)


_HADAMARD: dict[tuple, torch.Tensor] = {}


def hadamard_cached(group: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """ConvRot's normalized H_group ``[group, group]`` in ``dtype`` on ``device`` (built once each,
    outside any graph capture: the eager step before a capture builds it)."""
    key = (group, device, dtype)
    if key not in _HADAMARD:
        _HADAMARD[key] = hadamard(group, dtype=dtype, device=device).contiguous()
    return _HADAMARD[key]
