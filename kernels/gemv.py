"""Skinny matrix product for decode rows: ``y = x @ w.T`` with at most 16 rows of x (Triton).

At batch 1 a decode step is a chain of matrix-vector products whose cost is reading the weight
once. Each program owns ``BLOCK_N`` output columns and streams its ``[BLOCK_N, K]`` slice of the
weight in ``BLOCK_K`` tiles (software-pipelined), multiplying them with the rows of x padded to 16
on the tensor cores, accumulating in float32. No split over K, so no second reduction launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16


@triton.jit
def _gemv_kernel(X, W, B, Y, M, N, K, sx_m, sw_n, sy_m,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(W + offs_n[:, None] * sw_n + offs_k[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(X + offs_m[:, None] * sx_m + offs_k[None, :], mask=m_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < K
            w = tl.load(W + offs_n[:, None] * sw_n + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(X + offs_m[:, None] * sx_m + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * sy_m + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for an N x K weight."""
    return (16 if n <= 16384 else 64), 256, 4, 4


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


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)``: x ``[..., K]`` with at most 16 rows in all, w ``[N, K]`` row-major, bias
    ``[N]`` or None, all in one dtype (bf16/fp16). Returns ``[..., N]`` in that dtype (float32
    accumulation). ``config`` = (BLOCK_N, BLOCK_K, warps, stages) overrides the choice (benchmarks)."""
    why = gemv_reason(x, w)
    if why is not None:
        raise ValueError(f"gemv: unsupported operands: {why}; call torch.nn.functional.linear")
    n, k = w.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = _config(n, k) if config is None else config
    block_k = min(block_k, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x2, w, bias if bias is not None else w, y, m, n, k, x2.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=warps, num_stages=stages,
    )
    return y.reshape(*x.shape[:-1], n)
