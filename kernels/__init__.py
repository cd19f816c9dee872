"""Decode-attention kernels whose cost follows the filled length of the KV cache, not its capacity."""

from .attention import BACKENDS, GRAPH_SAFE, decode_attention, resolve_backend

__all__ = ["BACKENDS", "GRAPH_SAFE", "decode_attention", "resolve_backend"]
