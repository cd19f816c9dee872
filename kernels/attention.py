"""Decode attention's front: the backend table, input checks, backend selection, ``decode_attention``.

``ATTENTION_BACKENDS`` is the one table of backends, ``{name: AttentionBackend(function, reason,
graph_safe)}``: ``function(q, k_cache, v_cache, lengths, causal, scale)`` computes,
``reason(q, scale)`` says why it cannot run for this call (None when it can), ``graph_safe`` says
whether it can be captured in a CUDA graph (no host sync). The engine, the nodes' options
(``ATTENTION_CHOICES``) and the tests all read it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from . import attention_torch
from .attention_kitchen import kitchen_decode_attention, kitchen_reason
from .attention_torch import bucket_decode_attention, masked_decode_attention, torch_decode_attention
from .capabilities import say_once, triton_module, triton_reason

log = logging.getLogger(__name__)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Head dims the decode-attention kernels support.
HEAD_DIMS = (64, 128, 256)
#: Most new rows per decode_attention call (a decode step, an MTP draft, a verify of 1 + depth rows).
MAX_DECODE_ROWS = 8


class AttentionBackend(NamedTuple):
    """One decode-attention backend: what computes, why it cannot run for a call, graph safety."""

    function: Callable
    reason: Callable[[torch.Tensor, float], str | None]
    graph_safe: bool
    bucketed: bool = False


def _triton_attention(q, k_cache, v_cache, lengths, causal: bool, scale: float):
    mod, _ = triton_module("attention_triton")
    return mod.triton_decode_attention(q, k_cache, v_cache, lengths, causal, scale)


def _kitchen_attention(q, k_cache, v_cache, lengths, causal: bool, scale: float):
    return kitchen_decode_attention(q, k_cache, v_cache, lengths, causal, scale).contiguous()


def _always(q: torch.Tensor, scale: float) -> None:
    return None


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    "triton": AttentionBackend(_triton_attention, lambda q, scale: triton_reason(q.device), True),
    "kitchen": AttentionBackend(_kitchen_attention, kitchen_reason, True),
    "torch": AttentionBackend(torch_decode_attention, _always, False),
    "bucket": AttentionBackend(bucket_decode_attention, _always, True, bucketed=True),
    "masked": AttentionBackend(masked_decode_attention, _always, True),
}
#: What callers may ask for: "auto" (see ``resolve_backend``) or a backend of the table.
ATTENTION_CHOICES = ("auto", *ATTENTION_BACKENDS)


def backend_reason(name: str, q: torch.Tensor, scale: float | None = None) -> str | None:
    """None when backend ``name`` can run for q (``[B,Hq,S,D]``) and ``scale``, else why not."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return ATTENTION_BACKENDS[name].reason(q, scale)


def backend_for(name: str, heads: int, head_dim: int, dtype: torch.dtype, device) -> tuple[str, str | None]:
    """``(backend, why not)`` for decode rows of ``heads`` query heads of ``head_dim`` in ``dtype`` on
    ``device``: "auto" resolved (``resolve_backend``; it always runs), or ``name`` with
    ``backend_reason``'s answer (None when it can run)."""
    q = torch.empty(1, heads, 1, head_dim, dtype=dtype, device=device)
    scale = head_dim ** -0.5
    if name == "auto":
        return resolve_backend(q, scale), None
    return name, backend_reason(name, q, scale)


def _check(q, k_cache, v_cache, lengths) -> None:
    if not all(isinstance(t, torch.Tensor) for t in (q, k_cache, v_cache, lengths)):
        raise ValueError("decode_attention: q, k_cache, v_cache and lengths must be torch tensors")
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"decode_attention: expected q [B,Hq,S,D] and caches [B,Hkv,C,D], got q {tuple(q.shape)}, "
            f"k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"decode_attention: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} must have the same shape")
    b_sz, hq, s, d = q.shape
    kb, hkv, cap, kd = k_cache.shape
    if kb != b_sz or kd != d:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} and caches {tuple(k_cache.shape)} "
                         "disagree on batch or head_dim")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"decode_attention: query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if d not in HEAD_DIMS:
        raise ValueError(f"decode_attention: head_dim {d} is not supported; use one of {HEAD_DIMS}")
    if not 1 <= s <= MAX_DECODE_ROWS:
        raise ValueError(f"decode_attention: S={s} new rows; decode supports 1..{MAX_DECODE_ROWS} "
                         "(use a prefill attention for longer chunks)")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"decode_attention: dtypes q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}; "
                         "all three must be one of bfloat16, float16, float32")
    if lengths.dtype != torch.int32 or tuple(lengths.shape) != (b_sz,):
        raise ValueError(f"decode_attention: lengths must be int32 of shape [{b_sz}], got "
                         f"{lengths.dtype} {tuple(lengths.shape)}")
    devices = {t.device for t in (q, k_cache, v_cache, lengths)}
    if len(devices) != 1:
        raise ValueError("decode_attention: all tensors must be on one device, got "
                         f"{sorted(map(str, devices))}")


