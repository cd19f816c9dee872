"""Torch backends of decode attention: the length-aware reference, the bucketed graph-safe one and
the capacity-bound baseline.

``torch_decode_attention`` reads only the filled slots (it syncs the lengths to the host, so it is
not CUDA-graph safe). ``bucket_decode_attention`` reads the slots up to a host-known span, the
filled length rounded up to ``BUCKET`` slots (``bucket_end``): no host sync, so a CUDA graph
captured for one span serves every length inside it, and the cost follows the filled length in
steps of ``BUCKET``, never the capacity (the GPU path without Triton or kitchen's decode kernel).
``masked_decode_attention`` reproduces what ComfyUI does today: grouped q.K over the whole
capacity, an additive bias that hides the empty tail, fp32 softmax, then .V. It is kept for A/B
benchmarks only and is never chosen by ``backend="auto"``.
"""

from __future__ import annotations

import torch

#: Slots per step of the bucketed attention's span (``bucket_end``): about 4 MB of a 9B layer's
#: K and V (bf16, 4 KV heads of 256), a few per cent of a token's weight read at most.
BUCKET = 1024


def visible_limits(lengths: torch.Tensor, capacity: int, s: int, causal: bool) -> torch.Tensor:
    """Per-row visible slot count: int64 ``[B, S]`` from int32 ``lengths [B]`` clamped to ``[0, C]``.

    Causal row j sees slots ``< L - S + 1 + j``; non-causal rows see ``< L``. Values may be <= 0
    (row sees nothing).
    """
    lens = lengths.to(torch.int64).clamp(0, capacity).view(-1, 1)
    if not causal:
        return lens.expand(-1, s)
    return lens - s + 1 + torch.arange(s, device=lengths.device, dtype=torch.int64).view(1, s)


