"""Sampling: ComfyUI-equivalent target distribution, exact speculative acceptance, helpers.

``comfy_oracle`` below re-implements ComfyUI's ``BaseGenerate.sample_token`` one row at a time,
following its code path step by step (gather the distinct history tokens, penalise, scatter back,
temperature, then the top-k branch or the full-vocabulary branch), but it returns the
distribution instead of a sample, and it also reports how close each of its threshold decisions
came to flipping, so that random cases whose outcome float32 rounding could change are redrawn.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from qwen35_fast.engine.distribution import target_argmax, target_candidates, target_probs
from qwen35_fast.engine.draw import keyed_draw
from qwen35_fast.engine.sampling import Sampler
from qwen35_fast.engine.sampling_params import SamplingParams

AMBIGUOUS = 1e-5  # relative margin under which float32 and float64 may legitimately disagree


# ------------------------------------------------------------------------------------------
# Oracle: ComfyUI's sample_token, as a distribution
# ------------------------------------------------------------------------------------------

def _rel_gap(a: float, b: float) -> float:
    return abs(a - b) / max(1.0, abs(a), abs(b))


def _comfy_min_p(logits, min_p, margins):
    probs_before = torch.softmax(logits, dim=-1)
    top = probs_before.max(dim=-1, keepdim=True).values
    threshold = min_p * top
    below_top = probs_before < top  # the top itself is kept in any precision, even at min_p = 1
    if bool(below_top.any()):
        margins.append(float(((probs_before - threshold).abs() / threshold)[below_top].min()))
    remove = probs_before < threshold
    logits = logits.clone()
    logits[remove] = torch.finfo(logits.dtype).min
    return logits


def _comfy_top_p(logits, top_p, margins):
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    margins.append(float((cumulative - top_p).abs().min()))
    remove_sorted = cumulative > top_p
    remove_sorted[..., 0] = False
    cut = remove_sorted[0].nonzero()
    if len(cut):  # a tie straddling the cut makes the removed index a matter of sort order
        j = int(cut[0])
        margins.append(_rel_gap(float(sorted_logits[0, j - 1]), float(sorted_logits[0, j])))
    remove = torch.zeros_like(logits, dtype=torch.bool)
    remove.scatter_(1, sorted_idx, remove_sorted)
    logits = logits.clone()
    logits[remove] = torch.finfo(logits.dtype).min
    return logits


def comfy_oracle(logits_row, history, p: SamplingParams, dtype=torch.float64):
    """Distribution over V (float64) of ComfyUI's sampler for one row, and the smallest margin."""
    logits = logits_row.reshape(1, -1).to(dtype).clone()
    vocab = logits.shape[-1]
    margins = [math.inf]
    if not p.do_sample or p.temperature == 0.0:
        out = torch.zeros(vocab, dtype=torch.float64)
        out[int(torch.argmax(logits, dim=-1))] = 1.0
        return out, math.inf

    if len(history) > 0 and (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0):
        token_ids = torch.tensor(sorted(set(history)))
        token_logits = logits[:, token_ids]
        if p.repetition_penalty != 1.0:
            token_logits = torch.where(token_logits < 0, token_logits * p.repetition_penalty,
                                       token_logits / p.repetition_penalty)
        if p.presence_penalty != 0.0:
            token_logits = token_logits - p.presence_penalty
        logits[:, token_ids] = token_logits

    if p.temperature != 1.0:
        logits = logits / p.temperature

    out = torch.zeros(vocab, dtype=torch.float64)
    if p.top_k > 0:
        k = min(p.top_k, vocab)
        if k < vocab:
            ordered = torch.sort(logits[0], descending=True).values
            margins.append(_rel_gap(float(ordered[k - 1]), float(ordered[k])))
        logits, top_indices = torch.topk(logits, k)
        if p.min_p > 0.0:
            logits = _comfy_min_p(logits, p.min_p, margins)
        if p.top_p < 1.0:
            logits = _comfy_top_p(logits, p.top_p, margins)
        probs = torch.softmax(logits, dim=-1)
        out[top_indices[0]] = probs[0].to(torch.float64)
        return out, min(margins)

    if p.min_p > 0.0:
        logits = _comfy_min_p(logits, p.min_p, margins)
    if p.top_p < 1.0:
        logits = _comfy_top_p(logits, p.top_p, margins)
    out[:] = torch.softmax(logits, dim=-1)[0].to(torch.float64)
    return out, min(margins)


