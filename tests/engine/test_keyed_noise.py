"""Keyed noise (``engine/keyed_noise.py``) and the keyed draw (``engine/draw.py``).

The hash's bits against an independent restatement of its specification (``tests/oracles/
keyed_draw.py``: Python integers), on the CPU and on CUDA; its uniformity (each bit, the leading
byte, and pairs of neighbours in id, position and seed, by chi-square); the draw against the
float64 oracle; and the draw's distribution (over seeds, and over positions of one seed) against
the row's probabilities. Each chi-square test fails falsely with probability below 1e-7.
"""

from __future__ import annotations

import math

import pytest
import torch
from qwen35_fast.engine.draw import keyed_draw
from qwen35_fast.engine.keyed_noise import exponentials, mix, row_key, row_keys

from tests.oracles import keyed_draw as oracle

P_FAIL = 1e-7


def chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``counts`` against ``expected`` counts (every cell expected >= 5)."""
    assert float(expected.min()) >= 5
    stat = float(((counts.double() - expected) ** 2 / expected).sum())
    dof = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _bits(seed: int, positions, ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[P, K]``: the engine's 32 bits of every id at every position (``mix(id ^ key)``)."""
    keys = torch.tensor([row_key(seed, p) for p in positions], dtype=torch.int64).view(-1, 1)
    return mix(ids.view(1, -1) ^ keys)


def _edges(rng) -> list[tuple[int, int, int]]:
    """(seed, position, id) triples: random ones and the ends of each range."""
    cases = [(0, 0, 0), (2**64 - 1, 2**32 - 1, 248319), (2**32, 1, 2**32 - 1), (2**32 - 1, 2**31, 7)]
    def draw(high: int) -> int:
        return int(torch.randint(0, high, (1,), generator=rng))

    for _ in range(300):
        cases.append((draw(2**62) * 4 + draw(4), draw(2**31) * 2 + draw(2), draw(248320)))
    return cases


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bits_and_noise_equal_the_specification(rng, device):
    """Every triple's bits equal the oracle's (bit for bit, on this device) and its ``E`` the oracle's
    float64 value to a few ulps; a position's key is the same as an int and as a device tensor."""
    cases = _edges(rng)
    ids = torch.tensor([[i] for _, _, i in cases], dtype=torch.int64, device=device)
    keys = torch.tensor([[row_key(s, p)] for s, p, _ in cases], dtype=torch.int64, device=device)
    got_bits = mix(ids ^ keys).flatten().tolist()
    got_e = exponentials(ids, keys).flatten().tolist()
    for (seed, pos, tok), b, e in zip(cases, got_bits, got_e):
        assert row_key(seed, pos) == oracle.position_key(seed, pos)
        assert b == oracle.token_bits(seed, pos, tok), (seed, pos, tok)
        assert e == pytest.approx(oracle.noise(seed, pos, tok), rel=1e-14, abs=0), (seed, pos, tok)
    several = row_keys(5, 11, 3, device)
    assert several.device.type == device and several.flatten().tolist() == [oracle.position_key(5, 11 + i)
                                                                             for i in range(3)]
    assert row_keys(5, 11, 1, device) == oracle.position_key(5, 11)


def test_bad_seed_or_position_is_refused():
    for seed in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
            row_key(seed, 0)
    for pos in (-1, 2**32):
        with pytest.raises(ValueError, match=r"position must be an integer in \[0, 2\*\*32\)"):
            row_key(0, pos)


def test_bits_are_uniform(test_seed):
    """One seed, 256 positions x 4096 ids (2**20 words): every bit is set half the time (within 6
    standard deviations) and the leading byte is uniform over its 256 values."""
    bits = _bits(test_seed, range(1000, 1256), torch.arange(4096)).flatten()
    n = bits.numel()
    shares = torch.stack([((bits >> b) & 1).double().mean() for b in range(32)])
    assert float((shares - 0.5).abs().max()) < 6 * 0.5 / math.sqrt(n), shares
    counts = torch.bincount(bits >> 24, minlength=256)
    assert chi2_pvalue(counts, torch.full((256,), n / 256, dtype=torch.float64)) > P_FAIL


@pytest.mark.parametrize("neighbour", ["id", "position", "seed"])
def test_neighbours_are_independent(test_seed, neighbour):
    """The leading 4 bits of a word and of its neighbour (the next id, the next position, or the next
    seed) are independent: uniform over the 256 pairs."""
    seed = test_seed * 7919
    ids = torch.arange(2048) * 3
    a = _bits(seed, range(512), ids)
    if neighbour == "id":
        b = _bits(seed, range(512), ids + 1)
    elif neighbour == "position":
        b = _bits(seed, range(1, 513), ids)
    else:
        b = _bits(seed + 1, range(512), ids)
    pairs = ((a >> 28) * 16 + (b >> 28)).flatten()
    counts = torch.bincount(pairs, minlength=256)
    assert chi2_pvalue(counts, torch.full((256,), pairs.numel() / 256, dtype=torch.float64)) > P_FAIL


