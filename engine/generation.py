"""``generate``: Qwen3.5 decoding with ComfyUI's sampling semantics and exact MTP speculation.

Without MTP every step feeds the last token and samples the next one. With MTP (depth k) a step

1. runs the MTP head over the rows whose true hidden states arrived since the last step (the
   "catch-up" rows; the last one pairs the newest hidden with the pending token) and drafts
   d1 from its last row, then d2..dk by feeding the head's own normed output back;
2. verifies ``[pending, d1..dk]`` through the model in one causal forward (k+1 rows);
3. accepts drafts: greedy by exact argmax comparison (so the output equals non-MTP greedy token
   for token), sampled by speculative sampling against the penalised/filtered target distribution
   of each position (histories include the accepted drafts), plus a correction or bonus token;
4. commits 1 + accepted rows in every layer (K/V lengths, DeltaNet state snapshots) and rolls the
   MTP cache back to the last row computed from a true hidden state.

MTP conventions (vLLM's ``qwen3_5_mtp.py``, SGLang): head row t pairs the model's final hidden
state h_t (after the model's final norm) with the embedding of token t+1, concatenated as
``[embedding, hidden]`` before ``fc``, at position t; after the head's own norm, the shared
``lm_head`` gives logits for token t+2, and deeper drafts feed that normed output back as the
hidden state. ComfyUI's experimental MTP branch feeds the pre-norm hidden state instead:
``binding.mtp_hidden = "prenorm"`` selects that. The MTP cache only keeps rows computed from true
hidden states; rows of drafts at depth >= 2 are dropped after each verify and recomputed from the
verified hidden states at the next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .cache import ModelCache
from ..kernels import resolve_backend
from ..kernels.attention import BACKENDS, triton_reason
from ..kernels.attention_kitchen import kitchen_reason
from .binding import Qwen35Binding, bind
from .errors import Qwen35Error
from .forward import Runner
from .fused import FusedPlan
from .graphs import GraphRunner, graph_blocker, say_once
from .rope import normalize_positions
from .sampling import SamplingParams, sample, speculative_accept, target_candidates, target_probs

log = logging.getLogger(__name__)

MAX_MTP_DEPTH = 5
AUTO_MTP_DEPTH = 3


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


def _resolve_depth(mtp, binding: Qwen35Binding) -> int:
    has_head = binding.mtp is not None
    if mtp in ("off", None, False, 0):
        return 0
    if mtp == "auto":
        if not has_head:
            log.info("MTP: no MTP head on this model; generating without speculative decoding")
            return 0
        return AUTO_MTP_DEPTH
    if isinstance(mtp, str) and mtp.strip().isdigit():
        mtp = int(mtp.strip())
    if isinstance(mtp, bool) or not isinstance(mtp, int) or not 1 <= mtp <= MAX_MTP_DEPTH:
        raise Qwen35Error(f"mtp must be 'off', 'auto' or a depth 1..{MAX_MTP_DEPTH}, got {mtp!r}")
    if not has_head:
        raise Qwen35Error(f"mtp={mtp} needs an MTP head, and this model has none: load the checkpoint with "
                          "its mtp.* tensors (or graft them with build_mtp_head), or use mtp='auto'/'off'")
    return mtp


def _default_dtype(binding: Qwen35Binding, device: torch.device) -> torch.dtype:
    if binding.is_comfy:
        try:
            import comfy.model_management as mm

            return torch.bfloat16 if mm.should_use_bf16(device) else torch.float32
        except (ImportError, AttributeError):
            return torch.float32
    w = getattr(binding.transformer.embed_tokens, "weight", None)
    if w is not None and w.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return w.dtype
    return torch.float32


class _Positions:
    """Positions of absolute rows: prompt rows use the given ids, later rows continue at max + 1."""

    def __init__(self, prompt: torch.Tensor):
        self.prompt = prompt  # [3, T] int64
        self.length = prompt.shape[1]
        self.offset = int(prompt.max()) + 1 - self.length if self.length else 0

    def rows(self, start: int, count: int) -> torch.Tensor:
        end = start + count
        if end <= self.length:
            return self.prompt[:, start:end]
        tail_start = max(start, self.length)
        tail = torch.arange(tail_start, end, device=self.prompt.device, dtype=torch.int64) + self.offset
        tail = tail.expand(3, -1)
        if start >= self.length:
            return tail
        return torch.cat([self.prompt[:, start:], tail], dim=1)


def _check_request(embeds, max_length, min_tokens, attention, hidden):
    if not isinstance(embeds, torch.Tensor) or not embeds.dtype.is_floating_point:
        raise Qwen35Error("embeds must be a floating tensor [T, H] or [1, T, H]")
    if embeds.dim() == 2:
        embeds = embeds.unsqueeze(0)
    if embeds.dim() != 3:
        raise Qwen35Error(f"embeds must be [T, H] or [B, T, H], got shape {tuple(embeds.shape)}")
    if embeds.shape[0] != 1:
        raise Qwen35Error(f"batch size {embeds.shape[0]} is not supported: call generate once per prompt (B=1)")
    if embeds.shape[1] < 1:
        raise Qwen35Error("embeds hold no prompt rows; pass at least one token")
    if embeds.shape[2] != hidden:
        raise Qwen35Error(f"embeds width {embeds.shape[2]} != model hidden size {hidden}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise Qwen35Error(f"max_length must be a positive integer, got {max_length!r}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise Qwen35Error(f"min_tokens must be an integer >= 0, got {min_tokens!r}")
    if attention not in BACKENDS:
        raise Qwen35Error(f"attention must be one of {BACKENDS}, got {attention!r}")
    return embeds


class _Decoder:
    """State of one generate() call (kept off the model, so an interrupt leaves nothing behind)."""

    def __init__(self, binding: Qwen35Binding, params: SamplingParams, *, seed: int, stop_tokens, min_tokens: int,
                 initial_tokens, device, mtp_draft: str, room: int):
        self.b = binding
        self.params = params
        self.greedy = params.greedy
        self.generator = None if self.greedy else torch.Generator(device=device).manual_seed(int(seed))
        self.stops = {int(t) for t in stop_tokens}
        self.stop_ids = torch.tensor(sorted(self.stops), dtype=torch.int64, device=device)
        self.min_tokens = min_tokens
        self.generated: list[int] = []
        self.mtp_draft = mtp_draft
        self.device = device
        # Token history for the penalties, kept on the device so that long answers do not rebuild it
        # from a Python list at every position: initial tokens, generated tokens, then scratch rows.
        initial = [int(t) for t in initial_tokens]
        self.penalised = not self.greedy and (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0)
        self.hist = torch.zeros(len(initial) + room, dtype=torch.int64, device=device)
        self.count = 0
        self._write(initial)
        self.count = len(initial)

    def _write(self, tokens: Sequence[int]) -> None:
        if tokens and self.penalised:  # only the penalties read the history
            self.hist[self.count:self.count + len(tokens)] = _to_device(list(tokens), self.device)

    def accept(self, tokens: Sequence[int]) -> None:
        """Append generated tokens."""
        self._write(tokens)
        self.count += len(tokens)
        self.generated.extend(tokens)

    def histories(self, drafts: Sequence[int], rows: int) -> list:
        """Penalty histories of ``rows`` consecutive positions: row i has the history plus ``drafts[:i]``."""
        if not self.penalised:
            return [()] * rows
        self._write(drafts)
        return [self.hist[:self.count + i] for i in range(rows)]

    def mask(self, logits: torch.Tensor, first_count: int) -> torch.Tensor:
        """Forbid stop tokens on rows whose position is before ``min_tokens``. logits ``[N,V]``."""
        n = logits.shape[0]
        blocked = max(0, min(n, self.min_tokens - first_count))
        if blocked and self.stop_ids.numel():
            logits = logits.clone()
            logits[:blocked, self.stop_ids] = float("-inf")
        return logits

    def draw(self, logits: torch.Tensor) -> int:
        """The next token from one row of logits ``[1,V]`` (float32) after the current history."""
        if self.greedy:
            return int(logits[0].argmax())
        # ComfyUI's own draw (same candidate list and order, same generator use): with MTP off the
        # same seed gives core's tokens.
        probs, ids = target_candidates(logits, self.histories((), 1), self.params)
        return int(sample(probs, self.generator, candidates=ids)[0])


def generate(module_or_binding, embeds: torch.Tensor, *, do_sample: bool = True, max_length: int = 256,
             temperature: float = 1.0, top_k: int = 50, top_p: float = 0.9, min_p: float = 0.0,
             repetition_penalty: float = 1.0, seed: int = 42, stop_tokens: Sequence[int] | None = None,
             min_tokens: int = 0, presence_penalty: float = 0.0, initial_tokens: Sequence[int] = (),
             mtp="auto", position_ids: torch.Tensor | None = None, attention: str = "auto",
             execution_dtype: torch.dtype | None = None,
             callback: Callable[[list[int], list[int], GenerationStats], None] | None = None,
             mtp_draft: str | Callable[[int], int] = "argmax", cache_fill: float | None = None,
             cuda_graphs: bool | str = "auto", fused: bool | str = "auto") -> GenerationResult:
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
    Returns ``GenerationResult(tokens, stats, stop_reason)``.
    """
    binding = bind(module_or_binding)
    cfg = binding.config
    embeds = _check_request(embeds, max_length, min_tokens, attention, cfg.hidden_size)
    if not callable(mtp_draft) and mtp_draft not in ("argmax", "sample"):
        raise Qwen35Error(f"mtp_draft must be 'argmax' or 'sample', got {mtp_draft!r}")
    if cuda_graphs not in ("auto", True, False):
        raise Qwen35Error(f"cuda_graphs must be 'auto', True or False, got {cuda_graphs!r}")
    if fused not in ("auto", True, False):
        raise Qwen35Error(f"fused must be 'auto', True or False, got {fused!r}")
    params = SamplingParams(do_sample=bool(do_sample), temperature=float(temperature), top_k=int(top_k),
                            top_p=float(top_p), min_p=float(min_p), repetition_penalty=float(repetition_penalty),
                            presence_penalty=float(presence_penalty or 0.0))
    try:
        params.validate()
    except ValueError as exc:
        raise Qwen35Error(str(exc)) from exc
    depth = _resolve_depth(mtp, binding)
    device = embeds.device
    dtype = execution_dtype or _default_dtype(binding, device)
    stop_tokens = cfg.stop_tokens if stop_tokens is None else stop_tokens
    prompt_len = embeds.shape[1]
    positions = _Positions(normalize_positions(position_ids, prompt_len, device))

    backend = _backend_name(attention, cfg, dtype, device)
    if attention == "masked" and cache_fill is None:
        cache_fill = 0.0  # the capacity-bound baseline reads every slot: they must hold numbers
    capacity = prompt_len + max_length + depth + 1
    cache = ModelCache(cfg, batch=1, capacity=capacity, dtype=dtype, device=device, mtp=depth > 0,
                       fill=cache_fill)
    runner = Runner(binding, cache, dtype=dtype, device=device, attention=attention,
                    fused=_fused_plan(fused, binding, device, dtype))
    if cuda_graphs:
        blocker = graph_blocker(binding, torch.device(device), dtype, attention)
        if blocker is None:
            runner = GraphRunner(runner)
        elif cuda_graphs is True:
            raise Qwen35Error(f"cuda_graphs=True but {blocker}; use cuda_graphs='auto' or False")
        elif torch.device(device).type == "cuda":
            say_once(f"Qwen3.5 decode runs without CUDA graphs: {blocker}")
    dec = _Decoder(binding, params, seed=seed, stop_tokens=stop_tokens, min_tokens=min_tokens,
                   initial_tokens=initial_tokens, device=device, mtp_draft=mtp_draft, room=max_length + depth + 1)
    stats = GenerationStats(mtp_depth=depth, attention_backend=backend)
    with torch.no_grad(), binding.holding_output_weight():
        return _run(binding, runner, dec, stats, embeds.to(dtype), positions, max_length, depth, callback)


