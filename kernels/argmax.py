"""Greedy token choice on the device: ``torch.argmax(x, dim=-1)`` of logits rows in two Triton launches.

The greedy decode step ends in the output projection's logits ``[N, V]`` (V = 248320 for Qwen3.5).
torch's argmax of them costs a float32 cast, a memset and a reduction, each a kernel of its own
outside the overlapped chain. ``argmax_rows`` reads the logits as the projection wrote them (bf16,
fp16 or fp32; the cast is exact, so the index is the same): ``_argmax_partial_kernel`` gives each of up
to ``MAX_PARTS`` programs per row ``BLOCK`` columns' best (key, index), ``_argmax_final_kernel`` picks the
row's best of them and writes the int64 index. With programmatic dependent launch (Hopper+,
``kernels/pdl.py``) both launch while their predecessor finishes.

Same index as torch for every input: values are compared as float32 through an order-preserving
int32 key, -0.0 counts as +0.0, any NaN beats every number (torch's argmax returns a NaN's index),
and among equal values the first index wins. CUDA-graph safe: no host sync; the only allocation is
the partials buffer (and ``out`` when not given).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .capabilities import triton_device_reason
from .pdl import enter, launch_args

__all__ = ["BLOCK", "MAX_PARTS", "argmax_reason", "argmax_rows"]

BLOCK = 2048  # columns one program compares per tile
MAX_PARTS = 128  # programs per row (each walks its share of the row in BLOCK tiles)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _keys(X, offs, ok):
    # float32 values -> int32 keys in the same order (-0.0 as +0.0, every NaN the largest key);
    # masked columns get the smallest key
    v = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32) + 0.0  # + 0.0 turns -0.0 into +0.0
    bits = v.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(v != v, 2147483647, key)
    return tl.where(ok, key, -2147483647 - 1)


@triton.jit
def _argmax_partial_kernel(X, KEYS, IDX, sx, V, PER, PARTS, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    best_key = -2147483647 - 1
    best_idx = V  # any real index is smaller
    for c0 in range(part * PER, tl.minimum(part * PER + PER, V), BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        ok = offs < tl.minimum(part * PER + PER, V)
        key = _keys(X + row * sx, offs, ok)
        k = tl.max(key, 0)
        i = tl.min(tl.where(key == k, offs, V), 0)
        take = k > best_key  # tiles go left to right: an equal key later never wins
        best_idx = tl.where(take, i, best_idx)
        best_key = tl.where(take, k, best_key)
    tl.store(KEYS + row * PARTS + part, best_key)
    tl.store(IDX + row * PARTS + part, best_idx)


@triton.jit
def _argmax_final_kernel(KEYS, IDX, OUT, PARTS, V, P2: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, P2)
    ok = j < PARTS
    key = tl.load(KEYS + row * PARTS + j, mask=ok, other=-2147483647 - 1)
    idx = tl.load(IDX + row * PARTS + j, mask=ok, other=V)
    k = tl.max(key, 0)
    tl.store(OUT + row, tl.min(tl.where(key == k, idx, V), 0).to(tl.int64))


def argmax_reason(x: torch.Tensor) -> str | None:
    """None when ``argmax_rows`` can run on x (its device, dtype and last-dim stride), else why
    not (one line)."""
    if x.dtype not in _DTYPES:
        return f"logits are {x.dtype} (bf16, fp16 or fp32)"
    if x.dim() >= 1 and x.shape[-1] > 1 and x.stride(-1) != 1:
        return f"logits need a contiguous last dim (strides {tuple(x.stride())}); pass x.contiguous()"
    return triton_device_reason(x.device)


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)``: x ``[..., V]`` (bf16, fp16 or fp32, last dim contiguous) ->
    int64 ``[...]``, written into ``out`` (int64, contiguous, one element per row) when given."""
    why = argmax_reason(x)
    if why is not None:
        raise ValueError(f"argmax_rows: {why}; use torch.argmax instead")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"argmax_rows: x must be [..., V] with V >= 1, got {tuple(x.shape)}")
    v = x.shape[-1]
    if v >= 2**31 - 1:
        raise ValueError(f"argmax_rows: {v} columns do not fit int32 indices")
    try:
        x2 = x.view(-1, v)
    except RuntimeError:
        raise ValueError(f"argmax_rows: the leading dims of x {tuple(x.shape)} (strides {tuple(x.stride())}) "
                         "do not flatten to rows; pass x.contiguous()") from None
    n = x2.shape[0]
    if out is None:
        out = torch.empty(x.shape[:-1], dtype=torch.int64, device=x.device)
    elif out.dtype != torch.int64 or out.numel() != n or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"argmax_rows: out must be a contiguous int64 tensor of {n} elements on {x.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if n == 0:
        return out
    tiles = triton.cdiv(v, BLOCK)
    parts = min(tiles, MAX_PARTS)
    per = triton.cdiv(tiles, parts) * BLOCK
    parts = triton.cdiv(v, per)
    keys = torch.empty(n, parts, dtype=torch.int32, device=x.device)
    idx = torch.empty(n, parts, dtype=torch.int32, device=x.device)
    pdl = launch_args(x.device)
    _argmax_partial_kernel[(n, parts)](x2, keys, idx, x2.stride(0), v, per, parts, BLOCK=BLOCK, num_warps=4, **pdl)
    _argmax_final_kernel[(n,)](keys, idx, out, parts, v, P2=max(16, triton.next_power_of_2(parts)), num_warps=4, **pdl)
    return out
