"""Token sampling that reproduces ComfyUI's ``BaseGenerate.sample_token`` as a distribution.

``target_probs`` returns the probabilities ComfyUI's sampler draws from (penalties, temperature,
top-k, min-p, top-p, in that order and with the same tie rules), so a speculative decoder can
accept or reject drafts against exactly that distribution. ``sample`` draws from it,
``speculative_accept_rows`` is the exact accept / resample rule for a verify step's drafts, on
the device (``speculative_accept``: one draft; the greedy rule, an exact argmax comparison, is in
``speculative.accept``). ``Sampler`` keeps one generation's sampling state.

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
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


# --------------------------------------------------------------------------------------------
# Target distribution
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Sampling and speculative acceptance
# --------------------------------------------------------------------------------------------

def sample(probs: torch.Tensor, generator: torch.Generator | None, *, top_k: int = 0,
           candidates: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row, drawn the way ComfyUI's ``sample_token`` draws it. -> int64 ``[N]``.

    probs ``[N,V]`` (non-negative, any positive row sum), or ``[N,K]`` over ``candidates`` (int64
    ``[N,K]`` token ids, e.g. from ``target_candidates``). ComfyUI calls ``torch.multinomial`` on the
    top-k list in ``torch.topk`` order, so the generator is consumed per candidate and the same seed
    picks the same token only when the list and its order match: pass ``candidates`` for an exact
    replay, or ``top_k`` (> 0) to rebuild the list from ``probs [N,V]`` (``torch.topk`` of the
    probabilities: the same list and order unless two candidates have equal probability). With
    neither, the draw is over the whole vocabulary in index order (ComfyUI's ``top_k == 0`` path).
    ``generator`` must live on probs' device (None uses torch's default generator).
    """
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
        raise ValueError(f"sample: probs must be a 2-D tensor [N, V], got "
                         f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs)}")
    if candidates is None and top_k > 0:
        probs, candidates = torch.topk(probs, min(int(top_k), probs.shape[1]))
    if candidates is not None:
        if tuple(candidates.shape) != tuple(probs.shape):
            raise ValueError(f"sample: candidates {tuple(candidates.shape)} must match probs {tuple(probs.shape)}")
        picked = multinomial_one(probs, generator)
        return candidates.gather(1, picked).squeeze(-1)
    return multinomial_one(probs, generator).squeeze(-1)


