"""Residual add + RMSNorm of decode rows in one launch (``add_rms_norm``) and its torch twin.

``[..., H]`` rows, programs per (row, 512 columns), each reading its whole row for the norm. It
sums a split-K product's float32 partials as the residual, writes its output ConvRot-rotated too
with ``rotate=G`` (in the kernel for groups of 16 and 256, ``convrot_triton.convrot_rows``), and
with ``defer=True`` leaves the row's factor to the GEMV reading its output (``row_norm.py``).
Computes in float32, stores in x's dtype; the twin has the same rounding points.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .convrot_triton import convrot_rows, rotated, rotation, tile_cols, twin_rotate
from .op_checks import as_rows, check_dtype, check_last_contiguous, check_same, check_weight, require_triton, warps_for
from .pdl import enter, launch_args
from .row_norm import RowNorm

__all__ = ["add_rms_norm", "add_rms_norm_torch"]

NORM_SLICE = 512  # columns each add_rms_norm program writes (each reads its whole row for the norm)


@triton.jit
def _residual_rows(X, R, row, sx, sr, sr_p, cols, ok, HAS_RES: tl.constexpr, PARTS: tl.constexpr,
                   DT: tl.constexpr):
    """float32 ``h = x + residual`` (rounded to DT, with the partials summed and rounded first) at ``cols``."""
    x = tl.load(X + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row * sr + cols, mask=ok, other=0.0).to(tl.float32)
        for p in tl.static_range(1, PARTS):  # float32 partials of a split-K product, summed
            r += tl.load(R + p * sr_p + row * sr + cols, mask=ok, other=0.0)
        if PARTS > 0:
            r = r.to(DT).to(tl.float32)  # rounding point: the product in x's dtype
        x = (x + r).to(DT).to(tl.float32)  # rounding point: h is a tensor of x's dtype
    return x


@triton.jit
def _add_rms_norm_kernel(
    X, R, W, Y, HOUT, YROT, SQ,
    sx, sr, sr_p, sw, n_cols, eps,
    HAS_RES: tl.constexpr, PARTS: tl.constexpr, ROT: tl.constexpr, IEEE: tl.constexpr, BLOCK: tl.constexpr,
    SLICE: tl.constexpr, DEFER: tl.constexpr, PDL: tl.constexpr,
):
    # Program (row, slice) writes its SLICE columns (h, y and y rotated). It reads the whole row for
    # the mean square; with DEFER only its slice: then y is written without the row's factor and
    # the slice's sum of squares goes to SQ[row, slice] (``kernels/row_norm.py``). The slice is
    # loaded first: its load is in flight while the whole row is loaded and reduced.
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    DT: tl.constexpr = Y.dtype.element_ty
    sc = tile_cols(tl.program_id(1) * SLICE, SLICE)  # [SLICE // 16, 16], as convrot_rows takes it
    ok = sc < n_cols
    w = tl.load(W + sc * sw, mask=ok, other=0.0)
    if DEFER:
        hs = _residual_rows(X, R, row, sx, sr, sr_p, sc, ok, HAS_RES, PARTS, DT)
        tl.store(SQ + row * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(hs * hs, 1), 0))
        y = (hs * w).to(DT)
    elif SLICE == BLOCK:  # one program per row
        hs = _residual_rows(X, R, row, sx, sr, sr_p, sc, ok, HAS_RES, PARTS, DT)
        y = (hs * tl.rsqrt(tl.sum(tl.sum(hs * hs, 1), 0) / n_cols + eps) * w).to(DT)
    else:
        hs = _residual_rows(X, R, row, sx, sr, sr_p, sc, ok, HAS_RES, PARTS, DT)
        cols = tl.arange(0, BLOCK)
        h = _residual_rows(X, R, row, sx, sr, sr_p, cols, cols < n_cols, HAS_RES, PARTS, DT)
        y = (hs * tl.rsqrt(tl.sum(h * h, 0) / n_cols + eps) * w).to(DT)
    if HAS_RES:
        tl.store(HOUT + row * n_cols + sc, hs.to(DT), mask=ok)
    tl.store(Y + row * n_cols + sc, y, mask=ok)
    if ROT > 0:
        tl.store(YROT + row * n_cols + tl.trans(sc), convrot_rows(y, ROT, SLICE // 16, IEEE).to(DT),
                 mask=tl.trans(ok))



def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float, *, rotate: int = 0, defer: bool = False) -> tuple:
    """Plain-torch ``add_rms_norm`` (same math and rounding points; no checks, no graph promise)."""
    if residual is not None and residual.dim() == x.dim() + 1:  # split-K partials
        residual = residual.sum(0).to(x.dtype)
    h = x if residual is None else x + residual  # rounded to x.dtype
    if defer:
        hf = h.float()
        y = (hf * weight).to(x.dtype).contiguous()
        norm = (RowNorm(hf.square().sum(-1, keepdim=True), h.shape[-1], float(eps)),)
    else:
        y = F.rms_norm(h.float(), (h.shape[-1],), weight, eps).to(x.dtype).contiguous()
        norm = ()
    return ((y, h) if not rotate else (y, h, twin_rotate(y, rotate))) + norm


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, *, rotate: int = 0, config: tuple[int, int] | None = None,
                 defer: bool = False) -> tuple:
    """Residual add then RMSNorm, one launch. Returns ``(y, h)``, with ``rotate=G`` ``(y, h, y_rot)``;
    ``defer=True`` appends a ``RowNorm`` (``kernels/row_norm.py``) and leaves the row factor out of
    y and y_rot: ``y = h * weight`` rounded to x's dtype, ``RowNorm.sq`` float32 ``[..., P]`` the
    partial sums of squares of h (one per program), for a GEMV that applies the factor
    (``gemv_group(row_norm=)``); no program then reads the whole row.

    x ``[..., H]`` (last dim contiguous; bf16/fp16/fp32); residual the same shape and dtype, or
    float32 partial products ``[P, ..., H]`` (``gemv_group(split=P)``: summed in float32 and
    rounded to x's dtype first, as the unsplit product is), or None; weight float32 ``[H]`` (the
    effective weight, any ``+1`` offset already applied), eps a float.
    ``h = x + residual`` rounded to x's dtype (``h`` is x itself, no copy, when residual is None);
    ``y = h * rsqrt(mean(h**2, -1) + eps) * weight`` in float32, rounded to x's dtype;
    ``y_rot``: y ConvRot-rotated in groups of G (G divides H). y, h and y_rot are ``[..., H]``
    contiguous in x's dtype (h as passed when residual is None). ``config`` = (columns per program,
    warps) overrides the choice (benchmarks, tests).
    """
    op = "add_rms_norm"
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"{op}: x must be a tensor [..., H]")
    check_dtype(op, "x", x)
    hid = x.shape[-1]
    check_weight(op, weight, hid, f"hidden size of x {tuple(x.shape)}")
    tensors = {"x": x, "weight": weight}
    parts = 0  # residual in x's dtype; else the number of float32 partials
    if residual is not None:
        if isinstance(residual, torch.Tensor) and residual.dim() == x.dim() + 1 and residual.shape[1:] == x.shape \
                and residual.dtype == torch.float32 and residual.shape[0] >= 1:
            parts = residual.shape[0]
        elif not isinstance(residual, torch.Tensor) or residual.shape != x.shape or residual.dtype != x.dtype:
            got = (f"{tuple(residual.shape)} {residual.dtype}" if isinstance(residual, torch.Tensor)
                   else type(residual).__name__)
            raise ValueError(f"{op}: residual must match x ({tuple(x.shape)} {x.dtype}), be float32 partials "
                             f"[P, {', '.join(map(str, x.shape))}] or None, got {got}")
        tensors["residual"] = residual
    check_same(op, tensors)
    require_triton(op, x)
    check_last_contiguous(op, "x", x)
    block = triton.next_power_of_2(max(hid, 1))
    slice_ = min(block, NORM_SLICE)
    slice_, warps = (slice_, warps_for(slice_ if defer else block)) if config is None else config
    if slice_ < 1 or block % slice_ or slice_ & (slice_ - 1):
        raise ValueError(f"{op}: config columns {slice_} must be a power of two dividing {block}")
    fused = rotation(op, rotate, hid, slice_)
    x2 = as_rows(op, "x", x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y_rot = torch.empty(x.shape, dtype=x.dtype, device=x.device) if fused else y
    if residual is None:
        h, r2, sr_p, h_out = x, x2, 0, y  # R/HOUT unused (HAS_RES=False)
    else:
        check_last_contiguous(op, "residual", residual)
        if parts and not residual.is_contiguous():
            raise ValueError(f"{op}: partials must be contiguous; pass residual.contiguous()")
        r2 = as_rows(op, "residual", residual[0] if parts else residual)
        sr_p = residual.stride(0) if parts else 0
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        h_out = h
    slices = triton.cdiv(hid, slice_)  # programs per row
    sq = torch.empty(*x.shape[:-1], slices, dtype=torch.float32, device=x.device) if defer else y
    norm = (RowNorm(sq, hid, float(eps)),) if defer else ()
    if x2.shape[0] == 0 or hid == 0:
        return ((y, h) if not rotate else (y, h, y_rot)) + norm
    _add_rms_norm_kernel[(x2.shape[0], slices)](
        x2, r2, weight, y, h_out, y_rot, sq,
        x2.stride(0), r2.stride(0), sr_p, weight.stride(0), hid, float(eps),
        HAS_RES=residual is not None, PARTS=parts, ROT=fused, IEEE=x.dtype == torch.float32, BLOCK=block,
        SLICE=slice_, DEFER=defer, num_warps=warps, **launch_args(x.device),
    )
    if not rotate:
        return (y, h) + norm
    return (y, h, rotated(y, rotate, fused, y_rot)) + norm

