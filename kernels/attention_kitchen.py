"""Adapter for comfy-kitchen's ``flash_attention_decode_gqa``, feature-detected (never required).

Two signatures exist, both returning ``[B, S, Hq*D]``:

* ``flash_attention_decode_gqa(q, k, v, kv_lengths)`` (0.2.38, 0.2.39, the versions newer ComfyUI
  pins): always the causal staircase (row j sees slots ``< L - S + 1 + j``);
* ``flash_attention_decode_gqa(q, k, v, kv_lengths, causal=...)`` (0.2.40 and newer).

With the positional form a non-causal call of S > 1 rows runs one row at a time (a single row is
the same either way). Older kitchens (ComfyUI 0.29.0 pins 0.2.24) have no GQA decode. Which form was
found, or why kitchen cannot be used, is logged once. Kitchen's native kernel runs for bf16,
head_dim 256, on SM80+ (or RDNA3+); for anything else it silently computes over the whole capacity
in torch, so we report it as not applicable instead.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

CAUSAL = "causal="        # 0.2.40+: (q, k, v, kv_lengths, causal=...)
POSITIONAL = "positional"  # 0.2.38 / 0.2.39: (q, k, v, kv_lengths), causal staircase


@dataclass(frozen=True)
class KitchenDecode:
    """What was found: the module (None when unusable), the call form, and a one-line description."""

    module: object | None
    form: str | None
    note: str


def signature_form(fn) -> str | None:
    """``CAUSAL``, ``POSITIONAL`` or None (a signature this adapter does not know)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if "causal" in params:
        return CAUSAL
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params.values() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(positional) == 4 and len(required) == 4:
        return POSITIONAL
    return None


def kitchen_version(ck) -> str:
    """comfy-kitchen's version: its module's ``__version__``, else the installed distribution's
    metadata (0.2.24's module has no ``__version__``), else "(version unknown)"."""
    version = getattr(ck, "__version__", None)
    if version:
        return str(version)
    from importlib import metadata

    try:
        return metadata.version("comfy-kitchen")
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def _detect_uncached() -> KitchenDecode:
    try:  # an optional kernel library (not ComfyUI itself), imported by name like any optional backend
        ck = importlib.import_module("comfy_kitchen")
    except Exception as exc:  # ImportError, or a broken native extension
        return KitchenDecode(None, None, f"comfy-kitchen is not importable ({exc})")
    version = kitchen_version(ck)
    fn = getattr(ck, "flash_attention_decode_gqa", None)
    if fn is None:
        return KitchenDecode(None, None, f"comfy-kitchen {version} has no flash_attention_decode_gqa "
                                         "(0.2.38+ has it)")
    form = signature_form(fn)
    if form is None:
        try:
            sig = str(inspect.signature(fn))
        except (TypeError, ValueError):
            sig = "(?)"
        return KitchenDecode(None, None, f"comfy-kitchen {version}: unknown flash_attention_decode_gqa{sig}")
    call = "(q, k, v, kv_lengths, causal=)" if form == CAUSAL else "(q, k, v, kv_lengths), causal only"
    return KitchenDecode(ck, form, f"comfy-kitchen {version}: flash_attention_decode_gqa{call}")


@functools.lru_cache(maxsize=1)
def detect() -> KitchenDecode:
    """The installed kitchen's decode entry point (detected once, one log line either way)."""
    found = _detect_uncached()
    if found.module is None:
        log.info("kitchen decode attention unavailable: %s", found.note)
    else:
        log.info("kitchen decode attention: %s", found.note)
    return found


def kitchen_reason(q: torch.Tensor, scale: float) -> str | None:
    """None when kitchen's native GQA decode runs for this call, else why not (one line)."""
    found = detect()
    if found.module is None:
        return found.note
    if q.device.type != "cuda":
        return "kitchen decode runs on CUDA/HIP devices only"
    if q.shape[-1] != 256 or q.dtype != torch.bfloat16:
        return "kitchen decode supports bf16 with head_dim 256 only"
    if abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        return "kitchen decode uses the default scale head_dim**-0.5 only"
    available = getattr(found.module, "flash_attention_decode_gqa_is_available", None)
    if available is not None and not available(q.device, q.dtype):
        return "kitchen's native decode kernel is not available on this device"
    return None


def call_decode(fn, form: str, q, k_cache, v_cache, lengths, causal: bool):
    """Call kitchen's ``fn`` in ``form``: q ``[B,Hq,S,D]`` -> ``[B,Hq,S,D]``."""
    b_sz, hq, s, d = q.shape
    q = q.contiguous()
    if form == CAUSAL:
        out = fn(q, k_cache, v_cache, lengths, causal=causal)
    elif causal or s == 1:
        out = fn(q, k_cache, v_cache, lengths)
    else:  # every row sees < L: one single-row (staircase-free) call per row
        out = torch.cat([fn(q[:, :, j:j + 1].contiguous(), k_cache, v_cache, lengths) for j in range(s)], dim=1)
    return out.view(b_sz, s, hq, d).transpose(1, 2)


def kitchen_decode_attention(q, k_cache, v_cache, lengths, causal: bool, scale: float):
    """q ``[B,Hq,S,D]`` bf16, caches ``[B,Hkv,C,D]`` -> ``[B,Hq,S,D]``; kitchen's split count follows C."""
    why = kitchen_reason(q, scale)
    if why is not None:
        raise ValueError(f"backend='kitchen' cannot run: {why}; use backend='auto' or 'triton'")
    found = detect()
    return call_decode(found.module.flash_attention_decode_gqa, found.form, q, k_cache, v_cache, lengths, causal)
