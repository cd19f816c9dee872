"""Fused elementwise / norm kernels for the decode step (one Triton launch each).

At decode sizes (batch 1, S = 1..8 rows, hidden 4096) a Qwen3.5 layer is dominated by the launch
overhead of ~65 tiny torch kernels. These ops fold the elementwise and norm pieces into one launch
each and are CUDA-graph safe: no host sync, no ``.item()``, no data-dependent Python control flow,
and nothing allocated except the returned outputs. On Hopper+ they launch with programmatic
dependent launch (``kernels/pdl.py``): each lets the next kernel launch, then waits for its inputs.

Ops (each computes in float32 inside the kernel and stores in the input dtype):

* ``add_rms_norm``  residual add + RMSNorm                 ``[..., H]``         programs per (row, 512 columns)
* ``rms_norm_rope`` per-head RMSNorm + partial RoPE,       ``[B,S,Hn,D]`` ->
  written transposed for attention                         ``[B,Hn,S,D]``       one program per (row, head)
  (``rms_norm_rope_to_cache``: k written into its KV cache slots, v beside it;
  ``rms_norm_rope_qk``: q and the cache write of k and v in one launch)
* ``rope_tables``   RoPE cos/sin of S positions             ``[3,S]`` -> ``[S,R]`` one program per row
* ``silu_mul``      SwiGLU activation ``silu(g) * u``      ``[..., N]``         programs per (row, column tile)
* ``sigmoid_gate``  attention output gate ``o * sigmoid(gate)``, transposing o back to rows
                                                           ``[B,S,Hn*D]``       one program per (row, head)

``add_rms_norm``, ``silu_mul`` and ``sigmoid_gate`` take ``rotate=G``: they also return their
output ConvRot-rotated in groups of G (``y_g @ H_G`` of the rounded output, float32 products, one
rounding), which int8 ConvRot projections read directly: the row is in registers once, so the
rotation costs no launch of its own. Groups of 16 and 256 (``H_256 = H_16 (x) H_16``, two 16-wide
products, ``convrot_rows``) within one program's tile of 256 to 512 columns are done in the
kernel, other sizes and wider tiles by a ``hadamard_rotate`` launch after it. ``add_rms_norm``
also sums float32 partial products (a split-K projection), and with ``defer=True`` leaves the
row's factor to the GEMV reading its output (``kernels/row_norm.py``).

Each op has a plain-torch twin (``*_torch``; ``rope_tables``': ``engine.rope.Rope.tables``, which
the engine's torch path calls) doing the identical math; the twins are the fallback
when Triton cannot run and document the exact rounding points ("round" = cast to the input dtype),
which the kernels reproduce by casting to the dtype and back at the same places. The public ops
never fall back on their own: when ``fused_ops_reason`` says the kernels cannot run, they raise
ValueError naming the ``*_torch`` function, and the caller decides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

try:
    from triton.language.extra import libdevice
except ImportError:  # Triton < 3.0: rope_tables uses tl.cos / tl.sin
    libdevice = None

from .capabilities import interpreting, triton_device_reason
from .convrot import convrot_group_ok, hadamard, hadamard_rotate_torch
from .gemv import hadamard_cached, hadamard_rotate
from .pdl import enter, launch_args
from .row_norm import RowNorm

__all__ = [
    "add_rms_norm", "add_rms_norm_torch", "fused_ops_reason", "rms_norm_rope", "rms_norm_rope_qk",
    "rms_norm_rope_to_cache", "rms_norm_rope_to_cache_torch", "rms_norm_rope_torch", "rope_tables",
    "sigmoid_gate", "sigmoid_gate_torch", "silu_mul", "silu_mul_torch",
]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SILU_TILE = 1024  # columns per silu_mul program (no reduction there, so rows are cut into tiles)
_ROT_TILE_MAX = 512  # the widest tile a kernel rotates itself (``_rotation``; silu_mul's tile with it)
_NORM_SLICE = 512  # columns each add_rms_norm program writes (each reads its whole row for the norm)


# ------------------------------------------------------------------ kernels
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


@triton.jit
def _norm_rope_head(X, sx_b, sx_s, sx_h, p, heads, n_rows, W, sw, COS, SIN, sc_s, sc_r, ss_s, ss_r, d, rot, eps,
                    BLOCK: tl.constexpr, DT: tl.constexpr):
    """Head vector p of X ``[B,S,heads,D]`` (p over (b, s, h), h fastest): RMSNorm (rounded to DT)
    then rotate-half RoPE on its first ``rot`` columns with row s of cos/sin. Returns
    ``(float32 [BLOCK], b, s, h)``."""
    h = p % heads
    s = (p // heads) % n_rows
    b = p // (heads * n_rows)
    base = X + b.to(tl.int64) * sx_b + s.to(tl.int64) * sx_s + h.to(tl.int64) * sx_h
    cols = tl.arange(0, BLOCK)
    ok = cols < d
    half = rot // 2
    # partner of each rotary column under rotate-half: c <-> c + half (sign - on the first half)
    partner = tl.where(cols < half, cols + half, cols - half)
    is_rot = cols < rot
    x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(base + partner, mask=is_rot, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / d + eps)
    w = tl.load(W + cols * sw, mask=ok, other=0.0)
    wp = tl.load(W + partner * sw, mask=is_rot, other=0.0)
    # rounding point: the norm returns x's dtype before the rotation
    n = (x * inv * w).to(DT).to(tl.float32)
    n_p = (xp * inv * wp).to(DT).to(tl.float32)
    rot_v = tl.where(cols < half, -n_p, n_p)
    c = tl.load(COS + s * sc_s + cols * sc_r, mask=is_rot, other=1.0)
    sn = tl.load(SIN + s * ss_s + cols * ss_r, mask=is_rot, other=0.0)
    return tl.where(is_rot, n * c + rot_v * sn, n), b, s, h


@triton.jit
def _rms_norm_rope_kernel(
    XQ, WQ, OUTQ, XK, WK, KC, V, VC, LEN, COS, SIN,
    sq_b, sq_s, sq_h, swq, sk_b, sk_s, sk_h, swk, sv_b, sv_s, sv_h, so_b, so_h, so_c,
    sc_s, sc_r, ss_s, ss_r, n_q, hq, hk, n_rows, d, rot, eps,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    # Programs [0, n_q = B*S*hq): one q head vector each, written to OUTQ [B,hq,S,D]. Programs after
    # them: one k head vector each, written into the KV cache KC [B,hk,C,D] at slot LEN[b] + s,
    # with the same row of V [B,S,hk,D] copied beside it into VC.
    enter(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < d
    if pid < n_q:
        out, b, s, h = _norm_rope_head(XQ, sq_b, sq_s, sq_h, pid, hq, n_rows, WQ, swq, COS, SIN, sc_s, sc_r, ss_s,
                                       ss_r, d, rot, eps, BLOCK, OUTQ.dtype.element_ty)
        dst = OUTQ + ((b.to(tl.int64) * hq + h) * n_rows + s) * d + cols
        tl.store(dst, out.to(OUTQ.dtype.element_ty), mask=ok)
    else:
        out, b, s, h = _norm_rope_head(XK, sk_b, sk_s, sk_h, pid - n_q, hk, n_rows, WK, swk, COS, SIN, sc_s, sc_r,
                                       ss_s, ss_r, d, rot, eps, BLOCK, KC.dtype.element_ty)
        at = b.to(tl.int64) * so_b + h.to(tl.int64) * so_h + (tl.load(LEN + b).to(tl.int64) + s) * so_c + cols
        tl.store(KC + at, out.to(KC.dtype.element_ty), mask=ok)
        vrow = tl.load(V + b.to(tl.int64) * sv_b + s.to(tl.int64) * sv_s + h.to(tl.int64) * sv_h + cols, mask=ok)
        tl.store(VC + at, vrow, mask=ok)


@triton.jit
def _rope_tables_kernel(POS, INV, AXIS, COS, SIN, sp_a, sp_s, rot, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
                        PDL: tl.constexpr):
    # Program s: row s of both tables. Column j uses position axis AXIS[j] and frequency j mod rot/2.
    # LIBDEVICE (compiled): libdevice's cosf/sinf, as torch's kernels (the interpreter: numpy's).
    enter(PDL)
    s = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    ok = j < rot
    a = tl.load(AXIS + j, mask=ok, other=0)
    f = tl.load(POS + a * sp_a + s * sp_s, mask=ok, other=0).to(tl.float32) * tl.load(INV + j % (rot // 2), mask=ok,
                                                                                      other=0.0)
    if LIBDEVICE:
        tl.store(COS + s * rot + j, libdevice.cos(f), mask=ok)
        tl.store(SIN + s * rot + j, libdevice.sin(f), mask=ok)
    else:
        tl.store(COS + s * rot + j, tl.cos(f), mask=ok)
        tl.store(SIN + s * rot + j, tl.sin(f), mask=ok)


@triton.jit
def _silu_mul_kernel(G, U, OUT, OROT, sg, su, n_cols, ROT: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tile_cols(tl.program_id(1) * BLOCK, BLOCK)  # [BLOCK // 16, 16], as convrot_rows takes it
    ok = cols < n_cols
    g = tl.load(G + row * sg + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)  # rounding point: F.silu(g)
    out = (act * u).to(OUT.dtype.element_ty)
    tl.store(OUT + row * n_cols + cols, out, mask=ok)
    if ROT > 0:
        tl.store(OROT + row * n_cols + tl.trans(cols),
                 convrot_rows(out, ROT, BLOCK // 16, IEEE).to(OUT.dtype.element_ty), mask=tl.trans(ok))


@triton.jit
def _sigmoid_gate_kernel(
    ATT, GATE, OUT, OROT,
    so_b, so_h, so_s, sg_b, sg_s, sg_h,
    n_heads, n_rows, d,
    ROT: tl.constexpr, IEEE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    enter(PDL)
    pid = tl.program_id(0)  # over (b, s, h), in the output's order
    h = pid % n_heads
    s = (pid // n_heads) % n_rows
    b = pid // (n_heads * n_rows)
    cols = tile_cols(0, BLOCK)  # [BLOCK // 16, 16], as convrot_rows takes it
    ok = cols < d
    o = tl.load(ATT + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h + s.to(tl.int64) * so_s + cols,
                mask=ok, other=0.0).to(tl.float32)
    g = tl.load(GATE + b.to(tl.int64) * sg_b + s.to(tl.int64) * sg_s + h * sg_h + cols,
                mask=ok, other=0.0).to(tl.float32)
    sig = (1.0 / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)  # rounding point: sigmoid
    at = ((b.to(tl.int64) * n_rows + s) * n_heads + h) * d + cols
    out = (o * sig).to(OUT.dtype.element_ty)
    tl.store(OUT + at, out, mask=ok)
    if ROT > 0:
        tl.store(OROT + tl.trans(at), convrot_rows(out, ROT, BLOCK // 16, IEEE).to(OUT.dtype.element_ty),
                 mask=tl.trans(ok))


# ------------------------------------------------------------------ helpers
def fused_ops_reason(t: torch.Tensor) -> str | None:
    """None when the fused Triton kernels can run on t's device, else why not (one line)."""
    return triton_device_reason(t.device)


