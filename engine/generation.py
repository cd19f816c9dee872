"""``generate``: Qwen3.5 decoding with ComfyUI's sampling distribution and exact MTP speculation.

``generate`` checks the request once (``request.GenerationRequest``), builds the runner stack
(``stack.build_runner``) and runs the loop below. Without MTP every step feeds the pending token
and samples the next one, launched one step ahead of the host (``_decode_ahead``). With MTP
(depth k, fixed or chosen per cycle by ``mtp_auto``) a step drafts k tokens with the MTP head
over the catch-up rows (``speculative.draft``), verifies ``[pending, d1..dk]`` in one causal forward of
k + 1 rows, accepts a prefix of the drafts plus a correction or bonus token
(``speculative.accept``), and commits 1 + accepted rows in every layer. The terms are defined in
``engine/speculative.py``. A sampled token is drawn with noise keyed by the seed and its position
in the sequence (``engine/keyed_noise.py``), and MTP keeps only tokens equal to the model's own
draw at their positions, so the text is a function of the prompt, the settings and the seed: the
same at every ``mtp`` setting, ``"auto"`` included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from . import held
from .binding import Qwen35Binding, bind
from .cycle_costs import cycle_costs
from .draft_vocab import DraftVocab
from .mtp_auto import DepthController, FixedDepth
from .readback import Readback
from .request import GenerationRequest
from .rope import RowPositions
from .sampling import Sampler, to_device, token_ids
from .speculative import catch_up, draft, draft_from, judge, settle
from .stack import attention_backend, build_runner
from .thinking import ThinkingBudget


@dataclass
class GenerationStats:
    """Counters of one generation.

    ``tokens``: generated tokens; ``steps``: model forwards after the prefill; ``drafted`` /
    ``accepted``: MTP drafts proposed / kept (``acceptance_rate`` = accepted / drafted, 0 without
    drafts); ``prefill_s``: prompt forward up to the first token; ``decode_s``: the rest;
    ``tok_per_s``: tokens after the first per decode second; ``mtp_depth``: 0 when MTP is off,
    else the fixed depth or (``mtp_auto``) the deepest ``mtp="auto"`` could choose;
    ``mtp_depths``: {depth: cycles run at it} (0: tokens of plain steps between cycles);
    ``mtp_acceptance``: per draft position, the share of drafts kept where the ones before were
    (None where never reached); ``mtp_off``: why ``mtp="auto"`` ran plain steps, or None;
    ``mtp_trace``: ``mtp="auto"``'s ``DepthController.trace()`` (wall time per depth, switches), or None;
    ``draft_vocab``: which ids the drafts ranked (``DraftVocab.describe``), None for all of them;
    ``attention_backend``: the decode-attention backend used; ``decode_path``: the runner's
    (``stack.build_runner``: Triton kernels or module calls, CUDA graphs or not, and why);
    ``thinking_tokens``: with a thinking budget, the tokens before the thinking block's end (None
    without one); ``thinking_cut``: True where the budget closed the block.
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
    mtp_auto: bool = False
    mtp_depths: dict = field(default_factory=dict)
    mtp_acceptance: list = field(default_factory=list)
    mtp_off: str | None = None
    mtp_trace: dict | None = None
    draft_vocab: str | None = None
    attention_backend: str = ""
    decode_path: str = ""
    thinking_tokens: int | None = None
    thinking_cut: bool = False


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
             weight_cast: Callable | None = None, weights=None, draft_vocab: str = "auto",
             thinking_budget: ThinkingBudget | None = None) -> GenerationResult:
    """Generate up to ``max_length`` tokens after a prompt given as embeddings.

    embeds ``[T,H]`` or ``[1,T,H]`` float (batch 1), on the device to run on. ``position_ids``:
    None (positions 0..T-1) or ComfyUI's MRoPE ids ``[3,T]`` / ``[3,1,T]`` for image prompts (decode
    continues at max + 1). Sampling arguments follow ComfyUI's ``BaseGenerate.generate``;
    ``initial_tokens`` only feed the penalties; ``min_tokens`` forbids stop tokens before that many
    tokens. ``seed`` (0 .. 2**64 - 1): sampled tokens are exact draws from ComfyUI's distribution
    with noise keyed by the seed and the token's position, so the same prompt, settings and seed
    give the same tokens at every ``mtp`` setting (on any device where the logits round the same);
    not the random stream of core's ``TextGenerate``, so not core's tokens. ``mtp``: "off", a depth
    1..5, or "auto": with an MTP head, the depth (0..5) chosen before every cycle from the acceptance
    so far and the measured cost of each depth (``mtp_auto``); without one, off.
    ``mtp_draft``: "argmax" (the most likely token of the head's distribution, default) or "sample"
    (the head's filtered distribution drawn with the target's keyed noise at the draft's position);
    either way a draft is kept when it equals the model's token there. Benchmarks may pass
    ``fn(position) -> token``, whose token replaces each draft after the head ran (forced acceptance
    when it knows the answer).
    ``draft_vocab``: which ids drafts rank, "auto" (the released tokenizer's first 151,643 while the
    text stays in them), "subset" (those throughout) or "full" (``engine/draft_vocab.py``).
    ``attention``: a ``kernels.decode_attention`` backend. ``cuda_graphs``: "auto" (replay CUDA
    graphs for decode, draft and verify steps when the device, backend and weight placement allow;
    otherwise eager, with the reason logged once), True (require them) or False.
    ``fused``: "auto" (decode, draft and verify rows run through the fused Triton kernels on CUDA
    when the model's modules allow; otherwise the torch path, with the reason logged once), True
    (require them; on the CPU only under ``TRITON_INTERPRET=1``, for tests) or False.
    ``callback(all_tokens, new_tokens, stats)`` runs after every accepted step; if it
    raises, generation stops and the exception propagates (the model is untouched and reusable).
    ``thinking_budget``: None, or ``ThinkingBudget(tokens, close, end)`` (``engine/thinking.py``): the prompt
    opened a thinking block; when the first ``tokens`` tokens do not end it (``end``), the next ones are
    ``close`` and the answer follows; the stats count the thinking tokens and say whether it was cut.
    ``cache_fill`` pre-fills every K/V slot (tests: NaN shows unfilled slots are never read).
    Without it the runner stack (cache, fused plan, CUDA graphs) is kept on the model for its next
    generation, which reuses it while the weights and settings stay (``engine/held.py``).
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
        cache_fill=cache_fill, cuda_graphs=cuda_graphs, fused=fused, draft_vocab=draft_vocab,
        thinking_budget=thinking_budget)
    backend = attention_backend(req.attention, binding.config, req.dtype, req.device)
    keep = req.cache_fill is None
    runner = build_runner(binding, capacity=held.rounded_capacity(req.capacity) if keep else req.capacity,
                          dtype=req.dtype, device=req.device, attention=req.attention, mtp=req.mtp_depth > 0,
                          fused=req.fused, cuda_graphs=req.cuda_graphs, cache_fill=req.cache_fill,
                          verify_rows=req.mtp_depth + 1, keep=keep)
    binding = runner.binding  # a kept stack's binding: the same modules
    sampler = Sampler(req.sampling, seed=req.seed, first_position=req.prompt_len, stop_tokens=req.stop_tokens,
                      min_tokens=req.min_tokens, initial_tokens=req.initial_tokens, device=req.device,
                      mtp_draft=req.mtp_draft, thinking=req.thinking)
    stats = GenerationStats(mtp_depth=req.mtp_depth, attention_backend=backend,
                            decode_path=getattr(runner, "decode_path", ""))
    with torch.no_grad(), binding.holding_output_weight():
        try:
            result = _run(binding, runner, sampler, stats, req, callback)
        finally:
            if req.thinking.tokens:
                stats.thinking_tokens = sampler.thinking.thinking_tokens(sampler.generated)
                stats.thinking_cut = sampler.thinking.cut
        if keep:
            nbytes = runner.stack_bytes
            held.rest(runner, held.allocated(req.device) - runner.stack_base if nbytes is None else nbytes)
    return result


def _run(binding: Qwen35Binding, runner, sampler: Sampler, stats: GenerationStats, req: GenerationRequest,
         callback) -> GenerationResult:
    """Prefill, then the MTP-off loop (``_decode_ahead``) or the MTP loop (``_speculate``) until a
    stop token or max_length."""
    device, dtype = runner.device, runner.dtype
    positions = RowPositions(req.positions)
    t0 = time.perf_counter()
    hidden, pre = runner.forward(req.embeds, positions.rows(0, req.prompt_len), keep_rows=False)
    runner.cache.commit()
    logits = sampler.mask(binding.logits(hidden[:, -1:])[0], 0)
    token = sampler.draw(logits, 0)
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
    if not req.mtp_depth:
        stop = "max_length"
        while len(sampler.generated) < req.max_length and stop != "stop_token":  # paused at a thinking budget
            stop, _ = _decode_ahead(binding, runner, sampler, positions, sampler.limit(req.max_length), stats, report)
        return GenerationResult(list(sampler.generated), stats, stop)
    if req.mtp_auto:
        key = (id(binding.transformer), id(binding.mtp), str(dtype), str(device), sampler.greedy,
               type(runner).__name__, stats.attention_backend)
        costs = cycle_costs(key, req.mtp_depth)
        control = DepthController(req.mtp_depth, costs, ready=_ready(runner))
    else:
        control = FixedDepth(req.mtp_depth)
    # MTP catch-up rows: true hidden states and the embedding of the token that follows each.
    first = pre if binding.mtp_hidden == "prenorm" else hidden
    catch = [(first, torch.cat([req.embeds[:, 1:], binding.embed(token_ids([token], device), dtype, device)], dim=1))]
    vocab = DraftVocab(req.draft_vocab, binding.draft_vocab)
    vocab.see(list(sampler.generated))
    try:
        stop = _speculate(binding, runner, sampler, positions, req, stats, report, control, catch, vocab)
    finally:
        stats.draft_vocab = vocab.describe()
        if req.mtp_auto:
            costs.last_tokens = control.tokens
        summary = control.summary()
        stats.mtp_auto = req.mtp_auto
        stats.mtp_depths, stats.mtp_acceptance, stats.mtp_off = summary["depths"], summary["acceptance"], summary["off"]
        stats.mtp_trace = summary["trace"]
    return GenerationResult(list(sampler.generated), stats, stop)


def _ready(runner) -> set[int]:
    """The MTP depths whose graphs a kept stack already has (``GraphRunner.ready_depths``)."""
    return runner.ready_depths() if hasattr(runner, "ready_depths") else set()


def _speculate(binding: Qwen35Binding, runner, sampler: Sampler, positions: RowPositions, req: GenerationRequest,
               stats: GenerationStats, report, control, catch: list, vocab: DraftVocab) -> str:
    """The MTP loop: before each cycle ``control`` names its depth k (``mtp_auto.FixedDepth`` or
    ``DepthController``); k > 0 drafts k tokens and verifies them, 0 runs a plain segment
    (``_decode_ahead`` keeping its hidden states, which join ``catch``, the MTP head's pending
    catch-up rows ``[(hidden [1,R,H], next-token embeddings [1,R,H]), ...]``). Returns the stop
    reason.

    The next cycle's MTP catch-up is launched right behind the verify, before the host reads what
    the verify kept (``catch_up``), and its drafts before the host's bookkeeping for the cycle that
    just ended (the main cache's commit, the callback): the GPU never waits for the host between
    cycles. ``pending_id``: the pending token on the device when known there. Cycle wall times go
    to ``control``, except a cycle that captured graphs (the first at its depth: passed as
    ``first_seconds``) or caught up after a plain segment. After a plain segment the head catches
    up and makes ``control.shadow_depth()`` drafts without a verify; the next segment's first
    tokens score them (``control.shadow``). Drafts rank the ids ``vocab.rows`` says, which
    ``vocab.see`` updates from the tokens made."""
    device, dtype, cache = runner.device, runner.dtype, runner.cache
    max_length, use_prenorm = req.max_length, binding.mtp_hidden == "prenorm"
    pinned = torch.empty(2 * req.mtp_depth + 1, dtype=torch.int64, pin_memory=True) \
        if torch.device(device).type == "cuda" else None
    drafted, pending_id, mtp_start, shadow = None, None, 0, None
    ran: set[int] = _ready(runner)  # depths whose graphs exist: their first cycle captures nothing
    clock = time.perf_counter()
    while len(sampler.generated) < max_length:
        length = cache.length
        limit = sampler.limit(max_length)  # max_length, or a thinking budget's pause
        room = limit - len(sampler.generated) - 1
        control.room = room
        k = drafted.shape[0] if drafted is not None else min(control.choose(), room)
        if k == 0:
            count = min(control.segment_length(), room + 1) if room else 1
            keep = torch.empty(1, count, binding.config.hidden_size, dtype=dtype, device=device)
            before, per_token, began = len(sampler.generated), None, time.perf_counter()
            try:
                stop, per_token = _decode_ahead(binding, runner, sampler, positions, before + count, stats, report,
                                                keep=(keep, use_prenorm))
            finally:  # counted in the stats also when a callback stops the generation mid-segment
                new = sampler.generated[before:]
                if room:  # a segment the controller asked for (not the last token's single step)
                    control.plain(len(new), per_token, time.perf_counter() - began)
            if shadow is not None and len(new) >= len(shadow):
                control.shadow(len(shadow), next((i for i, t in enumerate(shadow) if t != new[i]), len(shadow)))
            shadow = None
            vocab.see(new)
            if stop == "stop_token" or len(sampler.generated) >= max_length:
                return stop
            if not catch:
                mtp_start = length
            catch.append((keep, binding.embed(token_ids(new, device), dtype, device)))
            depth = min(control.shadow_depth(), limit - len(sampler.generated) - 1)
            if depth > 0:  # the head catches up and drafts; the next segment's tokens score the drafts
                probe = time.perf_counter()
                hid, emb = (torch.cat(parts, dim=1) for parts in zip(*catch))
                drafts = draft(binding, runner, sampler, positions, hid, emb, mtp_start, cache.length, depth,
                               chunk=req.mtp_depth + 1, vocab=vocab.rows)
                catch, shadow = [], drafts.tolist()
                control.probed(time.perf_counter() - probe)
            pending_id, clock = None, time.perf_counter()
            continue
        first = k not in ran
        timed = not first
        ran.add(k)
        if pending_id is None:
            pending_id = to_device([sampler.generated[-1]], device)
        if drafted is None:
            hid, emb = (torch.cat(parts, dim=1) for parts in zip(*catch))
            drafted = draft(binding, runner, sampler, positions, hid, emb, mtp_start, length, k,
                            chunk=req.mtp_depth + 1, vocab=vocab.rows)
            catch, timed = [], False
        drafts, drafted = drafted, None
        stats.drafted += k
        rows = binding.embed(torch.cat([pending_id, drafts]).view(1, -1), dtype, device)
        hidden, pre, logits = runner.forward_logits(rows, positions.rows(length, k + 1))
        stats.steps += 1
        logits = sampler.mask(logits[0], len(sampler.generated))
        verdict = judge(sampler, logits, drafts, pinned)
        ahead = None
        if max_length - len(sampler.generated) > 2:  # a later cycle can draft: keep the MTP head in step
            ahead = catch_up(binding, runner, positions, pre if use_prenorm else hidden, verdict, length,
                             vocab=vocab.rows)
        new, accepted, pending_id = settle(verdict)
        stats.accepted += accepted
        now = time.perf_counter()
        control.cycle(k, accepted, now - clock if timed else None, first_seconds=now - clock if first else None,
                      wall=now - clock)
        clock = now
        stop_at = next((i for i, t in enumerate(new) if t in sampler.stops), None)
        if stop_at is not None:
            new = new[:stop_at + 1]
        sampler.accept(new)
        vocab.see(new)
        if ahead is not None:
            cache.mtp.commit(1 + accepted)  # the catch-up rows the verify kept
            mtp_start = length + 1 + accepted
            k_next = min(control.choose(), sampler.limit(max_length) - len(sampler.generated) - 1)
            if stop_at is None and k_next > 0:
                drafted = draft_from(binding, runner, sampler, positions, *ahead, length + 1 + accepted, k_next,
                                     vocab=vocab.rows)
        cache.commit(1 + accepted)
        report(new)
        if stop_at is not None:
            return "stop_token"
    return "max_length"


def _decode_ahead(binding: Qwen35Binding, runner, sampler: Sampler, positions: RowPositions, limit: int,
                  stats: GenerationStats, report, keep=None) -> tuple[str, float | None]:
    """Plain steps until ``limit`` tokens are generated or a stop token, one step ahead of the host:
    each step embeds the previous step's token on the device and is launched before the host reads
    that token, so what the host does per token (the read, the stop test, the callback, the next
    launch) overlaps the next step on the GPU. The tokens and the callbacks are those of a
    step-by-step loop (each draw names its position: the tokens generated before it); a stop
    token leaves one launched step unused. ``keep`` ``(buffer [1,N,H], prenorm)``: step i's hidden
    state (after the final norm, or before it) is copied into ``buffer[:, i]`` (the MTP head's
    catch-up rows). Returns the stop reason
    ("stop_token", or "max_length" when ``limit`` is reached) and the wall seconds per token after
    the first (None for fewer than 3 tokens)."""
    cache, device, dtype = runner.cache, runner.device, runner.dtype
    pinned = [torch.empty(1, dtype=torch.int64, pin_memory=True) for _ in range(2)] \
        if torch.device(device).type == "cuda" else [None, None]
    pending = token_ids(sampler.generated[-1:], device)  # [1, 1]
    start = launched = len(sampler.generated)
    inflight, first_read = None, None
    while True:
        step = None
        if launched < limit:
            pos = positions.rows(cache.length, 1)
            if sampler.greedy and not sampler.masks(launched):  # the argmax in the step itself
                if keep is None:
                    token = runner.forward_token(pending, pos)
                else:
                    token, hidden, pre = runner.forward_token_hidden(pending, pos)
            else:
                hidden, pre, logits = runner.forward_logits(binding.embed(pending, dtype, device), pos)
                token = sampler.draw_async(sampler.mask(logits[0], launched), launched)
            cache.commit()
            if keep is not None:
                i = launched - start
                keep[0][:, i:i + 1].copy_(pre if keep[1] else hidden)
            sampler.note(token)
            step = Readback(token, pinned[launched % 2])
            pending = token.view(1, 1)
            launched += 1
        if inflight is not None:
            t = inflight.value()
            stats.steps += 1
            sampler.accept([t], noted=True)
            report([t])
            if first_read is None:
                first_read = (time.perf_counter(), len(sampler.generated))
            if t in sampler.stops:
                return "stop_token", None
        if step is None:
            done = len(sampler.generated) - first_read[1] if first_read else 0
            per_token = (time.perf_counter() - first_read[0]) / done if done >= 2 else None
            return "max_length", per_token
        inflight = step
