"""Inline PTX helpers of the decode kernels (NVIDIA GPUs; the interpreter cannot run them).

* ``e4m3_bf16``: e4m3fn bytes to bf16 with integer ops and one packed multiply (the GEMV's fp8 path).
* ``l2_prefetch`` / ``prefetch_share``: ask L2 for lines of a weight the next product will stream
  (``prefetch.global.L2``: no data comes back, nothing waits for it).
* ``nibble_bytes`` / ``e2m1_bytes``: the PTX text (lines of an ``inline_asm`` block) that turns a
  32-bit word of convrot_w4a4 nibbles / nvfp4 E2M1 codes into bytes (``gemv4w.py``; ``gemv4m.py``
  uses ``nibble_bytes``).
* ``e2m1_halves`` / ``e4m3_half2``: the PTX text that places a word's E2M1 codes / an E4M3 byte
  straight into 16-bit float bits (the register tile's nvfp4, ``gemv4m.py``).

The programmatic-dependent-launch instructions live with their protocol in ``pdl.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_bf16(w):
    """e4m3fn bytes (uint8) -> bf16, four at a time with integer ops and one packed multiply:
    (sign << 15) | (magnitude << 4) is the bf16 of the value times 2^-120 for every finite byte,
    subnormals included (both formats keep the exponent field's offset), then times 2^120 (exact).
    NaN bytes (0x7F, 0xFF) give +-480. Faster than Triton's own conversion, which goes through
    fp16 on the conversion units (``benchmarks/CHANGELOG.md``)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, u0, u1, k, z;
        mov.b32 k, 0x7B807B80;
        mov.b32 z, 0x80008000;
        prmt.b32 t0, $2, 0, 0x1404;
        prmt.b32 t1, $2, 0, 0x3424;
        and.b32 u0, t0, 0x7F007F00;
        and.b32 u1, t1, 0x7F007F00;
        shr.b32 u0, u0, 4;
        shr.b32 u1, u1, 4;
        and.b32 t0, t0, 0x80008000;
        and.b32 t1, t1, 0x80008000;
        or.b32 t0, t0, u0;
        or.b32 t1, t1, u1;
        fma.rn.bf16x2 $0, t0, k, z;
        fma.rn.bf16x2 $1, t1, k, z;
        }""",
        constraints="=r,=r,r", args=[w], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def l2_prefetch(p, ok):
    """Ask L2 for the 128-byte line holding each address of ``p`` where ``ok`` (no data comes back)."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .pred q; setp.ne.b32 q, $2, 0; @q prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        constraints="=r,l,r", args=[p, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_share(P, n_lines, BLOCK: tl.constexpr):
    # This program's share of the n_lines 128-byte lines from byte pointer P (split evenly over the
    # grid), BLOCK lines at a time.
    prog = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    per = tl.cdiv(n_lines, tl.num_programs(0) * tl.num_programs(1))
    lo = prog * per
    hi = tl.minimum(lo + per, n_lines)
    for j in range(lo, hi, BLOCK):
        i = j + tl.arange(0, BLOCK)
        l2_prefetch(P + i.to(tl.int64) * 128, i < hi)


# ---------------------------------------------------------------- 4-bit unpacks as PTX text

def nibble_bytes(w: str, lo: str, hi: str) -> list[str]:
    """PTX putting q + 8 of convrot_w4a4 word ``w``'s even columns (0, 2, 4, 6) in the bytes of ``lo``,
    of its odd ones in ``hi``."""
    return [f"lop3.b32 {lo}, {w}, 0x0F0F0F0F, 0x08080808, 0x6a;", f"shr.b32 {hi}, {w}, 4;",
            f"lop3.b32 {hi}, {hi}, 0x0F0F0F0F, 0x08080808, 0x6a;"]


#: nvfp4 byte tables of ``e2m1_bytes``: 12 + 2v for the magnitude codes 0..7, positive and negative
#: (two 32-bit registers each, byte i = code i), and the byte permutes of the sign masks.
E2M1_POS = (0x0F0E0D0C, 0x18141210)
E2M1_NEG = (0x090A0B0C, 0x00040608)
SIGN_SEL = (0x9D8C, 0xBFAE)

#: The byte tables ``e2m1_bytes`` reads, loaded into registers tp0, tp1, tn0, tn1.
E2M1_TABLES = [f"mov.b32 tp0, {E2M1_POS[0]}; mov.b32 tp1, {E2M1_POS[1]};",
               f"mov.b32 tn0, {E2M1_NEG[0]}; mov.b32 tn1, {E2M1_NEG[1]};"]


