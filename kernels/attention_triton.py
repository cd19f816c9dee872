"""Length-aware split-KV decode attention in Triton.

Two launches over a fixed grid, so one CUDA graph serves every length:

1. ``_split_kernel`` grid ``(B * Hkv * row_blocks, n_split)``. Each program reads ``L = lengths[b]``
   on the device, cuts ``[0, L)`` into ``n_split`` chunks (a whole number of ``BLOCK_N`` tiles
   each) and runs online softmax over its chunk for all query rows of one kv head: the G query
   heads of the group times the S new rows share each K/V tile, so K/V are read once per kv head.
   A program whose chunk is empty exits at once, so busy programs and bytes follow L, never C.
2. ``_combine_kernel`` grid ``(B * Hq * S, D / 64)`` merges the active splits of one row by their
   log-sum-exp (all splits loaded at once, no serial chain) and writes the output in q's dtype.
   ``triton_decode_attention_gated``'s merge (``_combine_gate_kernel``, the same grid and merge)
   also applies the attention output gate ``o * sigmoid(gate)``, in place of
   ``fused_ops.sigmoid_gate``'s launch.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # very old Triton: nothing to catch by name
    OutOfResources = ()
from . import fallback, launch
from .pdl import launch_args, trigger, wait

log = logging.getLogger(__name__)

@triton.jit
def _split_kernel(
    Q, K, V, LENS, OP, LSEP,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_c, sv_b, sv_h, sv_c,
    cap, hkv, n_mb, scale_log2,
    S: tl.constexpr, G: tl.constexpr, D: tl.constexpr, N_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr, PENDING: tl.constexpr,
):
    trigger(PDL)  # the merge kernel may start; it waits for this grid before reading
    pid = tl.program_id(0)
    split = tl.program_id(1)
    mb = pid % n_mb
    bh = pid // n_mb
    b = bh // hkv
    kh = bh % hkv

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # row = head_in_group * S + s
    row_ok = rows < G * S
    hl = rows // S
    j = rows % S
    offs_d = tl.arange(0, D)
    q_ptr = Q + b * sq_b + (kh * G + hl)[:, None] * sq_h + j[:, None] * sq_s + offs_d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)  # issued before the length is known

    length = tl.load(LENS + b) + PENDING  # PENDING: rows in the cache the merge adds to LENS
    length = tl.minimum(tl.maximum(length, 0), cap)
    per = tl.cdiv(tl.cdiv(length, N_SPLIT), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, length)
    if CAUSAL:
        limit = length - S + 1 + j
    else:
        limit = length + 0 * j
    part = (bh * N_SPLIT + split) * (G * S) + rows  # partial-row index
    if end <= start:
        tl.store(LSEP + part, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
        return

    k_base = K + b * sk_b + kh * sk_h
    v_base = V + b * sv_b + kh * sv_h

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        k = tl.load(k_base + offs_n[:, None] * sk_c + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * scale_log2
        seen = (offs_n[None, :] < limit[:, None]) & n_ok[None, :]
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * sv_c + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(OP + part[:, None] * D + offs_d[None, :], o, mask=row_ok[:, None])
    tl.store(LSEP + part, lse, mask=row_ok)


@triton.jit
def _merged(OP, LSEP, b, h, s, hkv, S: tl.constexpr, G: tl.constexpr, D: tl.constexpr, N_SPLIT: tl.constexpr,
            SPLIT_P2: tl.constexpr, BLOCK_D: tl.constexpr):
    """Query head h's row s of batch b merged over the active splits, columns [d0, d0 + BLOCK_D) of
    program_id(1): ``(float32 [BLOCK_D], offs_d)``."""
    kh = h // G
    row = (h % G) * S + s
    splits = tl.arange(0, SPLIT_P2)
    part = ((b * hkv + kh) * N_SPLIT + splits) * (G * S) + row
    # every split wrote its lse (-inf when its chunk was empty or the row saw nothing there)
    lse = tl.load(LSEP + part, mask=splits < N_SPLIT, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    total = tl.sum(w, 0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    # loaded together with the lse (not after it); stale partials of empty splits get weight 0
    o = tl.load(OP + part[:, None] * D + offs_d[None, :], mask=(splits < N_SPLIT)[:, None], other=0.0)
    o = tl.where((w > 0)[:, None], o, 0.0)
    return tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0), offs_d


@triton.jit
def _count_pending(LENS, n_b, PENDING: tl.constexpr):
    """The first programs of a merge add the split pass's PENDING rows to LENS (one per batch row):
    every split program has read LENS by then (the merge runs after the split grid)."""
    pid = tl.program_id(0)
    if PENDING > 0:
        if (pid < n_b) & (tl.program_id(1) == 0):
            tl.store(LENS + pid, tl.load(LENS + pid) + PENDING)


@triton.jit
def _combine_kernel(
    OP, LSEP, OUT, LENS,
    so_b, so_h, so_s, hkv, n_b,
    S: tl.constexpr, G: tl.constexpr, D: tl.constexpr, N_SPLIT: tl.constexpr,
    SPLIT_P2: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr, PENDING: tl.constexpr,
):
    wait(PDL)  # the whole split grid has finished and its writes are visible
    _count_pending(LENS, n_b, PENDING)
    pid = tl.program_id(0)  # over B * Hq * S, in q's (b, h, s) order
    s = pid % S
    h = (pid // S) % (hkv * G)
    b = pid // (S * hkv * G)
    acc, offs_d = _merged(OP, LSEP, b, h, s, hkv, S, G, D, N_SPLIT, SPLIT_P2, BLOCK_D)
    tl.store(OUT + b * so_b + h * so_h + s * so_s + offs_d, acc.to(OUT.dtype.element_ty))


@triton.jit
def _combine_gate_kernel(
    OP, LSEP, GATE, OUT, LENS, sg_b, sg_s, sg_h, hkv, n_b,
    S: tl.constexpr, G: tl.constexpr, D: tl.constexpr, N_SPLIT: tl.constexpr,
    SPLIT_P2: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr, PENDING: tl.constexpr,
):
    # _combine_kernel's merge, in out's (b, s, h) order, then the gate with sigmoid_gate's
    # rounding points, written as rows [B,S,Hq*D].
    wait(PDL)  # the whole split grid has finished and its writes are visible
    _count_pending(LENS, n_b, PENDING)
    pid = tl.program_id(0)
    hq = hkv * G
    h = pid % hq
    s = (pid // hq) % S
    b = pid // (hq * S)
    acc, offs_d = _merged(OP, LSEP, b, h, s, hkv, S, G, D, N_SPLIT, SPLIT_P2, BLOCK_D)
    DT: tl.constexpr = OUT.dtype.element_ty
    o = acc.to(DT).to(tl.float32)  # rounding point: the attention output in q's dtype
    g = tl.load(GATE + b.to(tl.int64) * sg_b + s.to(tl.int64) * sg_s + h * sg_h + offs_d).to(tl.float32)
    sig = (1.0 / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)  # rounding point: sigmoid
    tl.store(OUT + ((b.to(tl.int64) * S + s) * hq + h) * D + offs_d, (o * sig).to(DT))


_SHRUNK: dict[tuple, int] = {}  # (device, dtype, D, BLOCK_M) -> how many tiles past the first pick compiled


def _split_pass(q, k_cache, v_cache, lengths, causal: bool, scale: float, n_split: int | None,
                config: dict | None, pending: int = 0):
    """The split pass: ``(o_part, lse_part, n_split, merge launch keywords)``."""
    if pending and lengths.dtype != torch.int32:  # the merge adds them to lengths as int32
        raise ValueError(f"decode attention: pending={pending} needs int32 lengths, got {lengths.dtype}")
    b_sz, hq, s, d = q.shape
    hkv, cap = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    rows = g * s
    block_m = max(16, triton.next_power_of_2(min(rows, 64)))
    n_mb = -(-rows // block_m)
    key = (str(q.device), q.dtype, d, block_m)
    picked_split, tile = launch.attention(d, g, s, b_sz * hkv * n_mb, q.element_size(), block_m, q.device,
                                          _SHRUNK.get(key, 0))
    n_split = n_split or picked_split
    cfg = dict(tile, **(config or {}))
    o_part = torch.empty(b_sz * hkv * n_split * rows * d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(b_sz * hkv * n_split * rows, dtype=torch.float32, device=q.device)
    log2e = 1.4426950408889634
    # Measured on an H200: launching the merge early saves ~0.6 us when its grid is small (16-row
    # blocks, S=1 for Qwen3.5), but its waiting programs slow the split pass for larger grids.
    merge_launch = launch_args(q.device) if block_m == 16 else {"PDL": False}
    pdl = merge_launch["PDL"]
    while True:
        block_n = cfg.pop("BLOCK_N")
        try:
            _split_kernel[(b_sz * hkv * n_mb, n_split)](
                q, k_cache, v_cache, lengths, o_part, lse_part,
                q.stride(0), q.stride(1), q.stride(2),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                cap, hkv, n_mb, scale * log2e,
                S=s, G=g, D=d, N_SPLIT=n_split, BLOCK_M=block_m, BLOCK_N=block_n,
                CAUSAL=causal, IEEE=q.dtype == torch.float32, PDL=pdl, PENDING=pending, **cfg,
            )
            break
        except OutOfResources as exc:  # the estimate missed: take the next smaller tile, once per shape
            nxt = _SHRUNK.get(key, 0) + 1
            if config or nxt >= len(fallback.ATTENTION_TILES):
                raise
            log.warning("decode_attention: %s; retrying with a smaller tile", exc)
            _SHRUNK[key] = nxt
            cfg = launch.attention(d, g, s, b_sz * hkv * n_mb, q.element_size(), block_m, q.device, nxt)[1]
    return o_part, lse_part, n_split, merge_launch


def _contiguous_last(q, k_cache, v_cache):
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    return q, k_cache, v_cache


def triton_decode_attention(q, k_cache, v_cache, lengths, causal: bool, scale: float,
                            n_split: int | None = None, config: dict | None = None,
                            split_only: bool = False, pending: int = 0):
    """Split-KV decode. q ``[B,Hq,S,D]``, caches ``[B,Hkv,C,D]`` (last dim contiguous) -> ``[B,Hq,S,D]``.

    No host sync; safe to capture in a CUDA graph and replay with new ``lengths`` values.
    ``n_split``/``config`` override the launch defaults; ``split_only`` (benchmarks) skips the merge.
    ``pending=P``: the cache holds ``lengths + P`` rows (the S new ones were written, their count
    not yet added: ``KVCache.write_rows(count_later=True)``); attention sees all of them and the
    merge adds P to ``lengths`` (int32, one launch fewer than adding it before).
    """
    if pending and split_only:
        raise ValueError(f"decode attention: pending={pending} needs the merge (split_only=False)")
    q, k_cache, v_cache = _contiguous_last(q, k_cache, v_cache)
    o_part, lse_part, n_split, merge_launch = _split_pass(q, k_cache, v_cache, lengths, causal, scale, n_split,
                                                          config, pending)
    if split_only:
        return o_part, lse_part
    b_sz, hq, s, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    out = torch.empty(b_sz, hq, s, d, dtype=q.dtype, device=q.device)
    merge_args = (o_part, lse_part, out, lengths, out.stride(0), out.stride(1), out.stride(2), hkv, b_sz)
    merge_meta = dict(S=s, G=g, D=d, N_SPLIT=n_split, SPLIT_P2=triton.next_power_of_2(n_split),
                      BLOCK_D=64, num_warps=4, PENDING=pending)
    grid = (b_sz * hq * s, d // 64)
    _combine_kernel[grid](*merge_args, **merge_launch, **merge_meta)
    return out


def triton_decode_attention_gated(q, k_cache, v_cache, lengths, causal: bool, scale: float, gate: torch.Tensor,
                                  n_split: int | None = None, config: dict | None = None, pending: int = 0):
    """``fused_ops.sigmoid_gate(triton_decode_attention(...), gate)`` with the gate applied by the
    merge pass itself: one launch fewer.

    q ``[B,Hq,S,D]``, gate ``[B,S,Hq,D]`` (last dim contiguous, q's dtype) -> ``[B,S,Hq*D]`` in q's
    dtype: the attention output rounded to q's dtype, times ``round(sigmoid(gate))``, rounded (the
    unfused pair's rounding points). The merge is ``_combine_kernel``'s (``_merged``), so the output
    equals the unfused pair's bit for bit. No ConvRot rotation: merging with one program per head
    so it could rotate for an int8 ``o_proj`` measured no faster than the pair (``FusedPlan.attend``).
    ``pending`` as for ``triton_decode_attention``.
    """
    q, k_cache, v_cache = _contiguous_last(q, k_cache, v_cache)
    b_sz, hq, s, d = q.shape
    hkv = k_cache.shape[1]
    if gate.shape != (b_sz, s, hq, d) or gate.dtype != q.dtype or gate.stride(-1) != 1:
        raise ValueError(f"decode attention gate: expected [B,S,Hq,D] = {(b_sz, s, hq, d)} in {q.dtype} with a "
                         f"contiguous last dim, got {tuple(gate.shape)} {gate.dtype}")
    o_part, lse_part, n_split, merge_launch = _split_pass(q, k_cache, v_cache, lengths, causal, scale, n_split,
                                                          config, pending)
    out = torch.empty(b_sz, s, hq * d, dtype=q.dtype, device=q.device)
    _combine_gate_kernel[(b_sz * s * hq, d // 64)](
        o_part, lse_part, gate, out, lengths, gate.stride(0), gate.stride(1), gate.stride(2), hkv, b_sz,
        S=s, G=hq // hkv, D=d, N_SPLIT=n_split, SPLIT_P2=triton.next_power_of_2(n_split), BLOCK_D=64,
        num_warps=4, PENDING=pending, **merge_launch)
    return out