def _rotation(op: str, rotate: int, width: int, block: int) -> int:
    """G when the kernel rotates its tile itself, 0 when not (no rotation, or one ``hadamard_rotate``
    launch after it). Checks G. Tiles of 256 to ``_ROT_TILE_MAX`` columns rotate in the kernel
    (``convrot_rows``' block-diagonal product grows as the tile squared: a 4096-column tile would
    need 272 KB of shared memory)."""
    if not rotate:
        return 0
    if not convrot_group_ok(rotate) or width % rotate:
        raise ValueError(f"{op}: rotate={rotate} must be a ConvRot group size (a power of 4) that divides "
                         f"the width {width}")
    if rotate in (16, 256) and 256 <= block <= _ROT_TILE_MAX and block % rotate == 0:
        return rotate
    return 0


def _rotated(out: torch.Tensor, rotate: int, fused: int, out_rot: torch.Tensor) -> torch.Tensor:
    """The rotated output: the kernel's own, or a ``hadamard_rotate`` launch over ``out``."""
    return out_rot if fused else hadamard_rotate(out, hadamard_cached(rotate, out.device, out.dtype))


def _num_warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def _require_triton(op: str, t: torch.Tensor) -> None:
    why = fused_ops_reason(t)
    if why is not None:
        raise ValueError(f"{op}: {why}; call {op}_torch instead")


