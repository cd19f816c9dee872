"""Inline PTX helpers of the decode kernels (NVIDIA GPUs; the interpreter cannot run them).

* ``e4m3_bf16``: e4m3fn bytes to bf16 with integer ops and one packed multiply (the GEMV's fp8 path).
* ``l2_prefetch`` / ``prefetch_share``: ask L2 for lines of a weight the next product will stream
  (``prefetch.global.L2``: no data comes back, nothing waits for it).

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