def multinomial_one(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``torch.multinomial(probs, 1, generator=generator)`` without its host syncs: probs ``[N,K]``
    float (valid rows: non-negative, finite, positive sums) -> int64 ``[N,1]``. torch draws one
    sample as ``argmax(probs / E)`` with ``E ~ Exp(1)`` from ``exponential_`` (the same generator
    use), after two ``.item()`` validity checks that would stall a loop running ahead of the host;
    this is that draw without the checks (the sampler's rows are softmax outputs)."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    torch.div(probs, q, out=q)
    return torch.argmax(q, dim=-1, keepdim=True)


def speculative_accept(probs_target: torch.Tensor, draft_token: int, generator: torch.Generator | None,
                       probs_draft: torch.Tensor | None = None) -> tuple[bool, int | None]:
    """Accept or replace one draft token so the kept token is distributed exactly as ``probs_target``.

    probs_target ``[V]`` (and probs_draft ``[V]`` if given) float, each summing to 1. Returns
    ``(True, None)`` when the draft is kept, else ``(False, replacement)`` with
    ``replacement != draft_token``. With ``probs_draft`` None the draft is treated as a point mass
    (a greedy or deterministic drafter); otherwise it must have been sampled from ``probs_draft``.
    """
    _check_probs_vector("probs_target", probs_target)
    v = probs_target.shape[0]
    if probs_draft is not None:
        _check_probs_vector("probs_draft", probs_draft)
        if probs_draft.shape != probs_target.shape:
            raise ValueError(f"speculative_accept: probs_draft {tuple(probs_draft.shape)} must match "
                             f"probs_target {tuple(probs_target.shape)}")
    draft_token = int(draft_token)
    if not 0 <= draft_token < v:
        raise ValueError(f"speculative_accept: draft_token {draft_token} is outside the vocabulary [0, {v})")

    drafts = torch.tensor([draft_token], device=probs_target.device)
    keep, replacement = speculative_accept_rows(probs_target[None], drafts, generator,
                                                None if probs_draft is None else probs_draft[None])
    if bool(keep[0]):
        return True, None
    return False, int(replacement[0])


def speculative_accept_rows(probs: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None,
                            probs_draft: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``speculative_accept`` for k drafts at once, on the device, without reading anything back.

    probs float ``[k,V]`` (the target's distribution at each draft's row), drafts int64 ``[k]``
    (in ``[0, V)``), probs_draft float ``[k,V]`` or None (point-mass drafts). Returns ``(keep bool
    [k], replacement int64 [k])``: row i keeps its draft d with probability ``p(d)`` (point mass)
    or ``min(1, p(d)/q(d))`` (a draft with ``q(d) == 0``: iff ``p(d) > 0``), and always when its
    residual is empty; else its token is ``replacement[i]``, drawn from the residual: ``p`` with d
    removed (point mass) or ``max(0, p - q)`` (never the draft). Every row draws its own uniform and its own
    residual sample from ``generator`` (on probs' device), so the rows are independent and a caller
    may stop at the first rejected one and drop the rest."""
    if probs.dim() != 2 or drafts.shape != (probs.shape[0],):
        raise ValueError(f"speculative_accept_rows: probs [k, V] and drafts [k], got {tuple(probs.shape)} and "
                         f"{tuple(drafts.shape)}")
    if probs_draft is not None and probs_draft.shape != probs.shape:
        raise ValueError(f"speculative_accept_rows: probs_draft {tuple(probs_draft.shape)} must match probs "
                         f"{tuple(probs.shape)}")
    k = probs.shape[0]
    idx = drafts.view(k, 1)
    res = probs.to(torch.float64)
    p_d = res.gather(1, idx).squeeze(1)
    if probs_draft is None:
        accept_p = p_d.clamp(0.0, 1.0)
        res = res.scatter(1, idx, 0.0)
    else:
        q = probs_draft.to(torch.float64)
        q_d = q.gather(1, idx).squeeze(1)
        accept_p = torch.where(q_d > 0.0, (p_d / q_d).clamp(0.0, 1.0), (p_d > 0.0).to(torch.float64))
        res = (res - q).clamp_(min=0.0)
    u = torch.rand(k, generator=generator, device=probs.device, dtype=torch.float64)
    # An empty residual is reachable only through rounding (p(d) just below 1, or p == q): d is
    # then the only outcome and is kept.
    keep = (u < accept_p) | ~(res.sum(dim=1) > 0.0)
    return keep, multinomial_one(res, generator).squeeze(1)


def _check_probs_vector(name: str, probs) -> None:
    if not isinstance(probs, torch.Tensor) or probs.dim() != 1 or probs.shape[0] == 0:
        raise ValueError(f"speculative_accept: {name} must be a non-empty 1-D tensor [V], got "
                         f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs)}")
    if not probs.dtype.is_floating_point:
        raise ValueError(f"speculative_accept: {name} must be a floating tensor, got {probs.dtype}")


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
    set (a bool mask on the device), the generator, stop tokens and ``min_tokens``. Kept off the
    model, so an interrupt leaves nothing behind. ``mtp_draft`` is how drafts are made (see
    ``speculative``)."""

    def __init__(self, params: SamplingParams, *, seed: int, stop_tokens, min_tokens: int, initial_tokens, device,
                 mtp_draft):
        self.params = params
        self.greedy = params.greedy
        self.generator = None if self.greedy else torch.Generator(device=device).manual_seed(int(seed))
        self.stops = {int(t) for t in stop_tokens}
        self.stop_ids = torch.tensor(sorted(self.stops), dtype=torch.int64, device=device)
        self.min_tokens = min_tokens
        self.generated: list[int] = []
        self.mtp_draft = mtp_draft
        self.device = device
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

    def masks(self, first_count: int) -> bool:
        """True when ``mask`` would change a row drawn at ``first_count`` generated tokens."""
        return first_count < self.min_tokens and self.stop_ids.numel() > 0

    def mask(self, logits: torch.Tensor, first_count: int) -> torch.Tensor:
        """Forbid stop tokens on rows whose position is before ``min_tokens``. logits ``[N,V]``."""
        n = logits.shape[0]
        blocked = max(0, min(n, self.min_tokens - first_count))
        if blocked and self.stop_ids.numel():
            logits = logits.clone()
            logits[:blocked, self.stop_ids] = float("-inf")
        return logits

    def draw_async(self, logits: torch.Tensor) -> torch.Tensor:
        """``draw`` without reading the token: int64 ``[1]`` on logits' device, no host sync (the
        same candidates and generator use as ``draw``). For a loop that launches the next step from
        this token before it reads it: ``note`` the token first, ``accept`` its value later."""
        if self.greedy:
            return logits[0].argmax().reshape(1)
        probs, ids = target_candidates(logits, self.seen_rows(None, 1, logits.shape[1]), self.params)
        return sample(probs, self.generator, candidates=ids)

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

    def draw(self, logits: torch.Tensor) -> int:
        """The next token from one row of logits ``[1,V]`` (float32) after the current history."""
        if self.greedy:
            return int(logits[0].argmax())
        # ComfyUI's own draw (same candidate list and order, same generator use): with MTP off the
        # same seed gives core's tokens.
        probs, ids = target_candidates(logits, self.seen_rows(None, 1, logits.shape[1]), self.params)
        return int(sample(probs, self.generator, candidates=ids)[0])