def _check_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; expected bfloat16, float16 or float32")


def _check_last_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must have a contiguous last dim (stride 1, got strides "
                         f"{tuple(t.stride())}); pass {name}.contiguous()")


def _check_same(op: str, tensors: dict[str, torch.Tensor]) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"{op}: {', '.join(tensors)} must be on one device, got {sorted(map(str, devices))}")


def _check_weight(op: str, weight: torch.Tensor, n: int, dim: str) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] != n:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{op}: weight must be a float32 tensor of shape [{n}] (the {dim}), got {got}")
    if weight.dtype != torch.float32:
        raise ValueError(f"{op}: weight has dtype {weight.dtype}; expected float32 (the effective weight, "
                         "prepared once by the caller, e.g. (1 + w).float())")


def _rows(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """t ``[..., N]`` as a ``[M, N]`` view with one row stride (never a copy)."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{op}: the leading dims of {name} (shape {tuple(t.shape)}, strides "
                         f"{tuple(t.stride())}) do not flatten to rows without a copy; pass "
                         f"{name}.contiguous()") from None


# ------------------------------------------------------------------ add + RMSNorm
def _twin_rotate(y: torch.Tensor, rotate: int) -> torch.Tensor:
    return hadamard_rotate_torch(y, hadamard(rotate, device=y.device))


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
    return ((y, h) if not rotate else (y, h, _twin_rotate(y, rotate))) + norm


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
    _check_dtype(op, "x", x)
    hid = x.shape[-1]
    _check_weight(op, weight, hid, f"hidden size of x {tuple(x.shape)}")
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
    _check_same(op, tensors)
    _require_triton(op, x)
    _check_last_contiguous(op, "x", x)
    block = triton.next_power_of_2(max(hid, 1))
    slice_ = min(block, _NORM_SLICE)
    slice_, warps = (slice_, _num_warps(slice_ if defer else block)) if config is None else config
    if slice_ < 1 or block % slice_ or slice_ & (slice_ - 1):
        raise ValueError(f"{op}: config columns {slice_} must be a power of two dividing {block}")
    fused = _rotation(op, rotate, hid, slice_)
    x2 = _rows(op, "x", x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y_rot = torch.empty(x.shape, dtype=x.dtype, device=x.device) if fused else y
    if residual is None:
        h, r2, sr_p, h_out = x, x2, 0, y  # R/HOUT unused (HAS_RES=False)
    else:
        _check_last_contiguous(op, "residual", residual)
        if parts and not residual.is_contiguous():
            raise ValueError(f"{op}: partials must be contiguous; pass residual.contiguous()")
        r2 = _rows(op, "residual", residual[0] if parts else residual)
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
    return (y, h, _rotated(y, rotate, fused, y_rot)) + norm


# ------------------------------------------------------------------ per-head RMSNorm + RoPE
def rms_norm_rope_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
    """Plain-torch ``rms_norm_rope`` (same math and rounding points; no checks, no graph promise)."""
    n = F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype).transpose(1, 2)  # [B,Hn,S,D]
    rot = cos.shape[-1]
    half = rot // 2
    nr = n[..., :rot].float()
    rotated = torch.cat((-nr[..., half:], nr[..., :half]), dim=-1)
    out = (nr * cos + rotated * sin).to(x.dtype)
    return torch.cat((out, n[..., rot:]), dim=-1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm then rotate-half RoPE on the first R dims, written as ``[B,Hn,S,D]``.

    x ``[B,S,Hn,D]`` (any strides, last dim contiguous, e.g. ``qg[..., :D]``; bf16/fp16/fp32),
    weight float32 ``[D]`` (effective weight), cos/sin float32 ``[S, R]`` with R even, 2 <= R <= D.
    Per head vector: ``n = round(x * rsqrt(mean(x**2) + eps) * weight)`` (float32 math, rounded to
    x's dtype as a norm module returns it); ``out[:R] = n[:R]*cos + cat(-n[R/2:R], n[:R/2])*sin`` in
    float32, ``out[R:] = n[R:]``. Returns ``[B,Hn,S,D]`` contiguous in x's dtype.
    """
    _check_rope("rms_norm_rope", x, weight, cos, sin)
    b_sz, s, hn, d = x.shape
    out = torch.empty(b_sz, hn, s, d, dtype=x.dtype, device=x.device)
    if out.numel():
        _launch_rope(x, weight, eps, cos, sin, out)
    return out


def rms_norm_rope_to_cache_torch(k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, eps: float,
                                 cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor, length: torch.Tensor) -> None:
    """Plain-torch ``rms_norm_rope_to_cache`` (same math, each batch at its own ``length[b]``; a host
    read of ``length``)."""
    rows = torch.arange(k.shape[1], device=k.device)
    normed = rms_norm_rope_torch(k, weight, eps, cos, sin)  # [B,Hn,S,D]
    for b, start in enumerate(length.tolist()):
        k_cache[b].index_copy_(1, rows + start, normed[b])
        v_cache[b].index_copy_(1, rows + start, v[b].transpose(0, 1))


def rms_norm_rope_to_cache(k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, eps: float,
                           cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, length: torch.Tensor) -> None:
    """``rms_norm_rope`` of k written straight into a KV cache, with v beside it, in one launch.

    k, v ``[B,S,Hkv,D]`` (last dim contiguous, one dtype); weight, eps, cos, sin as for
    ``rms_norm_rope``; k_cache, v_cache ``[B,Hkv,C,D]`` in k's dtype, one layout, last dim
    contiguous; length int32/int64 ``[B]`` on the device: row s of batch b goes to slot
    ``length[b] + s`` (read on the device: graph-safe; the caller checks the room and advances
    ``length``). Writes k_cache and v_cache, returns None.
    """
    op = "rms_norm_rope_to_cache"
    _check_cache_write(op, k, v, weight, cos, sin, k_cache, v_cache, length)
    if k.numel():
        _launch_rope(None, None, eps, cos, sin, None, k, weight, k_cache, v, v_cache, length)


def _check_cache_write(op: str, k, v, weight, cos, sin, k_cache, v_cache, length) -> None:
    _check_rope(op, k, weight, cos, sin)
    b_sz, s, hn, d = k.shape
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"{op}: v {tuple(v.shape)} {v.dtype} must match k {tuple(k.shape)} {k.dtype}")
    _check_last_contiguous(op, "v", v)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[:2] != (b_sz, hn) or c.shape[3] != d or c.dtype != k.dtype or c.stride(-1) != 1:
            raise ValueError(f"{op}: {name} {tuple(c.shape)} {c.dtype} is not a [B={b_sz},Hkv={hn},C,D={d}] cache "
                             f"in {k.dtype} with a contiguous last dim")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"{op}: k_cache and v_cache have different strides {k_cache.stride()} / {v_cache.stride()}")
    if length.shape != (b_sz,) or length.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: length must be int32/int64 [B={b_sz}], got {tuple(length.shape)} {length.dtype}")
    _check_same(op, {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "length": length})


