"""A draft hook with a chosen acceptance rate, for ``generate(mtp_draft=...)``.

``acceptance_hook(reference, p)`` replaces each draft (after the MTP head ran, so every step still
costs what it costs) by the reference token at that position with probability ``p``, decided once
per position with its own seeded generator, else by a token that is not the reference. With the
MTP-off tokens of the same prompt, settings and seed as the reference (greedy, or sampled: the
verify keeps a draft exactly when it equals the keyed draw MTP off made there) a right draft is
always accepted and a wrong one never, so each draft position is kept with probability ``p``
independently of the others: the acceptance a head of that quality would give, on any checkpoint,
random ones included.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence


def acceptance_hook(reference: Sequence[int], p: float, *, vocab: int, seed: int = 0) -> Callable[[int], int]:
    """``fn(position) -> token`` for ``mtp_draft``: ``reference[position]`` with probability ``p``
    (the same decision every time a position is drafted), else ``(reference[position] + 1) % vocab``;
    positions past the reference get token 0."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    rng = random.Random(seed)
    right: dict[int, bool] = {}

    def draft(position: int) -> int:
        if position not in right:
            right[position] = rng.random() < p
        if position >= len(reference):
            return 0
        token = int(reference[position])
        return token if right[position] else (token + 1) % vocab

    return draft
