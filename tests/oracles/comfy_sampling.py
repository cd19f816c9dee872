"""ComfyUI's ``BaseGenerate.sample_token`` restated as a distribution (float64, one row; test-only).
The token drawn from it for a seed and position is ``tests/oracles/keyed_draw.draw``'s."""

from __future__ import annotations

import torch


def comfy_distribution(logits: torch.Tensor, history, *, temperature: float, top_k: int, top_p: float,
                       min_p: float, repetition_penalty: float, presence_penalty: float) -> torch.Tensor:
    """Probabilities ``[V]`` (float64) of the token ComfyUI's sampler would draw from ``logits [V]``."""
    x = logits.to(torch.float64).clone().unsqueeze(0)
    floor = torch.finfo(x.dtype).min
    if len(history) and (repetition_penalty != 1.0 or presence_penalty != 0.0):
        ids = torch.tensor(sorted(set(int(t) for t in history)))
        sel = x[:, ids]
        if repetition_penalty != 1.0:
            sel = torch.where(sel < 0, sel * repetition_penalty, sel / repetition_penalty)
        sel = sel - presence_penalty
        x[:, ids] = sel
    if temperature != 1.0:
        x = x / temperature
    index = torch.arange(x.shape[-1]).unsqueeze(0)
    if top_k > 0:
        x, index = torch.topk(x, min(top_k, x.shape[-1]))
    if min_p > 0.0:
        p = torch.softmax(x, dim=-1)
        x = x.masked_fill(p < min_p * p.max(dim=-1, keepdim=True).values, floor)
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.cumsum(torch.softmax(sorted_x, dim=-1), dim=-1)
        drop = cum > top_p
        drop[..., 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), floor)
    probs = torch.softmax(x, dim=-1)
    out = torch.zeros(logits.shape[-1], dtype=torch.float64)
    out[index[0]] = probs[0]
    return out
