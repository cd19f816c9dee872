"""A thinking budget: after so many thinking tokens the block is closed and the answer follows.

``ThinkingBudget(tokens, close, end)``: ``tokens`` generated tokens may think (0: no limit); when the
model has not written ``end`` (the ``</think>`` id) among its first ``tokens`` tokens, the next tokens
are ``close`` (the ids of ``"\\n</think>\\n\\n"``, as the chat template closes a thinking block, ``end``
among them) and generation goes on from there. The prompt is assumed to open the thinking block.

``ThinkingLimit`` is its state in one generation, kept by the ``Sampler``: the loops generate up to
``limit()``, which pauses at the budget while it is open, so the decision is taken on the host with
every token before the budget known; a forced position's logits keep only the forced id (``apply``),
so greedy picks and keyed draws both give it, and MTP keeps a draft there only when it equals it.
The tokens before the budget and after the close are the model's own: the same text at every
``mtp`` setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import Qwen35Error


@dataclass(frozen=True)
class ThinkingBudget:
    """``tokens`` >= 0 (0: no limit); ``close``: token ids (>= 1 of them) written when the budget ends
    the thinking; ``end``: the id that ends a thinking block, one of ``close``."""

    tokens: int = 0
    close: tuple[int, ...] = ()
    end: int = -1

    def checked(self, vocab_size: int) -> ThinkingBudget:
        """This budget with ints, or Qwen35Error naming the bad field."""
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise Qwen35Error(f"thinking_budget must be an integer >= 0 (0: no limit), got {self.tokens!r}")
        if not self.tokens:
            return ThinkingBudget()
        close = tuple(self.close)
        bad = [t for t in (*close, self.end) if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < vocab_size]
        if not close or bad or self.end not in close:
            raise Qwen35Error(f"a thinking budget needs the ids that close thinking (close={close!r}) with the "
                              f"end-of-thinking id among them (end={self.end!r}), each in 0..{vocab_size - 1}")
        return ThinkingBudget(self.tokens, close, self.end)


def as_budget(value) -> ThinkingBudget:
    """``generate``'s ``thinking_budget`` argument: None / 0 (no limit) or a ``ThinkingBudget``."""
    if value is None or (type(value) is int and value == 0):
        return ThinkingBudget()
    if isinstance(value, ThinkingBudget):
        return value
    raise Qwen35Error("thinking_budget must be a ThinkingBudget(tokens, close, end) (the ids that close a "
                      f"thinking block come from the tokenizer), got {value!r}")


class ThinkingLimit:
    """One generation's budget state. ``limit(generated, max_length)``: how many tokens the loops may
    generate now; ``forced(count)``: the id forced at the token after ``count`` generated ones, or None;
    ``apply(logits, first_count)``: those ids in the logits; ``thinking_tokens(generated)`` / ``cut``: for the
    stats."""

    def __init__(self, budget: ThinkingBudget):
        self.budget = budget
        self.open = budget.tokens > 0  # the decision at the budget is still to take
        self.cut = False
        self._forced: dict[int, int] = {}
        self._scanned = 0

    def limit(self, generated: Sequence[int], max_length: int) -> int:
        """``max_length``, or the budget while it is undecided and not yet reached. At the budget (every
        token before it generated) the decision is taken: close the block unless ``end`` is among them."""
        if not self.open:
            return max_length
        n = self.budget.tokens
        if len(generated) < n and max_length > n:
            if self.budget.end not in generated[self._scanned:]:
                self._scanned = len(generated)
                return n
        self.open = False
        if len(generated) >= n and self.budget.end not in generated[:n]:
            self.cut = True
            self._forced = {n + i: t for i, t in enumerate(self.budget.close)}
        return max_length

    def forced(self, count: int) -> int | None:
        """The id the token after ``count`` generated ones must be, or None."""
        return self._forced.get(count)

    def apply(self, logits: torch.Tensor, first_count: int) -> torch.Tensor:
        """logits ``[N,V]`` whose row i is drawn after ``first_count + i`` tokens; forced rows keep only
        their id (0 there, -inf elsewhere). Returns ``logits`` itself when no row is forced."""
        if not self._forced:  # every step of a generation without a cut
            return logits
        rows = [(i, t) for i in range(logits.shape[0]) if (t := self._forced.get(first_count + i)) is not None]
        if not rows:
            return logits
        out = logits.clone()
        for i, t in rows:
            out[i].fill_(float("-inf"))
            out[i, t] = 0.0
        return out

    def thinking_tokens(self, generated: Sequence[int]) -> int:
        """Tokens generated before the block's end (all of them while it is open)."""
        end = self.budget.end
        return next((i for i, t in enumerate(generated) if t == end), len(generated))