def test_noise_is_exponential(test_seed):
    """``E`` over 2**20 (position, id) pairs: its decile counts are those of Exp(1)."""
    ids = torch.arange(4096).expand(256, -1)
    keys = torch.tensor([row_key(test_seed, p) for p in range(256)], dtype=torch.int64).view(-1, 1)
    e = exponentials(ids, keys).flatten()
    assert e.dtype == torch.float64 and bool((e > 0).all()) and bool(torch.isfinite(e).all())
    edges = torch.tensor([-math.log1p(-q / 10) for q in range(1, 10)], dtype=torch.float64)
    counts = torch.bincount(torch.bucketize(e, edges), minlength=10)
    assert chi2_pvalue(counts, torch.full((10,), e.numel() / 10, dtype=torch.float64)) > P_FAIL


def _random_rows(rng, n: int, k: int, vocab: int):
    probs = torch.softmax(torch.randn(n, k, generator=rng) * 2, dim=-1)
    probs[torch.rand(n, k, generator=rng) < 0.3] = 0.0
    probs[:, 0] += 1e-3  # every row keeps a positive entry
    ids = torch.stack([torch.randperm(vocab, generator=rng)[:k] for _ in range(n)])
    return probs, ids


def test_draw_equals_the_oracle(rng):
    """``keyed_draw`` over candidate lists (several rows at consecutive positions, and one row keyed by
    an int) and over whole rows (ids None): the oracle's token wherever its margin is not a rounding
    question; a token of probability 0 never."""
    checked = 0
    for trial in range(40):
        n, k, vocab = 1 + trial % 4, [2, 20, 300][trial % 3], 5000
        probs, ids = _random_rows(rng, n, k, vocab)
        seed = int(torch.randint(0, 2**62, (1,), generator=rng)) * 4 + trial % 4
        first = int(torch.randint(0, 9000, (1,), generator=rng))
        keys = row_keys(seed, first, n, "cpu")
        got = keyed_draw(probs, ids, keys)
        assert got.dtype == torch.int64 and got.shape == (n,)
        for i in range(n):
            full = torch.zeros(vocab, dtype=torch.float64).index_put_((ids[i],), probs[i].double())
            want, gap = oracle.draw(full, seed, first + i)
            assert full[int(got[i])] > 0
            if gap > 1e-9:
                assert int(got[i]) == want, (trial, i)
                checked += 1
        whole = torch.zeros(1, vocab)
        whole[0, ids[0]] = probs[0]
        assert keyed_draw(whole, None, row_key(seed, first)).tolist() == [oracle.draw(whole[0], seed, first)[0]]
    assert checked > 60, checked


def test_draw_ignores_candidate_order(rng):
    """The token depends on the (id, probability) pairs, not on their order in the list: a permuted
    candidate list draws the same token (the oracle: the unpermuted draw)."""
    probs, ids = _random_rows(rng, 4, 50, 3000)
    keys = row_keys(99, 10, 4, "cpu")
    want = keyed_draw(probs, ids, keys)
    perm = torch.randperm(50, generator=rng)
    assert torch.equal(keyed_draw(probs[:, perm], ids[:, perm], keys), want)


@pytest.mark.parametrize("over", ["seeds", "positions"])
def test_draw_follows_the_row_distribution(rng, over):
    """One row of 7 tokens (two of probability 0) drawn 12,000 times, at one position over seeds or with
    one seed over positions: the counts follow the row's probabilities."""
    p = torch.rand(7, generator=rng, dtype=torch.float64) + 0.05
    p[torch.randperm(7, generator=rng)[:2]] = 0.0
    p = (p / p.sum()).float()
    ids = torch.tensor([3, 17, 4, 250, 9, 1000, 42])
    trials = 12000
    base = int(torch.randint(0, 2**40, (1,), generator=rng))
    if over == "seeds":
        keys = torch.tensor([row_key(base + t, 77) for t in range(trials)]).view(-1, 1)
    else:
        keys = row_keys(base, 0, trials, "cpu")
    got = keyed_draw(p.expand(trials, -1), ids.expand(trials, -1), keys)
    counts = torch.stack([(got == t).sum() for t in ids]).double()
    assert float(counts[p == 0].sum()) == 0, "drew a token of probability 0"
    support = p > 0
    assert chi2_pvalue(counts[support], trials * p[support].double() / float(p[support].sum())) > P_FAIL


def test_draw_rejects_bad_shapes():
    p = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match=r"probs must be a 2-D tensor \[N, K\]"):
        keyed_draw(p[0], None, 0)
    with pytest.raises(ValueError, match="ids must be int64"):
        keyed_draw(p, torch.zeros(2, 3, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="ids must be int64"):
        keyed_draw(p, torch.zeros(2, 4, dtype=torch.int32), 0)
