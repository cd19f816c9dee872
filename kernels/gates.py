"""The gates of a decode layer: the SwiGLU activation ``silu(g) * u`` (``silu_mul``) and the
attention output gate ``o * sigmoid(gate)`` transposing o back to rows (``sigmoid_gate``), one
launch each, torch twins beside them. With ``rotate=G`` each also returns its output
ConvRot-rotated for an int8 ConvRot projection. Float32 inside, stored in the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .convrot_triton import ROT_TILE_MAX, convrot_rows, rotated, rotation, tile_cols, twin_rotate
from .op_checks import as_rows, check_dtype, check_last_contiguous, check_same, require_triton, warps_for
from .pdl import enter, launch_args

__all__ = ["sigmoid_gate", "sigmoid_gate_torch", "silu_mul", "silu_mul_torch"]

SILU_TILE = 1024  # columns per silu_mul program (no reduction there, so rows are cut into tiles)


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



def silu_mul_torch(g: torch.Tensor, u: torch.Tensor, *, rotate: int = 0):
    """Plain-torch ``silu_mul``: ``round(round(silu(g)) * u)`` exactly as torch computes it in g's dtype."""
    out = F.silu(g) * u
    return out if not rotate else (out, twin_rotate(out, rotate))


def silu_mul(g: torch.Tensor, u: torch.Tensor, *, rotate: int = 0):
    """``silu(g) * u`` in one launch. g, u ``[..., N]`` same shape and dtype, last dim contiguous.

    Mirrors torch's rounding in g's dtype: ``out = round(round(silu(g)) * u)``, each step computed
    in float32 (round = cast to g's dtype). Returns ``[..., N]`` contiguous in g's dtype; with
    ``rotate=G`` ``(out, out_rot)``, out_rot = out ConvRot-rotated in groups of G (G divides N).
    """
    op = "silu_mul"
    if not isinstance(g, torch.Tensor) or not isinstance(u, torch.Tensor) or g.dim() < 1:
        raise ValueError(f"{op}: g and u must be tensors [..., N]")
    check_dtype(op, "g", g)
    if g.shape != u.shape or g.dtype != u.dtype:
        raise ValueError(f"{op}: g ({tuple(g.shape)} {g.dtype}) and u ({tuple(u.shape)} {u.dtype}) "
                         "must have the same shape and dtype")
    check_same(op, {"g": g, "u": u})
    require_triton(op, g)
    check_last_contiguous(op, "g", g)
    check_last_contiguous(op, "u", u)
    g2, u2 = as_rows(op, "g", g), as_rows(op, "u", u)
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    n = g.shape[-1]
    block = min(triton.next_power_of_2(max(n, 1)), ROT_TILE_MAX if rotate else SILU_TILE)
    fused = rotation(op, rotate, n, block)
    out_rot = torch.empty(g.shape, dtype=g.dtype, device=g.device) if fused else out
    if out.numel() == 0:
        return out if not rotate else (out, out_rot)
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](
        g2, u2, out, out_rot, g2.stride(0), u2.stride(0), n, ROT=fused, IEEE=g.dtype == torch.float32,
        BLOCK=block, num_warps=4, **launch_args(g.device),
    )
    return out if not rotate else (out, rotated(out, rotate, fused, out_rot))


# ------------------------------------------------------------------ attention output gate
def sigmoid_gate_torch(o: torch.Tensor, gate: torch.Tensor, *, rotate: int = 0):
    """Plain-torch ``sigmoid_gate``: ``o.transpose(1, 2).reshape(B, S, Hn*D) * torch.sigmoid(gate)``."""
    b_sz, hn, s, d = o.shape
    out = o.transpose(1, 2).reshape(b_sz, s, hn * d) * torch.sigmoid(gate.reshape(b_sz, s, hn * d))
    return out if not rotate else (out, twin_rotate(out, rotate))


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
    check_dtype(op, "o", o)
    b_sz, hn, s, d = o.shape
    if gate.shape not in ((b_sz, s, hn * d), (b_sz, s, hn, d)) or gate.dtype != o.dtype:
        raise ValueError(f"{op}: gate must be [B,S,Hn*D] = {(b_sz, s, hn * d)} or [B,S,Hn,D] in {o.dtype} for o "
                         f"{tuple(o.shape)}, got {tuple(gate.shape)} {gate.dtype}")
    check_same(op, {"o": o, "gate": gate})
    require_triton(op, o)
    check_last_contiguous(op, "o", o)
    check_last_contiguous(op, "gate", gate)
    head_stride = gate.stride(2) if gate.dim() == 4 else d
    out = torch.empty(b_sz, s, hn * d, dtype=o.dtype, device=o.device)
    block = triton.next_power_of_2(max(d, 1))
    fused = rotation(op, rotate, hn * d, block if d == block else 0)  # groups within one head
    out_rot = torch.empty(out.shape, dtype=o.dtype, device=o.device) if fused else out
    if out.numel() == 0:
        return out if not rotate else (out, out_rot)
    _sigmoid_gate_kernel[(b_sz * s * hn,)](
        o, gate, out, out_rot,
        o.stride(0), o.stride(1), o.stride(2), gate.stride(0), gate.stride(1), head_stride,
        hn, s, d,
        ROT=fused, IEEE=o.dtype == torch.float32, BLOCK=block, num_warps=warps_for(block),
        **launch_args(o.device),
    )
    return out if not rotate else (out, rotated(out, rotate, fused, out_rot))
