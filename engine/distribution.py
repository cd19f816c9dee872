"""The distribution ComfyUI's ``BaseGenerate.sample_token`` draws from, as tensors.

``target_probs`` returns it (penalties, temperature, top-k, min-p, top-p, in that order and with
the same tie rules), so a speculative decoder can accept or reject drafts against exactly that
distribution. ``target_candidates`` returns it as ComfyUI's top-k candidate list (what
``draw.sample`` replays), ``target_argmax`` its most likely token without building it.

Contract: logits ``[N,V]`` of any floating dtype (the filters run in it: pass float32 for float32
semantics) on any device, never modified; ``histories`` one per row: token ids (ints or a 1-D
integer tensor, in ``[0, V)``) or a bool ``[N,V]`` seen-token mask. Results live on the logits'
device: probabilities float32, token ids int64. Bad input raises ValueError.

ComfyUI's filters, restated (``x`` are the logits of one row):

* repetition penalty ``r`` and presence penalty ``c`` act once on every distinct token of the
  history: ``x = x * r if x < 0 else x / r``, then ``x = x - c``;
* ``x = x / temperature`` unless the temperature is exactly 1;
* ``top_k > 0``: keep the ``min(top_k, V)`` largest (``torch.topk``); all later filters work on
  those survivors only. ``top_k == 0`` skips this and the later filters see the whole vocabulary;
* ``min_p > 0``: drop tokens whose softmax probability is strictly below ``min_p * max``;
* ``top_p < 1``: sort descending, drop every token whose inclusive cumulative probability is
  strictly above ``top_p``, but always keep the first;
* dropped tokens get ``finfo(dtype).min`` (not ``-inf``), then a softmax.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch

from .sampling_params import SamplingParams

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def target_probs(logits: torch.Tensor, histories: Sequence[Sequence[int]],
                 params: SamplingParams) -> torch.Tensor:
    """Distribution ComfyUI samples from. logits ``[N,V]`` float -> probs ``[N,V]`` float32.

    Row ``i`` is penalised with the distinct tokens of ``histories[i]`` (a sequence of ints or a
    1-D integer tensor, values in ``[0, V)``). ``histories`` may instead be a bool ``[N,V]`` mask of
    the tokens seen so far, which a decode loop can update in place per token instead of passing
    ever longer lists. The filters run in the logits' dtype, as ComfyUI's do; pass float32 logits
    for float32 semantics. For greedy params the result is a one-hot of the argmax of the raw
    logits (no penalties: ComfyUI's greedy path ignores them). ``logits`` is never modified.
    """
    n, v = _check_request(logits, histories, params)
    if params.greedy:
        out = torch.zeros(n, v, dtype=torch.float32, device=logits.device)
        return out.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    x = _penalised_tempered(logits, histories, params)
    if params.top_k > 0:
        probs_k, indices = _top_k_candidates(x, params)
        out = torch.zeros(n, v, dtype=torch.float32, device=logits.device)
        return out.scatter_(1, indices, probs_k)
    return _filtered_softmax(x, params).float()


def target_argmax(logits: torch.Tensor, histories: Sequence[Sequence[int]],
                  params: SamplingParams) -> torch.Tensor:
    """The most likely token of ``target_probs``'s distribution per row, without building it:
    logits ``[N,V]`` -> int64 ``[N]``. top-k, min-p and top-p never drop a row's largest
    penalised, tempered logit, and softmax keeps its order, so this is the argmax of those logits
    (ties: the lowest id; where top-k or top-p cuts between tied tokens, ``target_probs`` may keep
    another of them). No ``torch.topk`` or softmax over the vocabulary: what a point-mass draft
    needs."""
    _check_request(logits, histories, params)
    if params.greedy:
        return logits.argmax(dim=-1)
    return _penalised_tempered(logits, histories, params).argmax(dim=-1)


def _check_request(logits, histories, params: SamplingParams) -> tuple[int, int]:
    params.validate()
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"target_probs: logits must be a 2-D tensor [N, V], got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"target_probs: logits must be a floating tensor (float32 preferred), got {logits.dtype}")
    n, v = logits.shape
    if n == 0 or v == 0:
        raise ValueError(f"target_probs: logits must have at least one row and one column, got {(n, v)}")
    if len(histories) != n:
        raise ValueError(f"target_probs: need one token history per logits row, got {len(histories)} "
                         f"histories for {n} rows (pass [] for a row without history)")
    return n, v


def _penalised_tempered(logits: torch.Tensor, histories, params: SamplingParams) -> torch.Tensor:
    """Penalties on the rows' seen tokens, then the temperature (ComfyUI's first two steps)."""
    x = logits
    if params.repetition_penalty != 1.0 or params.presence_penalty != 0.0:
        n, v = logits.shape
        mask = _history_mask(histories, n, v, logits.device)
        if mask is not None:
            x = torch.where(mask, _penalise(x, params), x)
    if params.temperature != 1.0:
        x = x / params.temperature
    return x


def target_candidates(logits: torch.Tensor, histories: Sequence[Sequence[int]],
                      params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's sampling candidates: logits ``[N,V]`` -> ``(probs [N,K] float32, ids [N,K] int64)``.

    With ``top_k > 0`` the K = min(top_k, V) candidates are ``torch.topk``'s survivors in its order
    (descending), exactly the list ComfyUI's ``sample_token`` hands to ``torch.multinomial``; filtered
    candidates keep probability 0. Otherwise (and for greedy params) K = V in index order. Feed the
    pair to ``sample(probs, generator, candidates=ids)`` to draw the token ComfyUI would draw.
    """
    if params.greedy or params.top_k <= 0:
        probs = target_probs(logits, histories, params)
        ids = torch.arange(probs.shape[1], device=probs.device).expand(probs.shape[0], -1)
        return probs, ids
    _check_request(logits, histories, params)
    return _top_k_candidates(_penalised_tempered(logits, histories, params), params)


