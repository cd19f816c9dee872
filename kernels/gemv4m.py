"""4-bit weights (convrot_w4a4, nvfp4) in the decode-row products on the tensor cores, in registers
(Triton + PTX ``mma.sync``).

The tile behind ``gemv4.gemv4_group`` for bf16 / fp16 x of 1..8 rows, K a multiple of 32 and
16-byte aligned rows of weights and x, on NVIDIA GPUs of compute capability 8.0+
(``mma.sync.m16n8k16``, which every such GPU has), where the launch config is ``(16, 128 * CHUNKS,
warps, 1, 2)`` (``launch.gemv4``). Elsewhere the word tile (``gemv4w.py``) or the tile of ``gemv4.py``.

The product is ``D[16 weight rows, 8 x rows] += A[16, 16] @ B[16, 8]``: the weights are the MMA's
A operand and x's rows its B operand, so x's rows are padded to 8, not 16. Each warp owns 16 weight
rows; lane (g, t) = (lane / 4, lane % 4) holds A's rows g and g + 8 and B's column (x row) g, and
the fragment layout is PTX's (``mma.m16n8k16``, A row-major, B column-major). No operand moves
between lanes or through shared memory: a lane reads its A and B fragments straight from memory,
which is possible because a dot product does not care in which order its K terms come, as long as
A and B agree. For each 128-column chunk lane t reads the 32 columns ``32 t .. 32 t + 31`` of its
rows: one 16-byte load per weight row (4 words of 8 codes), four of x. Word ``i`` (columns ``c = 32
t + 8 i + 0..7``) feeds two MMAs, each taking two pairs of its columns as its K pairs (2t, 2t + 1)
and (2t + 8, 2t + 9) (``mma_asm``), x's B registers the same columns.

A code becomes its 16-bit float by integer work alone. convrot_w4a4: ``(w & 0x0F0F0F0F) ^
0x08080808`` (and the same of ``w >> 4``) is q + 8 in the bytes of the even (odd) columns; a byte
permute puts two bytes under the exponent byte 0x43 (bf16: 128 + byte) or 0x64 (fp16: 1024 + byte),
and one packed FMA takes the offset off, exactly. nvfp4: a code's magnitude bits go under the
float's lowest exponent bits and top mantissa bit and its sign to the sign bit (``ptx.e2m1_halves``:
its E2M1 value times 2^-126 / 2^-14, subnormals included), and one packed FMA multiplies it by its
block's E4M3 scale times 2^7 (``ptx.e4m3_half2``, made once per chunk): the value times its scale
times 2^-7, exact (at most 6 significant bits, a multiple of 2^-17 and at most 21). Products and
sums are float32 on the tensor cores. The per-row float32 scale (nvfp4: the tensor scale times 2^7)
multiplies the result, as does ``row_norm``'s factor.

Each program's warps take the program's K steps in turn and their sums meet in one reduction;
split-K over programs as ``gemv4.py``.

The lanes' roles come from the position of each value in a ``[32 * warps]`` tensor, one value a
thread (Triton's layout for it; offsets are multiplied by ``one``, 1 at run time, so that no load
or store is vectorised across lanes).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gemv4w import swizzled
from .pdl import trigger, wait
from .ptx import HALF_BITS_REGS, e2m1_halves, e4m3_consts, e4m3_half2, nibble_bytes, prefetch_share

#: 16-bit float kind of x (``gemv4.X_KIND``) -> (PTX type, exponent byte, 1.0 twice)
HALF = {2: ("bf16", 0x43, 0x3F803F80), 1: ("f16", 0x64, 0x3C003C00)}
#: x kind -> minus the offset a convrot_w4a4 code's 16-bit float carries, twice (bf16: 128 + q + 8; fp16:
#: 1024 + q + 8)
OFFSET = {2: 0xC308C308, 1: 0xE408E408}
#: columns of a row one lane reads per chunk, and the warp's 4 lanes along K together
LANE_COLS, CHUNK_COLS = tl.constexpr(32), tl.constexpr(128)


def mma_asm(xk: int, fmt: int = 1) -> str:
    """The PTX of one 128-column chunk of a lane. Operands: ``$0..$3`` D (f32 out: rows g, g of x rows
    2t, 2t + 1, then rows g + 8); ``$4`` / ``$5`` the addresses of the lane's first weight word in rows
    g / g + 8, ``$6`` of its first x value in x row g; ``$7`` / ``$8`` / ``$9`` nonzero where those rows
    exist; ``$10`` the columns left from the lane's first (the chunk reads where that is positive);
    ``$11..$14`` C (f32 in); nvfp4 (``fmt`` 2): ``$15..$18`` the E4M3 block scales of rows g and g + 8
    for the lane's two 16-column blocks (g block 0, g block 1, g + 8 block 0, g + 8 block 1), each a
    byte in bits 0..7, the rest zero. convrot_w4a4 pairs even and odd columns, nvfp4 columns 4 apart
    (x's pairs by byte permutes); nvfp4's D is the product times 2^-7."""
    kind, exp, one = HALF[xk]
    out = [".reg .pred ra, rb, rx, pc;", ".reg .b32 b0, b1, wa<4>, wb<4>, xr<16>;",
           "setp.gt.s32 pc, $10, 0;", "setp.ne.b32 ra, $7, 0; setp.ne.b32 rb, $8, 0; setp.ne.b32 rx, $9, 0;",
           "and.pred ra, ra, pc; and.pred rb, rb, pc; and.pred rx, rx, pc;",
           "mov.f32 $0, $11; mov.f32 $1, $12; mov.f32 $2, $13; mov.f32 $3, $14;",
           " ".join(f"mov.b32 {r}{j}, 0;" for r in ("wa", "wb") for j in range(4)),
           " ".join(f"mov.b32 xr{j}, 0;" for j in range(16)),
           "@ra ld.global.nc.L1::no_allocate.v4.b32 {wa0, wa1, wa2, wa3}, [$4+0];",
           "@rb ld.global.nc.L1::no_allocate.v4.b32 {wb0, wb1, wb2, wb3}, [$5+0];"]
    out += [f"@rx ld.global.v4.b32 {{xr{4 * j}, xr{4 * j + 1}, xr{4 * j + 2}, xr{4 * j + 3}}}, [$6+{16 * j}];"
            for j in range(4)]
    if fmt == 1:
        out += [".reg .b32 m, one, off, la, ha, lb, hb, a0, a1, a2, a3;",
                f"mov.b32 m, {exp * 0x01010101:#010x}; mov.b32 one, {one:#010x}; mov.b32 off, {OFFSET[xk]:#010x};"]
    else:  # the four block scales, times 2^7, as two copies of x's kind each
        out += [HALF_BITS_REGS, ".reg .b32 fa<4>, fb<4>, sc<4>;", *e4m3_consts(kind)]
        for j in range(4):
            out += e4m3_half2(f"${15 + j}", f"sc{j}", kind)
    for i in range(4):
        xs = [f"xr{4 * i + j}" for j in range(4)]  # x columns (8i + 0, 1), (2, 3), (4, 5), (6, 7) of the lane's
        if fmt == 1:  # pairs (0, 2) | (4, 6), then (1, 3) | (5, 7); x paired the same way
            out += nibble_bytes(f"wa{i}", "la", "ha") + nibble_bytes(f"wb{i}", "lb", "hb")
            for ra_, rb_, sel in (("la", "lb", "0x5410"), ("ha", "hb", "0x7632")):
                out += [f"prmt.b32 a0, {ra_}, m, 0x4140;", f"prmt.b32 a1, {rb_}, m, 0x4140;",
                        f"prmt.b32 a2, {ra_}, m, 0x4342;", f"prmt.b32 a3, {rb_}, m, 0x4342;"]
                out += [f"fma.rn.{kind}x2 a{j}, a{j}, one, off;" for j in range(4)]
                out += [f"prmt.b32 b0, {xs[0]}, {xs[1]}, {sel};", f"prmt.b32 b1, {xs[2]}, {xs[3]}, {sel};",
                        f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 {{$0, $1, $2, $3}}, "
                        "{a0, a1, a2, a3}, {b0, b1}, {$0, $1, $2, $3};"]
        else:  # codes (i, i + 4) of a word are columns (1, 5), (0, 4), (3, 7), (2, 6); pairs (0, 4) | (2, 6),
            # then (1, 5) | (3, 7); x's pairs by byte permutes
            fa, fb = [f"fa{j}" for j in range(4)], [f"fb{j}" for j in range(4)]
            out += e2m1_halves(f"wa{i}", fa, kind) + e2m1_halves(f"wb{i}", fb, kind)
            out += [f"fma.rn.{kind}x2 {r}, {r}, sc{i // 2 + 2 * (r in fb)}, ez;" for r in fa + fb]  # exact
            for lo, hi, sel in ((1, 3, "0x5410"), (0, 2, "0x7632")):
                out += [f"prmt.b32 b0, {xs[0]}, {xs[2]}, {sel};", f"prmt.b32 b1, {xs[1]}, {xs[3]}, {sel};",
                        f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 {{$0, $1, $2, $3}}, "
                        f"{{fa{lo}, fb{lo}, fa{hi}, fb{hi}}}, {{b0, b1}}, {{$0, $1, $2, $3}};"]
    return "{\n" + "\n".join(out) + "\n}"


MMA_BF16 = tl.constexpr(mma_asm(2, 1))
MMA_F16 = tl.constexpr(mma_asm(1, 1))
MMA_BF16_FP4 = tl.constexpr(mma_asm(2, 2))
MMA_F16_FP4 = tl.constexpr(mma_asm(1, 2))
CONSTRAINTS = tl.constexpr("=f,=f,=f,=f,l,l,l,r,r,r,r,f,f,f,f")
CONSTRAINTS_FP4 = tl.constexpr("=f,=f,=f,=f,l,l,l,r,r,r,r,f,f,f,f,r,r,r,r")


@triton.jit
def _chunk(d0, d1, d2, d3, pa, pb, px, oka, okb, okx, left, S, ra, rb, col, s_cols, XK: tl.constexpr,
           FMT: tl.constexpr):
    # one 128-column chunk of every lane: D += its products (nvfp4: the block scales read here)
    # addresses as int64 ("l"): Triton 3.6 type-checks the asm's arguments pairwise, as a binary op
    pa, pb, px = pa.to(tl.int64), pb.to(tl.int64), px.to(tl.int64)
    if FMT == 1:
        args = [pa, pb, px, oka, okb, okx, left, d0, d1, d2, d3]
        if XK == 2:
            out = tl.inline_asm_elementwise(MMA_BF16, CONSTRAINTS, args, (tl.float32,) * 4, is_pure=False, pack=1)
        else:
            out = tl.inline_asm_elementwise(MMA_F16, CONSTRAINTS, args, (tl.float32,) * 4, is_pure=False, pack=1)
    else:  # the lane's two 16-column blocks, swizzled as gemv4._tile4's
        blk = col // 16
        ok = left > 0
        sa = swizzled(ra, blk, s_cols)
        sb = swizzled(rb, blk, s_cols)
        a0 = tl.load(S + sa, mask=ok, other=0).to(tl.int32) & 255
        a1 = tl.load(S + sa + 1, mask=ok, other=0).to(tl.int32) & 255
        b0 = tl.load(S + sb, mask=ok, other=0).to(tl.int32) & 255
        b1 = tl.load(S + sb + 1, mask=ok, other=0).to(tl.int32) & 255
        args = [pa, pb, px, oka, okb, okx, left, d0, d1, d2, d3, a0, a1, b0, b1]
        if XK == 2:
            out = tl.inline_asm_elementwise(MMA_BF16_FP4, CONSTRAINTS_FP4, args, (tl.float32,) * 4, is_pure=False,
                                            pack=1)
        else:
            out = tl.inline_asm_elementwise(MMA_F16_FP4, CONSTRAINTS_FP4, args, (tl.float32,) * 4, is_pure=False,
                                            pack=1)
    return out


@triton.jit
def _factor(NRMr, ok, n_nrm, n_mean, eps, ROW_NORM: tl.constexpr):
    # the RMSNorm factor of the x row at NRMr, per lane
    j = tl.arange(0, ROW_NORM)
    sq = tl.load(NRMr[:, None] + j[None, :], mask=ok[:, None] & (j < n_nrm)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(sq, 1) / n_mean + eps)


@triton.jit
def _tile4m(X, W, S, T, Y, M, N, K, K_PER, sx_m, sw_n, s_cols, sy_m, sy_k, pid, NRM, n_nrm, s_nrm, n_mean, eps,
            one, WARPS: tl.constexpr, CHUNKS: tl.constexpr, XK: tl.constexpr, FMT: tl.constexpr,
            PDL: tl.constexpr, ROW_NORM: tl.constexpr):
    # Program (pid, program_id(1)): weight rows pid * 16 + 0..15 over the columns [pid_k * K_PER, + K_PER)
    pid_k = tl.program_id(1)
    e = tl.arange(0, 32 * WARPS) * one  # one value a thread: its lane's role
    lane = e % 32
    g = lane // 4
    t = lane % 4
    ra = pid * 16 + g
    k_lo = pid_k * K_PER
    k_hi = tl.minimum(k_lo + K_PER, K)
    STEP: tl.constexpr = CHUNK_COLS * CHUNKS
    first = k_lo + (e // 32) * STEP + LANE_COLS * t  # this lane's first column of the first step
    pa = W + ra.to(tl.int64) * sw_n + first // 2
    pb = pa + 8 * sw_n
    px = X + g * sx_m + first
    oka = (ra < N).to(tl.int32)
    okb = (ra + 8 < N).to(tl.int32)
    okx = (g < M).to(tl.int32)
    wait(PDL)
    trigger(PDL)
    d0 = tl.zeros((32 * WARPS,), dtype=tl.float32)
    d1, d2, d3 = d0, d0, d0
    for kc in range(k_lo, k_hi, STEP * WARPS):
        col = first + (kc - k_lo)
        for c in tl.static_range(CHUNKS):
            d0, d1, d2, d3 = _chunk(d0, d1, d2, d3, pa + c * CHUNK_COLS // 2, pb + c * CHUNK_COLS // 2,
                                    px + c * CHUNK_COLS, oka, okb, okx, k_hi - col - c * CHUNK_COLS, S, ra, ra + 8,
                                    col + c * CHUNK_COLS, s_cols, XK, FMT)
        pa += STEP * WARPS // 2
        pb += STEP * WARPS // 2
        px += STEP * WARPS
    if WARPS > 1:  # the warps' K chunks summed: lane l's four values
        d0 = tl.sum(tl.reshape(d0, (WARPS, 32)), 0)
        d1 = tl.sum(tl.reshape(d1, (WARPS, 32)), 0)
        d2 = tl.sum(tl.reshape(d2, (WARPS, 32)), 0)
        d3 = tl.sum(tl.reshape(d3, (WARPS, 32)), 0)
        lane = tl.arange(0, 32) * one
    r0 = pid * 16 + lane // 4
    r1 = r0 + 8
    x0 = 2 * (lane % 4)
    x1 = x0 + 1
    if FMT == 2:  # D was the product times 2^-7
        s0 = 128.0 * tl.load(T).to(tl.float32) + tl.zeros_like(d0)
        s1 = s0
    else:
        s0 = tl.load(S + r0, mask=r0 < N, other=0.0).to(tl.float32)
        s1 = tl.load(S + r1, mask=r1 < N, other=0.0).to(tl.float32)
    if ROW_NORM > 0:
        f0 = _factor(NRM + x0 * s_nrm, x0 < M, n_nrm, n_mean, eps, ROW_NORM)
        f1 = _factor(NRM + x1 * s_nrm, x1 < M, n_nrm, n_mean, eps, ROW_NORM)
        s0b, s0c, s1b, s1c = s0 * f0, s0 * f1, s1 * f0, s1 * f1
    else:
        s0b, s0c, s1b, s1c = s0, s0, s1, s1
    Yk = Y + pid_k * sy_k
    ty = Y.dtype.element_ty
    tl.store(Yk + x0 * sy_m + r0, (d0 * s0b).to(ty), mask=(x0 < M) & (r0 < N))
    tl.store(Yk + x1 * sy_m + r0, (d1 * s0c).to(ty), mask=(x1 < M) & (r0 < N))
    tl.store(Yk + x0 * sy_m + r1, (d2 * s1b).to(ty), mask=(x0 < M) & (r1 < N))
    tl.store(Yk + x1 * sy_m + r1, (d3 * s1c).to(ty), mask=(x1 < M) & (r1 < N))


@triton.jit(do_not_specialize=["one"])
def gemv4m_kernel(X, W0, W1, W2, W3, S0, S1, S2, S3, T0, T1, T2, T3, Y0, Y1, Y2, Y3, M, K, K_PER, N0, N1, N2, N3,
                  E0, E1, E2, sx_m, sw0, sw1, sw2, sw3, c0, c1, c2, c3, sy0, sy1, sy2, sy3, sk0, sk1, sk2, sk3,
                  NRM, n_nrm, s_nrm, n_mean, eps, PF, n_pf, one,
                  COUNT: tl.constexpr, WARPS: tl.constexpr, CHUNKS: tl.constexpr, XK: tl.constexpr,
                  FMT: tl.constexpr, PDL: tl.constexpr, ROW_NORM: tl.constexpr, PREFETCH: tl.constexpr):
    """Programs [0, E0) serve weight 0 (16 rows each), [E0, E1) weight 1, ... (as ``gemv._gemv_kernel``);
    W* the packed weights as bytes ``[N, K/2]`` (row stride sw* bytes, 16-byte aligned); convrot_w4a4
    (FMT 1): S* their float32 row scales; nvfp4 (FMT 2): S* their swizzled E4M3 block scales as bytes
    (c* columns of them), T* their float32 tensor scales. X ``[M, K]`` bf16 / fp16 (XK 2 / 1; row
    stride sx_m, 16-byte aligned), Y* ``[M, N]`` or float32 partials ``[P, M, N]`` (sk*). K a
    multiple of 32, M <= 8."""
    pid = tl.program_id(0)
    if pid < E0:
        _tile4m(X, W0, S0, T0, Y0, M, N0, K, K_PER, sx_m, sw0, c0, sy0, sk0, pid, NRM, n_nrm, s_nrm, n_mean, eps,
                one, WARPS, CHUNKS, XK, FMT, PDL, ROW_NORM)
    elif COUNT > 1 and pid < E1:
        _tile4m(X, W1, S1, T1, Y1, M, N1, K, K_PER, sx_m, sw1, c1, sy1, sk1, pid - E0, NRM, n_nrm, s_nrm, n_mean,
                eps, one, WARPS, CHUNKS, XK, FMT, PDL, ROW_NORM)
    elif COUNT > 2 and pid < E2:
        _tile4m(X, W2, S2, T2, Y2, M, N2, K, K_PER, sx_m, sw2, c2, sy2, sk2, pid - E1, NRM, n_nrm, s_nrm, n_mean,
                eps, one, WARPS, CHUNKS, XK, FMT, PDL, ROW_NORM)
    elif COUNT > 3:
        _tile4m(X, W3, S3, T3, Y3, M, N3, K, K_PER, sx_m, sw3, c3, sy3, sk3, pid - E2, NRM, n_nrm, s_nrm, n_mean,
                eps, one, WARPS, CHUNKS, XK, FMT, PDL, ROW_NORM)
    if PREFETCH:
        prefetch_share(PF, n_pf, 128)
