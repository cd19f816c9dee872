"""4-bit weights in the decode-row products, read as 32-bit words on the FMA units (Triton).

The tile behind ``gemv4.gemv4_group`` for ``convrot_w4a4`` and ``nvfp4`` weights whose rows are whole
32-bit words (K a multiple of 8, the storage 4-byte aligned) and 1..``launch.WORD_ROWS`` (8) rows of x,
each row's accumulator unrolled (Triton 3.2 has no list of tensors to index); ``gemv4.py``'s
tensor-core tile takes the rest.

Each 32-bit word holds the signed nibbles of 8 consecutive columns (column 8w + j in bits 4j..4j+3,
kitchen's even-column-low order). Per word, integer work alone makes 8 float32 values 136 + q: the
nibbles of the even and odd columns are masked into bytes and flipped by 8 (``(w & 0x0F0F0F0F) ^
0x08080808``, the same for ``w >> 4``: q + 8 in 0..15), and each byte becomes the float32 whose bits
are ``0x43000000 | byte << 16`` (128 + byte: one byte permute on NVIDIA GPUs, ``_nib8_ptx``; shifts
and masks elsewhere, ``_nib8``, the same values). A row of x gives each word its 8 columns by one
16-byte load (``_x8_ptx``, NVIDIA GPUs, rows on 16 bytes), else as a ``[words, 8]`` tile split into
columns (``_columns``; Triton 3.4-3.6 move that tile through shared memory and spill at 4 rows); the
float32 products accumulate per word, and ``136 * sum(x)`` leaves the sum at the end (float32 x:
q itself, no sum). The per-row float32 scale multiplies the result, as does ``row_norm``'s factor.

nvfp4 (``FMT`` 2): a word holds 8 E2M1 codes, the even column in a byte's high nibble; per 4 codes
two byte permutes look 12 + 2|v| and 12 - 2|v| up in byte tables, a third turns the sign bits into
byte masks, one lop3 picks, and the bytes become 140 + 2v under the exponent byte
(``E2M1_ASM``; ``_e2m1`` per code elsewhere). A 16-column block is two words: each word's 8
products are summed and multiplied by the block's E4M3 scale (read from the swizzled layout)
before they join the accumulator; the tensor scale and the 1/2 multiply the result.

No tensor cores: one warp per program, each lane owning whole words, so no product crosses lanes
before the final sum. Launch config ``(BLOCK_N, BLOCK_K columns, warps, stages[, 1: vector loads of
the words])`` (``launch.gemv4``, kind ``w4a4``; ``fallback.gemv4w_config``); split-K, the group of
up to four weights, ``prefetch`` and programmatic dependent launch as ``gemv4.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import trigger, wait
from .ptx import E2M1_TABLES, e2m1_bytes, nibble_bytes, prefetch_share

OFFSET = tl.constexpr(136.0)  # 128 from the exponent bits, 8 from the flipped sign bit


def _as_floats(order) -> list[str]:
    """PTX making output j the float32 128 + byte b of register r, for (r, b) = ``order[j]``: prmt
    puts the byte under the exponent byte 0x43 held in ``m`` (selector 0x7b44: bytes 4, 4, b, 7 of
    {r, m})."""
    return [f"prmt.b32 ${j}, {r}, m, 0x7{b}44;" for j, (r, b) in enumerate(order)]


def _block(lines: list[str]) -> str:
    return "{\n    " + "\n    ".join(lines) + "\n    }"


#: ``_nib8_ptx``'s PTX: 8 float32 136 + q from each int32 word, column order 0..7 (even columns in
#: the low nibbles, ``lo``; odd ones in ``hi``).
NIB8_ASM = tl.constexpr(_block([".reg .b32 lo, hi, m;", *nibble_bytes("$8", "lo", "hi"), "mov.b32 m, 0x43000000;",
                                 *_as_floats([(r, b) for b in range(4) for r in ("lo", "hi")])]))


@triton.jit
def _nib8_ptx(wd):
    return tl.inline_asm_elementwise(
        asm=NIB8_ASM, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[wd], dtype=(tl.float32,) * 8, is_pure=True,
        pack=1)


@triton.jit
def _byte_f(src, B: tl.constexpr):
    # byte B of src (0..15) -> float32 128 + byte
    if B == 0:
        t = (src << 16) & 0x00FF0000
    elif B == 1:
        t = (src << 8) & 0x00FF0000
    elif B == 2:
        t = src & 0x00FF0000
    else:
        t = (src >> 8) & 0x00FF0000
    return (t | 0x43000000).to(tl.float32, bitcast=True)


@triton.jit
def _nib8(wd, PTX: tl.constexpr):
    # (f0..f7): float32 136 + q of columns 8w + 0..7 of each word w
    if PTX:
        return _nib8_ptx(wd)
    lo = (wd & 0x0F0F0F0F) ^ 0x08080808
    hi = ((wd >> 4) & 0x0F0F0F0F) ^ 0x08080808
    return (_byte_f(lo, 0), _byte_f(hi, 0), _byte_f(lo, 1), _byte_f(hi, 1), _byte_f(lo, 2), _byte_f(hi, 2),
            _byte_f(lo, 3), _byte_f(hi, 3))


@triton.jit
def _e2m1(nib):
    # E2M1 code (int32 0..15: sign, 2 exponent bits, 1 mantissa bit) -> float32, exactly.
    mag = nib & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    pw = tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0))
    v = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pw)
    return tl.where((nib & 8) != 0, -v, v)


@triton.jit
def _e4m3(b):
    # float8_e4m3fn byte (int32 0..255) -> float32, exactly (no FP8 instructions: any GPU).
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    pw = ((e + 120) << 23).to(tl.float32, bitcast=True)  # 2^(e - 7)
    v = tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * pw)
    return tl.where((b & 128) != 0, -v, v)


#: ``_e2m1_8_ptx``'s PTX: 8 float32 140 + 2v from each int32 word of E2M1 codes (column 8w + 2b in
#: the high nibble of byte b, 8w + 2b + 1 in the low one), column order 0..7: ``e2m1_bytes``, then
#: each byte under the exponent byte 0x43 (the even column's byte second in each pair).
E2M1_ASM = tl.constexpr(_block([".reg .b32 s, p, q, k, w4, lo, hi, m, tp0, tp1, tn0, tn1;", *E2M1_TABLES,
                                 "mov.b32 m, 0x43000000;", *e2m1_bytes("$8", "lo", "hi"),
                                 *_as_floats([(r, b ^ 1) for r in ("lo", "hi") for b in range(4)])]))


@triton.jit
def swizzled(r, blk, s_cols):
    # the byte offset of nvfp4's E4M3 scale of row r, 16-column block blk, in cuBLAS's swizzled layout
    # (``gemv4.py``'s module docstring; s_cols columns of blocks): 128 x 4 tiles of 512 bytes
    return ((r >> 7) * (s_cols // 4) + (blk >> 2)) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + (blk & 3)


@triton.jit
def _e2m1_8_ptx(wd):
    return tl.inline_asm_elementwise(
        asm=E2M1_ASM, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[wd], dtype=(tl.float32,) * 8, is_pure=True,
        pack=1)


@triton.jit
def _e2m1_8(wd, PTX: tl.constexpr):
    # (f0..f7): float32 2v of the E2M1 codes of columns 8w + 0..7 of each word w (exact)
    if PTX:
        f0, f1, f2, f3, f4, f5, f6, f7 = _e2m1_8_ptx(wd)
        return f0 - 140.0, f1 - 140.0, f2 - 140.0, f3 - 140.0, f4 - 140.0, f5 - 140.0, f6 - 140.0, f7 - 140.0
    return (2.0 * _e2m1((wd >> 4) & 15), 2.0 * _e2m1(wd & 15), 2.0 * _e2m1((wd >> 12) & 15),
            2.0 * _e2m1((wd >> 8) & 15), 2.0 * _e2m1((wd >> 20) & 15), 2.0 * _e2m1((wd >> 16) & 15),
            2.0 * _e2m1((wd >> 28) & 15), 2.0 * _e2m1((wd >> 24) & 15))


@triton.jit
def _columns(xv):
    # x tile [BLOCK_W, 8] -> its 8 columns, each [BLOCK_W] (in-thread splits)
    bw: tl.constexpr = xv.shape[0]
    a, b = tl.split(tl.reshape(xv, (bw, 4, 2)))
    a0, a1 = tl.split(tl.reshape(a, (bw, 2, 2)))
    b0, b1 = tl.split(tl.reshape(b, (bw, 2, 2)))
    x0, x4 = tl.split(a0)
    x2, x6 = tl.split(a1)
    x1, x5 = tl.split(b0)
    x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _x8_ptx(p, ok, XK: tl.constexpr):
    # The 8 consecutive x values at each 16-byte aligned address of ``p`` (0 where not ``ok``) as
    # float32, one vector load per lane and word: no tile of x goes through a layout change. XK: x's
    # kind (X_KIND: 0 float32, 1 fp16, 2 bf16).
    if XK == 0:  # two 16-byte loads straight into the outputs
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .pred q;
            setp.ne.b32 q, $9, 0;
            mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
            mov.b32 $4, 0; mov.b32 $5, 0; mov.b32 $6, 0; mov.b32 $7, 0;
            @q ld.global.v4.b32 {$0, $1, $2, $3}, [$8];
            @q ld.global.v4.b32 {$4, $5, $6, $7}, [$8 + 16];
            }""",
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,l,r", args=[p, ok.to(tl.int32)], dtype=(tl.float32,) * 8,
            is_pure=False, pack=1)
    elif XK == 1:  # fp16 halves converted
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .pred q;
            .reg .b32 r<4>;
            .reg .b16 h<8>;
            setp.ne.b32 q, $9, 0;
            mov.b32 r0, 0; mov.b32 r1, 0; mov.b32 r2, 0; mov.b32 r3, 0;
            @q ld.global.v4.b32 {r0, r1, r2, r3}, [$8];
            mov.b32 {h0, h1}, r0; mov.b32 {h2, h3}, r1; mov.b32 {h4, h5}, r2; mov.b32 {h6, h7}, r3;
            cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1; cvt.f32.f16 $2, h2; cvt.f32.f16 $3, h3;
            cvt.f32.f16 $4, h4; cvt.f32.f16 $5, h5; cvt.f32.f16 $6, h6; cvt.f32.f16 $7, h7;
            }""",
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,l,r", args=[p, ok.to(tl.int32)], dtype=(tl.float32,) * 8,
            is_pure=False, pack=1)
    else:  # bf16: a half's bits are the top of its float32
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .pred q;
            .reg .b32 r<4>;
            setp.ne.b32 q, $9, 0;
            mov.b32 r0, 0; mov.b32 r1, 0; mov.b32 r2, 0; mov.b32 r3, 0;
            @q ld.global.v4.b32 {r0, r1, r2, r3}, [$8];
            shl.b32 $0, r0, 16; and.b32 $1, r0, 0xFFFF0000; shl.b32 $2, r1, 16; and.b32 $3, r1, 0xFFFF0000;
            shl.b32 $4, r2, 16; and.b32 $5, r2, 0xFFFF0000; shl.b32 $6, r3, 16; and.b32 $7, r3, 0xFFFF0000;
            }""",
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,l,r", args=[p, ok.to(tl.int32)], dtype=(tl.float32,) * 8,
            is_pure=False, pack=1)


