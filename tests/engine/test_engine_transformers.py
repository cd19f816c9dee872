"""Engine vs transformers' ``Qwen3_5ForCausalLM`` (same random weights): logits, greedy tokens,
DeltaNet states, and 3-axis (MRoPE) positions."""

from __future__ import annotations

import pytest
import torch
from qwen35_fast.engine import bind, generate
from qwen35_fast.engine.cache import DeltaNetState, ModelCache
from qwen35_fast.engine.forward import Runner

from tests.oracles.tiny import engine_model, make_tiny

pytest.importorskip("transformers", minversion="5.2")
from tests.oracles.hf import hf_model  # noqa: E402

TOL = 2e-4


@pytest.fixture
def pair(tmp_path, rng):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    sd, d = make_tiny(seed, strength=0.8, num_hidden_layers=8)
    return engine_model(sd, tmp_path), hf_model(sd, d), d


def test_logits_and_deltanet_states(pair, rng):
    model, hf, d = pair
    ids = torch.randint(0, d["vocab_size"], (1, 30), generator=rng)
    prompt_len = 21
    with torch.no_grad():
        out = hf(input_ids=ids, use_cache=True)
    want = out.logits[0]
    cache_hf = out.cache if hasattr(out, "cache") else out.past_key_values

    b = bind(model)
    cache = ModelCache(b.config, batch=1, capacity=64, dtype=torch.float32, device="cpu")
    run = Runner(b, cache, dtype=torch.float32, device="cpu")
    emb = b.embed(ids, torch.float32, "cpu")
    got = []
    h, _ = run.forward(emb[:, :prompt_len], torch.arange(prompt_len).expand(3, -1), keep_rows=False)
    cache.commit()
    got.append(b.logits(h)[0])
    pos = prompt_len
    for width in (1, 3, 1, 4):  # one-row decodes and multi-row (verify-like) steps
        h, _ = run.forward(emb[:, pos:pos + width], torch.arange(pos, pos + width).expand(3, -1))
        cache.commit()
        got.append(b.logits(h)[0])
        pos += width
    assert pos == 30
    torch.testing.assert_close(torch.cat(got), want, atol=TOL, rtol=TOL)
    for i, state in enumerate(cache.layers):
        if isinstance(state, DeltaNetState):
            torch.testing.assert_close(state.recurrent, cache_hf.get_recurrent_state(i), atol=TOL, rtol=TOL)
            conv = cache_hf.get_conv_state(i)  # transformers keeps K columns, we keep the last K-1
            torch.testing.assert_close(state.conv, conv[..., -(d["conv_kernel_size"] - 1):], atol=TOL, rtol=TOL)


def test_greedy_tokens_equal(pair, rng):
    model, hf, d = pair
    ids = torch.randint(0, d["vocab_size"], (1, 7), generator=rng)
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20)[0, 7:].tolist()
        logits = hf(input_ids=torch.cat([ids, torch.tensor([want[:-1]])], dim=1)).logits[0, 6:]
    emb = bind(model).embed(ids, torch.float32, "cpu")
    got = generate(model, emb, do_sample=False, max_length=20, mtp="off", stop_tokens=[]).tokens
    if got != want:  # allowed only at a float32 near-tie of transformers' own logits
        i = next(j for j in range(20) if got[j] != want[j])
        top2 = logits[i].topk(2).values
        assert float(top2[0] - top2[1]) < 1e-4, f"token {i}: engine {got[i]}, transformers {want[i]}"


def test_mrope_positions_match(pair, rng):
    """3-axis positions as transformers' ``position_ids [3, B, T]`` (interleaved MRoPE layout)."""
    model, hf, d = pair
    ids = torch.randint(0, d["vocab_size"], (1, 12), generator=rng)
    pos = torch.cat([torch.arange(3).expand(3, 3),
                     torch.stack([torch.full((6,), 3), torch.arange(2).repeat_interleave(3) + 3,
                                  torch.arange(3).repeat(2) + 3]),
                     (torch.arange(3) + 6).expand(3, 3)], dim=1)
    with torch.no_grad():
        want = hf(input_ids=ids, position_ids=pos.unsqueeze(1)).logits[0]
        plain = hf(input_ids=ids).logits[0]
    assert (want - plain).abs().max() > 1e-3  # the positions matter
    b = bind(model)
    cache = ModelCache(b.config, batch=1, capacity=16, dtype=torch.float32, device="cpu")
    h, _ = Runner(b, cache, dtype=torch.float32, device="cpu").forward(b.embed(ids, torch.float32, "cpu"), pos)
    torch.testing.assert_close(b.logits(h)[0], want, atol=TOL, rtol=TOL)
