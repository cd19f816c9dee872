"""A generation request, checked once at the boundary (as ``SamplingParams`` is for sampling).

``GenerationRequest.check`` turns ``generate()``'s keyword arguments into one record or raises
Qwen35Error naming the argument; nothing after it re-checks. The MTP setting and ``max_length``
have their one parser / check here, used by the ComfyUI layer too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..kernels import ATTENTION_CHOICES
from .argument_checks import check_cache_room, check_seed, check_token_ids, check_top_k
from .binding import Qwen35Binding
from .draft_vocab import check_mode as check_draft_vocab
from .errors import Qwen35Error
from .rope import normalize_positions
from .sampling_params import SamplingParams
from .thinking import ThinkingBudget, as_budget

log = logging.getLogger(__name__)

MAX_MTP_DEPTH = 5
#: MTP settings as the nodes offer them: "auto", "off" or a depth.
MTP_CHOICES = ("auto", "off", *(str(d) for d in range(1, MAX_MTP_DEPTH + 1)))


def parse_mtp(value) -> str | int:
    """An MTP setting: "auto", "off" or a depth 1..5 (digit strings from combos, and 0 / False for
    off, accepted). Raises Qwen35Error (a ValueError) otherwise."""
    if value is False or (type(value) is int and value == 0):
        return "off"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if value in ("auto", "off") or (type(value) is int and 1 <= value <= MAX_MTP_DEPTH):
        return value
    raise Qwen35Error(f"mtp must be 'off', 'auto' or a depth 1..{MAX_MTP_DEPTH}, got {value!r}")


def mtp_depth(mtp, binding: Qwen35Binding) -> int:
    """Draft depth for setting ``mtp`` on this model (0 = off; "auto": the deepest it may choose,
    ``MAX_MTP_DEPTH``); Qwen35Error when a depth needs a head the model lacks. "auto" is off, with
    a log line, without a head."""
    mtp = "off" if mtp is None else parse_mtp(mtp)
    has_head = binding.mtp is not None
    if mtp == "off":
        return 0
    if mtp == "auto":
        if not has_head:
            log.info("MTP: no MTP head on this model; generating without speculative decoding")
            return 0
        return MAX_MTP_DEPTH
    if not has_head:
        raise Qwen35Error(f"mtp={mtp} needs an MTP head, and this model has none: load the checkpoint with "
                          "its mtp.* tensors (or graft them with build_mtp_head), or use mtp='auto'/'off'")
    return mtp


def check_max_length(max_length) -> int:
    """``max_length`` as an int >= 1, else Qwen35Error (a ValueError)."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise Qwen35Error(f"max_length must be a positive integer, got {max_length!r}")
    return max_length


def _check_embeds(embeds, hidden: int) -> torch.Tensor:
    if not isinstance(embeds, torch.Tensor) or not embeds.dtype.is_floating_point:
        raise Qwen35Error("embeds must be a floating tensor [T, H] or [1, T, H]")
    if embeds.dim() == 2:
        embeds = embeds.unsqueeze(0)
    if embeds.dim() != 3:
        raise Qwen35Error(f"embeds must be [T, H] or [B, T, H], got shape {tuple(embeds.shape)}")
    if embeds.shape[0] != 1:
        raise Qwen35Error(f"batch size {embeds.shape[0]} is not supported: call generate once per prompt (B=1)")
    if embeds.shape[1] < 1:
        raise Qwen35Error("embeds hold no prompt rows; pass at least one token")
    if embeds.shape[2] != hidden:
        raise Qwen35Error(f"embeds width {embeds.shape[2]} != model hidden size {hidden}")
    return embeds


def default_dtype(binding: Qwen35Binding) -> torch.dtype:
    """The execution dtype when the caller gives none: the embedding's float dtype, else float32.
    (The ComfyUI layer always passes the dtype ComfyUI itself would compute in.)"""
    w = getattr(binding.transformer.embed_tokens, "weight", None)
    if w is not None and w.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return w.dtype
    return torch.float32