@triton.jit
def _row(acc, xs, f0, f1, f2, f3, f4, f5, f6, f7, sc, Xr, offs_w, w_hi, EVEN: tl.constexpr, EXACT: tl.constexpr,
         XK: tl.constexpr, FMT: tl.constexpr):
    # one row of x against the tile's words: acc [BLOCK_N, BLOCK_W] += f * x (FMT 2, nvfp4: += sc *
    # sum of the word's 8 products, sc its block scale); xs += x unless EXACT (f is the code's value
    # itself there, not 136 + q). XK >= 0: x's 8 columns of each word by ``_x8_ptx`` (x's kind,
    # X_KIND); -1: a [BLOCK_W, 8] tile split into its columns (``_columns``).
    if XK >= 0:
        x0, x1, x2, x3, x4, x5, x6, x7 = _x8_ptx(Xr + offs_w * 8, offs_w < w_hi, XK)
    else:
        cols = (offs_w * 8)[:, None] + tl.arange(0, 8)[None, :]
        if EVEN:
            xv = tl.load(Xr + cols)
        else:
            xv = tl.load(Xr + cols, mask=(offs_w < w_hi)[:, None], other=0.0)
        x0, x1, x2, x3, x4, x5, x6, x7 = _columns(xv.to(tl.float32))
    if not EXACT:
        xs += ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    if FMT == 2:
        t = f0 * x0[None, :]
    else:
        t = acc + f0 * x0[None, :]
    t += f1 * x1[None, :]
    t += f2 * x2[None, :]
    t += f3 * x3[None, :]
    t += f4 * x4[None, :]
    t += f5 * x5[None, :]
    t += f6 * x6[None, :]
    t += f7 * x7[None, :]
    if FMT == 2:
        return acc + sc * t, xs
    return t, xs