def _check_rope(op: str, x, weight, cos, sin) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{op}: expected x [B,S,Hn,D], got {got}")
    _check_dtype(op, "x", x)
    s, d = x.shape[1], x.shape[3]
    _check_weight(op, weight, d, f"head_dim of x {tuple(x.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.float32:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op}: {name} must be float32 [S, R], got {got}")
    if cos.shape != sin.shape:
        raise ValueError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    rot = cos.shape[1]
    if cos.shape[0] != s:
        raise ValueError(f"{op}: cos/sin have {cos.shape[0]} rows but x {tuple(x.shape)} has S={s}; "
                         "pass the tables made for these positions")
    if rot % 2 or not 2 <= rot <= d:
        raise ValueError(f"{op}: rotary dims R={rot} (cos/sin last dim) must be even and in [2, D={d}]")
    _check_same(op, {"x": x, "weight": weight, "cos": cos, "sin": sin})
    _require_triton(op, x)
    _check_last_contiguous(op, "x", x)


def _launch_rope(q, wq, eps, cos, sin, q_out, k=None, wk=None, k_cache=None, v=None, v_cache=None,
                 length=None) -> None:
    """One launch: q (or None) normed and rotated into q_out ``[B,Hq,S,D]``, k (or None) into k_cache at
    ``length`` with v beside it."""
    x = q if q is not None else k
    b_sz, s, _, d = x.shape
    hq = q.shape[2] if q is not None else 0
    hk = k.shape[2] if k is not None else 0
    block = triton.next_power_of_2(d)
    qs = (q.stride(0), q.stride(1), q.stride(2), wq.stride(0)) if q is not None else (0, 0, 0, 0)
    ks = (k.stride(0), k.stride(1), k.stride(2), wk.stride(0)) if k is not None else (0, 0, 0, 0)
    vs = v.stride()[:3] if k is not None else (0, 0, 0)
    so = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)) if k is not None else (0, 0, 0)
    q_args = (q, wq, q_out) if q is not None else (x, cos, x)  # unread when hq == 0
    k_args = (k, wk, k_cache, v, v_cache, length) if k is not None else (x, cos, x, x, x, x)  # unread when hk == 0
    _rms_norm_rope_kernel[(b_sz * s * (hq + hk),)](
        *q_args, *k_args, cos, sin, *qs, *ks, *vs, *so,
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), b_sz * s * hq, hq, hk, s, d, cos.shape[1],
        float(eps), BLOCK=block, num_warps=_num_warps(block), **launch_args(x.device),
    )


