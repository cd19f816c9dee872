"""MTP speculative decoding: drafting with the MTP head and accepting drafts against the model.

Terms (as in vLLM's rejection sampler):

* **pending token**: the newest generated token. It is known but not yet fed through the model;
  every step starts by feeding it (alone without MTP, followed by the drafts with MTP).
* **catch-up rows**: the MTP head's input rows whose true hidden states arrived since the last
  step. Head row t pairs the model's final hidden state h_t with the embedding of token t+1, so
  the last catch-up row pairs the newest true hidden state with the pending token. The head runs
  over them first (that keeps its own K/V cache in step with the model's), and its last row
  drafts d1; d2..dk feed the head's own normed output back as the hidden state. After a verify
  the head runs over all of its k+1 rows before the host knows how many were kept (``catch_up``:
  the kept ones are the catch-up rows, the rest are not committed), so the GPU goes on from the
  verify to the head while the host reads the verify's outcome.
* **drafts** ``d1..dk``: proposed tokens. The model verifies ``[pending, d1..dk]`` in one causal
  forward of k + 1 rows.
* **accepted drafts**: the longest prefix of drafts equal to the model's own token at their rows:
  greedy, its argmax; sampled, its keyed draw (``Sampler.draw_rows``: the noise of the seed and
  the row's sequence position, the one MTP off uses there). Every kept token is therefore the
  token MTP off makes at that position, so the text is MTP off's at every depth (greedy and
  sampled), each token an exact draw from the target distribution; decided on the device, one
  read per verify step. A draft drawn from the head's distribution with the same keyed noise
  (``mtp_draft="sample"``) equals the target's draw whenever the race picks the same id in both.
* **correction token**: the model's token at the first rejected draft's row. **bonus token**: when
  all k drafts are accepted, the model's token at the verify's last row. Either way a step yields
  accepted + 1 tokens, and the last of them becomes the next pending token.
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

from ..kernels import MAX_DECODE_ROWS
from .distribution import target_argmax
from .readback import Readback
from .rope import RowPositions
from .sampling import Sampler, to_device

#: Catch-ups of more rows than this (a prompt) run as one forward; shorter ones in decode-row chunks.
CHUNKED_MAX = 512


def draft(binding, runner, sampler: Sampler, positions: RowPositions, catchup_hidden: torch.Tensor,
          catchup_emb: torch.Tensor, mtp_start: int, length: int, k: int, chunk: int = 1,
          vocab: int | None = None):
    """Run the MTP head over the catch-up rows (``catchup_hidden``, ``catchup_emb`` ``[1,R,H]``,
    starting at row ``mtp_start``) and draft k tokens after the pending token at row ``length``.

    More than ``MAX_DECODE_ROWS`` and at most ``CHUNKED_MAX`` catch-up rows (a plain segment's) run
    as decode-row forwards, each committed before the next (the same causal result): R - 1 rows in
    pieces of ``chunk`` rows (the verify's row count: kernels a generation already compiled, graphs
    it may already have) and single rows, then the last row with its logits. A prompt runs as one
    forward.

    Returns the k drafts as int64 ``[k]`` on the device (each draft is embedded for the next from
    there, so drafting never waits for the host): ``mtp_draft="argmax"``, the most likely token of
    the head's distribution; ``"sample"``, its keyed draw at the draft's position. The MTP cache
    ends at ``length`` rows. ``vocab``: the draft vocabulary (drafts rank
    ids below it; None: all, ``engine/draft_vocab.py``).
    """
    rows = catchup_hidden.shape[1]
    first = 0
    if MAX_DECODE_ROWS < rows <= CHUNKED_MAX:
        chunk = max(1, min(chunk, MAX_DECODE_ROWS))
        while first < rows - 1:
            n = chunk if rows - 1 - first >= chunk else 1
            runner.mtp_forward(catchup_hidden[:, first:first + n], catchup_emb[:, first:first + n],
                               positions.rows(mtp_start + first, n))
            runner.cache.mtp.commit()
            first += n
    out, logits = runner.mtp_logits(catchup_hidden[:, first:], catchup_emb[:, first:],
                                    positions.rows(mtp_start + first, rows - first), vocab=vocab)
    runner.cache.mtp.commit()
    return draft_from(binding, runner, sampler, positions, out[:, -1:], logits, length, k, vocab=vocab)


def catch_up(binding, runner, positions: RowPositions, hidden: torch.Tensor, verdict: Verdict, start: int,
             vocab: int | None = None):
    """The MTP head over every row of a verify step, launched before the host knows how many of
    them were kept: hidden ``[1,k+1,H]`` (the verify's true hidden states, rows from ``start``), each
    paired with the embedding of the step's new token at that row (``verdict.new_ids``). Rows after
    the accepted ones see only rows before them (causal), so the kept rows come out as a catch-up
    over just those would give them; the rest are dropped by the caller's ``commit(accepted + 1)``.
    Returns ``(row, logits)``: the head's output ``[1,1,H]`` and logits ``[1,1,V]`` of the last kept
    row (``verdict.accepted``, chosen on the device), for ``draft_from``, over the draft vocabulary
    ``vocab``. The k+1 rows stay staged in the MTP cache."""
    emb = binding.embed(verdict.new_ids.view(1, -1), runner.dtype, runner.device)
    return runner.mtp_logits(hidden, emb, positions.rows(start, hidden.shape[1]), row=verdict.accepted, vocab=vocab)


def draft_from(binding, runner, sampler: Sampler, positions: RowPositions, last: torch.Tensor,
               logits: torch.Tensor, length: int, k: int, vocab: int | None = None):
    """Draft k tokens after the pending token at row ``length`` from the head's output ``last``
    ``[1,1,H]`` and logits ``[1,1,V]`` of the newest catch-up row (already committed to the MTP
    cache). Returns the drafts as ``draft`` does; the MTP cache ends at ``length`` rows."""
    device, dtype = runner.device, runner.dtype
    mcache = runner.cache.mtp
    drafts: list[torch.Tensor] = []  # int64 [1] each, on the device
    for j in range(k):
        if j:
            emb = binding.embed(drafts[-1].view(1, 1), dtype, device)
            last, logits = runner.mtp_logits(last, emb, positions.rows(length - 1 + j, 1), vocab=vocab)
            mcache.commit()
        logits = sampler.mask(logits[0], len(sampler.generated) + j)
        if callable(sampler.mtp_draft):  # benchmark hook: the head ran, its draft is replaced
            drafts.append(to_device([int(sampler.mtp_draft(len(sampler.generated) + j))], device))
        elif sampler.greedy:
            drafts.append(logits[0].argmax().reshape(1))
        else:
            seen = sampler.seen_rows(torch.cat(drafts) if drafts else None, j + 1, logits.shape[1])[-1:]
            if sampler.mtp_draft == "sample":  # the noise the target draws this position with
                drafts.append(sampler.draw_rows(logits, seen, len(sampler.generated) + j))
            else:  # point mass on the target's most likely token: no top-k or softmax needed
                drafts.append(target_argmax(logits, seen, sampler.params))
    mcache.rollback(k - 1)
    return torch.cat(drafts)


class Verdict:
    """A verify step's outcome on the device, its read to the host under way (``judge``):
    ``new_ids`` int64 ``[k+1]``, the model's token at every verify row (the accepted drafts equal
    its first ones, then the correction or bonus token; rows after those unused), ``accepted``
    int64 ``[1]`` (drafts kept); ``ids`` ``[2k+1]``, what the host reads: ``new_ids``, then the drafts."""

    def __init__(self, k: int, ids: torch.Tensor, read: Readback, new_ids: torch.Tensor, accepted: torch.Tensor):
        self.k, self.ids, self.read = k, ids, read
        self.new_ids, self.accepted = new_ids, accepted


def judge(sampler: Sampler, logits: torch.Tensor, drafts: torch.Tensor,
          pinned: torch.Tensor | None = None) -> Verdict:
    """The verify logits ``[k+1,V]`` (row i: the position after ``len(sampler.generated) + i``
    tokens) against the drafts (int64 ``[k]`` on the device), decided on the device and sent to the
    host (into ``pinned``, at least 2k+1 entries, on CUDA: see ``Readback``) without waiting;
    ``settle`` reads it. The model's token at row i: greedy, the argmax; sampled, the keyed draw
    with the penalties' history of the drafts before row i (``Sampler.draw_rows``). A draft is
    kept while it equals the model's token at its row."""
    k = drafts.shape[0]
    if sampler.greedy:
        target = logits.argmax(dim=-1)
    else:
        target = sampler.draw_rows(logits, sampler.seen_rows(drafts, k + 1, logits.shape[1]), len(sampler.generated))
    ids = torch.cat([target, drafts])
    accepted = (target[:k] == drafts).to(torch.int64).cumprod(0).sum().view(1)
    return Verdict(k, ids, Readback(ids, pinned), target, accepted)


def settle(verdict: Verdict) -> tuple[list[int], int, torch.Tensor]:
    """Read ``judge``'s outcome (the step's one read): the accepted drafts, then the correction or
    bonus token; the number of drafts accepted; and the last new token as int64 ``[1]`` on the
    device."""
    k, read = verdict.k, verdict.read.values()
    target, proposed = read[:k + 1], read[k + 1:]
    accepted = 0
    while accepted < k and target[accepted] == proposed[accepted]:
        accepted += 1
    return target[:accepted + 1], accepted, verdict.ids[accepted:accepted + 1]


def accept(sampler: Sampler, logits: torch.Tensor, drafts: torch.Tensor) -> tuple[list[int], int, torch.Tensor]:
    """``settle(judge(...))``: new tokens from the verify logits ``[k+1,V]`` and the drafts (int64
    ``[k]`` on the device), the number of drafts accepted, and the last new token as int64 ``[1]``
    on the device; one read."""
    return settle(judge(sampler, logits, drafts))
