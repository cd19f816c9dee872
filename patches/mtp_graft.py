"""Graft an MTP head (``mtp.*`` tensors) onto the Qwen3.5 model of a freshly loaded ComfyUI CLIP.

ComfyUI's loader drops unknown ``mtp.*`` keys, and the Comfy-Org prompt-enhancer files carry none,
so the pack reads them itself (only the ``mtp.*`` entries, through safetensors' ``safe_open``),
builds the head with the engine and attaches it as ``mtp`` of the decoder module tree, where the
engine's binding looks for it. The first file is never rewritten.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..engine import Qwen35Error, bind, build_mtp_head
from . import comfy_bridge as bridge

log = logging.getLogger(__name__)

MTP_PREFIXES = ("mtp.", "model.mtp.")
QWEN35_MARKER = "model.language_model.layers.0.linear_attn.A_log"


class MTPHeadError(ValueError):
    """The MTP file is missing, unreadable, has no ``mtp.*`` tensors, or does not fit the model."""


def file_keys(path: str) -> list[str]:
    """Tensor names in a safetensors file (header only); ValueError naming the file when unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad file for the user
        raise MTPHeadError(f"Cannot read {path!r} as safetensors ({exc}). Re-download the file.") from exc


def is_qwen35_file(keys: Iterable[str]) -> bool:
    """True when the tensor names are those of a Qwen3.5 checkpoint ComfyUI recognises."""
    return QWEN35_MARKER in set(keys)


def read_mtp_tensors(path: str, device="cpu") -> dict:
    """Only the ``mtp.*`` tensors of ``path`` (``model.mtp.`` folded to ``mtp.``); {} when none."""
    from safetensors import safe_open

    out = {}
    try:
        with safe_open(path, framework="pt", device=str(device)) as f:
            for key in f.keys():
                for prefix in MTP_PREFIXES:
                    if key.startswith(prefix):
                        out["mtp." + key[len(prefix):]] = f.get_tensor(key)
                        break
    except Exception as exc:  # noqa: BLE001
        raise MTPHeadError(f"Cannot read the MTP head from {path!r} ({exc}).") from exc
    return out


def _engine_config(target: bridge.Qwen35Target):
    """The engine's config for the loaded ComfyUI model (through its binding)."""
    binding = bind(target.transformer)
    config = getattr(binding, "config", None)
    if config is None:
        raise bridge.Qwen35Unsupported("The engine binding exposes no config; cannot size the MTP head.")
    return config


def _model_dtype_device(model):
    """dtype/device for the head: those of the model's norm weights (floating, never int8)."""
    import torch

    for p in model.parameters():
        if p.is_floating_point() and p.dtype in (torch.float16, torch.bfloat16, torch.float32):
            return p.dtype, p.device
    return torch.float32, torch.device("cpu")


def graft_mtp(clip, tensors: dict, *, source: str = "") -> int:
    """Build the MTP head from ``tensors`` and attach it to ``clip``'s Qwen3.5; return its parameter count.

    Raises MTPHeadError naming the file and the tensor when the head does not fit the model.
    """
    target = bridge.find_qwen35(clip)
    config = _engine_config(target)
    dtype, device = _model_dtype_device(target.model)
    try:
        head = build_mtp_head(tensors, config, dtype=dtype, device=device)
    except (Qwen35Error, KeyError, ValueError, RuntimeError) as exc:
        raise MTPHeadError(
            f"The MTP head in {source or 'the file'} does not fit this Qwen3.5 model: {exc}. Use the "
            "mtp.* tensors of the same Qwen3.5 size (for the 9B prompt enhancer: those of "
            "Qwen/Qwen3.5-9B).") from exc
    target.model.mtp = head
    n = sum(p.numel() for p in head.parameters())
    log.info("Qwen3.5 MTP head grafted from %s (%.1f M parameters)", source or "memory", n / 1e6)
    return n
