"""Qwen3.5 text runtime: bind to a loaded model tree, prefill + decode on a length-aware cache,
exact MTP speculative decoding, and a standalone safetensors loader."""

from ..kernels import ATTENTION_CHOICES
from .binding import Qwen35Binding, bind
from .config import Qwen35Config
from .errors import Qwen35Error
from .generation import GenerationResult, GenerationStats, generate
from .modules import int8_head
from .request import MTP_CHOICES, GenerationRequest, check_max_length, parse_mtp
from .stack import build_runner
from .standalone_loader import build_mtp_head, load_standalone
from .thinking import ThinkingBudget

__all__ = [
    "ATTENTION_CHOICES",
    "MTP_CHOICES",
    "GenerationRequest",
    "GenerationResult",
    "GenerationStats",
    "Qwen35Binding",
    "Qwen35Config",
    "Qwen35Error",
    "ThinkingBudget",
    "bind",
    "build_mtp_head",
    "build_runner",
    "check_max_length",
    "generate",
    "int8_head",
    "load_standalone",
    "parse_mtp",
]
