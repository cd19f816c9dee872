"""Cost and output follow the filled length: capacity never changes tokens; unfilled slots are never read."""

from __future__ import annotations

import math

import pytest
import torch
from qwen35_fast.engine import generate

from tests.oracles.tiny import add_mtp, engine_model, make_tiny


@pytest.fixture
def model(tmp_path, rng):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    sd, d = make_tiny(seed, strength=0.2, num_hidden_layers=8)
    sd = add_mtp(sd, d, seed + 1, noise=0.02, norm_spread=0.05)
    return engine_model(sd, tmp_path), d


class _Enough(Exception):
    pass


def _first_tokens(model, prompt, n, max_length, **kw):
    """The first n tokens of a generation with ``max_length`` (stopped by the callback)."""
    got = []

    def stop(all_tokens, new, stats):
        if len(all_tokens) >= n:
            got.extend(all_tokens[:n])
            raise _Enough

    try:
        res = generate(model, prompt, max_length=max_length, stop_tokens=[], callback=stop, **kw)
    except _Enough:
        return got
    return res.tokens[:n]


@pytest.mark.parametrize("kw", [dict(do_sample=False, mtp="off"), dict(do_sample=False, mtp=3),
                                dict(do_sample=True, seed=7, mtp=3, top_k=8, temperature=1.2),
                                dict(do_sample=True, seed=3, mtp="off", top_k=0, top_p=0.8)])
def test_max_length_does_not_change_tokens(model, rng, kw):
    m, d = model
    prompt = torch.randn(9, d["hidden_size"], generator=rng)
    # The last few tokens of a max_length run draft fewer tokens, which changes how many random
    # numbers a sampled run draws there: compare the tokens before that tail.
    n = 64 - 6
    short = _first_tokens(m, prompt, n, 64, **kw)
    long = _first_tokens(m, prompt, n, 100_000, **kw)
    assert len(short) == n and short == long


@pytest.mark.parametrize("kw", [dict(do_sample=False, mtp="off"), dict(do_sample=False, mtp=4),
                                dict(do_sample=True, seed=11, mtp=2, top_k=10, presence_penalty=0.5)])
def test_poisoned_unfilled_slots_change_nothing(model, rng, kw):
    m, d = model
    prompt = torch.randn(6, d["hidden_size"], generator=rng)
    clean = generate(m, prompt, max_length=40, stop_tokens=[], cache_fill=0.0, **kw)
    poisoned = generate(m, prompt, max_length=40, stop_tokens=[], cache_fill=math.nan, **kw)
    assert poisoned.tokens == clean.tokens
    assert generate(m, prompt, max_length=40, stop_tokens=[], **kw).tokens == clean.tokens


def test_poison_reaches_a_capacity_bound_read(model, rng):
    """The poison is effective: the capacity-bound "masked" baseline does read unfilled slots."""
    m, d = model
    prompt = torch.randn(6, d["hidden_size"], generator=rng)
    clean = generate(m, prompt, do_sample=False, max_length=12, mtp="off", attention="masked")
    ok = generate(m, prompt, do_sample=False, max_length=12, mtp="off", attention="torch")
    assert clean.tokens == ok.tokens and clean.stats.attention_backend == "masked"
    try:
        bad = generate(m, prompt, do_sample=False, max_length=12, mtp="off", attention="masked",
                       cache_fill=math.nan)
    except RuntimeError:
        return
    assert bad.tokens != clean.tokens


def test_triton_backend_in_the_engine(model, rng):
    """The Triton kernel (interpreted on CPU) inside the engine: same tokens, poison never read."""
    from qwen35_fast.kernels import backend_reason

    m, d = model
    why = backend_reason("triton", torch.empty(1, 2, 1, 64))
    if why is not None:
        pytest.skip(why)
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    want = generate(m, prompt, do_sample=False, max_length=8, mtp=3, attention="torch", stop_tokens=[])
    got = generate(m, prompt, do_sample=False, max_length=8, mtp=3, attention="triton", stop_tokens=[],
                   cache_fill=math.nan)
    assert got.tokens == want.tokens and got.stats.attention_backend == "triton"


@pytest.mark.parametrize("kw", [dict(do_sample=False, mtp="off"), dict(do_sample=False, mtp=3),
                                dict(do_sample=True, seed=5, mtp=2, top_k=10, presence_penalty=0.5)])
def test_bucketed_backend_in_the_engine(model, rng, monkeypatch, kw):
    """The bucketed attention (the GPU path without Triton or kitchen), over spans of 8 slots that a
    generation crosses several times, with NaN in every unfilled slot: the torch path's tokens."""
    from qwen35_fast.kernels import attention_torch

    monkeypatch.setattr(attention_torch, "BUCKET", 8)
    m, d = model
    prompt = torch.randn(6, d["hidden_size"], generator=rng)
    want = generate(m, prompt, max_length=30, stop_tokens=[], attention="torch", **kw)
    got = generate(m, prompt, max_length=30, stop_tokens=[], attention="bucket", cache_fill=math.nan, **kw)
    assert got.tokens == want.tokens and got.stats.attention_backend == "bucket"
