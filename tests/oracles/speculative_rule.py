"""The speculative acceptance rule restated one draft at a time on the host (float64; test-only):
the exact pieces ``draw.speculative_accept_rows`` draws from on the device."""

from __future__ import annotations

import torch


def acceptance_probability(probs_target: torch.Tensor, draft_token: int,
                           probs_draft: torch.Tensor | None = None) -> float:
    """Chance of keeping ``draft_token``: ``p(d)`` for a point-mass draft, else ``min(1, p(d)/q(d))``.

    probs ``[V]``; a draft with ``q(d) == 0`` is accepted iff ``p(d) > 0``.
    """
    p_d = float(probs_target[draft_token])
    if probs_draft is None:
        return min(1.0, max(0.0, p_d))
    q_d = float(probs_draft[draft_token])
    if q_d <= 0.0:
        return 1.0 if p_d > 0.0 else 0.0
    return min(1.0, max(0.0, p_d / q_d))


def residual_distribution(probs_target: torch.Tensor, draft_token: int,
                          probs_draft: torch.Tensor | None = None) -> torch.Tensor | None:
    """Where a rejected draft resamples from: float64 ``[V]`` summing to 1, or None if it is empty.

    Point-mass draft: ``p`` with ``draft_token`` removed. Otherwise: ``max(0, p - q)``. Both are
    renormalised; None means the residual has no mass (then the draft is the only possible
    outcome and must be kept).
    """
    p = probs_target.to(torch.float64)
    if probs_draft is None:
        res = p.clone()
        res[draft_token] = 0.0
    else:
        res = (p - probs_draft.to(torch.float64)).clamp_(min=0.0)
    total = float(res.sum())
    if not total > 0.0:
        return None
    return res / total