def rms_norm_rope_qk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """``rms_norm_rope(q, ...)`` and ``rms_norm_rope_to_cache(k, v, ...)`` in one launch: returns q
    normed and rotated ``[B,Hq,S,D]`` (as ``rms_norm_rope``) and writes k and v into the cache at
    ``length`` (as ``rms_norm_rope_to_cache``). q ``[B,S,Hq,D]`` and k, v ``[B,S,Hkv,D]`` share B, S,
    D and the dtype; each has its own float32 norm weight ``[D]``; one eps, one cos/sin ``[S, R]``."""
    op = "rms_norm_rope_qk"
    _check_rope(op, q, q_weight, cos, sin)
    _check_cache_write(op, k, v, k_weight, cos, sin, k_cache, v_cache, length)
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.dtype != k.dtype:
        raise ValueError(f"{op}: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must share B, S, D "
                         "and the dtype")
    _check_same(op, {"q": q, "k": k})
    b_sz, s, hq, d = q.shape
    out = torch.empty(b_sz, hq, s, d, dtype=q.dtype, device=q.device)
    if out.numel():
        _launch_rope(q, q_weight, eps, cos, sin, out, k, k_weight, k_cache, v, v_cache, length)
    return out


# ------------------------------------------------------------------ RoPE tables
def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor, axis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The multimodal RoPE cos/sin tables of S rows in one launch (instead of six torch kernels).

    pos int64 ``[3, S]`` (any strides: a view of a position table), inv_freq float32 ``[R/2]``, axis
    int64 ``[R]`` (which of the 3 position rows each rotary column follows, values 0..2). Column j of
    row s: ``f = float32(pos[axis[j], s]) * inv_freq[j mod R/2]``; returns float32 ``cos(f)``,
    ``sin(f)`` ``[S, R]`` contiguous (libdevice's cosf/sinf, as torch's CUDA kernels compute them).
    Its torch twin is the engine's own ``engine.rope.Rope.tables``.
    """
    op = "rope_tables"
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[0] != 3 or pos.dtype != torch.int64:
        got = f"{tuple(pos.shape)} {pos.dtype}" if isinstance(pos, torch.Tensor) else type(pos).__name__
        raise ValueError(f"{op}: pos must be int64 [3, S], got {got}")
    half = inv_freq.shape[0] if isinstance(inv_freq, torch.Tensor) and inv_freq.dim() == 1 else -1
    if half < 1 or inv_freq.dtype != torch.float32 or not isinstance(axis, torch.Tensor) \
            or axis.shape != (2 * half,) or axis.dtype != torch.int64:
        raise ValueError(f"{op}: inv_freq must be float32 [R/2] and axis int64 [R] (the Rope's own tensors), got "
                         f"{getattr(inv_freq, 'shape', None)} / {getattr(axis, 'shape', None)}")
    _check_same(op, {"pos": pos, "inv_freq": inv_freq, "axis": axis})
    _require_triton(op, pos)
    rot, s = 2 * half, pos.shape[1]
    cos = torch.empty(s, rot, dtype=torch.float32, device=pos.device)
    sin = torch.empty_like(cos)
    if s:
        _rope_tables_kernel[(s,)](pos, inv_freq.contiguous(), axis.contiguous(), cos, sin, pos.stride(0),
                                  pos.stride(1), rot, BLOCK=triton.next_power_of_2(rot),
                                  LIBDEVICE=libdevice is not None and not interpreting(), num_warps=1,
                                  **launch_args(pos.device))
    return cos, sin


# ------------------------------------------------------------------ SwiGLU activation
def silu_mul_torch(g: torch.Tensor, u: torch.Tensor, *, rotate: int = 0):
    """Plain-torch ``silu_mul``: ``round(round(silu(g)) * u)`` exactly as torch computes it in g's dtype."""
    out = F.silu(g) * u
    return out if not rotate else (out, _twin_rotate(out, rotate))


