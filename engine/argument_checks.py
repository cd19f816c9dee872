"""Checks of ``generate()`` arguments that ``GenerationRequest.check`` runs before any work: token
ids inside the vocabulary, a seed torch accepts, an integer ``top_k``, and a ``max_length`` whose
K/V cache fits the device. Each raises Qwen35Error naming the argument and the fix; none coerces.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable

import torch

from .config import Qwen35Config
from .errors import Qwen35Error

SEED_LIMIT = 1 << 64  # keyed noise's seed range, 0 .. 2**64 - 1 (ComfyUI's seed widget range)


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_token_ids(name: str, ids: Iterable, vocab_size: int) -> tuple[int, ...]:
    """``ids`` as ints in ``[0, vocab_size)``, else Qwen35Error naming the first bad one."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise Qwen35Error(f"{name} must be a sequence of token ids, got {type(ids).__name__}")
    ids = list(ids)
    for t in ids:
        if not _integer(t) or not 0 <= t < vocab_size:
            raise Qwen35Error(f"{name}: {t!r} is not a token id of this model (integers 0 .. {vocab_size - 1}); "
                              "pass ids from this model's tokenizer")
    return tuple(int(t) for t in ids)


def check_seed(seed) -> int:
    """``seed`` as an int in ``[0, 2**64)``, else Qwen35Error."""
    if not _integer(seed) or not 0 <= seed < SEED_LIMIT:
        raise Qwen35Error(f"seed must be an integer from 0 to 2**64 - 1, got {seed!r}")
    return int(seed)


def check_top_k(top_k) -> int:
    """``top_k`` as an int (an integral float such as 20.0 included), else Qwen35Error: never rounded."""
    if _integer(top_k):
        return int(top_k)
    if isinstance(top_k, float) and top_k.is_integer():
        return int(top_k)
    raise Qwen35Error(f"top_k must be an integer >= 0 (0 disables top-k), got {top_k!r}")


def _device_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` in bytes, or None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def check_cache_room(cfg: Qwen35Config, capacity: int, mtp_layers: int, dtype: torch.dtype, device) -> None:
    """Qwen35Error when the K/V cache for ``capacity`` positions alone exceeds the device's memory."""
    layers = len(cfg.full_attention_layers) + mtp_layers
    need = layers * 2 * cfg.num_key_value_heads * cfg.head_dim * capacity * torch.empty((), dtype=dtype).element_size()
    total = _device_bytes(torch.device(device))
    if total is not None and need > total:
        raise Qwen35Error(f"max_length is too large: the K/V cache for {capacity} positions needs "
                          f"{need / 2**30:.1f} GiB, more than the {total / 2**30:.1f} GiB of {device}. Lower "
                          "max_length (the official enhancer settings use 16256 and 24000).")
