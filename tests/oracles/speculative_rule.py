"""The speculative verify rule restated on the host (test-only): drafts are kept while they equal
the model's own token at their row (greedy: its argmax; sampled: its keyed draw, ``keyed_draw``),
then the model's token at the first row that differs (the correction) or after the last draft
(the bonus)."""

from __future__ import annotations


def verify_outcome(targets: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """``(new tokens, drafts kept)`` of a verify step whose k + 1 rows have the model's tokens
    ``targets`` and whose k drafts are ``drafts``."""
    assert len(targets) == len(drafts) + 1
    kept = 0
    while kept < len(drafts) and drafts[kept] == targets[kept]:
        kept += 1
    return list(targets[:kept + 1]), kept