# ------------------------------------------------------------------------------------------
# Random cases
# ------------------------------------------------------------------------------------------

def _random_params(r: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        do_sample=True,
        temperature=r.choice([1.0, r.uniform(0.3, 2.0)]),
        top_k=r.choice([0, 0, r.randint(1, 40), r.randint(1, vocab), vocab + r.randint(0, 5)]),
        top_p=r.choice([1.0, r.uniform(0.2, 0.99), r.uniform(0.9, 0.999)]),
        min_p=r.choice([0.0, r.uniform(0.0, 0.3), r.uniform(0.3, 1.0), 1.0]),
        repetition_penalty=r.choice([1.0, r.uniform(0.5, 2.5)]),
        presence_penalty=r.choice([0.0, r.uniform(-1.0, 2.0)]),
    )


def _random_history(r: random.Random, logits_row: torch.Tensor) -> list[int]:
    vocab = logits_row.shape[0]
    top = torch.topk(logits_row, min(20, vocab)).indices.tolist()
    n = r.choice([0, r.randint(1, 8), r.randint(10, 60)])
    # Half the history sits among the leading tokens so the penalties move the filter boundaries.
    return [r.choice(top) if r.random() < 0.5 else r.randrange(vocab) for _ in range(n)]


def _random_case(rng: torch.Generator, r: random.Random, max_vocab: int = 2000):
    n = r.randint(1, 6)
    vocab = r.randint(2, max_vocab)
    scale = r.choice([0.5, 2.0, 5.0])
    logits = torch.randn(n, vocab, generator=rng) * scale
    histories = [_random_history(r, logits[i]) for i in range(n)]
    return logits, histories, _random_params(r, vocab)


def test_target_probs_matches_comfyui_on_random_cases(rng):
    r = random.Random(int(torch.randint(2**31, (1,), generator=rng)))
    checked = skipped = 0
    while checked < 100:
        logits, histories, params = _random_case(rng, r)
        expected, margins = zip(*(comfy_oracle(logits[i], histories[i], params) for i in range(len(logits))))
        if min(margins) < AMBIGUOUS:
            skipped += 1
            continue
        before = logits.clone()
        got = target_probs(logits, histories, params)
        assert got.dtype == torch.float32 and got.shape == logits.shape
        assert torch.equal(logits, before), "target_probs modified its input"
        torch.testing.assert_close(got.double(), torch.stack(expected), rtol=1e-4, atol=1e-7,
                                   msg=lambda m: f"{params}\n{m}")
        checked += 1
    assert skipped < checked // 5, f"too many ambiguous cases ({skipped})"


def test_target_argmax_is_the_mode_of_comfyuis_distribution(rng):
    """A point-mass draft's token: the most likely token of ComfyUI's sampling distribution
    (the float64 oracle), penalties and temperature included, on random rows; and cases where a
    penalised history token had the largest raw logit came up (the penalties decided them)."""
    r = random.Random(int(torch.randint(2**31, (1,), generator=rng)))
    checked = decided = 0
    while checked < 100:
        logits, histories, params = _random_case(rng, r)
        expected = [comfy_oracle(logits[i], histories[i], params)[0] for i in range(len(logits))]
        top2 = [e.topk(2).values if e.numel() > 1 else e for e in expected]
        if any(e.numel() > 1 and float(t[0] - t[1]) < 1e-9 for e, t in zip(expected, top2)):
            continue  # a tie in the distribution: either token is its mode
        got = target_argmax(logits, histories, params)
        assert got.dtype == torch.int64 and got.tolist() == [int(e.argmax()) for e in expected], params
        decided += sum(int(e.argmax()) != int(logits[i].argmax()) for i, e in enumerate(expected))
        checked += 1
    assert decided > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_probs_ties_match_comfyui_bit_for_bit(rng, dtype):
    # Coarse logits give many exact ties at the top-k / top-p / min-p boundaries. In the logits'
    # own dtype the oracle runs the same torch primitives, so ties must break identically.
    r = random.Random(int(torch.randint(2**31, (1,), generator=rng)))
    for _ in range(60):
        n, vocab = r.randint(1, 6), r.randint(2, 40)
        logits = (torch.randint(-4, 5, (n, vocab), generator=rng) * 0.5).to(dtype)
        histories = [[r.randrange(vocab) for _ in range(r.randint(0, 10))] for _ in range(n)]
        params = _random_params(r, vocab)
        got = target_probs(logits, histories, params)
        want = torch.stack([comfy_oracle(logits[i], histories[i], params, dtype=dtype)[0] for i in range(n)])
        assert torch.equal(got, want.float()), f"{params}\n{logits}\n{got}\n{want}"