def _fused_plan(fused, binding, device, dtype) -> FusedPlan | None:
    """The fused-kernel plan for decode rows, or None (reason logged once on CUDA; error if required)."""
    if fused is False or (fused == "auto" and torch.device(device).type != "cuda"):
        return None
    plan, why = FusedPlan.build(binding, device, dtype)
    if plan is None:
        if fused is True:
            raise Qwen35Error(f"fused=True but {why}; use fused='auto' or False")
        say_once(f"Qwen3.5 decode runs without the fused kernels (slower): {why}")
    return plan


def _backend_name(attention: str, cfg, dtype, device) -> str:
    """The decode-attention backend that will run; Qwen35Error up front if the chosen one cannot."""
    q = torch.empty(1, cfg.num_attention_heads, 1, cfg.head_dim, dtype=dtype, device=device)
    scale = cfg.head_dim ** -0.5
    if attention == "auto":
        return resolve_backend(q, scale)
    why = None
    if attention == "triton":
        why = triton_reason(q)
    elif attention == "kitchen":
        why = kitchen_reason(q, scale)
    if why is not None:
        raise Qwen35Error(f"attention={attention!r} cannot run here: {why}; use attention='auto'")
    return attention


def _run(binding, runner: Runner, dec: _Decoder, stats: GenerationStats, embeds, positions: _Positions,
         max_length: int, depth: int, callback) -> GenerationResult:
    device, dtype = runner.device, runner.dtype
    cache = runner.cache
    t0 = time.perf_counter()
    prompt_len = embeds.shape[1]
    hidden, pre = runner.forward(embeds, positions.rows(0, prompt_len), keep_rows=False)
    cache.commit()
    logits = dec.mask(binding.logits(hidden[:, -1:])[0], 0)
    token = dec.draw(logits)
    dec.accept([token])
    stats.prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()

    def report(new: list[int]) -> None:
        stats.tokens = len(dec.generated)
        stats.decode_s = time.perf_counter() - t1
        stats.tok_per_s = (stats.tokens - 1) / stats.decode_s if stats.decode_s > 0 else 0.0
        stats.acceptance_rate = stats.accepted / stats.drafted if stats.drafted else 0.0
        if callback is not None:
            callback(list(dec.generated), list(new), stats)

    report([token])
    if token in dec.stops:
        return GenerationResult(list(dec.generated), stats, "stop_token")

    use_prenorm = binding.mtp_hidden == "prenorm"
    # MTP catch-up rows: true hidden states and the embedding of the token that follows each.
    if depth:
        pend_hidden = pre if use_prenorm else hidden
        pend_emb = torch.cat([embeds[:, 1:], binding.embed(_ids([token], device), dtype, device)], dim=1)
        mtp_start = 0

    while len(dec.generated) < max_length:
        length = cache.length
        pending = dec.generated[-1]
        k = min(depth, max_length - len(dec.generated) - 1)
        if k == 0:
            rows = binding.embed(_ids([pending], device), dtype, device)
            hidden, _ = runner.forward(rows, positions.rows(length, 1))
            cache.commit()
            stats.steps += 1
            logits = dec.mask(binding.logits(hidden)[0], len(dec.generated))
            new = [dec.draw(logits)]
        else:
            drafts, qs = _draft(binding, runner, dec, positions, pend_hidden, pend_emb, mtp_start, length, k)
            stats.drafted += k
            rows = binding.embed(_ids([pending] + drafts, device), dtype, device)
            hidden, pre = runner.forward(rows, positions.rows(length, k + 1))
            stats.steps += 1
            logits = dec.mask(binding.logits(hidden)[0], len(dec.generated))
            new, accepted = _accept(dec, logits, drafts, qs)
            stats.accepted += accepted
            cache.commit(1 + accepted)
            kept = pre if use_prenorm else hidden
            pend_hidden = kept[:, :accepted + 1]
            pend_emb = torch.cat([rows[:, 1:accepted + 1],
                                  binding.embed(_ids([new[-1]], device), dtype, device)], dim=1)
            mtp_start = length
        stop_at = next((i for i, t in enumerate(new) if t in dec.stops), None)
        if stop_at is not None:
            new = new[:stop_at + 1]
        dec.accept(new)
        report(new)
        if stop_at is not None:
            return GenerationResult(list(dec.generated), stats, "stop_token")
    return GenerationResult(list(dec.generated), stats, "max_length")


