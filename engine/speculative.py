"""MTP speculative decoding: drafting with the MTP head and accepting drafts against the model.

Terms (as in vLLM's rejection sampler):

* **pending token**: the newest generated token. It is known but not yet fed through the model;
  every step starts by feeding it (alone without MTP, followed by the drafts with MTP).
* **catch-up rows**: the MTP head's input rows whose true hidden states arrived since the last
  step. Head row t pairs the model's final hidden state h_t with the embedding of token t+1, so
  the last catch-up row pairs the newest true hidden state with the pending token. The head runs
  over them first (that keeps its own K/V cache in step with the model's), and its last row
  drafts d1; d2..dk feed the head's own normed output back as the hidden state.
* **drafts** ``d1..dk``: proposed tokens. The model verifies ``[pending, d1..dk]`` in one causal
  forward of k + 1 rows.
* **accepted drafts**: the longest prefix that survives acceptance; greedy compares with the
  model's argmax (so greedy MTP equals plain greedy token for token), sampled uses
  ``sampling.speculative_accept_rows`` (accept with min(1, p/q), else resample from the residual;
  every draft's decision drawn on the device, one read per verify step).
* **correction token**: the token drawn in place of the first rejected draft (from the residual
  distribution; greedy: the model's argmax there). **bonus token**: when all k drafts are
  accepted, the token drawn from the verify's last row. Either way a step yields accepted + 1
  tokens, and the last of them becomes the next pending token.
* **staged / committed rows**: the verify stages k + 1 rows in every layer; the caller commits
  1 + accepted of them (``ModelCache.commit``). The MTP cache keeps only rows computed from true
  hidden states: rows of drafts at depth >= 2 are rolled back after drafting and recomputed from
  the verified hidden states at the next step.

Conventions (vLLM's ``qwen3_5_mtp.py``, SGLang): the head concatenates ``[embedding, hidden]``
before ``fc`` at position t, h_t taken after the model's final norm; after the head's own norm
the shared ``lm_head`` gives logits for token t+2. ComfyUI's experimental MTP branch feeds the
pre-norm hidden state instead: ``binding.mtp_hidden = "prenorm"`` selects that.
"""

from __future__ import annotations

import torch

from .rope import RowPositions
from .sampling import Sampler, sample, speculative_accept_rows, target_probs, to_device


def draft(binding, runner, sampler: Sampler, positions: RowPositions, catchup_hidden: torch.Tensor,
          catchup_emb: torch.Tensor, mtp_start: int, length: int, k: int):
    """Run the MTP head over the catch-up rows (``catchup_hidden``, ``catchup_emb`` ``[1,R,H]``,
    starting at row ``mtp_start``) and draft k tokens after the pending token at row ``length``.

    Returns ``(drafts, qs)``: the k token ids as int64 ``[k]`` on the device (each draft is embedded
    for the next from there, so drafting never waits for the host) and, for each, the draft
    distribution ``[V]`` when drafts are sampled (``mtp_draft="sample"``), else None (point-mass
    drafts). The MTP cache ends at ``length`` rows.
    """
    device, dtype = runner.device, runner.dtype
    mcache = runner.cache.mtp
    rows = catchup_hidden.shape[1]
    out, logits = runner.mtp_logits(catchup_hidden, catchup_emb, positions.rows(mtp_start, rows))
    mcache.commit()
    last = out[:, -1:]
    drafts: list[torch.Tensor] = []  # int64 [1] each, on the device
    qs: list[torch.Tensor | None] = []
    for j in range(k):
        if j:
            emb = binding.embed(drafts[-1].view(1, 1), dtype, device)
            last, logits = runner.mtp_logits(last, emb, positions.rows(length - 1 + j, 1))
            mcache.commit()
        logits = sampler.mask(logits[0], len(sampler.generated) + j)
        qs.append(None)
        if callable(sampler.mtp_draft):  # benchmark hook: the head ran, its draft is replaced
            drafts.append(to_device([int(sampler.mtp_draft(len(sampler.generated) + j))], device))
        elif sampler.greedy:
            drafts.append(logits[0].argmax().reshape(1))
        else:
            q = target_probs(logits, sampler.seen_rows(torch.cat(drafts) if drafts else None, j + 1,
                                                       logits.shape[1])[-1:], sampler.params)
            if sampler.mtp_draft == "sample":
                drafts.append(sample(q, sampler.generator, top_k=sampler.params.top_k))
                qs[-1] = q[0]
            else:
                drafts.append(q[0].argmax().reshape(1))
    mcache.rollback(k - 1)
    return torch.cat(drafts), qs


def accept(sampler: Sampler, logits: torch.Tensor, drafts: torch.Tensor,
           qs) -> tuple[list[int], int, torch.Tensor]:
    """New tokens from the verify logits ``[k+1,V]`` and the drafts (int64 ``[k]`` on the device):
    the accepted drafts, then the correction or bonus token; the number of drafts accepted; and
    the last new token as int64 ``[1]`` on the device. Sampled: every draft's accept decision,
    replacement and the bonus token are drawn on the device and read back once."""
    k = drafts.shape[0]
    if sampler.greedy:
        both_ids = torch.cat([logits.argmax(dim=-1), drafts])
        both = both_ids.tolist()  # one read for the two
        target, proposed = both[:k + 1], both[k + 1:]
        accepted = 0
        while accepted < k and target[accepted] == proposed[accepted]:
            accepted += 1
        return proposed[:accepted] + [target[accepted]], accepted, both_ids[accepted:accepted + 1]
    probs = target_probs(logits, sampler.seen_rows(drafts, k + 1, logits.shape[1]), sampler.params)
    keep, replacement = speculative_accept_rows(probs[:k], drafts, sampler.generator,
                                                None if qs[0] is None else torch.stack(qs))
    bonus = sample(probs[k:k + 1], sampler.generator, top_k=sampler.params.top_k)
    ids = torch.cat([drafts, keep.to(torch.int64), replacement, bonus])
    read = ids.tolist()  # the step's one read
    proposed, kept = read[:k], read[k:2 * k]
    accepted = next((i for i in range(k) if not kept[i]), k)
    last = 2 * k + accepted if accepted < k else 3 * k  # the replacement or the bonus
    return proposed[:accepted] + [read[last]], accepted, ids[last:last + 1]