@triton.jit
def _store(acc, xs, scale, Yr, offs_n, n_ok, NRMr, n_nrm, n_mean, eps, ROW_NORM: tl.constexpr):
    # one row's result: (sum(acc) - OFFSET * sum(xs)) * scale [* its RMSNorm factor]
    out = (tl.sum(acc, 1) - OFFSET * tl.sum(xs, 0)) * scale
    if ROW_NORM > 0:
        j = tl.arange(0, ROW_NORM)
        sq = tl.load(NRMr + j, mask=j < n_nrm, other=0.0)
        out *= tl.rsqrt(tl.sum(sq, 0) / n_mean + eps)
    tl.store(Yr + offs_n, out.to(Yr.dtype.element_ty), mask=n_ok)


@triton.jit
def _tile4w(X, W, S, T, Y, N, KW, W_PER, sx_m, sw_n, s_cols, sy_m, sy_k, pid, NRM, n_nrm, s_nrm, n_mean, eps, one,
            ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN: tl.constexpr,
            PTX: tl.constexpr, PDL: tl.constexpr, ROW_NORM: tl.constexpr, VEC: tl.constexpr,
            EXACT: tl.constexpr, XK: tl.constexpr, FMT: tl.constexpr):
    # Program (pid, program_id(1)): BLOCK_N outputs over the words [pid_k * W_PER, + W_PER). VEC 0:
    # the words' offsets times ``one`` (1 at run time, unknown to the compiler) keep every lane on
    # whole words of its own (no vector loads, no layout change for x); VEC 1: vector loads. FMT 1:
    # convrot_w4a4 (S its float32 row scales); 2: nvfp4 (S its swizzled E4M3 block scales, s_cols
    # columns of them, T its float32 tensor scale; a 16-column block is two words).
    pid_k = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_lo = pid_k * W_PER
    w_hi = tl.minimum(w_lo + W_PER, KW)
    wait(PDL)
    trigger(PDL)
    z = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    zs = tl.zeros((BLOCK_W,), dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = z, z, z, z, z, z, z, z
    s0, s1, s2, s3, s4, s5, s6, s7 = zs, zs, zs, zs, zs, zs, zs, zs
    for w0 in range(w_lo, w_hi, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        if VEC:
            ptrs = W + offs_n[:, None] * sw_n + offs_w[None, :]
        else:
            ptrs = W + offs_n[:, None] * sw_n + offs_w[None, :] * one
        if EVEN and PDL:  # read once: evict first, L2 keeps the activations and partials
            wd = tl.load(ptrs, eviction_policy="evict_first")
        elif EVEN:
            wd = tl.load(ptrs)
        else:
            wd = tl.load(ptrs, mask=n_ok[:, None] & (offs_w < w_hi)[None, :], other=0)
        if FMT == 2:  # 2v of each code (exact); the word's block scale, swizzled as gemv4._tile4's
            f0, f1, f2, f3, f4, f5, f6, f7 = _e2m1_8(wd, PTX)
            blk = (offs_w >> 1)[None, :]
            r = offs_n[:, None]
            s_off = swizzled(r, blk, s_cols)
            if EVEN:
                sb = tl.load(S + s_off)
            else:
                sb = tl.load(S + s_off, mask=n_ok[:, None] & (offs_w < w_hi)[None, :], other=0)
            sc = _e4m3(sb.to(tl.int32) & 255)
        else:
            f0, f1, f2, f3, f4, f5, f6, f7 = _nib8(wd, PTX)
            sc = 1.0
            if EXACT:  # float32 x: q itself, so no sum of x leaves the accumulator (exact products)
                f0, f1, f2, f3 = f0 - OFFSET, f1 - OFFSET, f2 - OFFSET, f3 - OFFSET
                f4, f5, f6, f7 = f4 - OFFSET, f5 - OFFSET, f6 - OFFSET, f7 - OFFSET
        a0, s0 = _row(a0, s0, f0, f1, f2, f3, f4, f5, f6, f7, sc, X, offs_w, w_hi, EVEN, EXACT, XK, FMT)
        if ROWS > 1:
            a1, s1 = _row(a1, s1, f0, f1, f2, f3, f4, f5, f6, f7, sc, X + sx_m, offs_w, w_hi,
                          EVEN, EXACT, XK, FMT)
        if ROWS > 2:
            a2, s2 = _row(a2, s2, f0, f1, f2, f3, f4, f5, f6, f7, sc, X + 2 * sx_m, offs_w, w_hi,
                          EVEN, EXACT, XK, FMT)
        if ROWS > 3:
            a3, s3 = _row(a3, s3, f0, f1, f2, f3, f4, f5, f6, f7, sc, X + 3 * sx_m, offs_w, w_hi,
                          EVEN, EXACT, XK, FMT)
        if ROWS > 4:
            a4, s4 = _row(a4, s4, f0, f1, f2, f3, f4, f5, f6, f7, sc, X + 4 * sx_m, offs_w, w_hi,
                          EVEN, EXACT, XK, FMT)
        if ROWS > 5:
            a5, s5 = _row(a5, s5, f0, f1, f2, f3, f4, f5, f6, f7, sc, X + 5 * sx_m, offs_w, w_hi,
                          EVEN, EXACT, XK, FMT)
        if ROWS > 6:
            a6, s6 = _row(a6, s6, f0, f1, f2, f3, f4, f5, f6, f7, sc, X + 6 * sx_m, offs_w, w_hi,
                          EVEN, EXACT, XK, FMT)
        if ROWS > 7:
            a7, s7 = _row(a7, s7, f0, f1, f2, f3, f4, f5, f6, f7, sc, X + 7 * sx_m, offs_w, w_hi,
                          EVEN, EXACT, XK, FMT)
    if FMT == 2:  # the codes were 2v
        scale = 0.5 * tl.load(T).to(tl.float32)
    else:
        scale = tl.load(S + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    Yk = Y + pid_k * sy_k
    _store(a0, s0, scale, Yk, offs_n, n_ok, NRM, n_nrm, n_mean, eps, ROW_NORM)
    if ROWS > 1:
        _store(a1, s1, scale, Yk + sy_m, offs_n, n_ok, NRM + s_nrm, n_nrm, n_mean, eps, ROW_NORM)
    if ROWS > 2:
        _store(a2, s2, scale, Yk + 2 * sy_m, offs_n, n_ok, NRM + 2 * s_nrm, n_nrm, n_mean, eps, ROW_NORM)
    if ROWS > 3:
        _store(a3, s3, scale, Yk + 3 * sy_m, offs_n, n_ok, NRM + 3 * s_nrm, n_nrm, n_mean, eps, ROW_NORM)
    if ROWS > 4:
        _store(a4, s4, scale, Yk + 4 * sy_m, offs_n, n_ok, NRM + 4 * s_nrm, n_nrm, n_mean, eps, ROW_NORM)
    if ROWS > 5:
        _store(a5, s5, scale, Yk + 5 * sy_m, offs_n, n_ok, NRM + 5 * s_nrm, n_nrm, n_mean, eps, ROW_NORM)
    if ROWS > 6:
        _store(a6, s6, scale, Yk + 6 * sy_m, offs_n, n_ok, NRM + 6 * s_nrm, n_nrm, n_mean, eps, ROW_NORM)
    if ROWS > 7:
        _store(a7, s7, scale, Yk + 7 * sy_m, offs_n, n_ok, NRM + 7 * s_nrm, n_nrm, n_mean, eps, ROW_NORM)


@triton.jit(do_not_specialize=["one"])
def gemv4w_kernel(X, W0, W1, W2, W3, S0, S1, S2, S3, T0, T1, T2, T3, Y0, Y1, Y2, Y3, KW, W_PER, N0, N1, N2, N3,
                  E0, E1, E2, sx_m, sw0, sw1, sw2, sw3, c0, c1, c2, c3, sy0, sy1, sy2, sy3, sk0, sk1, sk2, sk3,
                  NRM, n_nrm, s_nrm, n_mean, eps, PF, n_pf, one,
                  COUNT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                  EVEN: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr, ROW_NORM: tl.constexpr,
                  PREFETCH: tl.constexpr, VEC: tl.constexpr, EXACT: tl.constexpr, XK: tl.constexpr,
                  FMT: tl.constexpr):
    """Programs [0, E0) serve weight 0, [E0, E1) weight 1, ... (as ``gemv._gemv_kernel``); W* are the
    packed weights viewed as int32 ``[N, K/8]`` (row stride sw* in words); convrot_w4a4 (FMT 1): S*
    their float32 row scales; nvfp4 (FMT 2): S* their swizzled E4M3 block scales as bytes (c* columns),
    T* their float32 tensor scales. X ``[ROWS, K]`` (row stride sx_m), Y* ``[ROWS, N]`` or float32
    partials ``[P, ROWS, N]`` (sk*). EXACT: no sum of x taken off (float32 x, or nvfp4)."""
    pid = tl.program_id(0)
    if pid < E0:
        _tile4w(X, W0, S0, T0, Y0, N0, KW, W_PER, sx_m, sw0, c0, sy0, sk0, pid, NRM, n_nrm, s_nrm, n_mean, eps,
                one, ROWS, BLOCK_N, BLOCK_W, EVEN, PTX, PDL, ROW_NORM, VEC, EXACT, XK, FMT)
    elif COUNT > 1 and pid < E1:
        _tile4w(X, W1, S1, T1, Y1, N1, KW, W_PER, sx_m, sw1, c1, sy1, sk1, pid - E0, NRM, n_nrm, s_nrm, n_mean,
                eps, one, ROWS, BLOCK_N, BLOCK_W, EVEN, PTX, PDL, ROW_NORM, VEC, EXACT, XK, FMT)
    elif COUNT > 2 and pid < E2:
        _tile4w(X, W2, S2, T2, Y2, N2, KW, W_PER, sx_m, sw2, c2, sy2, sk2, pid - E1, NRM, n_nrm, s_nrm, n_mean,
                eps, one, ROWS, BLOCK_N, BLOCK_W, EVEN, PTX, PDL, ROW_NORM, VEC, EXACT, XK, FMT)
    elif COUNT > 3:
        _tile4w(X, W3, S3, T3, Y3, N3, KW, W_PER, sx_m, sw3, c3, sy3, sk3, pid - E2, NRM, n_nrm, s_nrm, n_mean,
                eps, one, ROWS, BLOCK_N, BLOCK_W, EVEN, PTX, PDL, ROW_NORM, VEC, EXACT, XK, FMT)
    if PREFETCH:
        prefetch_share(PF, n_pf, 128)
