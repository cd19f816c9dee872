"""An RMSNorm whose per-row factor is left to the product that reads its output.

``y = h * rsqrt(mean(h**2) + eps) * w`` is a row of ``z = h * w`` times one number per row, and a
projection of y is the projection of z times that number. ``fused_ops.add_rms_norm(defer=True)``
therefore writes z and, per row, float32 partial sums of squares of h (one per program, each over
its own columns): no program reads the whole row. The product that reads z
(``gemv.gemv_group(row_norm=)``) sums the partials and applies the factor to its float32
accumulator, before its output is rounded. ``RowNorm`` carries those partials; ``factor`` computes
the factor in torch for a consumer that is not the GEMV.

The GEMV loads the partial sums before its weight stream (after it, the step was slower; the
measurements: ``benchmarks/CHANGELOG.md``, ``benchmarks/norm.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["RowNorm", "factor"]


class RowNorm(NamedTuple):
    """The deferred factor of an RMSNorm over rows of width ``n``: ``sq`` float32 ``[..., P]`` (the
    rows' leading dims, then P partial sums of squares whose sum is the row's), and the norm's eps."""

    sq: torch.Tensor
    n: int
    eps: float


def factor(norm: RowNorm) -> torch.Tensor:
    """float32 ``[..., 1]``: ``rsqrt(sum(sq) / n + eps)`` per row, what ``z`` is multiplied by."""
    return torch.rsqrt(norm.sq.sum(-1, keepdim=True) / norm.n + norm.eps)