def _top_k_candidates(x: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = torch.topk(x, min(params.top_k, x.shape[-1]))
    return _filtered_softmax(values, params).float(), indices


def _penalise(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Penalised copy of every logit (the caller keeps it only where the token was seen)."""
    r = params.repetition_penalty
    if r != 1.0:
        x = torch.where(x < 0, x * r, x / r)
    if params.presence_penalty != 0.0:
        x = x - params.presence_penalty
    return x


def _history_mask(histories, n: int, v: int, device: torch.device) -> torch.Tensor | None:
    """Bool ``[N,V]``: token seen in the row's history, or None when every history is empty."""
    if isinstance(histories, torch.Tensor) and histories.dtype == torch.bool:
        if tuple(histories.shape) != (n, v):
            raise ValueError(f"target_probs: a seen-token mask must be bool [N, V] = {[n, v]}, "
                             f"got {list(histories.shape)}")
        return histories.to(device)
    rows, cols = [], []
    for i, hist in enumerate(histories):
        ids = _token_ids(hist, i)
        if ids.numel() == 0:
            continue
        ids = ids.to(device=device, dtype=torch.long)
        cols.append(ids)
        rows.append(torch.full_like(ids, i))
    if not cols:
        return None
    cols_t = torch.cat(cols)
    bad = (cols_t < 0) | (cols_t >= v)
    if bool(bad.any()):  # one check for all rows (a single sync when the ids live on the GPU)
        where = int(bad.nonzero()[0, 0])
        raise ValueError(f"target_probs: histories[{int(torch.cat(rows)[where])}] has token id "
                         f"{int(cols_t[where])} outside the vocabulary [0, {v}); pass ids of the model "
                         f"that made the logits")
    mask = torch.zeros(n, v, dtype=torch.bool, device=device)
    mask[torch.cat(rows), cols_t] = True
    return mask


def _token_ids(hist, i: int) -> torch.Tensor:
    """One history as a 1-D integer tensor (lists go through ``array``: far faster than torch)."""
    if isinstance(hist, torch.Tensor):
        ids = hist.reshape(-1)
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"target_probs: histories[{i}] must hold integer token ids, got {ids.dtype}")
        return ids
    if isinstance(hist, (str, bytes)):
        raise ValueError(f"target_probs: histories[{i}] must be a sequence of token ids, got {type(hist).__name__}")
    try:
        buf = array.array("q", hist)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"target_probs: histories[{i}] must hold integer token ids ({exc})") from None
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(buf, dtype=torch.int64)


def _filtered_softmax(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """min-p then top-p on ``x [N,K]`` (ComfyUI's order and tie rules), then softmax."""
    floor = torch.finfo(x.dtype).min
    if params.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        threshold = params.min_p * probs.max(dim=-1, keepdim=True).values
        x = x.masked_fill(probs < threshold, floor)
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cumulative = torch.cumsum(torch.softmax(sorted_x, dim=-1), dim=-1)
        drop_sorted = cumulative > params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        x = x.masked_fill(drop, floor)
    return torch.softmax(x, dim=-1)
