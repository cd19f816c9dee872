"""4-bit weights in the decode-row products: ``y = x @ W.T`` with W stored as ComfyUI stores it (Triton).

Weight-only: x stays bf16 / fp16 / fp32, each 4-bit weight is widened in registers to x's dtype
(exactly: every value below is representable there), float32 accumulation, bytes read = the packed
weights and their scales once. For bf16 / fp16 x the widening is integer work alone: a code's bits
are placed under a 16-bit float's exponent (``_nibbles16``, ``_e2m1_16``); convrot_w4a4's signed
nibble q becomes OFFSET + q, and ``OFFSET * sum(x)`` leaves the float32 accumulator at the end.
No repacking: the kernels read comfy-kitchen's ``QuantizedTensor`` storage as ComfyUI loaded it.
Works wherever Triton runs (no INT4 / FP4 tensor cores needed). Three tiles: either format with K a
multiple of 8, 4-byte aligned rows and 1..8 rows of x runs ``gemv4w.py``'s word tile on the FMA
units (``launch.gemv4_words``), or, with bf16 / fp16 x where the launch config's fifth value is 2
and ``_mma_reason`` is None, ``gemv4m.py``'s register tile on the tensor cores (PTX ``mma.sync``); everything
else (more rows, other storage) this module's tensor-core tile, x's dtype on the tensor cores as in
``gemv.py``.

Formats (``FORMATS``; ComfyUI 0.29.0 ``comfy/quant_ops.py`` ``QUANT_ALGOS``):

* ``convrot_w4a4`` (kitchen ``TensorCoreConvRotW4A4Layout``): ``qdata`` int8 ``[N, K/2]``, two
  signed nibbles a byte, the even column in the low nibble; ``scale`` float32 ``[N]`` (one per output
  row: kitchen's quantizer is row-wise, its ``quant_group_size`` 64 names the int4 MMA tile); rows
  ConvRot-rotated in groups of G (``W_rot = W @ H_G.T``), so x is rotated first: by the kernel that
  produced x (``rotated``), else one ``hadamard_rotate`` launch. ``W = unrotate(q * scale)``.
* ``nvfp4`` (kitchen ``TensorCoreNVFP4Layout``): ``qdata`` uint8 ``[roundup(N,16), roundup(K,16)/2]``,
  two E2M1 codes a byte, the even column in the HIGH nibble (kitchen's ``hi_first``); ``block_scale``
  float8_e4m3fn, one per 16 columns, in cuBLAS's swizzled layout ``[roundup(N,128), roundup(K/16,4)]``
  (``float_utils.to_blocked``: 128x4 tiles of 512 bytes, row r at ``(r%32)*16 + (r//32%4)*4``);
  ``scale`` float32 ``[]`` (``weight_scale_2``). ``W = e2m1(q) * (block_scale * scale)``.

An E2M1 value times its E4M3 block scale has at most 6 significant bits, so it is formed exactly in
x's dtype; the per-row / per-tensor float32 scale multiplies the float32 accumulator. Launch
settings come from ``launch.gemv4`` (the word and register tiles: the GPU's table, kinds ``w4a4`` /
``nvfp4``, else ``fallback.gemv4_pick``; this tile: ``fallback.gemv4_config``); split-K, ``row_norm``,
``prefetch`` and programmatic dependent launch behave as in ``gemv.gemv_group``.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from . import fallback, launch
from .capabilities import compiled, device_record, say_once
from .convrot_triton import flat_rows, hadamard_cached, hadamard_rotate
from .gemv import MAX_GEMV_ROWS, MAX_GROUP, _prefetch_args, _row_norm_args
from .gemv4m import gemv4m_kernel
from .gemv4w import _e2m1, _e4m3, gemv4w_kernel, swizzled
from .packed4 import FORMATS, Packed4, packed_reason, round_up
from .pdl import launch_args, trigger, wait
from .ptx import prefetch_share
from .row_norm import RowNorm

log = logging.getLogger(__name__)

__all__ = ["FORMATS", "Packed4", "gemv4", "gemv4_group", "gemv4_reason"]

#: format name -> the kernel's FMT
FMT = {"convrot_w4a4": 1, "nvfp4": 2}
#: x dtype -> the kernel's HALF16 (0: float32, exact conversions and IEEE dots)
X_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def _nibbles16(nib, HALF16: tl.constexpr):
    # 4-bit codes (int32 0..15) -> 16-bit float bit patterns by integer operations alone (no convert
    # instruction). HALF16 1: fp16, 2: bf16.
    # Signed int4 q (two's complement nibble) becomes OFFSET + q, q + 8 being nib ^ 8: fp16 1032
    # (0x6400 is 1024, unit steps up to 2048), bf16 136 (0x4300 is 128, unit steps up to 256).
    if HALF16 == 1:
        bits = (nib ^ 8) | 0x6400
    else:
        bits = (nib ^ 8) | 0x4300
    return bits.to(tl.int16)


@triton.jit
def _e2m1_16(nib, HALF16: tl.constexpr):
    # E2M1 code (int32 0..15) -> its fp16 (HALF16 1) / bf16 (2) bit pattern, exactly: exponent e >= 1
    # and mantissa m become (1 + m/2) * 2^(e-1) by moving the 3 bits under the exponent field and
    # adding the bias of 0.5 (H); e = 0 is 0 or 0.5 (m * H).
    mag = nib & 7
    if HALF16 == 1:
        h = 0x3800
        bits = tl.where(mag >= 2, (mag << 9) + h, mag * h)
    else:
        h = 0x3F00
        bits = tl.where(mag >= 2, (mag << 6) + h, mag * h)
    return (bits | ((nib & 8) << 12)).to(tl.int16)


@triton.jit
def _tile4(X, W, S, T, Y, M, N, K, K_PER, sx_m, sw_n, s_cols, sy_m, sy_k, pid, NRM, n_nrm, s_nrm, n_mean, eps,
           FMT: tl.constexpr, HALF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, PDL: tl.constexpr, ROW_NORM: tl.constexpr):
    # Program (pid, program_id(1)): BLOCK_N columns over [pid_k * K_PER, + K_PER) (a multiple of
    # BLOCK_K). Each K tile: BLOCK_K / 2 bytes per row, its even and odd columns multiplied with x's
    # even and odd columns as two dots. FMT 1: convrot_w4a4 (S per-row float32), 2: nvfp4 (S the
    # swizzled E4M3 block scales with s_cols columns, T the float32 tensor scale).
    HALF: tl.constexpr = BLOCK_K // 2
    pid_k = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_lo = pid_k * K_PER
    k_hi = tl.minimum(k_lo + K_PER, K)
    wait(PDL)
    trigger(PDL)
    if ROW_NORM > 0:
        j = tl.arange(0, ROW_NORM)
        sq = tl.load(NRM + offs_m[:, None] * s_nrm + j[None, :], mask=m_ok[:, None] & (j < n_nrm)[None, :], other=0.0)
        factor = tl.rsqrt(tl.sum(sq, 1) / n_mean + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_b = k0 // 2 + tl.arange(0, HALF)  # byte columns
        even = 2 * offs_b
        w_mask = n_ok[:, None] & (even < K)[None, :]
        if PDL:
            b = tl.load(W + offs_n[:, None] * sw_n + offs_b[None, :], mask=w_mask, other=0,
                        eviction_policy="evict_first")
        else:
            b = tl.load(W + offs_n[:, None] * sw_n + offs_b[None, :], mask=w_mask, other=0)
        x_e = tl.load(X + offs_m[:, None] * sx_m + even[None, :], mask=m_ok[:, None] & (even < K)[None, :], other=0.0)
        x_o = tl.load(X + offs_m[:, None] * sx_m + even[None, :] + 1,
                      mask=m_ok[:, None] & (even + 1 < K)[None, :], other=0.0)
        b = b.to(tl.int32)
        if FMT == 1 and HALF16 > 0:  # signed nibbles, even column low, as OFFSET + q (one integer op each)
            w_e = _nibbles16(b & 15, HALF16).to(x_e.dtype, bitcast=True)
            w_o = _nibbles16((b >> 4) & 15, HALF16).to(x_e.dtype, bitcast=True)
            x_sum += tl.sum(x_e.to(tl.float32), 1) + tl.sum(x_o.to(tl.float32), 1)
        elif FMT == 1:  # float32 x: each signed nibble converted
            w_e = ((b << 28) >> 28).to(tl.float32)
            w_o = (b >> 4).to(tl.float32)
        else:  # E2M1 codes, even column high; times the block's E4M3 scale
            b = b & 255
            blk = k0 // 16 + tl.arange(0, HALF // 8)
            r = offs_n[:, None]
            s_off = swizzled(r, blk[None, :], s_cols)
            sb = tl.load(S + s_off, mask=n_ok[:, None] & (blk < s_cols)[None, :], other=0).to(tl.int32) & 255
            sc = tl.reshape(tl.broadcast_to(_e4m3(sb)[:, :, None], (BLOCK_N, HALF // 8, 8)), (BLOCK_N, HALF))
            if HALF16 > 0:  # code and scale exact in x's dtype, and so is their product (<= 6 bits)
                sc = sc.to(x_e.dtype)
                w_e = _e2m1_16(b >> 4, HALF16).to(x_e.dtype, bitcast=True) * sc
                w_o = _e2m1_16(b & 15, HALF16).to(x_e.dtype, bitcast=True) * sc
            else:
                w_e = _e2m1(b >> 4) * sc
                w_o = _e2m1(b & 15) * sc
        if HALF16 == 0:
            acc += tl.dot(x_e, tl.trans(w_e), input_precision="ieee")
            acc += tl.dot(x_o, tl.trans(w_o), input_precision="ieee")
        else:
            acc += tl.dot(x_e, tl.trans(w_e))
            acc += tl.dot(x_o, tl.trans(w_o))
    if FMT == 1 and HALF16 > 0:  # the offset's share: OFFSET * sum(x) over this program's columns
        acc -= (1032.0 if HALF16 == 1 else 136.0) * x_sum[:, None]
    if FMT == 1:
        acc *= tl.load(S + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    else:
        acc *= tl.load(T).to(tl.float32)
    if ROW_NORM > 0:
        acc *= factor[:, None]
    tl.store(Y + pid_k * sy_k + offs_m[:, None] * sy_m + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv4_kernel(X, W0, W1, W2, W3, S0, S1, S2, S3, T0, T1, T2, T3, Y0, Y1, Y2, Y3, M, K, K_PER,
                  N0, N1, N2, N3, E0, E1, E2, sx_m, sw0, sw1, sw2, sw3, sc0, sc1, sc2, sc3,
                  sy0, sy1, sy2, sy3, sk0, sk1, sk2, sk3, NRM, n_nrm, s_nrm, n_mean, eps, PF, n_pf,
                  COUNT: tl.constexpr, FMT: tl.constexpr, HALF16: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, ROW_NORM: tl.constexpr,
                  PREFETCH: tl.constexpr):
    # Programs [0, E0) serve weight 0, [E0, E1) weight 1, ... (as ``gemv._gemv_kernel``).
    pid = tl.program_id(0)
    if pid < E0:
        _tile4(X, W0, S0, T0, Y0, M, N0, K, K_PER, sx_m, sw0, sc0, sy0, sk0, pid, NRM, n_nrm, s_nrm, n_mean, eps,
               FMT, HALF16, BLOCK_M, BLOCK_N, BLOCK_K, PDL, ROW_NORM)
    elif COUNT > 1 and pid < E1:
        _tile4(X, W1, S1, T1, Y1, M, N1, K, K_PER, sx_m, sw1, sc1, sy1, sk1, pid - E0, NRM, n_nrm, s_nrm, n_mean,
               eps, FMT, HALF16, BLOCK_M, BLOCK_N, BLOCK_K, PDL, ROW_NORM)
    elif COUNT > 2 and pid < E2:
        _tile4(X, W2, S2, T2, Y2, M, N2, K, K_PER, sx_m, sw2, sc2, sy2, sk2, pid - E1, NRM, n_nrm, s_nrm, n_mean,
               eps, FMT, HALF16, BLOCK_M, BLOCK_N, BLOCK_K, PDL, ROW_NORM)
    elif COUNT > 3:
        _tile4(X, W3, S3, T3, Y3, M, N3, K, K_PER, sx_m, sw3, sc3, sy3, sk3, pid - E2, NRM, n_nrm, s_nrm, n_mean,
               eps, FMT, HALF16, BLOCK_M, BLOCK_N, BLOCK_K, PDL, ROW_NORM)
    if PREFETCH:
        prefetch_share(PF, n_pf, 128)


def gemv4_reason(x: torch.Tensor, p: Packed4) -> str | None:
    """None when ``gemv4_group`` takes x with the 4-bit weight ``p``, else why not (one line)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"x is {x.dtype} (bf16, fp16 or fp32)"
    why = packed_reason(p)
    if why is not None:
        return why
    rows = x.numel() // max(1, x.shape[-1])
    if x.shape[-1] != p.k or not 1 <= rows <= MAX_GEMV_ROWS:
        return f"x {tuple(x.shape)} does not give 1..{MAX_GEMV_ROWS} rows of width {p.k}"
    if x.device != p.qdata.device:
        return "x and the weight are on different devices"
    return None