def e2m1_bytes(w: str, lo: str, hi: str) -> list[str]:
    """PTX putting 12 + 2v of nvfp4 word ``w``'s codes in bytes: columns 1, 0, 3, 2 in ``lo``, 5, 4, 7,
    6 in ``hi`` (the even column in a byte's high nibble). Per 4 codes: the magnitudes (code & 7,
    nibble-spaced as prmt selectors want them) pick 12 + 2|v| and 12 - 2|v| from the byte tables, the
    sign bits become byte masks (prmt's sign-replicate mode over w and w << 4) that choose between
    them (lop3 0xD8: c ? b : a)."""
    def four(reg, sel):
        return ["prmt.b32 p, tp0, tp1, s;", "prmt.b32 q, tn0, tn1, s;", f"prmt.b32 k, {w}, w4, {sel};",
                f"lop3.b32 {reg}, p, q, k, 0xD8;"]
    return [f"shl.b32 w4, {w}, 4;", f"and.b32 s, {w}, 0x7777;", *four(lo, SIGN_SEL[0]), f"shr.b32 s, {w}, 16;",
            "and.b32 s, s, 0x7777;", *four(hi, SIGN_SEL[1])]


# ---------------------------------------------------------------- nvfp4 codes and scales as 16-bit float bits

#: scratch registers of ``e2m1_halves`` and ``e4m3_half2``, and their constants (``e4m3_consts``)
HALF_BITS_REGS = ".reg .b32 eu, ev, ek0, ek1, ez;"
#: (lowest bit of a code's magnitude in x's 16-bit float, the mask of those bits in both halves) per kind
E2M1_PLACE = {"bf16": (6, 0x01C001C0), "f16": (9, 0x0E000E00)}
#: (shift that puts an E4M3 byte's magnitude under the float's, its mask, the multipliers that then make
#: it the scale times 2^7, twice) per kind: bf16 bits are the scale times 2^-120, fp16's times 2^-8
E4M3_PLACE = {"bf16": (4, 0x07F007F0, (0x7B807B80, 0x7B007B00)), "f16": (1, 0x3F803F80, (0x78007800,))}


def e4m3_consts(kind: str) -> list[str]:
    """PTX loading the constants ``e4m3_half2`` multiplies by (registers ``ek0``, ``ek1``; ``ez`` = -0, -0)."""
    return [*(f"mov.b32 ek{j}, {k:#010x};" for j, k in enumerate(E4M3_PLACE[kind][2])), "mov.b32 ez, 0x80008000;"]


def e2m1_halves(w: str, dst: list[str], kind: str) -> list[str]:
    """PTX putting nvfp4 word ``w``'s 8 E2M1 codes into ``dst[0..3]`` as x's 16-bit float ("bf16" / "f16")
    bits: ``dst[i]`` holds code i (bits 4i..4i+3 of ``w``) in its low half and code i + 4 in its high half,
    each worth its E2M1 value times 2^-126 (bf16) / 2^-14 (fp16). A code's 3 magnitude bits go under the
    float's two lowest exponent bits and its top mantissa bit (so E2M1's 0.5 is the float's subnormal)
    and its sign bit to the sign: per register one shift each way, an ``and`` and a ``lop3``."""
    low, mask = E2M1_PLACE[kind]
    out = []
    for i, d in enumerate(dst):
        sm, ss = low - 4 * i, 12 - 4 * i  # the magnitude's shift, the sign's (left when positive)
        out.append(f"shl.b32 eu, {w}, {sm};" if sm >= 0 else f"shr.b32 eu, {w}, {-sm};")
        sign = "ev" if ss else w
        if ss:
            out.append(f"shl.b32 ev, {w}, {ss};")
        out += [f"and.b32 eu, eu, {mask:#010x};", f"lop3.b32 {d}, {sign}, eu, 0x80008000, 0xEC;"]  # (a & c) | b
    return out


def e4m3_half2(b: str, dst: str, kind: str) -> list[str]:
    """PTX putting two copies of E4M3 byte ``b``'s value times 2^7 (bits 0..7 of ``b``, the rest zero) into
    ``dst`` as x's 16-bit float ("bf16" / "f16"), exactly, subnormals included: the byte under the float's
    sign, exponent and mantissa (both formats' exponent fields count from their own offsets, so the bits
    are the value times 2^-120 / 2^-8), then multiplied by powers of two (``e4m3_consts``)."""
    shift, mask, times = E4M3_PLACE[kind]
    return [f"prmt.b32 {dst}, {b}, 0, 0x0404;", f"shr.b32 eu, {dst}, {shift};", f"and.b32 eu, eu, {mask:#010x};",
            f"lop3.b32 {dst}, {dst}, eu, 0x80008000, 0xEC;",
            *(f"fma.rn.{kind}x2 {dst}, {dst}, ek{j}, ez;" for j in range(len(times)))]
