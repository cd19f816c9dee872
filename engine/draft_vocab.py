"""The draft vocabulary: MTP drafts ranked over the tokenizer's first ids only.

A draft's output projection reads the whole ``lm_head`` (248,320 x 4096: 1.02 GB in int8, of the
1.26 GB a 9B draft reads). The released tokenizer's first 151,643 ids are its byte-level BPE
vocabulary of the earlier Qwen generations; the ids from there to 248,043 were added for more
languages, and the special tokens (``<|endoftext|>``, ``<|im_end|>``, ``<think>``, ...) start at
248,044. English, Chinese and code text is nearly all below the cut (with ComfyUI's
``qwen35_tokenizer``: 99.8% of this pack's README and ARCHITECTURE, 99.98% of its engine code,
99.3% of the Chinese text in ComfyUI's sources). A draft that reads the first 151,643 rows reads
0.40 GB less, and its logits past the cut are -inf: greedy drafts are the argmax below it, sampled
drafts are drawn from the head's distribution renormalised below it, and that distribution is
what the verify's acceptance test uses, so the output keeps the target's distribution (greedy: the
MTP-off tokens) whatever the cut. A draft the cut leaves out is a rejected one, never a wrong token.

``DraftVocab`` decides per generation (``draft_vocab``):

* ``"auto"`` (default): the cut while the text stays in it; once the tokens made so far hold at
  least ``OUTSIDE_MIN`` ids between the cut and the special tokens and they are ``OUTSIDE_SHARE``
  of them (a script the cut lacks: Japanese, Korean, Arabic, ...), the full vocabulary for the rest
  of the generation. A model whose vocabulary is not the released one drafts over all of it.
* ``"subset"``: the cut throughout (benchmarks on random weights, whose tokens are spread over the
  whole vocabulary; tests with a small vocabulary set ``Qwen35Binding.draft_vocab``);
* ``"full"``: every id.
"""

from __future__ import annotations

import torch

from .errors import Qwen35Error

#: The released tokenizer's vocabulary (the output projection's rows).
RELEASED_VOCAB = 248_320
#: Its byte-level BPE ids: the draft vocabulary.
RELEASED_DRAFT_IDS = 151_643
#: Its first special token (``<|endoftext|>``); the ids between the cut and it are ordinary text.
RELEASED_SPECIALS = 248_044
OUTSIDE_MIN = 4
OUTSIDE_SHARE = 0.02
MODES = ("auto", "subset", "full")


def draft_ids(vocab_size: int) -> int | None:
    """The draft vocabulary of a model with ``vocab_size`` output rows: ``RELEASED_DRAFT_IDS`` for
    the released tokenizer, else None (every id)."""
    return RELEASED_DRAFT_IDS if vocab_size == RELEASED_VOCAB else None


def check_mode(mode: str) -> str:
    """``mode`` if it is one of ``MODES``, else Qwen35Error naming them."""
    if mode not in MODES:
        raise Qwen35Error(f"draft_vocab must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    return mode


class DraftVocab:
    """The ids one generation's drafts rank (see the module docstring): ``rows`` is the cut (drafts
    over ids ``[0, rows)``) or None (all). ``see(tokens)`` after each batch of new tokens;
    ``switched_at``: the tokens made when ``"auto"`` gave the cut up (None: it did not)."""

    def __init__(self, mode: str, cut: int | None, specials: int = RELEASED_SPECIALS):
        self.mode, self.cut, self.specials = check_mode(mode), cut, specials
        self.rows = None if mode == "full" else cut
        self._outside = self._made = 0
        self.switched_at: int | None = None

    def see(self, tokens: list[int]) -> None:
        """Count ``tokens`` (new ones, in order); in ``"auto"`` mode give the cut up once the text
        has left it (``OUTSIDE_MIN`` and ``OUTSIDE_SHARE``)."""
        if self.rows is None or self.mode != "auto":
            return
        self._made += len(tokens)
        self._outside += sum(1 for t in tokens if self.rows <= t < self.specials)
        if self._outside >= OUTSIDE_MIN and self._outside >= OUTSIDE_SHARE * self._made:
            self.rows, self.switched_at = None, self._made

    def describe(self) -> str | None:
        """For the per-generation log line: what the drafts ranked; None when every id throughout."""
        if self.switched_at is not None:
            return f"drafts over the first {self.cut:,} ids until token {self.switched_at}, then all"
        return None if self.rows is None else f"drafts over the first {self.cut:,} ids"


def pad(sub: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits of the first ids ``[..., n]`` -> ``[..., vocab]``, -inf past ``n`` (same dtype)."""
    out = sub.new_full((*sub.shape[:-1], vocab), float("-inf"))
    out[..., :sub.shape[-1]] = sub
    return out