def gemv4_group(x: torch.Tensor, weights: list[Packed4], *, rotate: bool = True,
                config: tuple[int, ...] | None = None, split: int = 1, row_norm: RowNorm | None = None,
                prefetch: torch.Tensor | None = None, prefetch_bytes: int | None = None) -> list[torch.Tensor]:
    """``[x @ W.T for W in weights]`` in one launch: 1..4 4-bit weights of one format (and one ConvRot
    group), x ``[..., K]`` bf16/fp16/fp32 with at most 16 rows in all -> ``[..., N_i]`` in x's dtype
    (float32 accumulation). ``rotate=False``: x is already ConvRot-rotated in the weights' group
    (convrot_w4a4); else it is rotated here (one launch). ``config`` = (BLOCK_N, BLOCK_K, warps,
    stages[, 1: the word tile's vector loads; 2: the register tile where it fits, else the word
    tile's own pick]) replaces the launch table's (BLOCK_K in weight columns, a multiple of 32; the
    tensor-core tile needs BLOCK_N >= 16; the register tile 16 and 128 or 256). ``split``,
    ``row_norm``, ``prefetch`` / ``prefetch_bytes`` as ``gemv.gemv_group`` (split > 1: float32
    partials ``[P', ..., N_i]``). ValueError names what does not fit."""
    if split < 1:
        raise ValueError(f"gemv4: split must be >= 1, got {split}")
    if not 1 <= len(weights) <= MAX_GROUP:
        raise ValueError(f"gemv4: 1..{MAX_GROUP} weights, got {len(weights)}")
    first = weights[0]
    for p in weights:
        why = gemv4_reason(x, p)
        if why is None and (p.fmt, p.convrot) != (first.fmt, first.convrot):
            why = "weights of different formats or ConvRot groups in one launch"
        if why is not None:
            raise ValueError(f"gemv4: unsupported operands: {why}; call the module (ComfyUI dequantizes)")
    k = first.k
    if first.fmt == "convrot_w4a4" and first.convrot and rotate:
        x = hadamard_rotate(x, hadamard_cached(first.convrot, x.device, x.dtype))
    x2 = flat_rows(x, k)
    m = x2.shape[0]
    nrm = _row_norm_args(row_norm, x, m) if row_norm is not None else (x2, 0, 0, 1, 0.0, 0)
    ns = [p.n for p in weights]
    words = launch.gemv4_words(first.fmt, k, m) and all(_rows_aligned(p.qdata, 4) for p in weights)
    cfg = tuple(config) if config is not None else \
        launch.gemv4(sum(ns), k, first.fmt, m, x.device, weights=len(weights), x_bytes=x.element_size(),
                     words=words)[0]
    mma = words and len(cfg) > 4 and cfg[4] == 2
    why = _mma_reason(x2, weights) if mma else None
    if why is not None:  # the register tile cannot run here: the word tile's own pick
        if compiled(x2.device):
            say_once(log, f"4-bit products of {m} rows run on the FMA word tile, slower than the tensor-core "
                          f"register tile: {why}")
        mma, cfg = False, fallback.gemv4w_config(sum(ns), k, m)
    block_n, block_k, warps, stages = cfg[:4]
    if mma and (block_n != 16 or block_k not in (128, 256)):
        raise ValueError(f"gemv4: config {cfg}: the register tile takes BLOCK_N 16 and BLOCK_K 128 or 256")
    block_k = block_k if mma else max(32, min(block_k, triton.next_power_of_2(k)))
    if block_k % 32 or block_n < (1 if words else 16):
        raise ValueError(f"gemv4: config {cfg}: BLOCK_K must be a multiple of 32 and BLOCK_N at least "
                         f"{1 if words else 16}")
    k_per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    parts = triton.cdiv(k, k_per)
    shape = (m,) if split == 1 else (parts, m)
    outs = [torch.empty(*shape, n, dtype=x.dtype if split == 1 else torch.float32, device=x.device) for n in ns]
    ends, total = [], 0
    for n in ns:
        total += triton.cdiv(n, block_n)
        ends.append(total)
    pad = MAX_GROUP - len(weights)
    pf = _prefetch_args(prefetch, x.device, prefetch_bytes) or (x2, 0)
    ys, nn, ee = outs + [outs[0]] * pad, ns + [0] * pad, (ends + [total] * pad)[:3]
    common = dict(num_warps=warps, num_stages=stages, **launch_args(x.device))
    nv = first.fmt == "nvfp4"
    ss = [p.block_scale.view(torch.uint8).reshape(-1) if nv else p.scale.reshape(-1) for p in weights]
    ts = [p.scale.reshape(-1) for p in weights]
    cols = [p.block_scale.numel() // round_up(round_up(p.n, 16), 128) if nv else 0 for p in weights]
    ss, ts, cc = ss + [ss[0]] * pad, ts + [ts[0]] * pad, cols + [0] * pad
    if mma:
        ws = [p.qdata for p in weights] + [weights[0].qdata] * pad
        gemv4m_kernel[(total, parts)](
            x2, *ws, *ss, *ts, *ys, m, k, k_per, *nn, *ee, x2.stride(0), *(w.stride(0) for w in ws), *cc,
            *(y.stride(-2) for y in ys), *(y.stride(0) if split > 1 else 0 for y in ys), *nrm[:5], *pf, 1,
            COUNT=len(weights), WARPS=warps, CHUNKS=block_k // 128, XK=X_KIND[x.dtype], FMT=FMT[first.fmt],
            ROW_NORM=nrm[5], PREFETCH=pf[1] > 0, **launch_args(x.device), num_warps=warps, num_stages=1)
        return [y.reshape(*shape[:-1], *x.shape[:-1], n) for y, n in zip(outs, ns)]
    if words:
        ptx = compiled(x.device) and torch.version.hip is None
        ws = [p.qdata.view(torch.int32) for p in weights]
        ws = ws + [ws[0]] * pad
        even = k % k_per == 0 and all(n % block_n == 0 for n in ns)
        gemv4w_kernel[(total, parts)](
            x2, *ws, *ss, *ts, *ys, k // 8, k_per // 8, *nn, *ee, x2.stride(0), *(w.stride(0) for w in ws), *cc,
            *(y.stride(-2) for y in ys), *(y.stride(0) if split > 1 else 0 for y in ys), *nrm[:5], *pf, 1,
            COUNT=len(weights), ROWS=m, BLOCK_N=block_n, BLOCK_W=block_k // 8, EVEN=even,
            PTX=ptx, ROW_NORM=nrm[5], PREFETCH=pf[1] > 0, VEC=len(cfg) > 4 and cfg[4] == 1,
            EXACT=x.dtype == torch.float32 or nv, XK=X_KIND[x.dtype] if ptx and _x_aligned(x2) else -1,
            FMT=FMT[first.fmt], **common)
        return [y.reshape(*shape[:-1], *x.shape[:-1], n) for y, n in zip(outs, ns)]
    ws = [p.qdata for p in weights]
    ws = ws + [ws[0]] * pad
    _gemv4_kernel[(total, parts)](
        x2, *ws, *ss, *ts, *ys, m, k, k_per, *nn, *ee, x2.stride(0), *(w.stride(0) for w in ws), *cc,
        *(y.stride(-2) for y in ys), *(y.stride(0) if split > 1 else 0 for y in ys), *nrm[:5], *pf,
        COUNT=len(weights), FMT=FMT[first.fmt], HALF16=X_KIND[x.dtype], BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=block_k, ROW_NORM=nrm[5], PREFETCH=pf[1] > 0, **common)
    return [y.reshape(*shape[:-1], *x.shape[:-1], n) for y, n in zip(outs, ns)]


def _mma_reason(x2: torch.Tensor, weights: list[Packed4]) -> str | None:
    """None where ``gemv4m.py``'s tile takes x2 ``[M, K]`` with ``weights`` (bf16 / fp16 x, K a
    multiple of 32, rows of x and weights on 16 bytes, Triton compiling for an NVIDIA GPU of compute
    capability 8.0+), else why not (one line)."""
    record = device_record(x2.device)
    if not compiled(x2.device) or torch.version.hip is not None or record is None:
        return "no Triton compiling PTX for an NVIDIA GPU here"
    if record.arch < 80:
        return f"compute capability {record.arch // 10}.{record.arch % 10} (8.0+ has the MMA it needs)"
    if x2.dtype not in (torch.bfloat16, torch.float16):
        return f"activations are {x2.dtype} (bf16 / fp16; ComfyUI's --fp32-text-enc makes them float32)"
    if x2.shape[1] % 32 or not _x_aligned(x2) or not all(_rows_aligned(p.qdata, 16) for p in weights):
        return "the rows of x or of the weights are not on 16 bytes"
    return None


def _x_aligned(x2: torch.Tensor) -> bool:
    """True where every 8 columns of x's rows ``[M, K]`` start on 16 bytes (``gemv4w._x8_ptx``)."""
    return x2.data_ptr() % 16 == 0 and (x2.stride(0) * x2.element_size()) % 16 == 0 and x2.stride(-1) == 1


def _rows_aligned(q: torch.Tensor, nbytes: int) -> bool:
    """True where every row of the packed bytes ``q`` starts on ``nbytes`` and holds whole units of
    them: 4 for ``gemv4w.py``'s 32-bit words, 16 for ``gemv4m.py``'s vector loads."""
    return q.data_ptr() % nbytes == 0 and q.stride(0) % nbytes == 0 and q.shape[-1] % nbytes == 0


def gemv4(x: torch.Tensor, p: Packed4, *, rotate: bool = True, config: tuple[int, ...] | None = None,
          row_norm: RowNorm | None = None) -> torch.Tensor:
    """``x @ W.T`` for one 4-bit weight (``gemv4_group`` with one weight): x ``[..., K]`` -> ``[..., N]``."""
    return gemv4_group(x, [p], rotate=rotate, config=config, row_norm=row_norm)[0]
