"""ConvRot's rotation in Triton: a launch of its own, and the in-register rotation of a tile that
the norm, gate and DeltaNet kernels apply to their own output. ``convrot.py`` beside it holds the
matrix and the torch twin (``hadamard_rotate_torch``), which need no Triton.

ComfyUI's int8 ConvRot weights are stored rotated per group of G input features (``W_rot = W @ H.T``),
so their input is rotated the same way (``x_g @ H``) before the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .capabilities import triton_device_reason
from .convrot import convrot_group_ok, hadamard, hadamard_cached, hadamard_rotate_torch
from .pdl import enter, launch_args

#: The widest tile a kernel rotates itself (``rotation``): the block-diagonal product of
#: ``convrot_rows`` grows as the tile squared (a 4096-column tile would need 272 KB of shared memory).
ROT_TILE_MAX = 512


@triton.jit
def _h16(i, j):
    """H_16[i, j] as float32 (+-1/4) from the indices, no load: H_16 = H_4 (x) H_4 / 4, and the regular
    H_4 is -1 on its anti-diagonal (i + j == 3), +1 elsewhere."""
    neg = ((i // 4 + j // 4) == 3) ^ ((i % 4 + j % 4) == 3)
    return tl.where(neg, -0.25, 0.25)


@triton.jit
def convrot_rows(y, G: tl.constexpr, R: tl.constexpr, IEEE: tl.constexpr):
    """``[R, 16]`` values in the io dtype (row r holds features 16r .. 16r + 15 of the tile) with
    every group of G (16 or 256) times H_G, float32 out **transposed**: ``[16, R]``, element
    (j, r) is feature 16r + j (store it at ``tl.trans`` of the input's offsets). H_16 is made in
    registers from the indices (``_h16``), not loaded: the load sat between the kernel's reduction
    and the rotation, on the step's critical path (H200, chained deferred 9B norms, 1 row,
    ``benchmarks/norm.py``: 1.74 -> 1.47 us a launch). H_256 = H_16 (x) H_16, so a group as a 16x16 matrix X (rows
    16g .. 16g + 15 of y) becomes H_16 X H_16 (H_16 is symmetric): first H_16 y^T, then times a
    block-diagonal ``[R, R]`` matrix of H_16 blocks (float32 products). With y as the right
    operand of the first product, Triton leaves the kernel's loads and arithmetic in their own
    layout: as the left operand (and with reshapes of the tile) every loaded tensor went through
    shared memory first (19 barriers in the deferred norm, 7 now; Triton 3.6, sm90)."""
    c = tl.arange(0, 16)
    h = _h16(c[:, None], c[None, :]).to(y.dtype)
    if IEEE:
        z = tl.dot(h, tl.trans(y), input_precision="ieee")
    else:
        z = tl.dot(h, tl.trans(y))  # exact products (H_16 holds +-1/4), float32 sums
    if G == 256:  # the other factor, over the 16 rows of each group
        r = tl.arange(0, R)
        same = (r[:, None] // 16) == (r[None, :] // 16)
        blocks = tl.where(same, _h16(r[:, None] % 16, r[None, :] % 16), 0.0)
        z = tl.dot(z, blocks, input_precision="ieee")
    return z


@triton.jit
def tile_cols(start, COLS: tl.constexpr):
    """Column indices ``start + [0, COLS)`` as ``[COLS // 16, 16]`` (``[1, COLS]`` below 16), the
    shape ``convrot_rows`` takes."""
    C: tl.constexpr = 16 if COLS >= 16 else COLS
    return start + tl.arange(0, COLS // C)[:, None] * C + tl.arange(0, C)[None, :]



@triton.jit
def _rotate_kernel(X, H, Y, K, sx_m, sy_m, G: tl.constexpr, GROUPS: tl.constexpr, BLOCK_J: tl.constexpr,
                   IEEE: tl.constexpr, PDL: tl.constexpr):
    # Program (row, group tile, column block): GROUPS consecutive groups of one row as the rows of a
    # [GROUPS, G] matrix, times columns [j0, j0 + BLOCK_J) of H.
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    c = tl.arange(0, G)
    ok = (grp * G < K)[:, None]
    x = tl.load(X + row * sx_m + grp[:, None] * G + c[None, :], mask=ok, other=0.0)
    h = tl.load(H + c[:, None] * G + j[None, :])
    if IEEE:
        y = tl.dot(x, h, input_precision="ieee")
    else:
        y = tl.dot(x, h)
    tl.store(Y + row * sy_m + grp[:, None] * G + j[None, :], y.to(Y.dtype.element_ty), mask=ok)




def hadamard_rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """ConvRot's activation rotation: every group of ``G`` features times ``h`` ``[G, G]``.

    x ``[..., K]`` (bf16/fp16/fp32, K a multiple of G) -> same shape and dtype; float32
    accumulation, one rounding to x's dtype (as ComfyUI's rotation in x's dtype rounds). With
    weights rotated as ``W_rot = W @ h.T`` per group, ``rotate(x) @ W_rot.T == x @ W.T``. Triton
    where it runs (CUDA, or the CPU interpreter), else ``hadamard_rotate_torch``.
    """
    g = h.shape[0]
    if h.shape != (g, g) or x.shape[-1] % g:
        raise ValueError(f"hadamard_rotate: width {x.shape[-1]} is not a multiple of the group size {g} "
                         f"(h {tuple(h.shape)})")
    if triton_device_reason(x.device) is not None:
        return hadamard_rotate_torch(x, h)
    k = x.shape[-1]
    x2 = flat_rows(x, k)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    groups, block_j = 16, min(64, g)  # 16 groups: the smallest tile the tensor-core dot takes
    hh = h.to(device=x.device, dtype=x.dtype).contiguous()
    grid = (x2.shape[0], triton.cdiv(k // g, groups), g // block_j)
    _rotate_kernel[grid](x2, hh, y, k, x2.stride(0), y.stride(0), G=g, GROUPS=groups, BLOCK_J=block_j,
                         IEEE=x.dtype == torch.float32, num_warps=4, **launch_args(x.device))
    return y.reshape(x.shape)


def flat_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x ``[..., k]`` as ``[M, k]`` rows with a unit column stride (a view where one exists)."""
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def rotation(op: str, rotate: int, width: int, block: int) -> int:
    """G when a kernel rotates its own tile of ``block`` columns, 0 when not (no rotation, or one
    ``hadamard_rotate`` launch after it). Checks G: a ConvRot group size dividing ``width``. Tiles
    of 256 to ``ROT_TILE_MAX`` columns in groups of 16 or 256 rotate in the kernel."""
    if not rotate:
        return 0
    if not convrot_group_ok(rotate) or width % rotate:
        raise ValueError(f"{op}: rotate={rotate} must be a ConvRot group size (a power of 4) that divides "
                         f"the width {width}")
    if rotate in (16, 256) and 256 <= block <= ROT_TILE_MAX and block % rotate == 0:
        return rotate
    return 0


def rotated(out: torch.Tensor, rotate: int, fused: int, out_rot: torch.Tensor) -> torch.Tensor:
    """The rotated output: the kernel's own (``fused``), or a ``hadamard_rotate`` launch over ``out``."""
    return out_rot if fused else hadamard_rotate(out, hadamard_cached(rotate, out.device, out.dtype))


def twin_rotate(y: torch.Tensor, rotate: int) -> torch.Tensor:
    """The torch twins' rotation of their rounded output."""
    return hadamard_rotate_torch(y, hadamard(rotate, device=y.device))
