"""Qwen3.5 text runtime: bind to a loaded model tree, prefill + decode on a length-aware cache,
exact MTP speculative decoding, and a standalone safetensors loader."""

from .binding import Qwen35Binding, bind
from .config import Qwen35Config
from .errors import Qwen35Error
from .generation import GenerationResult, GenerationStats, generate
from .standalone_loader import build_mtp_head, load_standalone

__all__ = [
    "GenerationResult",
    "GenerationStats",
    "Qwen35Binding",
    "Qwen35Config",
    "Qwen35Error",
    "bind",
    "build_mtp_head",
    "generate",
    "load_standalone",
]