_AUTO_CHOICE: dict[tuple, str] = {}


def resolve_backend(q: torch.Tensor, scale: float) -> str:
    """The backend ``"auto"`` uses for this shape/dtype/device (decided once, logged once).

    Preference: triton (flat in capacity, fastest in our benchmark), then kitchen where its native
    kernel applies, then on a GPU bucket (graph-safe), on the CPU torch (no graphs there, and it
    reads exactly the filled slots). ``"masked"`` is never chosen.
    """
    key = (q.device.type, q.dtype, tuple(q.shape[1:]), round(scale, 12))
    choice = _AUTO_CHOICE.get(key)
    if choice is not None:
        return choice
    on_cpu = q.device.type == "cpu"
    t_why = "the CPU runs the torch path" if on_cpu else backend_reason("triton", q, scale)
    if t_why is None:
        choice = "triton"
    else:
        k_why = backend_reason("kitchen", q, scale)
        choice = "kitchen" if k_why is None else "torch" if on_cpu else "bucket"
        if not on_cpu:
            say_once(log, f"decode_attention: Triton kernel unavailable ({t_why}); using '{choice}'"
                      + ("" if choice == "kitchen" else
                         f" (kitchen: {k_why}): torch attention over the filled length rounded up to "
                         f"{attention_torch.BUCKET} slots")
                      + ". Cost follows the filled length, not the capacity, and the step can be captured "
                      "in CUDA graphs.")
    _AUTO_CHOICE[key] = choice
    log.info("decode_attention: backend 'auto' -> '%s' for q %s %s on %s", choice,
             tuple(q.shape[1:]), q.dtype, q.device.type)
    return choice


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, *, causal: bool = True, scale: float | None = None,
                     backend: str = "auto", span: int | None = None) -> torch.Tensor:
    """Attention of S new query rows over a fixed-capacity KV cache whose cost follows the filled length.

    q ``[B,Hq,S,D]``; k_cache, v_cache ``[B,Hkv,C,D]``; lengths int32 ``[B]`` on q's device = filled
    slots including the S new rows (clamped to ``[0, C]``). Causal row j sees slots
    ``< lengths[b] - S + 1 + j``; non-causal rows see ``< lengths[b]``. Query head h reads kv head
    ``h // (Hq // Hkv)``. D in {64,128,256}, 1 <= S <= 8, all of bf16/fp16/fp32 (one dtype).
    Returns ``[B,Hq,S,D]`` contiguous in q's dtype; a row that sees no slot is zeros. ``scale``
    defaults to ``D**-0.5``. Slots at or past the visible limit are never read by the
    length-aware backends (``triton``, ``kitchen``, ``torch``), so their content does not matter.
    ``span`` (a host count, for the bucketed backend; the others ignore it): every length is at
    most ``span`` and, when it comes from ``attention_torch.bucket_end`` of the filled slots, more
    than ``span - BUCKET``; the bucketed backend then reads slots ``< span`` only and zeroes the
    unfilled ones of the last ``BUCKET`` in place. Without ``span`` it reads (and zeroes the
    unfilled slots of) the whole capacity.
    """
    _check(q, k_cache, v_cache, lengths)
    if backend not in ATTENTION_CHOICES:
        raise ValueError(f"decode_attention: unknown backend {backend!r}; choose one of {ATTENTION_CHOICES}")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if backend == "auto":
        backend = resolve_backend(q, scale)
    entry = ATTENTION_BACKENDS[backend]
    if backend == "triton":  # kitchen's adapter raises its own error naming the alternatives
        why = entry.reason(q, scale)
        if why is not None:
            raise ValueError(f"backend='triton' cannot run: {why}; use backend='auto'")
    if entry.bucketed:
        end = k_cache.shape[2] if span is None else min(span, k_cache.shape[2])
        stale_from = 0 if span is None else max(0, end - attention_torch.BUCKET)
        return entry.function(q, k_cache[:, :, :end], v_cache[:, :, :end], lengths, causal, scale,
                              stale_from=stale_from)
    return entry.function(q, k_cache, v_cache, lengths, causal, scale)