def test_target_probs_full_vocabulary_with_pe_settings(rng):
    vocab = 248320
    logits = torch.randn(2, vocab, generator=rng) * 3.0
    r = random.Random(int(torch.randint(2**31, (1,), generator=rng)))
    histories = [_random_history(r, logits[0]) + [r.randrange(vocab) for _ in range(2000)], []]
    for top_k in (20, 0):  # PE preset, then ComfyUI's top_k=0 path over the whole vocabulary
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=0.95, min_p=0.0,
                                presence_penalty=1.5)
        got = target_probs(logits, histories, params)
        for i in range(2):
            want, margin = comfy_oracle(logits[i], histories[i], params)
            if margin >= AMBIGUOUS:
                torch.testing.assert_close(got[i].double(), want, rtol=1e-4, atol=1e-7)
        assert (got[0] > 0).sum() <= (20 if top_k else vocab)


def test_target_probs_penalty_rules_by_hand():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0]])
    params = SamplingParams(top_k=0, top_p=1.0, repetition_penalty=2.0)
    # Positive logits are divided, negative ones multiplied; repeats count once.
    got = target_probs(logits, [[0, 1, 1, 0, 0]], params)
    torch.testing.assert_close(got, torch.softmax(torch.tensor([[1.0, -4.0, 1.0, 0.0]]), -1))
    params = SamplingParams(top_k=0, top_p=1.0, presence_penalty=1.5)
    got = target_probs(logits, [[2, 2, 2]], params)
    torch.testing.assert_close(got, torch.softmax(torch.tensor([[2.0, -2.0, -0.5, 0.0]]), -1))
    # Each row uses its own history.
    got = target_probs(logits.repeat(2, 1), [[2], []], params)
    torch.testing.assert_close(got[1], torch.softmax(logits[0], -1))
    assert got[0, 2] < got[1, 2]


def test_histories_as_tensors_or_seen_mask(rng):
    r = random.Random(int(torch.randint(2**31, (1,), generator=rng)))
    logits, histories, _ = _random_case(rng, r, max_vocab=500)
    params = SamplingParams(top_k=0, top_p=1.0, repetition_penalty=1.7, presence_penalty=0.6)
    want = target_probs(logits, histories, params)
    as_tensors = [torch.tensor(h, dtype=torch.int32) for h in histories]
    assert torch.equal(target_probs(logits, as_tensors, params), want)
    seen = torch.zeros(logits.shape, dtype=torch.bool)
    for i, h in enumerate(histories):
        seen[i, h] = True
    assert torch.equal(target_probs(logits, seen, params), want)
    with pytest.raises(ValueError, match="seen-token mask must be bool"):
        target_probs(logits, seen[:, :-1], params)


def test_target_probs_filter_rules_by_hand():
    logits = torch.tensor([[0.0, 0.0, 5.0, -1.0]])
    # min_p keeps probabilities equal to the threshold (strict <).
    got = target_probs(torch.tensor([[0.0, -1.0, 0.0]]), [[]], SamplingParams(top_k=0, top_p=1.0, min_p=1.0))
    torch.testing.assert_close(got, torch.tensor([[0.5, 0.0, 0.5]]))
    # top_p always keeps the first token, however small top_p is.
    got = target_probs(logits, [[]], SamplingParams(top_k=0, top_p=1e-6))
    assert torch.equal(got, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))
    # top_k keeps exactly k tokens, even inside a tie.
    got = target_probs(logits, [[]], SamplingParams(top_k=2, top_p=1.0))
    assert int((got > 0).sum()) == 2 and got[0, 2] > 0.99
    # top_k larger than the vocabulary is clamped.
    got = target_probs(logits, [[]], SamplingParams(top_k=99, top_p=1.0))
    torch.testing.assert_close(got, torch.softmax(logits, -1))


def test_greedy_is_argmax_of_raw_logits(rng):
    logits = torch.randn(4, 100, generator=rng)
    top = logits.argmax(-1)
    histories = [[int(t)] * 3 for t in top]  # penalties would move the argmax if applied
    for params in (SamplingParams(do_sample=False, presence_penalty=50.0),
                   SamplingParams(temperature=0.0, repetition_penalty=100.0)):
        got = target_probs(logits, histories, params)
        assert torch.equal(got, torch.nn.functional.one_hot(top, 100).float())


