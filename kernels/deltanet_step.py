"""One fused launch for the decode/verify rows of a Gated DeltaNet layer (Triton).

Everything between the layer's input projections and its ``out_proj`` runs in one program per
(batch, value head): the causal depthwise conv over ``[conv state | new rows]`` with SiLU, the L2
norm of q and k (q scaled by ``Dk^-0.5``), the gates ``g = -exp(A_log) * softplus(a + dt_bias)``
and ``beta = sigmoid(b)``, the gated delta rule for each of the S rows (the ``[Dk, Dv]`` float32
state stays in registers; the state after every row is written out so a partly accepted MTP verify
can keep any prefix, the last row's over the committed state itself when the caller asks), and the
gated RMSNorm ``rms_norm(o) * w * silu(z)`` of the output. The conv window (old state followed by
the new rows) is written out too, so the caller can commit any number of rows. Each window column
is loaded once (conv taps held in registers, the window sliding by one row per row), and row t+1's
inputs are loaded before row t's state math and stores (a load that follows a store cannot move
above it). The unfused torch path (``engine/deltanet.py`` + the layer's modules) computes the
same function; rounding points follow it: conv output and SiLU are rounded to the execution dtype,
as is ``o`` before the norm and the normalised ``o`` before the gate. With programmatic dependent
launch (``pdl.py``) the state and the constants are read before waiting for the projections. With
``rotate=G`` the output is also written ConvRot-rotated, as an int8_convrot ``out_proj`` reads it:
the value columns are then split over programs and a second small kernel does the gated norm over
two heads at a time (a group of 256 spans two 128-wide heads) and the rotation. Launch settings
(value-column blocks, warps) come from ``launch.deltanet``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch
from .convrot import convrot_group_ok
from .convrot_triton import convrot_rows, hadamard_cached, hadamard_rotate
from .pdl import enter, launch_args, trigger, wait


@triton.jit
def _softplus(x):
    # torch.nn.functional.softplus (beta 1, threshold 20)
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _round(x, DT: tl.constexpr):
    return x.to(DT).to(tl.float32)


@triton.jit
def _conv_silu(x, h1, h2, h3, w0, w1, w2, w3, K: tl.constexpr, DT: tl.constexpr):
    """SiLU(conv) of one row: ``x`` the row's raw channels, h1..h3 the window's columns 1..3 before
    it (old conv state or earlier rows), w_d the tap weight d columns back; taps summed oldest first."""
    acc = tl.zeros(x.shape, dtype=tl.float32)
    if K >= 4:
        acc += w3 * h3.to(tl.float32)
    if K >= 3:
        acc += w2 * h2.to(tl.float32)
    if K >= 2:
        acc += w1 * h1.to(tl.float32)
    acc += w0 * x.to(tl.float32)
    acc = _round(acc, DT)
    return _round(acc * tl.sigmoid(acc), DT)


@triton.jit
def _taps(CW, ch, K: tl.constexpr):
    """The conv weights of channels ``ch`` as float32, d columns back for d = 0..3 (zeros past K)."""
    w0 = tl.load(CW + ch * K + (K - 1)).to(tl.float32)
    w1 = tl.zeros(w0.shape, dtype=tl.float32)
    w2 = tl.zeros(w0.shape, dtype=tl.float32)
    w3 = tl.zeros(w0.shape, dtype=tl.float32)
    if K >= 2:
        w1 = tl.load(CW + ch * K + (K - 2)).to(tl.float32)
    if K >= 3:
        w2 = tl.load(CW + ch * K + (K - 3)).to(tl.float32)
    if K >= 4:
        w3 = tl.load(CW + ch * K + (K - 4)).to(tl.float32)
    return w0, w1, w2, w3


@triton.jit
def _old_columns(CIN, b, q_ch, k_ch, v_ch, sc_b, sc_c, d: tl.constexpr, K: tl.constexpr, WIN, sw_b, sw_c, first):
    """The old conv state's column d back from the first new row (d = 1..3; zeros past K - 1) of the
    q, k and v channels, also written to the window out (q/k where ``first``, v always)."""
    q = tl.zeros(q_ch.shape, dtype=CIN.dtype.element_ty)
    k = tl.zeros(k_ch.shape, dtype=CIN.dtype.element_ty)
    v = tl.zeros(v_ch.shape, dtype=CIN.dtype.element_ty)
    if d <= K - 1:
        q = tl.load(CIN + b * sc_b + q_ch * sc_c + (K - 1 - d))
        k = tl.load(CIN + b * sc_b + k_ch * sc_c + (K - 1 - d))
        v = tl.load(CIN + b * sc_b + v_ch * sc_c + (K - 1 - d))
        tl.store(WIN + b * sw_b + q_ch * sw_c + (K - 1 - d), q, mask=first)
        tl.store(WIN + b * sw_b + k_ch * sw_c + (K - 1 - d), k, mask=first)
        tl.store(WIN + b * sw_b + v_ch * sw_c + (K - 1 - d), v)
    return q, k, v


@triton.jit
def _new_columns(QKV, b, t, q_ch, k_ch, v_ch, sx_b, sx_s, K: tl.constexpr, WIN, sw_b, sw_c, first):
    """Row t's raw q, k and v channels, also written to the window out (column K - 1 + t; q/k where
    ``first``, v always)."""
    q = tl.load(QKV + b * sx_b + t * sx_s + q_ch)
    k = tl.load(QKV + b * sx_b + t * sx_s + k_ch)
    v = tl.load(QKV + b * sx_b + t * sx_s + v_ch)
    tl.store(WIN + b * sw_b + q_ch * sw_c + (K - 1 + t), q, mask=first)
    tl.store(WIN + b * sw_b + k_ch * sw_c + (K - 1 + t), k, mask=first)
    tl.store(WIN + b * sw_b + v_ch * sw_c + (K - 1 + t), v)
    return q, k, v


@triton.jit
def _step_kernel(
    QKV, Z, A, BETA, CIN, CW, NEG_A, DT_BIAS, STATE, NW, OUT, STATES, WIN,
    sx_b, sx_s, sz_b, sz_s, sa_b, sa_s, sb_b, sb_s, sc_b, sc_c, ss_b, ss_h,
    so_b, so_s, st_t, st_b, st_h, sw_b, sw_c,
    eps, q_scale,
    HV: tl.constexpr, REP: tl.constexpr, KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BV: tl.constexpr, S: tl.constexpr, K: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr,
    LAST_IN_PLACE: tl.constexpr,
):
    # grid (B * HV, DV // BV): program (b, h, vb) owns value columns [vb*BV, (vb+1)*BV) of head h.
    # With BV < DV the gated norm (a reduction over all DV columns) is left to _gated_norm_kernel.
    pid = tl.program_id(0)
    vb = tl.program_id(1)
    b = pid // HV
    h = pid % HV
    kh = h // REP
    offs_k = tl.arange(0, DK)
    offs_v = vb * BV + tl.arange(0, BV)
    q_ch = kh * DK + offs_k
    k_ch = KEY_DIM + kh * DK + offs_k
    v_ch = 2 * KEY_DIM + h * DV + offs_v

    # The recurrent state (the committed one: no other kernel of this step writes it; with
    # LAST_IN_PLACE this program writes its own tile back after the last row) and the constants
    # are read before waiting for the projections.
    trigger(PDL)
    state = tl.load(STATE + b * ss_b + h * ss_h + offs_k[:, None] * DV + offs_v[None, :])
    neg_a = tl.load(NEG_A + h)
    dt_bias = tl.load(DT_BIAS + h)
    nw = tl.load(NW + offs_v)
    wait(PDL)

    # The conv window, each column loaded once and written to the window out as it is read (q/k
    # channels by the first value head of each key head, v channels by every head): the K-1 old
    # columns first, then each row's. Row t+1's inputs are loaded before row t's state math and
    # stores, so their latency hides behind it (a load that follows a store cannot move above it).
    first = (offs_k + ((h % REP) + vb) * DK) < DK  # all true in program (first value head of the key head, vb 0)
    wq0, wq1, wq2, wq3 = _taps(CW, q_ch, K)
    wk0, wk1, wk2, wk3 = _taps(CW, k_ch, K)
    wv0, wv1, wv2, wv3 = _taps(CW, v_ch, K)
    q3, k3, v3 = _old_columns(CIN, b, q_ch, k_ch, v_ch, sc_b, sc_c, 3, K, WIN, sw_b, sw_c, first)
    q2, k2, v2 = _old_columns(CIN, b, q_ch, k_ch, v_ch, sc_b, sc_c, 2, K, WIN, sw_b, sw_c, first)
    q1, k1, v1 = _old_columns(CIN, b, q_ch, k_ch, v_ch, sc_b, sc_c, 1, K, WIN, sw_b, sw_c, first)
    qn, kn, vn = _new_columns(QKV, b, 0, q_ch, k_ch, v_ch, sx_b, sx_s, K, WIN, sw_b, sw_c, first)
    a_n = tl.load(A + b * sa_b + h)
    b_n = tl.load(BETA + b * sb_b + h)

    for t in tl.static_range(S):
        qx, kx, vx, a_in, b_in = qn, kn, vn, a_n.to(tl.float32), b_n.to(tl.float32)
        if BV == DV:
            z = tl.load(Z + b * sz_b + t * sz_s + h * DV + offs_v).to(tl.float32)
        if t + 1 < S:
            qn, kn, vn = _new_columns(QKV, b, t + 1, q_ch, k_ch, v_ch, sx_b, sx_s, K, WIN, sw_b, sw_c, first)
            a_n = tl.load(A + b * sa_b + (t + 1) * sa_s + h)
            b_n = tl.load(BETA + b * sb_b + (t + 1) * sb_s + h)
        q = _conv_silu(qx, q1, q2, q3, wq0, wq1, wq2, wq3, K, DT)
        k = _conv_silu(kx, k1, k2, k3, wk0, wk1, wk2, wk3, K, DT)
        v = _conv_silu(vx, v1, v2, v3, wv0, wv1, wv2, wv3, K, DT)
        q3, q2, q1 = q2, q1, qx
        k3, k2, k1 = k2, k1, kx
        v3, v2, v1 = v2, v1, vx
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        decay = tl.exp(neg_a * _softplus(a_in + dt_bias))
        beta = tl.sigmoid(b_in)

        state = state * decay
        mem = tl.sum(k[:, None] * state, axis=0)  # [DV]
        delta = (v - mem) * beta
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(q[:, None] * state, axis=0)  # [DV]
        if LAST_IN_PLACE and t == S - 1:  # the state after the last row, over the one read above
            tl.store(STATE + b * ss_b + h * ss_h + offs_k[:, None] * DV + offs_v[None, :], state)
        else:
            tl.store(STATES + t * st_t + b * st_b + h * st_h + offs_k[:, None] * DV + offs_v[None, :], state)

        if BV == DV:
            o = _round(o, DT)
            n = _round(o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps) * nw, DT)
            y = n * (z * tl.sigmoid(z))
            tl.store(OUT + b * so_b + t * so_s + h * DV + offs_v, y.to(DT))
        else:
            tl.store(OUT + b * so_b + t * so_s + h * DV + offs_v, o.to(DT))


@triton.jit
def _gated_norm_kernel(OUT, Z, NW, OROT, so_b, so_s, sz_b, sz_s, eps, HV: tl.constexpr, S: tl.constexpr,
                       DV: tl.constexpr, GH: tl.constexpr, ROT: tl.constexpr, IEEE: tl.constexpr,
                       DT: tl.constexpr, PDL: tl.constexpr):
    """In place on OUT ``[B,S,HV*DV]``: ``rms_norm(o) * w * silu(z)`` per (b, row, head), GH heads
    per program; with ROT (16 or 256) the result is also written ConvRot-rotated to OROT (same
    shape), the GH * DV columns being whole groups."""
    enter(PDL)
    pid = tl.program_id(0)
    NG: tl.constexpr = HV // GH
    g = pid % NG
    t = (pid // NG) % S
    b = pid // (NG * S)
    C: tl.constexpr = 16 if DV >= 16 else DV  # the program's columns as [R, C], as convrot_rows takes them
    R: tl.constexpr = GH * DV // C
    r = tl.arange(0, R)
    offs = g * (GH * DV) + r[:, None] * C + tl.arange(0, C)[None, :]
    ptr = OUT + b * so_b + t * so_s + offs
    o = tl.load(ptr).to(tl.float32)
    sq = tl.sum(o * o, axis=1)  # [R]: each head's rows summed below
    head = r // (DV // C)
    sq = tl.sum(tl.where(head[:, None] == head[None, :], sq[None, :], 0.0), axis=1)
    n = _round(o * tl.rsqrt(sq / DV + eps)[:, None] * tl.load(NW + offs % DV), DT)
    z = tl.load(Z + b * sz_b + t * sz_s + offs).to(tl.float32)
    y = (n * (z * tl.sigmoid(z))).to(DT)
    tl.store(ptr, y)
    if ROT > 0:
        tl.store(OROT + (b * S + t) * (HV * DV) + tl.trans(offs), convrot_rows(y, ROT, R, IEEE).to(DT))


#: The most conv taps ``_step_kernel`` keeps (its window holds the current row and three before it).
MAX_CONV_KERNEL = 4
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def step_reason(qkv: torch.Tensor, key_head_dim: int, value_head_dim: int, conv_kernel: int) -> str | None:
    """None when ``gated_delta_step`` supports these inputs, else why not (one line)."""
    if not 1 <= conv_kernel <= MAX_CONV_KERNEL:
        return f"a conv kernel of {conv_kernel} taps (1 to {MAX_CONV_KERNEL}; Qwen3.5's have 4)"
    if qkv.dtype not in _TL_DTYPES:
        return f"dtype {qkv.dtype} (float32, float16 or bfloat16 only)"
    if not (_pow2(key_head_dim) and _pow2(value_head_dim)):
        return f"head dims {key_head_dim}/{value_head_dim} are not powers of two"
    if qkv.dim() != 3 or not 1 <= qkv.shape[1] <= 16:
        return f"qkv of shape {tuple(qkv.shape)} (expected [B, S<=16, conv_dim])"
    return None


def gated_delta_step(qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     conv_state: torch.Tensor, conv_weight: torch.Tensor, neg_a: torch.Tensor,
                     dt_bias: torch.Tensor, state: torch.Tensor, norm_weight: torch.Tensor, eps: float, *,
                     key_heads: int, states_out: torch.Tensor | None = None,
                     window_out: torch.Tensor | None = None, config: tuple[int, int] | None = None,
                     rotate: int = 0, last_in_place: bool = False):
    """Fused Gated DeltaNet rows (see the module docstring).

    qkv ``[B,S,2*Hk*Dk+Hv*Dv]`` (in_proj_qkv output; last dim contiguous), z ``[B,S,Hv*Dv]``, a, b
    ``[B,S,Hv]`` (in_proj_a / in_proj_b outputs), all in the execution dtype; conv_state
    ``[B,C,K-1]`` and conv_weight ``[C,K]`` in that dtype; neg_a (``-exp(A_log)``), dt_bias float32
    ``[Hv]``; state float32 ``[B,Hv,Dk,Dv]`` contiguous (read only, unless ``last_in_place``);
    norm_weight float32 ``[Dv]`` (the gated norm's effective weight). ``key_heads`` = Hk.

    Returns ``(out [B,S,Hv*Dv] dtype, states [S,B,Hv,Dk,Dv] float32 (state after each row), window
    [B,C,K-1+S] dtype (old conv state then the S new rows))``; ``states_out`` / ``window_out`` may
    be given (contiguous, those shapes) to write into. ``last_in_place``: the state after the last
    row is written over ``state`` itself (each program reads its tile first), so ``states`` holds
    only the S-1 rows before it (``[S-1,B,Hv,Dk,Dv]``): for a caller that always keeps at least one
    row of the S and keeps all S most often (no copy then). ``config``: (value-column blocks,
    warps) to override the tuned choice (benchmarks, tests). ``rotate=G`` (a ConvRot group size
    dividing Hv*Dv) appends ``out`` ConvRot-rotated in groups of G (``[B,S,Hv*Dv]``, float32
    products of the rounded ``out``, one rounding), what an int8 ConvRot ``out_proj`` reads: for G
    16 or 256 the gated norm's kernel writes it (then the value columns are always split, so that
    kernel runs), else one ``hadamard_rotate`` launch.
    """
    bsz, s, c = qkv.shape
    hv = a.shape[-1]
    dk, dv = state.shape[-2], state.shape[-1]
    kernel = conv_weight.shape[-1]
    key_dim = key_heads * dk
    why = step_reason(qkv, dk, dv, kernel)
    if why is not None:
        raise ValueError(f"gated_delta_step: unsupported input: {why}; use the torch path (engine/deltanet.py)")
    if hv % key_heads or c != 2 * key_dim + hv * dv:
        raise ValueError(f"gated_delta_step: qkv width {c} != 2*{key_heads}*{dk} + {hv}*{dv}, or value heads "
                         f"{hv} not a multiple of key heads {key_heads}")
    if tuple(state.shape) != (bsz, hv, dk, dv) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"gated_delta_step: state must be contiguous float32 {(bsz, hv, dk, dv)}, got "
                         f"{tuple(state.shape)} {state.dtype}")
    if tuple(conv_state.shape) != (bsz, c, kernel - 1) or tuple(conv_weight.shape) != (c, kernel):
        raise ValueError(f"gated_delta_step: conv_state {tuple(conv_state.shape)} / conv_weight "
                         f"{tuple(conv_weight.shape)} do not match [B,{c},K-1] / [{c},K]")
    if tuple(z.shape) != (bsz, s, hv * dv) or tuple(a.shape) != (bsz, s, hv) or tuple(b.shape) != (bsz, s, hv):
        raise ValueError(f"gated_delta_step: z {tuple(z.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)} do not "
                         f"match B={bsz}, S={s}, Hv={hv}, Dv={dv}")
    if norm_weight.numel() != dv or neg_a.numel() != hv or dt_bias.numel() != hv:
        raise ValueError("gated_delta_step: norm_weight must have Dv entries, neg_a and dt_bias Hv")
    for name, t in (("qkv", qkv), ("z", z), ("a", a), ("b", b)):
        if t.stride(-1) != 1:
            raise ValueError(f"gated_delta_step: {name} needs a contiguous last dim")
    conv_weight = conv_weight.contiguous()
    if conv_state.stride(-1) != 1:
        conv_state = conv_state.contiguous()
    dt = qkv.dtype
    out = torch.empty(bsz, s, hv * dv, dtype=dt, device=qkv.device)
    kept = s - 1 if last_in_place else s  # rows whose state goes to states_out
    if states_out is None:
        states_out = torch.empty(kept, bsz, hv, dk, dv, dtype=torch.float32, device=qkv.device)
    if window_out is None:
        window_out = torch.empty(bsz, c, kernel - 1 + s, dtype=dt, device=qkv.device)
    if tuple(states_out.shape) != (kept, bsz, hv, dk, dv) or not states_out.is_contiguous():
        raise ValueError(f"gated_delta_step: states_out must be contiguous {(kept, bsz, hv, dk, dv)}")
    st_ptr = states_out if kept else state  # nothing goes to an empty states_out (one row in place)
    if tuple(window_out.shape) != (bsz, c, kernel - 1 + s) or window_out.stride(-1) != 1:
        raise ValueError(f"gated_delta_step: window_out must be {(bsz, c, kernel - 1 + s)} with a contiguous last dim")
    if rotate and (not convrot_group_ok(rotate) or (hv * dv) % rotate):
        raise ValueError(f"gated_delta_step: rotate={rotate} must be a ConvRot group size (a power of 4) that "
                         f"divides the output width {hv * dv}")
    heads = _rotation_heads(rotate, hv, dv)  # value heads per gated-norm program (0: no rotation there)
    split, warps = launch.deltanet(dk, dv, s, bool(heads), qkv.device) if config is None else config
    if split == 1:  # whole heads: the step kernel does the gated norm itself, a rotation launch follows
        heads = 0
    if dv % split or not _pow2(dv // split):
        raise ValueError(f"gated_delta_step: cannot split {dv} value columns into {split} power-of-two blocks")
    _step_kernel[(bsz * hv, split)](
        qkv, z, a, b, conv_state, conv_weight, neg_a, dt_bias, state, norm_weight, out, st_ptr, window_out,
        qkv.stride(0), qkv.stride(1), z.stride(0), z.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        conv_state.stride(0), conv_state.stride(1), state.stride(0), state.stride(1),
        out.stride(0), out.stride(1), *((states_out.stride(0), states_out.stride(1), states_out.stride(2)) if kept
                                        else (0, 0, 0)),
        window_out.stride(0), window_out.stride(1),
        float(eps), dk ** -0.5,
        HV=hv, REP=hv // key_heads, KEY_DIM=key_dim, DK=dk, DV=dv, BV=dv // split, S=s, K=kernel,
        DT=_TL_DTYPES[dt], LAST_IN_PLACE=last_in_place, num_warps=warps, **launch_args(qkv.device),
    )
    out_rot = torch.empty_like(out) if heads else out
    if split > 1:
        gh = heads or 1
        _gated_norm_kernel[(bsz * s * (hv // gh),)](
            out, z, norm_weight, out_rot, out.stride(0), out.stride(1), z.stride(0), z.stride(1), float(eps),
            HV=hv, S=s, DV=dv, GH=gh, ROT=rotate if heads else 0, IEEE=dt == torch.float32, DT=_TL_DTYPES[dt],
            num_warps=4, **launch_args(qkv.device))
    if not rotate:
        return out, states_out, window_out
    if not heads:
        out_rot = hadamard_rotate(out, hadamard_cached(rotate, out.device, dt))
    return out, states_out, window_out, out_rot


def _rotation_heads(rotate: int, hv: int, dv: int) -> int:
    """Value heads per gated-norm program when that kernel can write the ConvRot-``rotate`` output
    (G 16 or 256 over whole groups of at least 256 columns, heads of at least 16 columns, as
    ``convrot_triton.convrot_rows`` takes them), else 0."""
    if rotate not in (16, 256) or dv < 16:
        return 0
    width = max(rotate, 256)
    if width % dv or hv % (width // dv):
        return 0
    return width // dv
