"""Drawing tokens: ComfyUI's draw from a distribution, and the exact speculative accept rule.

``sample`` draws one token per row the way ComfyUI's ``sample_token`` does (``torch.multinomial``
over its candidate list); ``multinomial_one`` is that draw without torch's host syncs.
``speculative_accept_rows`` is the exact accept / resample rule for a verify step's drafts, on the
device (``speculative_accept``: one draft; the greedy rule, an exact argmax comparison, is in
``speculative.accept``).

Contract: probabilities float ``[N,K]`` (``[V]`` for ``speculative_accept``), token ids int64;
every result stays on the probabilities' device, where the ``torch.Generator`` must live too
(None: torch's default generator). Only ``speculative_accept`` reads back to the host.
"""

from __future__ import annotations

import torch


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
