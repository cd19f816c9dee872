"""``Sampler``: the sampling state of one ``generate()`` call; host token lists to the device.

``Sampler`` draws each token from ComfyUI's distribution (``distribution``) after the history so
far, with the noise keyed by the seed and the token's position in the sequence (``draw``,
``keyed_noise``), and forbids stop tokens before ``min_tokens``. Contract: logits float32 ``[N,V]``
on the model's device; the penalties' seen set (bool ``[1,V]``) lives there too; ``draw`` reads the
token back (an int), ``draw_async`` and ``draw_rows`` leave int64 on the device. A draw names
``count``, the number of tokens generated before it: the token's position is the prompt length
plus ``count``, so the same seed draws the same token there however the loop got to it.
``to_device`` / ``token_ids``: a list of ints -> int64 ``[N]`` / ``[1,N]`` on a device, with no
host sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .distribution import target_candidates
from .draw import keyed_draw
from .keyed_noise import row_keys
from .sampling_params import SamplingParams
from .thinking import ThinkingBudget, ThinkingLimit


def to_device(tokens: list[int], device) -> torch.Tensor:
    """int64 ``[N]`` on ``device``. To CUDA through pinned memory without a host sync (torch's
    pinned-block cache keeps the block until the copy is done)."""
    t = torch.tensor(tokens, dtype=torch.int64)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def token_ids(tokens: list[int], device) -> torch.Tensor:
    """int64 ``[1, N]`` on ``device`` (see ``to_device``)."""
    return to_device(tokens, device).unsqueeze(0)


class Sampler:
    """The sampling state of one generate() call: the tokens generated so far, the penalties' seen
    set (a bool mask on the device), the seed, stop tokens and ``min_tokens``. Kept off the model,
    so an interrupt leaves nothing behind. ``first_position``: the sequence position of the first
    generated token (the prompt's length); seed in ``[0, 2**64)``. ``mtp_draft`` is how drafts are
    made (see ``speculative``). ``thinking``: a checked ``ThinkingBudget``, whose forced close the
    loops meet through ``limit``, ``masks`` and ``mask``."""

    def __init__(self, params: SamplingParams, *, seed: int, first_position: int, stop_tokens, min_tokens: int,
                 initial_tokens, device, mtp_draft, thinking: ThinkingBudget = ThinkingBudget()):
        self.params = params
        self.greedy = params.greedy
        self.seed = int(seed)
        self.first_position = int(first_position)
        row_keys(self.seed, self.first_position, 1, device)  # a bad seed or position fails here, before any step
        self.stops = {int(t) for t in stop_tokens}
        self.stop_ids = torch.tensor(sorted(self.stops), dtype=torch.int64, device=device)
        self.min_tokens = min_tokens
        self.generated: list[int] = []
        self.mtp_draft = mtp_draft
        self.device = device
        self.thinking = ThinkingLimit(thinking)
        self.penalised = not self.greedy and (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0)
        self._initial = [int(t) for t in initial_tokens]
        # The tokens the penalties act on, bool [1, V] on the device, built at the first penalised
        # draw (the vocabulary comes with the logits) and updated there: no draw waits for the host.
        self._seen_mask: torch.Tensor | None = None

    def accept(self, tokens: Sequence[int], *, noted: bool = False) -> None:
        """Append generated tokens (``noted``: already in the seen set through ``note``)."""
        self.generated.extend(tokens)
        if tokens and self._seen_mask is not None and not noted:
            self._seen_mask.index_fill_(1, to_device(list(tokens), self.device), True)

    def seen_rows(self, drafts: torch.Tensor | None, rows: int, vocab: int) -> list | torch.Tensor:
        """Penalty histories of ``rows`` consecutive positions (``target_probs``'s ``histories``):
        row i has the seen set plus ``drafts[:i]`` (int64 on the device). ``[()] * rows`` without
        penalties, else bool ``[rows, V]`` (device ops only: a draft or verify never waits for the
        host; a single row without drafts is the seen set itself, not to be modified)."""
        if not self.penalised:
            return [()] * rows
        seen = self._seen(vocab)
        if rows == 1:
            return seen
        out = seen.expand(rows, vocab).clone()
        for j in range(rows - 1):  # draft j joins the rows after it (index_fill_: a scalar, no copy)
            out[j + 1:].index_fill_(1, drafts[j:j + 1], True)
        return out

    def limit(self, max_length: int) -> int:
        """How many tokens the loops may generate before they ask again: ``max_length``, or the thinking
        budget while its decision waits on the tokens before it (taken here once they are all generated)."""
        return self.thinking.limit(self.generated, max_length)

    def masks(self, first_count: int) -> bool:
        """True when ``mask`` would change a row drawn at ``first_count`` generated tokens."""
        return (first_count < self.min_tokens and self.stop_ids.numel() > 0) or \
            self.thinking.forced(first_count) is not None

    def mask(self, logits: torch.Tensor, first_count: int) -> torch.Tensor:
        """Forbid stop tokens on rows whose position is before ``min_tokens``, and keep only the forced id
        on rows the thinking budget forces. logits ``[N,V]``, row i drawn after ``first_count + i`` tokens."""
        n = logits.shape[0]
        blocked = max(0, min(n, self.min_tokens - first_count))
        if blocked and self.stop_ids.numel():
            logits = logits.clone()
            logits[:blocked, self.stop_ids] = float("-inf")
        return self.thinking.apply(logits, first_count)

    def draw_async(self, logits: torch.Tensor, count: int) -> torch.Tensor:
        """``draw`` without reading the token: int64 ``[1]`` on logits' device, no host sync (the
        same token as ``draw``). For a loop that launches the next step from this token before it
        reads it: ``note`` the token first, ``accept`` its value later."""
        if self.greedy:
            return logits[0].argmax().reshape(1)
        return self.draw_rows(logits, self.seen_rows(None, 1, logits.shape[1]), count)

    def draw_rows(self, logits: torch.Tensor, histories, count: int) -> torch.Tensor:
        """Sampled tokens of consecutive positions: row i of logits ``[N,V]`` is drawn from ComfyUI's
        distribution with ``histories`` (``seen_rows``) at position ``first_position + count + i``
        -> int64 ``[N]`` on the device, no host sync. The same logits, history and position give
        the same token, whichever distribution (target or draft) the row comes from."""
        probs, ids = target_candidates(logits, histories, self.params)
        return keyed_draw(probs, ids, row_keys(self.seed, self.first_position + count, logits.shape[0], self.device))

    def note(self, token: torch.Tensor) -> None:
        """Add the token ``draw_async`` just returned (int64 ``[1]`` on the device) to the penalties'
        seen set, before the next ``draw_async`` (then ``accept(..., noted=True)`` its value)."""
        if self.penalised:  # index_fill_: a scalar fill (item assignment copies True to the device: a sync)
            self._seen_mask.index_fill_(1, token, True)

    def _seen(self, vocab: int) -> torch.Tensor:
        """bool ``[1, V]``: the tokens the penalties act on (built once from the initial and the
        generated tokens, then kept up to date by ``accept`` and ``note``)."""
        if self._seen_mask is None:
            self._seen_mask = torch.zeros(1, vocab, dtype=torch.bool, device=self.device)
            tokens = self._initial + self.generated
            if tokens:
                self._seen_mask.index_fill_(1, to_device(tokens, self.device), True)
        return self._seen_mask

    def draw(self, logits: torch.Tensor, count: int) -> int:
        """The token after ``count`` generated ones from one row of logits ``[1,V]`` (float32),
        after the current history."""
        return int(self.draw_async(logits, count)[0])
