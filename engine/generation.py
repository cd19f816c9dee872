"""``generate``: Qwen3.5 decoding with ComfyUI's sampling semantics and exact MTP speculation.

``generate`` checks the request once (``request.GenerationRequest``), builds the runner stack
(``stack.build_runner``) and runs the loop below. Without MTP every step feeds the pending token
and samples the next one, launched one step ahead of the host (``_decode_ahead``). With MTP
(depth k) a step drafts k tokens with the MTP head over the catch-up rows
(``speculative.draft``), verifies ``[pending, d1..dk]`` in one causal forward of
k + 1 rows, accepts a prefix of the drafts plus a correction or bonus token
(``speculative.accept``), and commits 1 + accepted rows in every layer. The terms are defined in
``engine/speculative.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .binding import Qwen35Binding, bind
from .readback import Readback
from .request import GenerationRequest
from .rope import RowPositions
from .sampling import Sampler, to_device, token_ids
from .speculative import catch_up, draft, draft_from, judge, settle
from .stack import attention_backend, build_runner


@dataclass
class GenerationStats:
    """Counters of one generation.

    ``tokens``: generated tokens; ``steps``: model forwards after the prefill; ``drafted`` /
    ``accepted``: MTP drafts proposed / kept (``acceptance_rate`` = accepted / drafted, 0 without
    drafts); ``prefill_s``: prompt forward up to the first token; ``decode_s``: the rest;
    ``tok_per_s``: tokens after the first per decode second; ``mtp_depth``: 0 when MTP is off;
    ``attention_backend``: the decode-attention backend used.
    """

    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tok_per_s: float = 0.0
    mtp_depth: int = 0
    attention_backend: str = ""


@dataclass
class GenerationResult:
    """Generated token ids (stop token included when one ended the answer), stats, and why it
    stopped: "stop_token" or "max_length"."""

    tokens: list[int]
    stats: GenerationStats
    stop_reason: str


def generate(module_or_binding, embeds: torch.Tensor, *, do_sample: bool = True, max_length: int = 256,
             temperature: float = 1.0, top_k: int = 50, top_p: float = 0.9, min_p: float = 0.0,
             repetition_penalty: float = 1.0, seed: int = 42, stop_tokens: Sequence[int] | None = None,
             min_tokens: int = 0, presence_penalty: float = 0.0, initial_tokens: Sequence[int] = (),
             mtp="auto", position_ids: torch.Tensor | None = None, attention: str = "auto",
             execution_dtype: torch.dtype | None = None,
             callback: Callable[[list[int], list[int], GenerationStats], None] | None = None,
             mtp_draft: str | Callable[[int], int] = "argmax", cache_fill: float | None = None,
             cuda_graphs: bool | str = "auto", fused: bool | str = "auto",
             weight_cast: Callable | None = None, weights=None) -> GenerationResult:
    """Generate up to ``max_length`` tokens after a prompt given as embeddings.

    embeds ``[T,H]`` or ``[1,T,H]`` float (batch 1), on the device to run on. ``position_ids``:
    None (positions 0..T-1) or ComfyUI's MRoPE ids ``[3,T]`` / ``[3,1,T]`` for image prompts (decode
    continues at max + 1). Sampling arguments follow ComfyUI's ``BaseGenerate.generate``;
    ``initial_tokens`` only feed the penalties; ``min_tokens`` forbids stop tokens before that many
    tokens. ``mtp``: "off", "auto" (depth 3 with an MTP head, else off) or a depth 1..5.
    ``mtp_draft``: "argmax" (point-mass drafts, default) or "sample" (drafts drawn from the head's
    filtered distribution; acceptance min(1, p/q)); benchmarks may pass ``fn(position) -> token``,
    whose token replaces each draft after the head ran (forced acceptance when it knows the answer).
    ``attention``: a ``kernels.decode_attention`` backend. ``cuda_graphs``: "auto" (replay CUDA
    graphs for decode, draft and verify steps when the device, backend and weight placement allow;
    otherwise eager, with the reason logged once), True (require them) or False.
    ``fused``: "auto" (decode, draft and verify rows run through the fused Triton kernels on CUDA
    when the model's modules allow; otherwise the torch path, with the reason logged once), True
    (require them; on the CPU only under ``TRITON_INTERPRET=1``, for tests) or False.
    ``callback(all_tokens, new_tokens, stats)`` runs after every accepted step; if it
    raises, generation stops and the exception propagates (the model is untouched and reusable).
    ``cache_fill`` pre-fills every K/V slot (tests: NaN shows unfilled slots are never read).
    ``weight_cast``: the application layer's hook for module weights it casts per call (see
    ``bind``); ComfyUI's layer passes it. ``weights``: how decode kernels read module weights in place
    (see ``bind``; default: the engine's own modules); ComfyUI's layer passes its resolver.
    Returns ``GenerationResult(tokens, stats, stop_reason)``.
    """
    binding = bind(module_or_binding, weight_cast=weight_cast, weights=weights)
    req = GenerationRequest.check(
        binding, embeds, do_sample=do_sample, max_length=max_length, temperature=temperature, top_k=top_k,
        top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, stop_tokens=stop_tokens,
        min_tokens=min_tokens, presence_penalty=presence_penalty, initial_tokens=initial_tokens, mtp=mtp,
        position_ids=position_ids, attention=attention, execution_dtype=execution_dtype, mtp_draft=mtp_draft,
        cache_fill=cache_fill, cuda_graphs=cuda_graphs, fused=fused)
    backend = attention_backend(req.attention, binding.config, req.dtype, req.device)
    runner = build_runner(binding, capacity=req.capacity, dtype=req.dtype, device=req.device,
                          attention=req.attention, mtp=req.mtp_depth > 0, fused=req.fused,
                          cuda_graphs=req.cuda_graphs, cache_fill=req.cache_fill, verify_rows=req.mtp_depth + 1)
    sampler = Sampler(req.sampling, seed=req.seed, stop_tokens=req.stop_tokens, min_tokens=req.min_tokens,
                      initial_tokens=req.initial_tokens, device=req.device, mtp_draft=req.mtp_draft)
    stats = GenerationStats(mtp_depth=req.mtp_depth, attention_backend=backend)
    with torch.no_grad(), binding.holding_output_weight():
        return _run(binding, runner, sampler, stats, req, callback)


def _run(binding: Qwen35Binding, runner, sampler: Sampler, stats: GenerationStats, req: GenerationRequest,
         callback) -> GenerationResult:
    """The decode loop: prefill, then one step per pending token until a stop token or max_length."""
    device, dtype = runner.device, runner.dtype
    cache = runner.cache
    embeds, max_length, depth = req.embeds, req.max_length, req.mtp_depth
    positions = RowPositions(req.positions)
    t0 = time.perf_counter()
    prompt_len = req.prompt_len
    hidden, pre = runner.forward(embeds, positions.rows(0, prompt_len), keep_rows=False)
    cache.commit()
    logits = sampler.mask(binding.logits(hidden[:, -1:])[0], 0)
    token = sampler.draw(logits)
    sampler.accept([token])
    stats.prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()

    def report(new: list[int]) -> None:
        stats.tokens = len(sampler.generated)
        stats.decode_s = time.perf_counter() - t1
        stats.tok_per_s = (stats.tokens - 1) / stats.decode_s if stats.decode_s > 0 else 0.0
        stats.acceptance_rate = stats.accepted / stats.drafted if stats.drafted else 0.0
        if callback is not None:
            callback(list(sampler.generated), list(new), stats)

    report([token])
    if token in sampler.stops:
        return GenerationResult(list(sampler.generated), stats, "stop_token")

    use_prenorm = binding.mtp_hidden == "prenorm"
    # MTP catch-up rows: true hidden states and the embedding of the token that follows each.
    if depth:
        catchup_hidden = pre if use_prenorm else hidden
        catchup_emb = torch.cat([embeds[:, 1:], binding.embed(token_ids([token], device), dtype, device)], dim=1)
        mtp_start = 0

    if not depth:
        stop = _decode_ahead(binding, runner, sampler, positions, max_length, stats, report)
        return GenerationResult(list(sampler.generated), stats, stop)
    # The next step's MTP catch-up is launched right behind the verify, before the host reads what
    # the verify kept (``catch_up``), and its drafts before the host's bookkeeping for the step that
    # just ended (the main cache's commit, the callback): the GPU never waits for the host between
    # steps. ``pending_id``: the pending token on the device when known there.
    pinned = torch.empty(3 * depth + 2, dtype=torch.int64, pin_memory=True) \
        if torch.device(device).type == "cuda" else None
    drafted, pending_id = None, None
    while len(sampler.generated) < max_length:
        length = cache.length
        pending = sampler.generated[-1]
        if pending_id is None:
            pending_id = to_device([pending], device)
        k = min(depth, max_length - len(sampler.generated) - 1)
        ahead = None
        if k == 0:
            rows = binding.embed(pending_id.view(1, 1), dtype, device)
            hidden, _, logits = runner.forward_logits(rows, positions.rows(length, 1))
            cache.commit()
            stats.steps += 1
            logits = sampler.mask(logits[0], len(sampler.generated))
            new, pending_id = [sampler.draw(logits)], None
        else:
            if drafted is None:
                drafted = draft(binding, runner, sampler, positions, catchup_hidden, catchup_emb, mtp_start, length, k)
            (drafts, qs), drafted = drafted, None
            stats.drafted += k
            rows = binding.embed(torch.cat([pending_id, drafts]).view(1, -1), dtype, device)
            hidden, pre, logits = runner.forward_logits(rows, positions.rows(length, k + 1))
            stats.steps += 1
            logits = sampler.mask(logits[0], len(sampler.generated))
            verdict = judge(sampler, logits, drafts, qs, pinned)
            if min(depth, max_length - len(sampler.generated) - 2) > 0:  # the next step can draft
                ahead = catch_up(binding, runner, positions, pre if use_prenorm else hidden, verdict, length)
            new, accepted, pending_id = settle(verdict)
            stats.accepted += accepted
        stop_at = next((i for i, t in enumerate(new) if t in sampler.stops), None)
        if stop_at is not None:
            new = new[:stop_at + 1]
        sampler.accept(new)
        if ahead is not None:
            cache.mtp.commit(1 + accepted)  # the catch-up rows the verify kept
            k_next = min(depth, max_length - len(sampler.generated) - 1)
            if stop_at is None and k_next > 0:
                drafted = draft_from(binding, runner, sampler, positions, *ahead, length + 1 + accepted, k_next)
        if k:
            cache.commit(1 + accepted)
        report(new)
        if stop_at is not None:
            return GenerationResult(list(sampler.generated), stats, "stop_token")
    return GenerationResult(list(sampler.generated), stats, "max_length")


def _decode_ahead(binding: Qwen35Binding, runner, sampler: Sampler, positions: RowPositions, max_length: int,
                  stats: GenerationStats, report) -> str:
    """The MTP-off loop, one step ahead of the host: each step embeds the previous step's token on
    the device and is launched before the host reads that token, so what the host does per token
    (the read, the stop test, the callback, the next launch) overlaps the next step on the GPU. The
    tokens, the generator's use and the callbacks are those of a step-by-step loop; a stop token
    leaves one launched step unused. Returns the stop reason."""
    cache, device, dtype = runner.cache, runner.device, runner.dtype
    pinned = [torch.empty(1, dtype=torch.int64, pin_memory=True) for _ in range(2)] \
        if torch.device(device).type == "cuda" else [None, None]
    pending = token_ids(sampler.generated[-1:], device)  # [1, 1]
    launched, inflight = len(sampler.generated), None
    while True:
        step = None
        if launched < max_length:
            pos = positions.rows(cache.length, 1)
            if sampler.greedy and not sampler.masks(launched):  # the argmax in the step itself
                token = runner.forward_token(pending, pos)
                cache.commit()
            else:
                _, _, logits = runner.forward_logits(binding.embed(pending, dtype, device), pos)
                cache.commit()
                token = sampler.draw_async(sampler.mask(logits[0], launched))
            sampler.note(token)
            step = Readback(token, pinned[launched % 2])
            pending = token.view(1, 1)
            launched += 1
        if inflight is not None:
            t = inflight.value()
            stats.steps += 1
            sampler.accept([t], noted=True)
            report([t])
            if t in sampler.stops:
                return "stop_token"
        if step is None:
            return "max_length"
        inflight = step