def test_target_probs_rejects_bad_input():
    p = SamplingParams()
    with pytest.raises(ValueError, match="one token history per logits row"):
        target_probs(torch.zeros(2, 5), [[]], p)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 5\)"):
        target_probs(torch.zeros(1, 5), [[5]], SamplingParams(presence_penalty=1.0))
    with pytest.raises(ValueError, match="token id -1"):
        target_probs(torch.zeros(1, 5), [[-1]], SamplingParams(presence_penalty=1.0))
    with pytest.raises(ValueError, match="integer token ids"):
        target_probs(torch.zeros(1, 5), [[1.5]], SamplingParams(presence_penalty=1.0))
    with pytest.raises(ValueError, match="integer token ids"):
        target_probs(torch.zeros(1, 5), [torch.tensor([1.0])], SamplingParams(presence_penalty=1.0))
    with pytest.raises(ValueError, match=r"histories\[1\] has token id 7"):
        target_probs(torch.zeros(2, 5), [[1], torch.tensor([2, 7])], SamplingParams(presence_penalty=1.0))
    with pytest.raises(ValueError, match=r"2-D tensor \[N, V\]"):
        target_probs(torch.zeros(5), [[]], p)
    with pytest.raises(ValueError, match="floating"):
        target_probs(torch.zeros(1, 5, dtype=torch.long), [[]], p)
    with pytest.raises(ValueError, match="top_p"):
        target_probs(torch.zeros(1, 5), [[]], SamplingParams(top_p=0.0))


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", float("nan")),
    ("min_p", -0.01), ("min_p", 1.5),
    ("top_k", -1), ("top_k", 2.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", float("nan")),
])
def test_validation_names_the_bad_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        params.validate()


def test_validation_accepts_boundaries():
    for kw in ({"temperature": 0.0}, {"top_p": 1.0}, {"min_p": 0.0}, {"min_p": 1.0}, {"top_k": 0},
               {"repetition_penalty": 0.01}, {"presence_penalty": -2.0}):
        assert SamplingParams(**kw).validate() is not None
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(do_sample=False).greedy
    assert not SamplingParams().greedy


# ------------------------------------------------------------------------------------------
# The Sampler's draws: the keyed draw (the float64 oracle) of ComfyUI's distribution
# ------------------------------------------------------------------------------------------

def _draw_cases(rng, n):
    settings = [dict(temperature=1.0, top_k=20, top_p=0.95, min_p=0.0, repetition_penalty=1.0, presence_penalty=1.5),
                dict(temperature=0.7, top_k=64, top_p=0.95, min_p=0.05, repetition_penalty=1.05, presence_penalty=0.0),
                dict(temperature=1.3, top_k=0, top_p=0.9, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0),
                dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5),
                dict(temperature=0.9, top_k=3000, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0),
                dict(temperature=1.0, top_k=5, top_p=0.5, min_p=0.2, repetition_penalty=1.0, presence_penalty=0.0)]
    for i in range(n):
        kw = settings[i % len(settings)]
        vocab = int(torch.randint(50, 4000, (1,), generator=rng))
        logits = torch.randn(1, vocab, generator=rng) * float(torch.rand((), generator=rng) * 6 + 0.5)
        history = torch.randint(0, vocab, (int(torch.randint(0, 40, (1,), generator=rng)),), generator=rng).tolist()
        yield kw, logits, history


def test_sampler_draws_the_keyed_oracle_token(rng):
    """``Sampler.draw`` / ``draw_async`` / ``draw_rows`` (penalties, temperature, top-k, min-p, top-p)
    pick the token the float64 keyed-draw oracle picks from ComfyUI's distribution (this file's
    ``comfy_oracle``) at the position ``first_position + count (+ row)``, for one seed, with the
    penalties' history from the initial tokens; cases the oracle calls ambiguous are skipped."""
    from tests.oracles import keyed_draw as oracle

    checked = 0
    for kw, logits, history in _draw_cases(rng, 60):
        params = SamplingParams(do_sample=True, **kw)
        want_p, margin = comfy_oracle(logits[0], history, params)
        if margin < AMBIGUOUS:
            continue
        seed = int(torch.randint(2**62, (1,), generator=rng)) * 3
        first = int(torch.randint(0, 5000, (1,), generator=rng))
        s = Sampler(params, seed=seed, first_position=first, stop_tokens=[], min_tokens=0, initial_tokens=history,
                    device="cpu", mtp_draft="argmax")
        rows = logits.expand(3, -1)
        got_rows = s.draw_rows(rows, [history] * 3, 7).tolist()
        for count, got in ((0, s.draw(logits, 0)), (4, int(s.draw_async(logits, 4)[0])),
                           (7, got_rows[0]), (8, got_rows[1]), (9, got_rows[2])):
            want, gap = oracle.draw(want_p, seed, first + count)
            if gap > 1e-6:
                assert got == want, (kw, count)
                checked += 1
    assert checked >= 200, checked


