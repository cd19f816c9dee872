"""Skinny matrix products for decode rows: ``y = x @ w.T`` with at most 16 rows of x (Triton).

At batch 1 a decode step is a chain of matrix-vector products whose cost is reading the weights
once. Each program owns ``BLOCK_N`` output columns of one weight and streams its ``[BLOCK_N, K]``
slice in ``BLOCK_K`` tiles (software-pipelined), multiplying them with the rows of x padded to 16
on the tensor cores, float32 accumulation.

* Weights: bf16 / fp16 (x's dtype), or int8 / fp8 (e4m3fn, e5m2: ComfyUI's ``int8_tensorwise`` and
  ``float8_*`` layouts) with a float32 scale per output row or per tensor: weight-only
  quantization, the 8-bit values widened to x's dtype in registers (exact), the scale applied to
  the accumulated row. Bytes read: the weights once. ``capabilities.fp8_reason`` says where fp8 runs.
* ``gemv_group``: up to four weights that read the same x in one launch (a DeltaNet layer's four
  input projections, q/k/v, gate/up); a tile loop per weight, each with buffers of its own.
* ``split=P``: K cut into P ranges with programs of their own, float32 partials returned for a
  consumer that sums them (``norms.add_rms_norm``); ``launch.split_k`` gives the table's P.
* K slices (a launch config's fifth value): the program's warps own slices of each K tile instead
  of columns, one batched dot, the slices summed after the loop (Triton 3.3+, ``SLICES_REASON``).
* ``row_norm``: each row's result times the RMSNorm factor a deferred norm left (``row_norm.py``).
* ``prefetch=w``: once its result is stored, each program asks L2 for its share of the first bytes
  of the next product's weight (``ptx.prefetch_share``), where launches overlap (``pdl_reason``).
* ConvRot weights (``convrot=G``): x is rotated first by ``convrot_triton.hadamard_rotate``.

Launch settings (tile, warps, stages, K slices, split) come from ``launch.gemv``: the GPU's table,
else computed from its properties. A launch that needs more shared memory than the GPU has runs
with fewer stages and says so once. With programmatic dependent launch (Hopper+, ``pdl.py``) a
product is scheduled while its input's producer finishes and waits for it inside the kernel.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from . import launch
from .capabilities import FP8_DTYPES, QUANT_DTYPES, compiled, fp8_reason, pdl_reason, say_once
from .convrot_triton import flat_rows, hadamard_cached, hadamard_rotate
from .pdl import launch_args, trigger, wait
from .ptx import e4m3_bf16, prefetch_share
from .row_norm import RowNorm

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # very old Triton: nothing to catch by name
    OutOfResources = ()

log = logging.getLogger(__name__)

__all__ = ["MAX_GROUP", "MAX_GEMV_ROWS", "SLICES_REASON", "gemv", "gemv_group", "gemv_reason"]

MAX_GEMV_ROWS = 16  # rows one launch takes (padded to 16 for the tensor-core dot); decode rows are <= 8
MAX_GROUP = 4


def _slices_reason() -> str | None:
    """None when this Triton compiles the K-sliced tile (``_tile``'s SLICES > 1: a batched 3-D dot),
    else why not. Triton 3.0-3.2 cannot (compiled for sm_89 by ``tests/kernels/consumer_step.py``:
    3.0-3.2 reject ``tl.trans`` of a 3-D tile by a tuple, and given the permutation as arguments 3.2's
    compiler aborts the process on the 3-D dot's shared-memory load); 3.3 to 3.9 can."""
    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    if version >= (3, 3):
        return None
    return f"Triton {triton.__version__} cannot compile K-sliced GEMV tiles (Triton 3.3+ can)"


#: None, or why the K-sliced tile cannot run here (``_slices_reason``): a table's K-sliced config then
#: runs unsliced, and an explicit one is refused before it reaches the compiler.
SLICES_REASON = _slices_reason()


@triton.jit
def _widen(w, x_dtype: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr):
    # int8 or fp8 -> x's dtype, exact (FP8 as in ``_tile``); weights already in x's dtype unchanged.
    if QUANT:
        if FP8 == 3:
            w = e4m3_bf16(w)
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
    # tile loop per weight, each with buffers of its own (one shared loop measured slower in the step).
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
        prefetch_share(PF, n_pf, 128)



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




def gemv_group(x: torch.Tensor, weights: list[torch.Tensor], *, scales: list[torch.Tensor] | None = None,
               convrot: int = 0, config: tuple[int, ...] | None = None,
               split: int = 1, row_norm: RowNorm | None = None,
               prefetch: torch.Tensor | None = None, prefetch_bytes: int | None = None) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]`` in one launch (1..4 weights ``[N_i, K]``, row-major, one dtype).

    x ``[..., K]`` (bf16/fp16/fp32) with at most 16 rows in all. Weights in x's dtype, or int8 / fp8
    with ``scales`` (float32 per tensor or per output row: ``y = (x @ q.T) * scale``). Returns
    ``[..., N_i]`` tensors in x's dtype (float32 accumulation). ``convrot=G``: the weights are
    ConvRot-rotated in groups of G (K a multiple of G), so x is first rotated by ``hadamard_rotate``
    (one launch more, shared by the group). ``config`` = (BLOCK_N, BLOCK_K, warps, stages[, K
    slices]) replaces the launch table's (never shrunk; K slices capped at BLOCK_K / 16).
    ``split=P > 1`` cuts K into P ranges with programs of their own and returns float32 partial
    products ``[P', ..., N_i]`` (P' <= P: fewer when K has fewer tiles; scale applied) whose sum
    over the first dim is the product. ``row_norm``: x is an RMSNorm's output without its per-row
    factor (``row_norm.py``, ``sq`` ``[..., P]`` with x's leading dims): every float32 accumulator
    is multiplied by the factor before the output is rounded. ``prefetch``: the weight (any dtype,
    contiguous) the next product will stream; each program, once its own product is stored, asks L2
    for its share of that weight's first ``prefetch_bytes`` (default: the launch table's).
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
    x2 = flat_rows(x, k)
    m = x2.shape[0]
    nrm = _row_norm_args(row_norm, x, m) if row_norm is not None else (x2, 0, 0, 1, 0.0, 0)
    ns = [w.shape[0] for w in weights]
    cfg = _picked(sum(ns), k, quant, m, x, len(weights)) if config is None else tuple(config)
    block_n, block_k, warps, stages = cfg[:4]
    shrunk_key = (str(x.device), x.dtype, weights[0].dtype, cfg)
    stages = _SHRUNK.get(shrunk_key, stages)
    block_k = min(block_k, triton.next_power_of_2(k))
    slices = min(cfg[4] if len(cfg) > 4 else 1, max(1, block_k // 16))
    if slices > 1 and SLICES_REASON is not None:  # never reaches the compiler: Triton 3.2's aborts the process
        raise ValueError(f"gemv: config {cfg} has K slices: {SLICES_REASON}; give four values")
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
            if config is not None or stages <= 1:
                raise
            stages, why = stages - 1, exc
    if stages != tried:
        _SHRUNK[shrunk_key] = stages
        log.warning("gemv: launch config %s (%s x, %s weights) needs more shared memory than this GPU has (%s); "
                    "it runs with %d pipeline stages instead of %d, slower than it could: "
                    "benchmarks/tune.py writes settings for this GPU", cfg, x.dtype, weights[0].dtype, why,
                    stages, tried)
    return [y.reshape(*shape[:-1], *x.shape[:-1], n) for y, n in zip(outs, ns)]


def _picked(n: int, k: int, quant: bool, rows: int, x: torch.Tensor, weights: int) -> tuple[int, ...]:
    """The launch table's config for this launch; a K-sliced one where this Triton cannot compile K
    slices becomes the unsliced tile of the same columns (said once)."""
    cfg = launch.gemv(n, k, quant, rows, x.device, weights=weights, x_bytes=x.element_size())[0]
    if len(cfg) > 4 and cfg[4] > 1 and SLICES_REASON is not None:
        say_once(log, f"gemv: {SLICES_REASON}; the DeltaNet inputs and attention q/k/v run with unsliced tiles "
                      "(a little slower): update Triton (it comes with torch 2.7+)")
        return (cfg[0], 128, cfg[2], 5) if n >= 11264 else (cfg[0], 256, cfg[2], 4)
    return cfg


def _fp8_mode(w_dtype: torch.dtype, x: torch.Tensor) -> int:
    """``_tile``'s FP8 for weights of ``w_dtype`` read with x: 0 (int8 or x's dtype), 1 (e4m3fn), 2
    (e5m2), 3 (e4m3fn with bf16 x where the kernel is compiled for a GPU: ``ptx.e4m3_bf16``, inline
    PTX the interpreter cannot run)."""
    if w_dtype not in FP8_DTYPES:
        return 0
    mode = FP8_DTYPES.index(w_dtype) + 1
    return 3 if mode == 1 and x.dtype == torch.bfloat16 and compiled(x.device) else mode


#: (device, x dtype, weight dtype, config) -> the pipeline stages that fit where the config's did not
_SHRUNK: dict[tuple, int] = {}


def _prefetch_args(w: torch.Tensor | None, device: torch.device, nbytes: int | None = None) -> tuple | None:
    """The kernel's (PF, n_pf) for ``gemv_group(prefetch=w)``: w's first ``nbytes`` (default: the
    launch table's) as bytes and their count of 128-byte lines, where the prefetch runs (a
    contiguous ``w`` on ``device``, where ``capabilities.pdl_reason`` allows overlapped launches:
    the setting it was measured in), else None."""
    if w is None or pdl_reason(device) is not None:
        return None
    nbytes = launch.prefetch(device)[0] if nbytes is None else nbytes
    if nbytes <= 0 or w.device != device or not w.is_contiguous():
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
