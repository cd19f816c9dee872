"""RoPE for decode rows: the per-head RMSNorm + partial rotary embedding of q and k (written
transposed for attention, k and v into their KV cache slots: ``rms_norm_rope_qk``), and the step's
cos/sin tables from MRoPE positions (``rope_tables``). Torch twins beside each
(``rope_tables``': ``engine.rope.Rope.tables``). One program per (row, head); float32 inside.
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

from .capabilities import interpreting
from .op_checks import check_dtype, check_last_contiguous, check_same, check_weight, require_triton, warps_for
from .pdl import enter, launch_args

__all__ = ["rms_norm_rope", "rms_norm_rope_qk", "rms_norm_rope_to_cache", "rms_norm_rope_to_cache_torch",
           "rms_norm_rope_torch", "rope_tables"]


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
    check_last_contiguous(op, "v", v)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[:2] != (b_sz, hn) or c.shape[3] != d or c.dtype != k.dtype or c.stride(-1) != 1:
            raise ValueError(f"{op}: {name} {tuple(c.shape)} {c.dtype} is not a [B={b_sz},Hkv={hn},C,D={d}] cache "
                             f"in {k.dtype} with a contiguous last dim")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"{op}: k_cache and v_cache have different strides {k_cache.stride()} / {v_cache.stride()}")
    if length.shape != (b_sz,) or length.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: length must be int32/int64 [B={b_sz}], got {tuple(length.shape)} {length.dtype}")
    check_same(op, {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "length": length})


def _check_rope(op: str, x, weight, cos, sin) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{op}: expected x [B,S,Hn,D], got {got}")
    check_dtype(op, "x", x)
    s, d = x.shape[1], x.shape[3]
    check_weight(op, weight, d, f"head_dim of x {tuple(x.shape)}")
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
    check_same(op, {"x": x, "weight": weight, "cos": cos, "sin": sin})
    require_triton(op, x)
    check_last_contiguous(op, "x", x)


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
        float(eps), BLOCK=block, num_warps=warps_for(block), **launch_args(x.device),
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
    check_same(op, {"q": q, "k": k})
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
    check_same(op, {"pos": pos, "inv_freq": inv_freq, "axis": axis})
    require_triton(op, pos)
    rot, s = 2 * half, pos.shape[1]
    cos = torch.empty(s, rot, dtype=torch.float32, device=pos.device)
    sin = torch.empty_like(cos)
    if s:
        _rope_tables_kernel[(s,)](pos, inv_freq.contiguous(), axis.contiguous(), cos, sin, pos.stride(0),
                                  pos.stride(1), rot, BLOCK=triton.next_power_of_2(rot),
                                  LIBDEVICE=libdevice is not None and not interpreting(), num_warps=1,
                                  **launch_args(pos.device))
    return cos, sin