def test_sampler_refuses_a_seed_out_of_range():
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
        Sampler(SamplingParams(), seed=2**64, first_position=0, stop_tokens=[], min_tokens=0, initial_tokens=[],
                device="cpu", mtp_draft="argmax")



def test_target_candidates_match_target_probs(rng):
    params = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02, presence_penalty=1.5)
    logits = torch.randn(3, 500, generator=rng) * 3
    hist = [[1, 2, 3], [], [499, 7]]
    probs, ids = target_candidates(logits, hist, params)
    assert probs.shape == ids.shape == (3, 30) and probs.dtype == torch.float32 and ids.dtype == torch.int64
    full = torch.zeros(3, 500).scatter_(1, ids, probs)
    assert torch.equal(full, target_probs(logits, hist, params))
    assert bool((probs[:, :-1] >= probs[:, 1:]).all()), "candidates are not in descending order"
    with pytest.raises(ValueError, match="ids must be int64"):
        keyed_draw(probs, ids[:, :5], 0)


def test_sampler_seen_set_on_the_device():
    """The penalties' seen set that every draw reads (``draw_async``, ``draw``, MTP drafts and
    verify rows): the initial and accepted tokens, a noted in-flight token, and per row the drafts
    before it, against sets built by hand."""
    params = SamplingParams(do_sample=True, presence_penalty=1.5)
    s = Sampler(params, seed=0, first_position=3, stop_tokens=[], min_tokens=0, initial_tokens=[4, 9], device="cpu",
                mtp_draft="argmax")
    s.accept([2, 9])
    v = 12

    def ids(mask):
        return [set(row.nonzero().flatten().tolist()) for row in mask]

    assert ids(s.seen_rows(None, 1, v)) == [{2, 4, 9}]
    drafts = torch.tensor([7, 4, 11])
    assert ids(s.seen_rows(drafts, 4, v)) == [{2, 4, 9}, {2, 4, 7, 9}, {2, 4, 7, 9}, {2, 4, 7, 9, 11}]
    assert ids(s.seen_rows(None, 1, v)) == [{2, 4, 9}]  # the rows' drafts leave the seen set itself alone
    s.note(torch.tensor([5]))
    s.accept([5, 3])
    assert ids(s.seen_rows(None, 1, v)) == [{2, 3, 4, 5, 9}]
    plain = Sampler(SamplingParams(do_sample=True), seed=0, first_position=3, stop_tokens=[], min_tokens=0,
                    initial_tokens=[4], device="cpu", mtp_draft="argmax")
    assert plain.seen_rows(drafts, 4, v) == [()] * 4


@pytest.mark.gpu
def test_device_draws_never_sync_with_the_host():
    """What the decode loop runs per token while the GPU works ahead (``draw_async``, ``note``,
    ``accept``, verify rows' ``seen_rows``, a verify step's keyed draws over several rows), with the
    enhancer's sampling settings: no operation that waits for the GPU (torch's sync debug mode
    raises on one)."""
    dev = torch.device("cuda")
    params = SamplingParams(do_sample=True, temperature=1.0, top_k=20, top_p=0.95, min_p=0.0, presence_penalty=1.5)
    s = Sampler(params, seed=0, first_position=9, stop_tokens=[1], min_tokens=0, initial_tokens=[3], device=dev,
                mtp_draft="argmax")
    s.accept([5])
    logits = torch.randn(1, 4096, device=dev) * 4
    verify = torch.randn(4, 4096, device=dev) * 4

    def verify_draws(drafts):  # a sampled verify step's draws (``speculative.judge``)
        s.draw_rows(verify, s.seen_rows(drafts, 4, verify.shape[1]), 2)

    t = s.draw_async(s.mask(logits, 1), 1)  # warm-up: pinned blocks, kernels
    s.note(t)
    verify_draws(torch.cat([t, t, t]))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        t = s.draw_async(s.mask(logits, 2), 2)
        s.note(t)
        s.seen_rows(torch.cat([t, t]), 3, logits.shape[1])
        s.accept([7])
        verify_draws(torch.cat([t, t, t]))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