def silu_mul(g: torch.Tensor, u: torch.Tensor, *, rotate: int = 0):
    """``silu(g) * u`` in one launch. g, u ``[..., N]`` same shape and dtype, last dim contiguous.

    Mirrors torch's rounding in g's dtype: ``out = round(round(silu(g)) * u)``, each step computed
    in float32 (round = cast to g's dtype). Returns ``[..., N]`` contiguous in g's dtype; with
    ``rotate=G`` ``(out, out_rot)``, out_rot = out ConvRot-rotated in groups of G (G divides N).
    """
    op = "silu_mul"
    if not isinstance(g, torch.Tensor) or not isinstance(u, torch.Tensor) or g.dim() < 1:
        raise ValueError(f"{op}: g and u must be tensors [..., N]")
    _check_dtype(op, "g", g)
    if g.shape != u.shape or g.dtype != u.dtype:
        raise ValueError(f"{op}: g ({tuple(g.shape)} {g.dtype}) and u ({tuple(u.shape)} {u.dtype}) "
                         "must have the same shape and dtype")
    _check_same(op, {"g": g, "u": u})
    _require_triton(op, g)
    _check_last_contiguous(op, "g", g)
    _check_last_contiguous(op, "u", u)
    g2, u2 = _rows(op, "g", g), _rows(op, "u", u)
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    n = g.shape[-1]
    block = min(triton.next_power_of_2(max(n, 1)), _ROT_TILE_MAX if rotate else _SILU_TILE)
    fused = _rotation(op, rotate, n, block)
    out_rot = torch.empty(g.shape, dtype=g.dtype, device=g.device) if fused else out
    if out.numel() == 0:
        return out if not rotate else (out, out_rot)
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](
        g2, u2, out, out_rot, g2.stride(0), u2.stride(0), n, ROT=fused, IEEE=g.dtype == torch.float32,
        BLOCK=block, num_warps=4, **launch_args(g.device),
    )
    return out if not rotate else (out, _rotated(out, rotate, fused, out_rot))


