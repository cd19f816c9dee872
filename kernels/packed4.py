"""A 4-bit weight as ComfyUI stores it (``convrot_w4a4``, ``nvfp4``), Triton-free: the record the
ComfyUI glue builds over a ``QuantizedTensor``'s own storage (no copy), its checks, and a torch
twin of the dequantization (``dequantize``: what comfy-kitchen's layouts compute, float32).

Layouts (``kernels/gemv4.py`` reads them in place; comfy-kitchen 0.2.24+ ``tensor/convrot_w4a4.py``,
``tensor/nvfp4.py``):

* ``convrot_w4a4``: ``qdata`` int8 ``[N, K/2]`` (signed nibbles, even column low), ``scale`` float32
  ``[N]``, rows ConvRot-rotated in groups of ``convrot``: ``W = (q * scale) @ H_G`` per group.
* ``nvfp4``: ``qdata`` uint8 ``[roundup(N,16), roundup(K,16)/2]`` (E2M1 codes, even column high),
  ``block_scale`` float8_e4m3fn swizzled ``[roundup(N,128), roundup(K/16,4)]``, ``scale`` float32
  ``[]``: ``W = e2m1(q) * block_scale * scale``.
"""

from __future__ import annotations

import torch

__all__ = ["FORMATS", "Packed4", "dequantize", "packed_reason", "round_up"]

#: The 4-bit formats (ComfyUI's ``QUANT_ALGOS`` names) the decode GEMV reads in place.
FORMATS = ("convrot_w4a4", "nvfp4")


class Packed4:
    """One 4-bit weight as stored (see the module docstring): ``fmt`` (a ``FORMATS`` name),
    ``qdata`` (the packed bytes), ``scale`` (convrot_w4a4: float32 ``[N]``; nvfp4: float32 ``[]``),
    ``block_scale`` (nvfp4: float8_e4m3fn swizzled; else None), ``n``, ``k`` (the logical shape),
    ``convrot`` (convrot_w4a4's group size G)."""

    __slots__ = ("fmt", "qdata", "scale", "block_scale", "n", "k", "convrot")

    def __init__(self, fmt: str, qdata: torch.Tensor, scale: torch.Tensor, block_scale: torch.Tensor | None,
                 n: int, k: int, convrot: int = 0):
        self.fmt, self.qdata, self.scale, self.block_scale = fmt, qdata, scale, block_scale
        self.n, self.k, self.convrot = int(n), int(k), int(convrot)


def round_up(v: int, m: int) -> int:
    """v rounded up to a multiple of m."""
    return -(-v // m) * m


def packed_reason(p: Packed4) -> str | None:
    """None when ``p``'s storage is what its format stores (shapes, dtypes, one device), else why not."""
    q, n, k = p.qdata, p.n, p.k
    if p.fmt not in FORMATS:
        return f"format {p.fmt!r} is not one of {', '.join(FORMATS)}"
    if q.dim() != 2 or q.stride(1) != 1:
        return "its packed weight is not a row-major matrix"
    if p.fmt == "convrot_w4a4":
        if q.dtype != torch.int8 or tuple(q.shape) != (n, k // 2) or k % 2:
            return f"convrot_w4a4 storage {q.dtype} {tuple(q.shape)} is not int8 [{n}, {k // 2}]"
        if p.scale.dtype != torch.float32 or p.scale.numel() != n:
            return (f"convrot_w4a4 scale {p.scale.dtype} {tuple(p.scale.shape)} is not float32 per output row "
                    "(per-group scales are not a layout kitchen writes)")
        if p.convrot and k % p.convrot:
            return f"its ConvRot group {p.convrot} does not divide the width {k}"
        return None if p.scale.device == q.device else "its scale is on another device"
    bs = p.block_scale
    if q.dtype != torch.uint8 or tuple(q.shape) != (round_up(n, 16), round_up(k, 16) // 2):
        return f"nvfp4 storage {q.dtype} {tuple(q.shape)} is not uint8 [{round_up(n, 16)}, {round_up(k, 16) // 2}]"
    want = (round_up(round_up(n, 16), 128), round_up(round_up(k, 16) // 16, 4))
    if bs is None or bs.dtype != torch.float8_e4m3fn or bs.numel() != want[0] * want[1] or not bs.is_contiguous():
        got = "none" if bs is None else f"{bs.dtype} {tuple(bs.shape)}"
        return f"nvfp4 block scales ({got}) are not float8_e4m3fn in the swizzled layout {want}"
    if p.scale.dtype != torch.float32 or p.scale.numel() != 1:
        return f"nvfp4 tensor scale {p.scale.dtype} {tuple(p.scale.shape)} is not one float32"
    return None if bs.device == q.device == p.scale.device else "its scales are on another device"


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(p: Packed4) -> torch.Tensor:
    """The float32 weight ``[n, k]`` the stored tensors of ``p`` stand for (the torch twin of what
    the GEMV multiplies by; comfy-kitchen's layouts compute the same)."""
    if p.fmt == "convrot_w4a4":
        b = p.qdata.to(torch.int32)
        lo, hi = (b << 28) >> 28, b >> 4
        q = torch.stack([lo, hi], -1).reshape(p.n, -1)[:, :p.k].float() * p.scale.float().reshape(-1, 1)
        if p.convrot:
            from .convrot import hadamard

            h = hadamard(p.convrot, dtype=torch.float32, device=q.device)
            q = (q.reshape(p.n, -1, p.convrot) @ h).reshape(p.n, p.k)
        return q
    b = p.qdata.to(torch.int32) & 255
    codes = torch.stack([b >> 4, b & 15], -1).reshape(b.shape[0], -1)
    vals = torch.tensor(_E2M1, device=b.device)[codes]
    rows, blocks = vals.shape[0], vals.shape[1] // 16
    n_rb, n_cb = -(-rows // 128), -(-blocks // 4)
    bs = p.block_scale.view(torch.uint8).reshape(n_rb, n_cb, 32, 4, 4).permute(0, 3, 2, 1, 4)
    bs = bs.reshape(n_rb * 128, n_cb * 4)[:rows, :blocks].view(torch.float8_e4m3fn).float()
    w = vals.reshape(rows, blocks, 16) * bs[..., None] * p.scale.float()
    return w.reshape(rows, -1)[:p.n, :p.k]