def torch_decode_attention(q, k_cache, v_cache, lengths, causal: bool, scale: float):
    """Length-aware reference. q ``[B,Hq,S,D]``, caches ``[B,Hkv,C,D]`` -> ``[B,Hq,S,D]`` in q's dtype.

    Computes in fp32 over ``k_cache[b, :, :L_b]`` only; rows that see no slot are zeros.
    """
    b_sz, hq, s, d = q.shape
    hkv, cap = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    limits = visible_limits(lengths, cap, s, causal).cpu()  # host sync: not graph safe
    out = torch.zeros(b_sz, hq, s, d, dtype=torch.float32, device=q.device)
    for b in range(b_sz):
        filled = int(limits[b].max().clamp(min=0))
        if filled == 0:
            continue
        k = k_cache[b, :, :filled].float()  # [Hkv, L, D]
        v = v_cache[b, :, :filled].float()
        qg = q[b].float().reshape(hkv, g * s, d)  # rows ordered (head-in-group, s)
        scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [Hkv, G*S, L]
        row_limit = limits[b].to(q.device).repeat(g).view(1, g * s, 1)
        slot = torch.arange(filled, device=q.device).view(1, 1, filled)
        scores = scores.masked_fill(slot >= row_limit, float("-inf"))
        row_max = scores.amax(-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = torch.exp(scores - row_max)
        denom = p.sum(-1, keepdim=True)
        o = torch.matmul(p, v) / torch.where(denom > 0, denom, torch.ones_like(denom))
        out[b] = o.reshape(hq, s, d)
    return out.to(q.dtype)


def bucket_end(filled: int, capacity: int) -> int:
    """The span the bucketed attention reads: ``filled`` (committed + staged slots, a host count)
    rounded up to a multiple of ``BUCKET``, at most ``capacity``, at least one bucket's worth."""
    return min(capacity, -(-max(filled, 1) // BUCKET) * BUCKET)


def bucket_decode_attention(q, k_cache, v_cache, lengths, causal: bool, scale: float, *, stale_from: int = 0):
    """Graph-safe, length-aware in steps. q ``[B,Hq,S,D]``, caches ``[B,Hkv,N,D]`` cut by the caller
    to a span N >= every length (``bucket_end``) -> ``[B,Hq,S,D]`` in q's dtype.

    Slots at or past ``lengths[b]`` in ``[stale_from, N)`` are set to zero in both caches (in place:
    nothing reads an unfilled slot's content, and this keeps a NaN there out of the product with
    the values); slots before ``stale_from`` must be filled. Then q grouped per kv head (no K/V
    repeat) times the N keys in float32 (``_scores``), the hidden slots set to -inf, a float32
    softmax, and the probabilities in the values' dtype times the values (float32 accumulation).
    Rows that see no slot are zeros. No host sync. (SDPA with a mask took cuDNN's prefill kernel
    here: 145 us a layer for one row over 3,072 slots on an H100.)
    """
    b_sz, hq, s, d = q.shape
    hkv, span = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    lens = lengths.to(torch.int64).view(b_sz, 1)
    if stale_from < span:
        stale = (torch.arange(stale_from, span, device=q.device).view(1, -1) >= lens).view(b_sz, 1, -1, 1)
        k_cache[:, :, stale_from:].masked_fill_(stale, 0)
        v_cache[:, :, stale_from:].masked_fill_(stale, 0)
    limits = visible_limits(lengths, span, s, causal)  # [B, S]
    hidden = torch.arange(span, device=q.device).view(1, 1, span) >= limits.unsqueeze(-1)  # [B, S, N]
    hidden = hidden.unsqueeze(1).expand(b_sz, g, s, span).reshape(b_sz, 1, g * s, span)
    qg = q.reshape(b_sz * hkv, g * s, d)  # rows ordered (head in group, s), as the mask's
    scores = _scores(qg, k_cache.reshape(b_sz * hkv, span, d).transpose(1, 2)).view(b_sz, hkv, g * s, span)
    probs = torch.softmax(scores.mul_(scale).masked_fill_(hidden, float("-inf")), dim=-1)
    out = torch.matmul(probs.to(v_cache.dtype), v_cache).reshape(b_sz, hq, s, d)
    empty = (limits <= 0).view(b_sz, 1, s, 1)
    return torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out)


#: (device type, dtype) -> whether ``torch.bmm(..., out_dtype=torch.float32)`` runs there
_FP32_OUT: dict[tuple[str, torch.dtype], bool] = {}


def _scores(qg: torch.Tensor, kt: torch.Tensor) -> torch.Tensor:
    """``qg @ kt`` in float32: ``[G, R, D] x [G, D, N] -> [G, R, N]``. bf16 / fp16 operands are
    multiplied as they are with float32 output where torch offers it (``bmm(out_dtype=)``, CUDA,
    newer torch), else the keys are widened first (a float32 copy of the span)."""
    if qg.dtype == torch.float32:
        return torch.bmm(qg, kt)
    key = (qg.device.type, qg.dtype)
    if key not in _FP32_OUT:
        try:
            torch.bmm(qg[:1, :1], kt[:1, :, :1], out_dtype=torch.float32)
            _FP32_OUT[key] = True
        except (TypeError, RuntimeError, NotImplementedError):
            _FP32_OUT[key] = False
    if _FP32_OUT[key]:
        return torch.bmm(qg, kt, out_dtype=torch.float32)
    return torch.bmm(qg.float(), kt.float())


def masked_decode_attention(q, k_cache, v_cache, lengths, causal: bool, scale: float):
    """Capacity-bound baseline (today's ComfyUI): cost grows with C, whatever the filled length.

    q ``[B,Hq,S,D]``, caches ``[B,Hkv,C,D]`` -> ``[B,Hq,S,D]``. K/V are not repeated: q is grouped
    per kv head. The bias is 0 for visible slots and -inf elsewhere, added to fp32 scores. Rows
    that see no slot are set to zeros, as the other backends do.
    """
    b_sz, hq, s, d = q.shape
    hkv, cap = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    qg = q.reshape(b_sz, hkv, g * s, d)
    scores = torch.matmul(qg, k_cache.transpose(-1, -2)) * scale  # [B, Hkv, G*S, C]
    limits = visible_limits(lengths, cap, s, causal)  # [B, S]
    slot = torch.arange(cap, device=q.device).view(1, 1, cap)
    bias = torch.zeros(b_sz, s, cap, device=q.device, dtype=torch.float32)
    bias.masked_fill_(slot >= limits.unsqueeze(-1), float("-inf"))
    bias = bias.unsqueeze(1).repeat(1, g, 1, 1).reshape(b_sz, 1, g * s, cap)
    probs = torch.softmax(scores.float() + bias, dim=-1).to(v_cache.dtype)
    out = torch.matmul(probs, v_cache).reshape(b_sz, hq, s, d)
    empty = (limits <= 0).view(b_sz, 1, s, 1)
    return torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out)
