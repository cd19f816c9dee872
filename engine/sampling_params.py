"""``SamplingParams``: ComfyUI's sampling knobs, with ``BaseGenerate.generate``'s defaults.

Plain Python numbers, no tensors. ``validate`` raises ValueError naming the first bad field;
``greedy`` is True where ComfyUI takes its argmax path (no sampling, no penalties, no filters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class SamplingParams:
    """ComfyUI's sampling knobs, with the same defaults as ``BaseGenerate.generate``."""

    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.9
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        """True when ComfyUI takes its argmax path (no sampling, no penalties, no filters)."""
        return (not self.do_sample) or self.temperature == 0

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first bad field; return self so calls can chain."""
        t = self.temperature
        if not _is_real(t) or not (t >= 0) or math.isinf(t):
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (0 means greedy), "
                             f"got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0 (0 disables top-k), "
                             f"got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0 < self.top_p <= 1):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 disables top-p), got {self.top_p!r}")
        if not _is_real(self.min_p) or not (0 <= self.min_p <= 1):
            raise ValueError(f"SamplingParams.min_p must be in [0, 1] (0 disables min-p), got {self.min_p!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not (r > 0) or math.isinf(r):
            raise ValueError(f"SamplingParams.repetition_penalty must be a finite number > 0 "
                             f"(1 disables it), got {r!r}")
        c = self.presence_penalty
        if not _is_real(c) or not math.isfinite(c):
            raise ValueError(f"SamplingParams.presence_penalty must be a finite number (0 disables it), "
                             f"got {c!r}")
        return self


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
