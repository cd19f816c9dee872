"""Adapter for comfy-kitchen's ``flash_attention_decode_gqa`` (0.2.40 and newer), feature-detected.

ComfyUI pins an exact, older kitchen that has no GQA decode; this module never requires it.
Kitchen's native kernel runs for bf16, head_dim 256, on SM80+ (or RDNA3+); for anything else it
silently computes over the whole capacity in torch, so we report it as not applicable instead.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging

import torch

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _module():
    try:  # an optional kernel library (not ComfyUI itself), imported by name like any optional backend
        ck = importlib.import_module("comfy_kitchen")
    except Exception as exc:  # ImportError, or a broken native extension
        log.debug("comfy-kitchen not importable: %s", exc)
        return None
    fn = getattr(ck, "flash_attention_decode_gqa", None)
    if fn is None:
        return None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if "causal" not in params:
        return None
    return ck


def kitchen_reason(q: torch.Tensor, scale: float) -> str | None:
    """None when kitchen's native GQA decode runs for this call, else why not (one line)."""
    ck = _module()
    if ck is None:
        return "comfy-kitchen with flash_attention_decode_gqa (0.2.40+) is not installed"
    if q.device.type != "cuda":
        return "kitchen decode runs on CUDA/HIP devices only"
    if q.shape[-1] != 256 or q.dtype != torch.bfloat16:
        return "kitchen decode supports bf16 with head_dim 256 only"
    if abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        return "kitchen decode uses the default scale head_dim**-0.5 only"
    available = getattr(ck, "flash_attention_decode_gqa_is_available", None)
    if available is not None and not available(q.device, q.dtype):
        return "kitchen's native decode kernel is not available on this device"
    return None


def kitchen_decode_attention(q, k_cache, v_cache, lengths, causal: bool, scale: float):
    """q ``[B,Hq,S,D]`` bf16, caches ``[B,Hkv,C,D]`` -> ``[B,Hq,S,D]``; kitchen's split count follows C."""
    why = kitchen_reason(q, scale)
    if why is not None:
        raise ValueError(f"backend='kitchen' cannot run: {why}; use backend='auto' or 'triton'")
    b_sz, hq, s, d = q.shape
    out = _module().flash_attention_decode_gqa(q.contiguous(), k_cache, v_cache, lengths, causal=causal)
    return out.view(b_sz, s, hq, d).transpose(1, 2)