def _to_device(tokens: list[int], device) -> torch.Tensor:
    """int64 ``[N]`` on ``device``. To CUDA through pinned memory without a host sync (torch's
    pinned-block cache keeps the block until the copy is done)."""
    t = torch.tensor(tokens, dtype=torch.int64)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _ids(tokens: list[int], device) -> torch.Tensor:
    return _to_device(tokens, device).unsqueeze(0)


def _draft(binding, runner: Runner, dec: _Decoder, positions: _Positions, pend_hidden, pend_emb,
           mtp_start: int, length: int, k: int):
    """Catch the MTP cache up to ``length`` rows and draft k tokens; the MTP cache ends at ``length``."""
    device, dtype = runner.device, runner.dtype
    mcache = runner.cache.mtp
    rows = pend_hidden.shape[1]
    out = runner.mtp_forward(pend_hidden, pend_emb, positions.rows(mtp_start, rows))
    mcache.commit()
    last = out[:, -1:]
    drafts: list[int] = []
    qs: list[torch.Tensor | None] = []
    for j in range(k):
        if j:
            emb = binding.embed(_ids([drafts[-1]], device), dtype, device)
            last = runner.mtp_forward(last, emb, positions.rows(length - 1 + j, 1))
            mcache.commit()
        logits = dec.mask(binding.logits(last)[0], len(dec.generated) + j)
        if callable(dec.mtp_draft):  # benchmark hook: the head ran, its draft is replaced
            drafts.append(int(dec.mtp_draft(len(dec.generated) + j)))
            qs.append(None)
            continue
        if dec.greedy:
            drafts.append(int(logits[0].argmax()))
            qs.append(None)
            continue
        q = target_probs(logits, dec.histories(drafts, len(drafts) + 1)[-1:], dec.params)
        if dec.mtp_draft == "sample":
            drafts.append(int(sample(q, dec.generator, top_k=dec.params.top_k)[0]))
            qs.append(q[0])
        else:
            drafts.append(int(q[0].argmax()))
            qs.append(None)
    mcache.rollback(k - 1)
    return drafts, qs


def _accept(dec: _Decoder, logits: torch.Tensor, drafts: list[int], qs) -> tuple[list[int], int]:
    """New tokens from verify logits ``[k+1,V]`` and the number of drafts kept."""
    k = len(drafts)
    if dec.greedy:
        target = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < k and target[accepted] == drafts[accepted]:
            accepted += 1
        return drafts[:accepted] + [target[accepted]], accepted
    probs = target_probs(logits, dec.histories(drafts, k + 1), dec.params)
    new: list[int] = []
    for i in range(k):
        ok, replacement = speculative_accept(probs[i], drafts[i], dec.generator, qs[i])
        if not ok:
            return new + [replacement], i
        new.append(drafts[i])
    new.append(int(sample(probs[k:k + 1], dec.generator, top_k=dec.params.top_k)[0]))
    return new, k