@dataclass(frozen=True)
class GenerationRequest:
    """One checked ``generate()`` call.

    ``embeds`` ``[1,T,H]`` in the execution ``dtype``; ``positions`` int64 ``[3,T]`` (MRoPE ids of
    the prompt rows); ``mtp_depth`` 0 when MTP is off, else the fixed depth or, with ``mtp_auto``
    (``mtp="auto"`` on a model with a head), the deepest the controller may choose; ``draft_vocab``:
    ``engine/draft_vocab.py``'s mode; ``thinking``: a checked ``ThinkingBudget`` (``tokens`` 0: none);
    ``capacity``: K/V slots the cache needs (prompt + max_length + depth + 1).
    """

    embeds: torch.Tensor
    positions: torch.Tensor
    max_length: int
    min_tokens: int
    sampling: SamplingParams
    seed: int
    stop_tokens: tuple[int, ...]
    initial_tokens: tuple[int, ...]
    mtp_depth: int
    mtp_auto: bool
    mtp_draft: str | Callable[[int], int]
    draft_vocab: str
    attention: str
    dtype: torch.dtype
    cuda_graphs: bool | str
    fused: bool | str
    cache_fill: float | None
    thinking: ThinkingBudget = ThinkingBudget()

    @property
    def prompt_len(self) -> int:
        return self.embeds.shape[1]

    @property
    def device(self) -> torch.device:
        return self.embeds.device

    @property
    def capacity(self) -> int:
        return self.prompt_len + self.max_length + self.mtp_depth + 1

    @classmethod
    def check(cls, binding: Qwen35Binding, embeds, *, do_sample=True, max_length=256, temperature=1.0, top_k=50,
              top_p=0.9, min_p=0.0, repetition_penalty=1.0, seed=42, stop_tokens: Sequence[int] | None = None,
              min_tokens=0, presence_penalty=0.0, initial_tokens: Sequence[int] = (), mtp="auto",
              position_ids=None, attention="auto", execution_dtype=None, mtp_draft="argmax", cache_fill=None,
              cuda_graphs="auto", fused="auto", draft_vocab="auto", thinking_budget=None) -> GenerationRequest:
        """The record for ``generate()``'s arguments (same names and defaults), or Qwen35Error."""
        cfg = binding.config
        embeds = _check_embeds(embeds, cfg.hidden_size)
        check_max_length(max_length)
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise Qwen35Error(f"min_tokens must be an integer >= 0, got {min_tokens!r}")
        if attention not in ATTENTION_CHOICES:
            raise Qwen35Error(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}")
        if not callable(mtp_draft) and mtp_draft not in ("argmax", "sample"):
            raise Qwen35Error(f"mtp_draft must be 'argmax' or 'sample', got {mtp_draft!r}")
        check_draft_vocab(draft_vocab)
        thinking = as_budget(thinking_budget).checked(cfg.vocab_size)
        if cuda_graphs not in ("auto", True, False):
            raise Qwen35Error(f"cuda_graphs must be 'auto', True or False, got {cuda_graphs!r}")
        if fused not in ("auto", True, False):
            raise Qwen35Error(f"fused must be 'auto', True or False, got {fused!r}")
        params = SamplingParams(do_sample=bool(do_sample), temperature=float(temperature), top_k=check_top_k(top_k),
                                top_p=float(top_p), min_p=float(min_p),
                                repetition_penalty=float(repetition_penalty),
                                presence_penalty=float(presence_penalty or 0.0))
        try:
            params.validate()
        except ValueError as exc:
            raise Qwen35Error(str(exc)) from exc
        depth = mtp_depth(mtp, binding)
        auto = depth > 0 and parse_mtp(mtp) == "auto"
        dtype = execution_dtype or default_dtype(binding)
        stops = check_token_ids("stop_tokens", cfg.stop_tokens if stop_tokens is None else stop_tokens, cfg.vocab_size)
        initial = check_token_ids("initial_tokens", initial_tokens, cfg.vocab_size)
        if attention == "masked" and cache_fill is None:
            cache_fill = 0.0  # the capacity-bound baseline reads every slot: they must hold numbers
        positions = normalize_positions(position_ids, embeds.shape[1], embeds.device)
        check_cache_room(cfg, embeds.shape[1] + max_length + depth + 1, int(depth > 0), dtype, embeds.device)
        return cls(embeds=embeds.to(dtype), positions=positions, max_length=max_length, min_tokens=min_tokens,
                   sampling=params, seed=check_seed(seed), stop_tokens=stops,
                   initial_tokens=initial, mtp_depth=depth, mtp_auto=auto,
                   mtp_draft=mtp_draft, draft_vocab=draft_vocab, attention=attention, dtype=dtype,
                   cuda_graphs=cuda_graphs, fused=fused, cache_fill=cache_fill, thinking=thinking)
