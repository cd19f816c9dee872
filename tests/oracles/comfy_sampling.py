"""ComfyUI's ``BaseGenerate.sample_token`` restated as a distribution (float64, one row; test-only)."""

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


def comfy_sample_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                       repetition_penalty: float, token_history, generator, do_sample: bool = True,
                       presence_penalty: float = 0.0) -> torch.Tensor:
    """ComfyUI 0.29's ``BaseGenerate.sample_token`` restated line for line (the draw, not the
    distribution): logits ``[1,V]`` (modified in place, as core does) -> token ``[1,1]``."""
    if not do_sample or temperature == 0.0:
        return torch.argmax(logits, dim=-1, keepdim=True)
    if len(token_history) > 0 and (repetition_penalty != 1.0 or (presence_penalty is not None and
                                                                   presence_penalty != 0.0)):
        token_ids = torch.tensor(list(set(token_history)), device=logits.device)
        token_logits = logits[:, token_ids]
        if repetition_penalty != 1.0:
            token_logits = torch.where(token_logits < 0, token_logits * repetition_penalty,
                                       token_logits / repetition_penalty)
        if presence_penalty is not None and presence_penalty != 0.0:
            token_logits = token_logits - presence_penalty
        logits[:, token_ids] = token_logits
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:
        top_k = min(top_k, logits.shape[-1])
        logits, top_indices = torch.topk(logits, top_k)
        if min_p > 0.0:
            probs_before_filter = torch.nn.functional.softmax(logits, dim=-1)
            top_probs, _ = probs_before_filter.max(dim=-1, keepdim=True)
            logits[probs_before_filter < min_p * top_probs] = torch.finfo(logits.dtype).min
        if top_p < 1.0:
            sorted_logits, sorted_indices = torch.sort(logits, descending=True)
            cumulative_probs = torch.cumsum(torch.nn.functional.softmax(sorted_logits, dim=-1), dim=-1)
            sorted_indices_to_remove = cumulative_probs > top_p
            sorted_indices_to_remove[..., 0] = False
            indices_to_remove = torch.zeros_like(logits, dtype=torch.bool)
            indices_to_remove.scatter_(1, sorted_indices, sorted_indices_to_remove)
            logits[indices_to_remove] = torch.finfo(logits.dtype).min
        probs = torch.nn.functional.softmax(logits, dim=-1)
        next_token = torch.multinomial(probs, num_samples=1, generator=generator)
        return top_indices.gather(1, next_token)
    if min_p > 0.0:
        probs_before_filter = torch.nn.functional.softmax(logits, dim=-1)
        top_probs, _ = probs_before_filter.max(dim=-1, keepdim=True)
        logits[probs_before_filter < min_p * top_probs] = torch.finfo(logits.dtype).min
    if top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        cumulative_probs = torch.cumsum(torch.nn.functional.softmax(sorted_logits, dim=-1), dim=-1)
        sorted_indices_to_remove = cumulative_probs > top_p
        sorted_indices_to_remove[..., 0] = False
        indices_to_remove = torch.zeros_like(logits, dtype=torch.bool)
        indices_to_remove.scatter_(1, sorted_indices, sorted_indices_to_remove)
        logits[indices_to_remove] = torch.finfo(logits.dtype).min
    probs = torch.nn.functional.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