# ------------------------------------------------------------------ attention output gate
def sigmoid_gate_torch(o: torch.Tensor, gate: torch.Tensor, *, rotate: int = 0):
    """Plain-torch ``sigmoid_gate``: ``o.transpose(1, 2).reshape(B, S, Hn*D) * torch.sigmoid(gate)``."""
    b_sz, hn, s, d = o.shape
    out = o.transpose(1, 2).reshape(b_sz, s, hn * d) * torch.sigmoid(gate.reshape(b_sz, s, hn * d))
    return out if not rotate else (out, _twin_rotate(out, rotate))


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, *, rotate: int = 0):
    """Attention output gate in one launch: ``[B,Hn,S,D]`` o times ``sigmoid(gate)`` -> ``[B,S,Hn*D]``.

    o ``[B,Hn,S,D]`` and gate ``[B,S,Hn*D]`` or ``[B,S,Hn,D]`` (e.g. the gate half of a q projection
    viewed per head) of one dtype (bf16/fp16/fp32), any strides with a contiguous last dim.
    ``out = round(o' * round(sigmoid(gate)))`` with o' = o transposed to ``[B,S,Hn,D]`` and
    flattened, float32 math, round = cast to the dtype (torch's rounding).
    Returns ``[B,S,Hn*D]`` contiguous; with ``rotate=G`` ``(out, out_rot)``, out_rot = out
    ConvRot-rotated in groups of G (G divides Hn*D; in the kernel when G also divides D).
    """
    op = "sigmoid_gate"
    if not isinstance(o, torch.Tensor) or not isinstance(gate, torch.Tensor) or o.dim() != 4:
        raise ValueError(f"{op}: expected o [B,Hn,S,D] and gate [B,S,Hn*D] tensors")
    _check_dtype(op, "o", o)
    b_sz, hn, s, d = o.shape
    if gate.shape not in ((b_sz, s, hn * d), (b_sz, s, hn, d)) or gate.dtype != o.dtype:
        raise ValueError(f"{op}: gate must be [B,S,Hn*D] = {(b_sz, s, hn * d)} or [B,S,Hn,D] in {o.dtype} for o "
                         f"{tuple(o.shape)}, got {tuple(gate.shape)} {gate.dtype}")
    _check_same(op, {"o": o, "gate": gate})
    _require_triton(op, o)
    _check_last_contiguous(op, "o", o)
    _check_last_contiguous(op, "gate", gate)
    head_stride = gate.stride(2) if gate.dim() == 4 else d
    out = torch.empty(b_sz, s, hn * d, dtype=o.dtype, device=o.device)
    block = triton.next_power_of_2(max(d, 1))
    fused = _rotation(op, rotate, hn * d, block if d == block else 0)  # groups within one head
    out_rot = torch.empty(out.shape, dtype=o.dtype, device=o.device) if fused else out
    if out.numel() == 0:
        return out if not rotate else (out, out_rot)
    _sigmoid_gate_kernel[(b_sz * s * hn,)](
        o, gate, out, out_rot,
        o.stride(0), o.stride(1), o.stride(2), gate.stride(0), gate.stride(1), head_stride,
        hn, s, d,
        ROT=fused, IEEE=o.dtype == torch.float32, BLOCK=block, num_warps=_num_warps(block),
        **launch_args(o.device),
    )
    return out if not rotate else (out, _rotated(out, rotate, fused, out_rot))
