"""Drawing tokens with keyed noise: the exponential race over a row's candidates.

``keyed_draw`` picks, per row, ``argmax_i p_i / E(seed, position, id_i)`` with the keyed
``E ~ Exp(1)`` of ``keyed_noise``: an exact draw from the row's distribution ``p`` (the race
``torch.multinomial`` runs, up to the 2**-32 resolution of the uniform behind each ``E``). Two
distributions drawn at one position with one seed share their noise, so a draft drawn from the
MTP head's distribution equals the target's draw at that position whenever the race picks the same
id in both (the verify's accept rule: ``speculative.judge``).

Contract: probabilities float ``[N,K]`` (non-negative rows, each with a positive entry; any row
sum), token ids int64 ``[N,K]`` or None (the ids ``0..K-1``), row keys from ``keyed_noise`` (an int
for every row, or int64 ``[N,1]`` on the probabilities' device). Results are int64 ``[N]`` on that
device; nothing reads back to the host.
"""

from __future__ import annotations

import torch

from .keyed_noise import exponentials


def keyed_draw(probs: torch.Tensor, ids: torch.Tensor | None, keys: int | torch.Tensor) -> torch.Tensor:
    """One token per row: ``ids[i, argmax_j probs[i, j] / E(key_i, ids[i, j])]`` -> int64 ``[N]``.

    probs ``[N,K]`` (e.g. ``distribution.target_candidates``: ComfyUI's top-k list, or the whole
    vocabulary), ids int64 ``[N,K]`` (None: column j is token j). Ties (probability 0 everywhere but
    in one id, never two equal quotients in practice) go to the first column. Bad shapes raise
    ValueError."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.shape[1] == 0:
        raise ValueError(f"keyed_draw: probs must be a 2-D tensor [N, K] with K > 0, got "
                         f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs)}")
    if ids is None:
        ids = torch.arange(probs.shape[1], device=probs.device).expand(probs.shape[0], -1)
    if tuple(ids.shape) != tuple(probs.shape) or ids.dtype != torch.int64:
        raise ValueError(f"keyed_draw: ids must be int64 {tuple(probs.shape)} like probs, got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    picked = torch.argmax(torch.div(probs, exponentials(ids, keys)), dim=-1, keepdim=True)
    return ids.gather(1, picked).squeeze(1)
