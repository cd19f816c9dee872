"""Skinny matrix products for decode rows: ``y = x @ w.T`` with at most 16 rows of x (Triton).

At batch 1 a decode step is a chain of matrix-vector products whose cost is reading the weights
once. Each program owns ``BLOCK_N`` output columns of one weight and streams its ``[BLOCK_N, K]``
slice in ``BLOCK_K`` tiles (software-pipelined), multiplying them with the rows of x padded to 16
on the tensor cores, float32 accumulation, no split over K (no second reduction launch).

``gemv_group`` runs up to four weights that read the same x in one launch (a DeltaNet layer's
four input projections, q/k/v, gate/up), and ``glu=True`` computes x as ``silu(g) * u`` while
loading it (the MLP's down projection, rounded as ``F.silu(g) * u`` in x's dtype would be), so
the activation never goes through memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16
MAX_GROUP = 4


@triton.jit
def _tile(X, U, W, Y, M, N, K, sx_m, su_m, sw_n, sy_m, pid,
          GLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          EVEN_K: tl.constexpr):
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w_mask = n_ok[:, None]
            x_mask = m_ok[:, None]
        else:
            k_ok = offs_k < K
            w_mask = n_ok[:, None] & k_ok[None, :]
            x_mask = m_ok[:, None] & k_ok[None, :]
        w = tl.load(W + offs_n[:, None] * sw_n + offs_k[None, :], mask=w_mask, other=0.0)
        x = tl.load(X + offs_m[:, None] * sx_m + offs_k[None, :], mask=x_mask, other=0.0)
        if GLU:  # x holds g; u the other half: round(round(silu(g)) * u)
            g = x.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
            u = tl.load(U + offs_m[:, None] * su_m + offs_k[None, :], mask=x_mask, other=0.0)
            x = (act * u.to(tl.float32)).to(w.dtype)
        acc += tl.dot(x, tl.trans(w))
    tl.store(Y + offs_m[:, None] * sy_m + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_kernel(X, U, W0, W1, W2, W3, Y0, Y1, Y2, Y3, M, K, N0, N1, N2, N3, E0, E1, E2,
                 sx_m, su_m, sw0, sw1, sw2, sw3, sy0, sy1, sy2, sy3,
                 COUNT: tl.constexpr, GLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # Programs [0, E0) serve weight 0, [E0, E1) weight 1, ... (E* are cumulative block counts).
    pid = tl.program_id(0)
    if pid < E0:
        _tile(X, U, W0, Y0, M, N0, K, sx_m, su_m, sw0, sy0, pid, GLU, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    elif COUNT > 1 and pid < E1:
        _tile(X, U, W1, Y1, M, N1, K, sx_m, su_m, sw1, sy1, pid - E0, GLU, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    elif COUNT > 2 and pid < E2:
        _tile(X, U, W2, Y2, M, N2, K, sx_m, su_m, sw2, sy2, pid - E1, GLU, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    elif COUNT > 3:
        _tile(X, U, W3, Y3, M, N3, K, sx_m, su_m, sw3, sy3, pid - E2, GLU, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)


def _config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for N output columns in all over width K. Measured on an
    H200 at the 9B shapes (``benchmarks/gemv.py``): 32 columns per program everywhere; 128-wide K
    tiles, 5 stages for 8192..12288 columns of width 4096, else 256-wide tiles, 4 stages."""
    if k < 8192 and 8192 <= n <= 16384:
        return 32, 128, 4, 5
    return 32, 256, 4, 4


def gemv_reason(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """None when ``gemv`` supports these operands, else why not (one line)."""
    if w.dtype not in (torch.bfloat16, torch.float16) or x.dtype != w.dtype:
        return f"operands {x.dtype} x {w.dtype} (bf16 or fp16 weights, x in the same dtype)"
    if w.dim() != 2 or w.stride(1) != 1:
        return "weight is not a row-major matrix"
    rows = x.numel() // max(1, x.shape[-1])
    if x.shape[-1] != w.shape[1] or rows > MAX_ROWS or rows < 1:
        return f"x {tuple(x.shape)} does not give 1..{MAX_ROWS} rows of width {w.shape[1]}"
    if x.device != w.device:
        return "x and the weight are on different devices"
    return None


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def gemv_group(x: torch.Tensor, weights: list[torch.Tensor], *, up: torch.Tensor | None = None,
               config: tuple[int, int, int, int] | None = None) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]`` in one launch (1..4 weights ``[N_i, K]``, row-major, one dtype).

    x ``[..., K]`` with at most 16 rows in all, in the weights' dtype (bf16/fp16); returns
    ``[..., N_i]`` tensors in that dtype (float32 accumulation). With ``up`` (same shape as x) the
    product is taken with ``silu(x) * up`` (each rounded to the dtype, as torch rounds
    ``F.silu(x) * up``). ``config`` = (BLOCK_N, BLOCK_K, warps, stages) overrides the choice.
    """
    if not 1 <= len(weights) <= MAX_GROUP:
        raise ValueError(f"gemv_group: 1..{MAX_GROUP} weights, got {len(weights)}")
    k = weights[0].shape[-1]
    for w in weights:
        why = gemv_reason(x, w)
        if why is None and w.dtype != weights[0].dtype:
            why = "weights of different dtypes"
        if why is not None:
            raise ValueError(f"gemv: unsupported operands: {why}; call torch.nn.functional.linear")
    if up is not None and (up.shape != x.shape or up.dtype != x.dtype or up.device != x.device):
        raise ValueError(f"gemv: up {tuple(up.shape)} {up.dtype} must match x {tuple(x.shape)} {x.dtype}")
    x2 = _rows(x, k)
    u2 = _rows(up, k) if up is not None else x2
    m = x2.shape[0]
    ns = [w.shape[0] for w in weights]
    outs = [torch.empty(m, n, dtype=x.dtype, device=x.device) for n in ns]
    block_n, block_k, warps, stages = _config(sum(ns), k) if config is None else config
    block_k = min(block_k, triton.next_power_of_2(k))
    ends, total = [], 0
    for n in ns:
        total += triton.cdiv(n, block_n)
        ends.append(total)
    pad = MAX_GROUP - len(weights)
    ws, ys = weights + [weights[0]] * pad, outs + [outs[0]] * pad
    nn, ee = ns + [0] * pad, (ends + [total] * pad)[:3]
    _gemv_kernel[(total,)](
        x2, u2, *ws, *ys, m, k, *nn, *ee, x2.stride(0), u2.stride(0), *(w.stride(0) for w in ws),
        *(y.stride(0) for y in ys),
        COUNT=len(weights), GLU=up is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages,
    )
    return [y.reshape(*x.shape[:-1], n) for y, n in zip(outs, ns)]


def gemv(x: torch.Tensor, w: torch.Tensor, *, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``x @ w.T``: x ``[..., K]`` with at most 16 rows in all, w ``[N, K]`` row-major, one dtype
    (bf16/fp16). Returns ``[..., N]`` in that dtype (float32 accumulation)."""
    return gemv_group(x, [w], config=config)[0]
