"""Skinny matrix products for decode rows: ``y = x @ w.T`` with at most 16 rows of x (Triton).

At batch 1 a decode step is a chain of matrix-vector products whose cost is reading the weights
once. Each program owns ``BLOCK_N`` output columns of one weight and streams its ``[BLOCK_N, K]``
slice in ``BLOCK_K`` tiles (software-pipelined), multiplying them with the rows of x padded to 16
on the tensor cores, float32 accumulation; K is split only on request (``split``, below), and
then the consumer adds the partials (no reduction launch of its own).

Weights are bf16/fp16 (x's dtype) or int8 with a float32 scale per output row or per tensor
(ComfyUI's ``int8_tensorwise``), or fp8 (e4m3fn / e5m2, ComfyUI's ``float8_*`` layouts, per-tensor
scale): weight-only quantization, the int8 or fp8 values are widened to x's dtype in registers
(exact: |q| <= 128 and every fp8 value fit bf16, fp16 and fp32), multiplied on the tensor cores
with float32 accumulation, and the scale is applied to the accumulated row. Bytes read: the 8-bit
weights once (fp8 is loaded as bytes: e4m3 with bf16 x on a GPU is widened by ``_e4m3_bf16``,
else bitcast; ``capabilities.fp8_reason`` says where). ``hadamard_rotate`` gives x the ConvRot
rotation int8 ConvRot weights expect. With programmatic dependent launch (Hopper+,
``kernels/pdl.py``) a product is scheduled while its input's producer finishes and waits for it
inside the kernel.

``gemv_group`` runs up to four weights that read the same x in one launch (a DeltaNet layer's four
input projections, q/k/v, gate/up). ``split=P`` cuts K into P ranges with programs of their own and
returns float32 partials for a consumer that sums them: a 4096-wide output has only 128 programs of
32 columns, too few to keep the memory system busy (``split_k``). ``row_norm`` multiplies each
row's result by the RMSNorm factor a deferred norm left to it (``kernels/row_norm.py``).

K slices (a launch config's optional fifth value, ``_tile``'s SLICES): the program's warps own
slices of each K tile instead of columns, one batched dot, the slices summed after the loop. With
the warps on columns every warp reads the whole padded 16-row x tile from shared memory: at 32
int8 columns, 128-wide tiles and 4 warps that is 16 ``ld.shared.v2`` of x against 2
``ldmatrix.x4`` of weights per tile and warp in Triton 3.6's sm90 PTX, four x bytes per weight
byte; with 4 slices, 4 loads. Picked for the DeltaNet inputs and q/k/v (``_default_config``:
512-wide tiles, 4 slices, 3 stages). Launch by launch (H200, int8, 1 row,
``results/int8_gemv_h200_slices.json``) slices were slower everywhere else, so the x reads are
not what limits most launches: the 4096x4096 outputs 8.5 against 7.0 us (2 slices), gate+up 33.6
against 28.5, the MLP down projection 17.1 against 15.3, ``lm_head`` 256 against 235, and the
DeltaNet inputs at 128-wide tiles 24.2 against 17.4.

``prefetch=w``: the decode step passes each product the weight of the product after it
(``FusedPlan._prefetch_chain``); each program, after storing its own result, asks L2 for its share
of the first ``PREFETCH_BYTES`` of w (``prefetch.global.L2``, nothing waits for it), so DRAM keeps
reading while this product drains and the small kernel between the two runs. Only with overlapped
launches (``pdl_reason``), where it was measured: H200, 9B int8 in ComfyUI, MTP off, two processes
each, interleaved: 323.8 / 324.0 tok/s without, 326.8 / 326.9 with 8 MB, 326.0 / 326.2 with 4 MB,
318.8 / 318.7 with 16 MB; 323.4 against 325.0 on another machine. Measured and not taken: the small
kernels issuing the same prefetch themselves after their own loads (4 MB: 275 tok/s, 8 MB: 235:
their few programs cannot issue that many lines quickly, and the product waits for them), or
through 128 prefetch-only programs of their own (8 MB: 310.5 against 323.4). A mixer's input
product may ask for a length of its own (``MIXER_PREFETCH_BYTES``, ``gemv_group(prefetch_bytes=)``):
the DeltaNet step or the attention runs before the mixer's output product, with DRAM otherwise
idle, long enough to fetch a whole int8 output weight; an instrument for in-step measurements
(``benchmarks/comfy_e2e.py --variants``), by default the 8 MB of every other link, longer ones not
yet measured.

What was measured slower on an H200 and removed (``benchmarks/int8_gemv.py``): int8 widened to bf16
by a longer integer sequence than Triton's own (Triton 3.6 already widens without the conversion
units: one permute that sets the byte 0x43 above each value, two masks and one packed bf16
subtraction per pair): 0x4300 | the low 7 bits plus 0xC300 | the sign bit in one packed FMA, six
instructions per pair, ran the 9B int8 step in ComfyUI at 308.4 against 336.3 tok/s and the step's
products at 2669 against 2427 us launch by launch (timed as ``int8_gemv.py`` times them; through
float32, 2^23 + byte - (2^23 + 128): 2505 us), bit-identical products each: two more instructions
per pair in the tile loop cost 10%; the SiLU product computed inside the down projection's tiles
(every program recomputes it per tile: 99 us against 33 for ``silu_mul`` + cuBLAS), the ConvRot
rotation inside the product's tiles (two 16-wide products and layout shuffles per tile: 17 us
against 12 for a rotation launch + the product at 4096x4096), one-row products on the CUDA cores
instead of the tensor cores (2-3x slower), the weight tile as the dot's left operand (no faster at
any shape; at 64 and 128 columns, where Triton 3.6 makes it a wgmma, 0.57x to 0.82x the picked
launch of each group, int8 1 row), a one-row x loaded as a vector and broadcast to the dot's 16
rows (half the shared memory per program; the DeltaNet inputs 24.6 against 17.5 us, q/k/v 14.8
against 19.5, yet the 9B int8 step in ComfyUI 270.7 against 337.3 tok/s with it everywhere and
327.9 against 336.7 with it for q/k/v alone: ``benchmarks/README.md``), and the next residual
add + RMSNorm done by a split-K product's last program (a device finish counter, the row
normalized in 512-column pieces: 278 against 312 tok/s int8 9B MTP off, 518 against 787 with
forced MTP-3 at 4096 in one ``comfy_e2e.py`` run: one program normalizing whole rows after the
product costs more than the norm kernel's launch), and one tile loop for the whole
group, the program's weight picked by scalars before it: that reserves one weight's pipeline buffers
instead of one set per weight (Triton reserves each branch's buffers apart), 32 KB instead of 128 KB
per DeltaNet-inputs program and 72 KB instead of 144 KB for gate/up, and is as fast launch by launch
(``int8_gemv.py --sweep``), yet the 9B int8 step in ComfyUI ran 307.0 / 306.6 tok/s against 328.5 /
328.6 (forced MTP-3 791 against 844, bf16 212.0 against 217.7). A likely cause, not measured: with
less shared memory per program more of a product's programs share each SM, and the kernels launched
behind it find less room.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from .capabilities import (
    FP8_DTYPES,
    QUANT_DTYPES,
    device_limits,
    fp8_reason,
    interpreting,
    pdl_reason,
    say_once,
    triton_device_reason,
)
from .convrot import hadamard, hadamard_rotate_torch
from .overrides import EnvOverrides, entries, pow2_between
from .pdl import enter, launch_args, trigger, wait
from .row_norm import RowNorm

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # very old Triton: nothing to catch by name
    OutOfResources = ()

log = logging.getLogger(__name__)

__all__ = ["MAX_GROUP", "MAX_GEMV_ROWS", "gemv", "gemv_group", "gemv_reason", "hadamard", "hadamard_cached",
           "hadamard_rotate", "hadamard_rotate_torch", "load_overrides", "parse_overrides", "split_k"]

MAX_GEMV_ROWS = 16  # rows one launch takes (padded to 16 for the tensor-core dot); decode rows are <= 8
MAX_GROUP = 4
_PREFETCH_ENV = "QWEN35_FAST_L2_PREFETCH_KB"
_MIXER_PREFETCH_ENV = "QWEN35_FAST_L2_PREFETCH_MIXER_KB"


def _slices_reason() -> str | None:
    """None when this Triton compiles the K-sliced tile (``_tile``'s SLICES > 1: a batched 3-D dot),
    else why not. Triton 3.0-3.2 cannot (compiled for sm_89 by ``tests/consumer_step.py``: 3.0-3.2
    reject ``tl.trans`` of a 3-D tile by a tuple, and given the permutation as arguments 3.2's
    compiler aborts the process on the 3-D dot's shared-memory load); 3.3 to 3.9 can."""
    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    if version >= (3, 3):
        return None
    return f"Triton {triton.__version__} cannot compile K-sliced GEMV tiles (Triton 3.3+ can)"


#: None, or why the K-sliced tile cannot run here (``_slices_reason``); ``_default_config`` then
#: picks unsliced tiles, and a config with K slices is refused before it reaches the compiler.
SLICES_REASON = _slices_reason()


_DEFAULT_PREFETCH_BYTES = 8192 << 10


def _prefetch_bytes(env: str, default: int) -> int:
    """``env`` (KB) in bytes, ``default`` bytes when unset; ValueError naming it when it is no number."""
    kb = os.environ.get(env)
    if kb is None:
        return default
    try:
        return int(kb) << 10
    except ValueError:
        raise ValueError(f"{env}={kb!r} is not a whole number of KB (0 turns it off)") from None


def _prefetch_lengths() -> tuple[int, int]:
    """(``PREFETCH_BYTES``, ``MIXER_PREFETCH_BYTES``) from the environment; ValueError naming the
    variable whose value is no number."""
    prefetch = _prefetch_bytes(_PREFETCH_ENV, _DEFAULT_PREFETCH_BYTES)
    return prefetch, _prefetch_bytes(_MIXER_PREFETCH_ENV, prefetch)


#: Bytes of the next product's weight a product asks L2 for (``gemv_group(prefetch=)``): 8 MB measured
#: best of 4, 8 and 16 (``QWEN35_FAST_L2_PREFETCH_KB`` overrides; 0 turns it off). And the bytes of a
#: mixer's output projection weight its input product asks for (the DeltaNet step or the attention
#: runs between the two, with DRAM otherwise idle): ``QWEN35_FAST_L2_PREFETCH_MIXER_KB``, by default
#: ``PREFETCH_BYTES``. Both read again by ``load_overrides`` (each plan), which refuses a value that is
#: no number; on import such a value leaves the defaults, so the pack still loads and the plan says why.
try:
    PREFETCH_BYTES, MIXER_PREFETCH_BYTES = _prefetch_lengths()
except ValueError:
    PREFETCH_BYTES = MIXER_PREFETCH_BYTES = _DEFAULT_PREFETCH_BYTES

#: Launch overrides for in-step measurements (``load_overrides``): entries ``KIND:NxK=BN,BK,WARPS,STAGES``,
#: ``KIND:NxK=/SPLIT`` or both (``KIND:NxK=BN,BK,WARPS,STAGES/SPLIT``), separated by ``;``. KIND is
#: ``quant`` (int8 / fp8 weights) or ``float``; N is a launch's output columns in all (a group's
#: sum: 12352 for a 9B DeltaNet layer's inputs), K its width; SPLIT replaces ``split_k`` for that
#: weight; a fifth number after STAGES gives the K slices of a tile (``_tile``'s SLICES).
#: ``KIND:NxK@R=...`` applies to launches of R rows only (4: an MTP-3 verify) and, for the values it
#: gives, before an entry without ``@R``. Read when a fused plan is built (each generation), so one
#: process can compare settings.
CONFIG_ENV = "QWEN35_FAST_GEMV_CONFIG"


@triton.jit
def _e4m3_bf16(w):
    """e4m3fn bytes (uint8) -> bf16, four at a time with integer ops and one packed multiply:
    (sign << 15) | (magnitude << 4) is the bf16 of the value times 2^-120 for every finite byte,
    subnormals included (both formats keep the exponent field's offset), then times 2^120 (exact).
    NaN bytes (0x7F, 0xFF) give +-480. Triton's own conversion goes through fp16 on the
    conversion units: with it the 9B fp8 step ran at 269.3 tok/s, with this at 323.0 (H200,
    ``benchmarks/comfy_e2e.py --formats fp8``)."""
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
def _l2_prefetch(p, ok):
    """Ask L2 for the 128-byte line holding each address of ``p`` where ``ok`` (no data comes back)."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .pred q; setp.ne.b32 q, $2, 0; @q prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        constraints="=r,l,r", args=[p, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_share(P, n_lines, BLOCK: tl.constexpr):
    # This program's share of the n_lines 128-byte lines from byte pointer P (split evenly over the
    # grid), BLOCK lines at a time.
    prog = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    per = tl.cdiv(n_lines, tl.num_programs(0) * tl.num_programs(1))
    lo = prog * per
    hi = tl.minimum(lo + per, n_lines)
    for j in range(lo, hi, BLOCK):
        i = j + tl.arange(0, BLOCK)
        _l2_prefetch(P + i.to(tl.int64) * 128, i < hi)


@triton.jit
def _widen(w, x_dtype: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr):
    # int8 or fp8 -> x's dtype, exact (FP8 as in ``_tile``); weights already in x's dtype unchanged.
    if QUANT:
        if FP8 == 3:
            w = _e4m3_bf16(w)
        elif FP8 == 1:
            w = w.to(tl.float8e4nv, bitcast=True)
        elif FP8 == 2:
            w = w.to(tl.float8e5, bitcast=True)
        w = w.to(x_dtype)
    return w


@triton.jit
def _tile(X, W, S, Y, M, N, K, K_PER, sx_m, sw_n, ss_n, sy_m, sy_k, pid, NRM, n_nrm, s_nrm, n_mean, eps,
          QUANT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr,
          ROW_NORM: tl.constexpr, SLICES: tl.constexpr):
    # Program (pid, program_id(1)): BLOCK_N columns over the K range [pid_k * K_PER, + K_PER).
    # FP8: 0 (int8 or x's dtype), 1 (e4m3fn bytes), 2 (e5m2 bytes), 3 (e4m3fn bytes, bf16 x, on a
    # GPU: ``_e4m3_bf16``). ROW_NORM (a power of two >= n_nrm): each row's result times
    # rsqrt(sum of its n_nrm partial sums of squares in NRM / n_mean + eps), the RMSNorm factor
    # ``fused_ops.add_rms_norm(defer=True)`` left to its consumer. SLICES > 1: each K tile is cut
    # into SLICES slices multiplied as one batched dot (the warps own slices, not columns: each
    # reads only its slice of x's padded tile from shared memory), the slices summed after the loop.
    pid_k = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_lo = pid_k * K_PER
    k_hi = tl.minimum(k_lo + K_PER, K)
    wait(PDL)  # x is the previous kernel's output
    trigger(PDL)  # after the wait: the next product's programs queue behind this one, never ahead
    if ROW_NORM > 0:  # loaded before the weights stream, so its latency is not added after them
        j = tl.arange(0, ROW_NORM)
        sq = tl.load(NRM + offs_m[:, None] * s_nrm + j[None, :], mask=m_ok[:, None] & (j < n_nrm)[None, :], other=0.0)
        factor = tl.rsqrt(tl.sum(sq, 1) / n_mean + eps)
    if SLICES == 1:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w_mask = n_ok[:, None]
                x_mask = m_ok[:, None]
            else:
                k_ok = offs_k < K
                w_mask = n_ok[:, None] & k_ok[None, :]
                x_mask = m_ok[:, None] & k_ok[None, :]
            if PDL:  # read once: evict first, L2 keeps the activations and partials
                w = tl.load(W + offs_n[:, None] * sw_n + offs_k[None, :], mask=w_mask, other=0,
                            eviction_policy="evict_first")
            else:
                w = tl.load(W + offs_n[:, None] * sw_n + offs_k[None, :], mask=w_mask, other=0)
            x = tl.load(X + offs_m[:, None] * sx_m + offs_k[None, :], mask=x_mask, other=0.0)
            w = _widen(w, x.dtype, QUANT, FP8)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
    else:
        SLICE: tl.constexpr = BLOCK_K // SLICES
        acc3 = tl.zeros((SLICES, BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, SLICES)[:, None] * SLICE + tl.arange(0, SLICE)[None, :]  # [SLICES, SLICE]
            if EVEN_K:
                w_mask = n_ok[None, :, None]
                x_mask = m_ok[None, :, None]
            else:
                k_ok = (offs_k < K)[:, None, :]
                w_mask = n_ok[None, :, None] & k_ok
                x_mask = m_ok[None, :, None] & k_ok
            if PDL:
                w = tl.load(W + offs_n[None, :, None] * sw_n + offs_k[:, None, :], mask=w_mask, other=0,
                            eviction_policy="evict_first")
            else:
                w = tl.load(W + offs_n[None, :, None] * sw_n + offs_k[:, None, :], mask=w_mask, other=0)
            x = tl.load(X + offs_m[None, :, None] * sx_m + offs_k[:, None, :], mask=x_mask, other=0.0)
            w = _widen(w, x.dtype, QUANT, FP8)
            if IEEE:
                acc3 += tl.dot(x, tl.trans(w, 0, 2, 1), input_precision="ieee")
            else:
                acc3 += tl.dot(x, tl.trans(w, 0, 2, 1))
        acc = tl.sum(acc3, 0)
    if QUANT:  # per-row scales (ss_n = 1) or one per tensor (ss_n = 0)
        acc *= tl.load(S + offs_n * ss_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ROW_NORM > 0:
        acc *= factor[:, None]
    tl.store(Y + pid_k * sy_k + offs_m[:, None] * sy_m + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_kernel(X, W0, W1, W2, W3, S0, S1, S2, S3, Y0, Y1, Y2, Y3, M, K, K_PER, N0, N1, N2, N3, E0, E1, E2,
                 sx_m, sw0, sw1, sw2, sw3, ss0, ss1, ss2, ss3, sy0, sy1, sy2, sy3, sk0, sk1, sk2, sk3,
                 NRM, n_nrm, s_nrm, n_mean, eps, PF, n_pf,
                 COUNT: tl.constexpr, QUANT: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 PDL: tl.constexpr, FP8: tl.constexpr, ROW_NORM: tl.constexpr, PREFETCH: tl.constexpr,
                 SLICES: tl.constexpr):
    # Programs [0, E0) serve weight 0, [E0, E1) weight 1, ... (E* are cumulative block counts). A
    # tile loop per weight, each with buffers of its own: one shared loop measured slower in the
    # decode step (module docstring).
    pid = tl.program_id(0)
    if pid < E0:
        _tile(X, W0, S0, Y0, M, N0, K, K_PER, sx_m, sw0, ss0, sy0, sk0, pid, NRM, n_nrm, s_nrm, n_mean, eps,
              QUANT, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PDL, FP8, ROW_NORM, SLICES)
    elif COUNT > 1 and pid < E1:
        _tile(X, W1, S1, Y1, M, N1, K, K_PER, sx_m, sw1, ss1, sy1, sk1, pid - E0, NRM, n_nrm, s_nrm, n_mean, eps,
              QUANT, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PDL, FP8, ROW_NORM, SLICES)
    elif COUNT > 2 and pid < E2:
        _tile(X, W2, S2, Y2, M, N2, K, K_PER, sx_m, sw2, ss2, sy2, sk2, pid - E1, NRM, n_nrm, s_nrm, n_mean, eps,
              QUANT, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PDL, FP8, ROW_NORM, SLICES)
    elif COUNT > 3:
        _tile(X, W3, S3, Y3, M, N3, K, K_PER, sx_m, sw3, ss3, sy3, sk3, pid - E2, NRM, n_nrm, s_nrm, n_mean, eps,
              QUANT, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PDL, FP8, ROW_NORM, SLICES)
    if PREFETCH:  # after this program's product: the next product's first weight lines into L2
        _prefetch_share(PF, n_pf, 128)


_FORMAT = ("entries like 'quant:4096x12288=32,256,2,4/4', 'quant:12352x4096=32,512,4,3,4', "
           "'quant:4096x12288@4=/3' or 'float:4096x4096=/2' separated by ';'")


def parse_overrides(text: str) -> dict[tuple, tuple[tuple[int, ...] | None, int | None]]:
    """``CONFIG_ENV``'s value -> ``{(quant, N, K): (config or None, split or None)}``, an entry for
    R rows only (``NxK@R``) under ``(quant, N, K, R)``. ValueError naming the entry and the format
    when one is malformed or out of range (BLOCK_N, BLOCK_K powers of two from 16 to 1024, warps
    1..16 a power of two, stages 1..8, an optional fifth value, the K slices of a tile (``_tile``'s
    SLICES), a power of two leaving slices of at least 16, split 1..64, R 1..``MAX_GEMV_ROWS``)."""
    out = {}
    for entry in entries(text):
        try:
            kind, rest = entry.split(":", 1)
            shape, value = rest.split("=", 1)
            shape, at, rows_text = shape.partition("@")
            rows = int(rows_text) if at else None
            n, k = (int(v) for v in shape.lower().split("x"))
            cfg_text, _, split_text = value.partition("/")
            cfg = tuple(int(v) for v in cfg_text.split(",")) if cfg_text.strip() else None
            split = int(split_text) if split_text.strip() else None
        except ValueError:
            raise ValueError(f"{CONFIG_ENV}: cannot read {entry!r}: {_FORMAT}") from None
        kind = kind.strip()
        bad = (kind not in ("quant", "float") or n < 1 or k < 1 or (cfg is None and split is None)
               or (cfg is not None and (len(cfg) not in (4, 5) or not pow2_between(cfg[0], 16, 1024)
                                        or not pow2_between(cfg[1], 16, 1024)
                                        or not pow2_between(cfg[2], 1, 16) or not 1 <= cfg[3] <= 8
                                        or (len(cfg) == 5 and not pow2_between(cfg[4], 1, cfg[1] // 16))))
               or (split is not None and not 1 <= split <= 64)
               or (rows is not None and not 1 <= rows <= MAX_GEMV_ROWS))
        if bad:
            raise ValueError(f"{CONFIG_ENV}: {entry!r} is out of range (kind quant or float, BLOCK_N and BLOCK_K "
                             f"powers of two 16..1024, warps 1..16, stages 1..8, K slices a power of two up to "
                             f"BLOCK_K / 16, split 1..64, rows 1..{MAX_GEMV_ROWS}): {_FORMAT}")
        out[(kind == "quant", n, k) + ((rows,) if rows is not None else ())] = (cfg, split)
    return out


def _override(quant: bool, n: int, k: int, rows: int | None) -> tuple[tuple[int, ...] | None, int | None]:
    """(config, split) ``CONFIG_ENV`` gives a launch of ``rows`` rows (None: any), each None where it
    gives none: an entry for those rows first, then one for every row count."""
    anyrows = _OVERRIDES.values.get((quant, n, k), (None, None))
    mine = _OVERRIDES.values.get((quant, n, k, rows), (None, None)) if rows is not None else (None, None)
    return (mine[0] if mine[0] is not None else anyrows[0], mine[1] if mine[1] is not None else anyrows[1])


_OVERRIDES = EnvOverrides(CONFIG_ENV, parse_overrides)


def load_overrides() -> dict:
    """Read ``CONFIG_ENV`` (and the two prefetch lengths, ``_prefetch_lengths``) again;
    ``FusedPlan.build`` calls it for each generation, so launches captured after it use the new
    values. Returns the overrides in force; ValueError (``parse_overrides``, ``_prefetch_bytes``)
    leaves the previous values in force."""
    global PREFETCH_BYTES, MIXER_PREFETCH_BYTES
    lengths = _prefetch_lengths()  # all read before any is set
    overrides = _OVERRIDES.load()
    PREFETCH_BYTES, MIXER_PREFETCH_BYTES = lengths
    return overrides


def _config(n: int, k: int, quant: bool = False, rows: int | None = None, shared: int | None = None) -> tuple[int, ...]:
    """(BLOCK_N, BLOCK_K, warps, stages[, K slices]) of a launch of ``rows`` rows on a GPU whose
    blocks may use ``shared`` bytes of shared memory (None: no limit): ``CONFIG_ENV``'s for (quant,
    n, k) when it names one (``load_overrides``, ``_override``), else ``_default_config``'s
    measured pick."""
    cfg = _override(quant, n, k, rows)[0]
    return cfg if cfg is not None else _default_config(n, k, quant, rows or 1, shared)


def _default_config(n: int, k: int, quant: bool = False, rows: int = 1, shared: int | None = None) -> tuple[int, ...]:
    """(BLOCK_N, BLOCK_K, warps, stages[, K slices]) for N output columns in all over width K and
    ``rows`` rows (``shared``: the shared memory a block may use, None: no limit), measured on an
    H200 at the 9B decode launches, 1 and 4 rows (``benchmarks/int8_gemv.py``, results in
    ``benchmarks/results/int8_gemv_h200.json``). int8: 64 columns, 256-wide tiles for 16384
    columns and more (gate+up, the 248k-row output projection at its floor); 32 columns, 512-wide
    tiles cut into 4 K slices, 3 stages, for a DeltaNet layer's four inputs (12352 columns: 16.7 us
    against 17.4 for 32 columns, 128-wide tiles, 5 stages) and the attention q/k/v (10240 columns:
    16.3 against 19.5 for 256-wide tiles, 4 stages; 16.6 unsliced; with a Triton before 3.3,
    ``SLICES_REASON``, those unsliced tiles, said once); in the 9B int8 decode step in ComfyUI
    339.7 / 339.0 tok/s against 334.2 / 333.6 in two processes, q/k/v alone 336.2 sliced, 337.0
    unsliced (``results/int8_gemv_h200_slices.json``). With more rows (an MTP verify's) the DeltaNet
    inputs take the unsliced 128-wide tiles, 5 stages, where a block may use 160 KB of shared
    memory (128 KB with Triton 3.9 compiled for sm_89, ``tests/consumer_step.py``; a 99 KB
    consumer GPU keeps the sliced ones, 64 KB, rather than run them with fewer stages,
    unmeasured): forced MTP-3 in the 9B int8 step in ComfyUI 861.8 against 848.2 tok/s, medians of
    two interleaved in one process, measured at 4 rows (``results/comfy_e2e_h200_rows4.json``);
    there q/k/v at the same tiles, the MLP down projection at 64 columns in 3 K ranges and the
    output projection at 512-wide tiles were each slower (832.4, 808.9, 843.6). 2 warps for at
    most 8192 columns: the MLP down projection (in the 9B int8 decode step in ComfyUI 332.8
    tok/s against 328.9 / 328.1 with 4 warps in one run, 335.8 / 335.7 against 330.8 / 330.4 in
    another, on the greedy token step) and the 4096x4096 outputs, DeltaNet out and attention o
    (336.5 / 337.0 / 336.6 against 334.2 / 334.6 / 334.7 with 4 warps, interleaved in one run;
    2 warps for the 10240-column q/k/v instead: 334.2, no gain); else 32 columns, 256-wide tiles,
    4 warps, 4 stages. bf16: 128 columns, 128-wide tiles, 8 warps for the output
    projection (444 us against 459) and the DeltaNet inputs (27 us against 31); 64 columns for
    gate+up; 32 columns, 128-wide tiles, 5 stages for q/k/v; else 32 columns, 256-wide tiles.

    Isolated launches are not the last word: ``int8_gemv.py --sweep`` finds 3-stage configs faster
    one launch at a time (the MLP down projection with split-K 15.6 us against 16.6, the
    4096x4096 outputs 6.9 against 7.7, the DeltaNet inputs 16.8 against 17.5), and without
    programmatic dependent launch the whole int8 decode step gains from them (300 -> 309 tok/s),
    but with it, as an H200 runs, the step loses (312 -> 292 tok/s for the split-K ones, 308 for
    the others), so they are not picked."""
    if quant:
        if n >= 16384:
            return 64, 256, 4, 4
        if 8192 < n < 16384 and k < 8192:
            if rows > 1 and n >= 11264 and (shared is None or shared >= 160 * 1024):  # a verify's DeltaNet inputs
                return 32, 128, 4, 5
            if SLICES_REASON is None:
                return 32, 512, 4, 3, 4
            say_once(log, f"gemv: {SLICES_REASON}; the DeltaNet inputs and attention q/k/v run with the unsliced "
                          "tiles picked before them (1.5% slower in the 9B int8 step on an H200): update Triton "
                          "(it comes with torch 2.7+) to run them")
            return (32, 128, 4, 5) if n >= 11264 else (32, 256, 4, 4)
        if n <= 8192:
            return 32, 256, 2, 4
        return 32, 256, 4, 4
    if n >= 65536:
        return 128, 128, 8, 4
    if n >= 16384:
        return 64, 256, 4, 4
    if 11264 <= n and k < 8192:
        return 128, 128, 8, 4
    if 8192 <= n and k < 8192:
        return 32, 128, 4, 5
    return 32, 256, 4, 4


def split_k(n: int, k: int, quant: bool = False, rows: int | None = None) -> int:
    """K ranges (``gemv_group(split=)``) for one weight ``[n, k]`` whose consumer sums the float32
    partials (``fused_ops.add_rms_norm``). Up to 8192 columns make at most 256 programs of 32
    columns, too few to keep an H200's memory busy: int8 splits K in 4 (the 9B MLP down projection
    17 us against 22, the 4096x4096 outputs 8.1 against 9.2), bf16 in 2 (27 against 28, 10.8
    against 12.1); wider outputs are not split. ``CONFIG_ENV`` may name another split for (n, k),
    or for (n, k) at ``rows`` rows."""
    split = _override(quant, n, k, rows)[1]
    if split is not None:
        return split
    if n > 8192:
        return 1
    return 4 if quant else 2


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def gemv_reason(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> str | None:
    """None when ``gemv`` supports these operands, else why not (one line). ``w`` is float in x's
    dtype (``scale`` None), or int8 / fp8 (``capabilities.QUANT_DTYPES``) with a float32 ``scale`` of
    shape ``[]``, ``[1]``, ``[N]`` or ``[N, 1]``."""
    if x.dtype not in _FLOATS:
        return f"x is {x.dtype} (bf16, fp16 or fp32)"
    if w.dtype in QUANT_DTYPES:
        if scale is None:
            return f"{w.dtype} weight without a scale"
        if scale.dtype != torch.float32 or scale.numel() not in (1, w.shape[0]) or scale.device != w.device:
            return (f"scale {scale.dtype} {tuple(scale.shape)} is not float32 per tensor or per output row "
                    f"of a {tuple(w.shape)} weight on its device")
        if w.dtype in FP8_DTYPES:
            why = fp8_reason(w.device)
            if why is not None:
                return why
    elif w.dtype != x.dtype or scale is not None:
        return f"operands {x.dtype} x {w.dtype} (a weight in x's dtype, or int8 / fp8 with a scale)"
    if w.dim() != 2 or w.stride(1) != 1:
        return "weight is not a row-major matrix"
    rows = x.numel() // max(1, x.shape[-1])
    if x.shape[-1] != w.shape[1] or rows > MAX_GEMV_ROWS or rows < 1:
        return f"x {tuple(x.shape)} does not give 1..{MAX_GEMV_ROWS} rows of width {w.shape[1]}"
    if x.device != w.device:
        return "x and the weight are on different devices"
    return None


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


_HADAMARD: dict[tuple, torch.Tensor] = {}


def hadamard_cached(group: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """ConvRot's normalized H_group ``[group, group]`` in ``dtype`` on ``device`` (built once each,
    outside any graph capture: the eager step before a capture builds it)."""
    key = (group, device, dtype)
    if key not in _HADAMARD:
        _HADAMARD[key] = hadamard(group, dtype=dtype, device=device).contiguous()
    return _HADAMARD[key]


def gemv_group(x: torch.Tensor, weights: list[torch.Tensor], *, scales: list[torch.Tensor] | None = None,
               convrot: int = 0, config: tuple[int, int, int, int] | None = None,
               split: int = 1, row_norm: RowNorm | None = None,
               prefetch: torch.Tensor | None = None, prefetch_bytes: int | None = None) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]`` in one launch (1..4 weights ``[N_i, K]``, row-major, one dtype).

    x ``[..., K]`` (bf16/fp16/fp32) with at most 16 rows in all. Weights in x's dtype, or int8 / fp8
    with ``scales`` (float32 per tensor or per output row: ``y = (x @ q.T) * scale``). Returns
    ``[..., N_i]`` tensors in x's dtype (float32 accumulation). ``convrot=G``: the weights are
    ConvRot-rotated in groups of G (K a multiple of G), so x is first rotated by ``hadamard_rotate``
    (one launch more, shared by the group). ``config`` = (BLOCK_N, BLOCK_K, warps, stages[, K
    slices]) overrides the choice (K slices: ``_tile``'s SLICES, 1 when left out; capped at
    BLOCK_K / 16). ``split=P > 1`` cuts K into P ranges with programs of their own and returns
    float32 partial products ``[P', ..., N_i]`` (P' <= P: fewer when K has fewer tiles; scale
    applied) whose sum over the first dim is the product, for a consumer that adds them up
    (``fused_ops.add_rms_norm`` with ``x`` as the partials). ``row_norm``: x is an RMSNorm's output
    without its per-row factor (``kernels/row_norm.py``, ``sq`` ``[..., P]`` with x's leading dims):
    every product's float32 accumulator (each partial's, with ``split``) is multiplied by the
    factor before the output is rounded. ``prefetch``: the weight (any dtype, contiguous) the next
    product will stream; each program, once its own product is stored, asks L2 for its share of
    that weight's first ``PREFETCH_BYTES`` (``prefetch_bytes`` when given; see the module docstring;
    nothing else changes).
    """
    if split < 1:
        raise ValueError(f"gemv_group: split must be >= 1, got {split}")
    if not 1 <= len(weights) <= MAX_GROUP:
        raise ValueError(f"gemv_group: 1..{MAX_GROUP} weights, got {len(weights)}")
    quant = weights[0].dtype in QUANT_DTYPES
    fp8 = _fp8_mode(weights[0].dtype, x)
    if scales is not None and len(scales) != len(weights):
        raise ValueError(f"gemv_group: {len(scales)} scales for {len(weights)} weights")
    k = weights[0].shape[-1]
    for i, w in enumerate(weights):
        why = gemv_reason(x, w, None if scales is None else scales[i])
        if why is None and w.dtype != weights[0].dtype:
            why = "weights of different dtypes"
        if why is not None:
            raise ValueError(f"gemv: unsupported operands: {why}; call torch.nn.functional.linear")
    if convrot:
        x = hadamard_rotate(x, hadamard_cached(convrot, x.device, x.dtype))
    x2 = _rows(x, k)
    m = x2.shape[0]
    nrm = _row_norm_args(row_norm, x, m) if row_norm is not None else (x2, 0, 0, 1, 0.0, 0)
    ns = [w.shape[0] for w in weights]
    env_cfg = _override(quant, sum(ns), k, m)[0] if config is None else None
    limits = device_limits(x.device)
    cfg = _config(sum(ns), k, quant, m, limits and limits[1]) if config is None else config
    block_n, block_k, warps, stages = cfg[:4]
    shrunk_key = (str(x.device), x.dtype, weights[0].dtype, tuple(cfg))
    stages = _SHRUNK.get(shrunk_key, stages)
    block_k = min(block_k, triton.next_power_of_2(k))
    slices = min(cfg[4] if len(cfg) > 4 else 1, max(1, block_k // 16))
    if slices > 1 and SLICES_REASON is not None:  # never reaches the compiler: Triton 3.2's aborts the process
        named = f"{CONFIG_ENV} entry " if env_cfg is not None else "config "
        raise ValueError(f"gemv: {named}{tuple(cfg)} has K slices: {SLICES_REASON}; give four values")
    k_per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k  # a whole number of K tiles per range
    parts = triton.cdiv(k, k_per)  # <= split (fewer when K has fewer tiles)
    shape = (m,) if split == 1 else (parts, m)
    outs = [torch.empty(*shape, n, dtype=x.dtype if split == 1 else torch.float32, device=x.device) for n in ns]
    ss = [s.reshape(-1) for s in scales] if quant else list(weights)  # unread unless QUANT
    ends, total = [], 0
    for n in ns:
        total += triton.cdiv(n, block_n)
        ends.append(total)
    pad = MAX_GROUP - len(weights)
    pf = _prefetch_args(prefetch, x.device, prefetch_bytes) or (x2, 0)
    ws = [w.view(torch.uint8) for w in weights] if fp8 else list(weights)  # fp8 as bytes, bitcast in the kernel
    ws, ys, ss = ws + [ws[0]] * pad, outs + [outs[0]] * pad, ss + [ss[0]] * pad
    nn, ee = ns + [0] * pad, (ends + [total] * pad)[:3]
    tried, why = stages, None
    while True:
        try:
            _gemv_kernel[(total, parts)](
                x2, *ws, *ss, *ys, m, k, k_per, *nn, *ee, x2.stride(0), *(w.stride(0) for w in ws),
                *(int(quant and s.numel() > 1) for s in ss), *(y.stride(-2) for y in ys),
                *(y.stride(0) if split > 1 else 0 for y in ys), *nrm[:5], *pf,
                COUNT=len(weights), QUANT=quant, IEEE=x.dtype == torch.float32, BLOCK_M=16,
                BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages,
                FP8=fp8, ROW_NORM=nrm[5], PREFETCH=pf[1] > 0, SLICES=slices, **launch_args(x.device),
            )
            break
        except OutOfResources as exc:  # raised before anything is enqueued: nothing half-done
            stages, why = _fewer_stages(exc, cfg, stages, config is not None, env_cfg is not None, weights[0]), exc
    if stages != tried:
        _SHRUNK[shrunk_key] = stages
        log.warning("gemv: launch config %s (%s x, %s weights) needs more shared memory than this GPU has (%s); "
                    "it runs with %d pipeline stages instead of %d, slower than measured", tuple(cfg), x.dtype,
                    weights[0].dtype, why, stages, tried)
    return [y.reshape(*shape[:-1], *x.shape[:-1], n) for y, n in zip(outs, ns)]


def _fp8_mode(w_dtype: torch.dtype, x: torch.Tensor) -> int:
    """``_tile``'s FP8 for weights of ``w_dtype`` read with x: 0 (int8 or x's dtype), 1 (e4m3fn), 2
    (e5m2), 3 (e4m3fn with bf16 x where the kernel is compiled for a GPU: ``_e4m3_bf16``, inline
    PTX the interpreter cannot run)."""
    if w_dtype not in FP8_DTYPES:
        return 0
    mode = FP8_DTYPES.index(w_dtype) + 1
    return 3 if mode == 1 and x.dtype == torch.bfloat16 and _compiled(x.device) else mode


def _compiled(device: torch.device) -> bool:
    """True where Triton compiles kernels for ``device`` (a CUDA device without the interpreter)."""
    return device.type == "cuda" and not interpreting()


#: (device, x dtype, weight dtype, config) -> the pipeline stages that fit where the config's did not
_SHRUNK: dict[tuple, int] = {}


def _fewer_stages(exc: Exception, cfg: tuple, stages: int, explicit: bool, from_env: bool, w: torch.Tensor) -> int:
    """The pipeline depth to try after a launch needed more shared memory than the GPU has:
    ``stages - 1``. What the picked configs need depends on the Triton version (compiled for sm_89
    at the 9B shapes, bf16 x, ``tests/consumer_step.py``). With Triton 3.3 to 3.6 int8 / fp8
    weights fit a consumer GPU's 99 KB (at most 72 KB; with 3.0-3.2 gate+up needs 104 KB). With
    3.6 bf16 / fp16 weights do not all (gate+up 120 KB, the output projection 108 KB, a DeltaNet
    layer's four inputs 216 KB), nor does float32 x (up to 160 KB with int8 weights). Triton 3.9
    gives each weight of a grouped launch buffers of its own where 3.6 lets some share them: int8
    gate+up needs 144 KB, bf16 gate+up 240 KB, q/k/v 144 KB and the DeltaNet inputs 432 KB (past
    an H200's 227 KB too; the K-sliced launches stay at 64 KB). Fewer stages fit each of them
    (``tests/test_consumer_gpu.py`` compiles the step for sm_89, sm_120 and sm_90 and checks that
    every launch fits and that each shrink is said).
    An explicit ``config=`` re-raises (``int8_gemv.py``'s sweeps skip such configs), a
    ``CONFIG_ENV`` entry becomes a ValueError naming it, and a single stage that does not fit
    re-raises."""
    if explicit:
        raise exc
    if from_env:
        raise ValueError(f"{CONFIG_ENV}: the launch config {tuple(cfg)} for a {tuple(w.shape)} weight does not fit "
                         f"this GPU's shared memory ({exc}); name a smaller BLOCK_K or fewer stages") from exc
    if stages <= 1:
        raise exc
    return stages - 1


def _prefetch_args(w: torch.Tensor | None, device: torch.device, nbytes: int | None = None) -> tuple | None:
    """The kernel's (PF, n_pf) for ``gemv_group(prefetch=w)``: w's first ``nbytes`` (default
    ``PREFETCH_BYTES``) as
    bytes and their count of 128-byte lines, where the prefetch runs (a contiguous ``w`` on
    ``device``, where ``capabilities.pdl_reason`` allows overlapped launches: the setting it was
    measured in), else None."""
    nbytes = PREFETCH_BYTES if nbytes is None else nbytes
    if w is None or nbytes <= 0 or w.device != device or not w.is_contiguous() \
            or pdl_reason(device) is not None:
        return None
    return w.reshape(-1).view(torch.uint8), min(nbytes, w.numel() * w.element_size()) // 128


def _row_norm_args(row_norm: RowNorm, x: torch.Tensor, m: int) -> tuple:
    """The kernel's (NRM, n_nrm, s_nrm, n_mean, eps, ROW_NORM) for ``row_norm`` over x's m rows."""
    sq = row_norm.sq
    if not isinstance(sq, torch.Tensor) or sq.dtype != torch.float32 or sq.device != x.device \
            or tuple(sq.shape[:-1]) != tuple(x.shape[:-1]) or sq.shape[-1] < 1 or row_norm.n < 1:
        got = f"{tuple(sq.shape)} {sq.dtype}" if isinstance(sq, torch.Tensor) else type(sq).__name__
        raise ValueError(f"gemv: row_norm.sq must be float32 [{', '.join(map(str, x.shape[:-1]))}, P] on x's device "
                         f"(with n >= 1), got {got}")
    sq2 = sq.reshape(m, sq.shape[-1])
    if sq2.stride(-1) != 1:
        sq2 = sq2.contiguous()
    return sq2, sq2.shape[1], sq2.stride(0), int(row_norm.n), float(row_norm.eps), triton.next_power_of_2(sq2.shape[1])


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, *, convrot: int = 0,
         config: tuple[int, int, int, int] | None = None, row_norm: RowNorm | None = None) -> torch.Tensor:
    """``x @ w.T`` (times ``scale`` for int8 / fp8 ``w``; x ConvRot-rotated first with ``convrot=G``;
    times ``row_norm``'s factor, as ``gemv_group``): x ``[..., K]`` with at most 16 rows in all, w
    ``[N, K]`` row-major in x's dtype, int8 or fp8. Returns ``[..., N]`` in x's dtype (float32
    accumulation)."""
    return gemv_group(x, [w], scales=None if scale is None else [scale], convrot=convrot, config=config,
                      row_norm=row_norm)[0]


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
    x2 = _rows(x, k)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    groups, block_j = 16, min(64, g)  # 16 groups: the smallest tile the tensor-core dot takes
    hh = h.to(device=x.device, dtype=x.dtype).contiguous()
    grid = (x2.shape[0], triton.cdiv(k // g, groups), g // block_j)
    _rotate_kernel[grid](x2, hh, y, k, x2.stride(0), y.stride(0), G=g, GROUPS=groups, BLOCK_J=block_j,
                         IEEE=x.dtype == torch.float32, num_warps=4, **launch_args(x.device))
    return y.reshape(x.shape)
