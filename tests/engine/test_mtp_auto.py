"""``mtp="auto"``: the depth controller against an expected-throughput oracle, and generations that
switch depths (plain segments, probes, deeper cycles) while staying exact.

The generation tests give the controller stand-in costs (``StandIn``: a cycle at depth k costs
``1 + slope * k`` plain steps), so its choices follow the acceptance only, and draft with
``benchmarks.draft_hook.acceptance_hook``: each draft position right (the MTP-off token, always
kept by greedy) with probability P, else wrong (never kept).
"""

from __future__ import annotations

import random

import pytest
import qwen35_fast.engine.generation as generation
import qwen35_fast.engine.mtp_auto as mtp_auto
import torch
from qwen35_fast.engine import generate
from qwen35_fast.engine.mtp_auto import CycleCosts, DepthController

from benchmarks.draft_hook import acceptance_hook


class StandIn:
    """Costs of the controller's cost interface: ``1 + slope * depth`` per cycle, never updated."""

    def __init__(self, slope: float):
        self.slope = slope
        self.last_depth = None  # each generation starts afresh (at depth 1)

    def estimate(self, depth: int) -> float:
        return 1.0 + self.slope * depth

    def add(self, depth: int, seconds: float) -> None:
        pass


def oracle_depth(acceptance: list[float], slope: float, max_depth: int = 5) -> tuple[int, float]:
    """argmax over k of E_k / c_k, computed here from the true per-position acceptance; and the
    margin of the best over the runner-up."""
    rates = []
    for k in range(max_depth + 1):
        expected, run = 1.0, 1.0
        for j in range(k):
            run *= acceptance[j]
            expected += run
        rates.append(expected / (1.0 + slope * k))
    order = sorted(range(max_depth + 1), key=lambda k: -rates[k])
    return order[0], rates[order[0]] / rates[order[1]]


def simulate(controller: DepthController, acceptance: list[float], cycles: int, seed: int) -> list[int]:
    """Run the controller on a simulated head that keeps draft j with probability acceptance[j-1]
    (given the ones before it were kept); returns the depth each token was made at (0: plain)."""
    rng = random.Random(seed)
    depths = []
    for _ in range(cycles):
        k = controller.choose()
        if k == 0:
            n = controller.segment_length()
            depths += [0] * n
            controller.plain(n, None)
            continue
        accepted = 0
        while accepted < k and rng.random() < acceptance[accepted]:
            accepted += 1
        depths += [k] * (accepted + 1)
        controller.cycle(k, accepted, None)
    return depths


@pytest.mark.parametrize("acceptance,slope", [
    ([0.0] * 5, 0.2),
    ([0.05] * 5, 0.2),
    ([0.98] * 5, 0.2),
    ([0.9, 0.8, 0.3, 0.2, 0.1], 0.2),
    ([0.95, 0.9, 0.85, 0.2, 0.1], 0.15),
    ([0.7, 0.1, 0.1, 0.1, 0.1], 0.3),
    ([0.9, 0.9, 0.9, 0.9, 0.9], 1.2),
])
def test_controller_settles_on_the_oracle_depth(acceptance, slope):
    want, margin = oracle_depth(acceptance, slope)
    assert margin > 1.04, "a case the test can decide: the best depth clearly ahead"
    controller = DepthController(5, StandIn(slope))
    depths = simulate(controller, acceptance, 600, seed=len(acceptance) + int(100 * slope))
    late = depths[len(depths) // 2:]
    share = late.count(want) / len(late)
    assert share > 0.8, (want, {k: late.count(k) for k in set(late)})
    assert controller.best() == want
    if want == 0:  # settled within the probe window: plain within 4 cycles, then plain but for probes
        start = depths.index(0)
        assert start <= 4 and depths[start:start + mtp_auto.FIRST_SEGMENT] == [0] * mtp_auto.FIRST_SEGMENT
        assert share > 0.9


def test_controller_recovers_when_drafts_start_to_be_kept():
    """After a stretch of rejected drafts the controller runs plain steps; when the text becomes
    predictable its probes find it and it drafts deep again."""
    controller = DepthController(5, StandIn(0.2))
    simulate(controller, [0.0] * 5, 50, seed=1)
    assert controller.best() == 0
    later = simulate(controller, [1.0] * 5, 40, seed=2)
    assert later[-60:] == [5] * 60, later
    # the first probe after the longest segment finds it, a few short segments later it drafts again
    assert later.count(0) <= mtp_auto.MAX_SEGMENT + 8 * mtp_auto.FIRST_SEGMENT, later.count(0)


def test_cycle_costs_fill_untimed_depths():
    costs = CycleCosts(5)
    assert costs.estimate(3) == pytest.approx(1 + 3 * mtp_auto.PRIOR_SLOPE)
    for s in (2.0, 2.2, 2.1):
        costs.add(1, s)
    assert costs.estimate(1) == pytest.approx(2.1)  # the median
    assert costs.estimate(0) == pytest.approx(2.1 / (1 + mtp_auto.PRIOR_SLOPE))
    costs.add(3, 3.1)
    assert costs.estimate(5) == pytest.approx(4.1)  # the line through (1, 2.1) and (3, 3.1)
    assert costs.estimate(0) == pytest.approx(1.6)


# ------------------------------------------------------------------ generations


@pytest.fixture
def stand_in(monkeypatch):
    def install(slope: float = 0.2):
        monkeypatch.setattr(generation, "cycle_costs", lambda key, max_depth: StandIn(slope))
    return install


def _run(model, prompt, mtp, hook=None, n=96, prenorm=False):
    kw = dict(do_sample=False, max_length=n, stop_tokens=[], mtp=mtp)
    if hook is not None:
        kw["mtp_draft"] = hook
    return generate(model, prompt, **kw)


def test_auto_at_p0_settles_on_plain_steps(model, rng, stand_in):
    stand_in()
    m, d = model
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    off = _run(m, prompt, "off", n=64)
    res = _run(m, prompt, "auto", acceptance_hook(off.tokens, 0.0, vocab=d["vocab_size"]), n=64)
    assert res.tokens == off.tokens
    st = res.stats
    assert st.accepted == 0 and st.mtp_auto and st.mtp_depth == 5
    cycles = sum(n for k, n in st.mtp_depths.items() if k)
    assert st.mtp_depths[0] >= 56 and cycles <= 5, st.mtp_depths  # 2 cycles to settle, then probes
    assert st.mtp_off and "rarely accepted" in st.mtp_off


def test_auto_at_p1_goes_deep(model, rng, stand_in):
    stand_in()
    m, d = model
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    off = _run(m, prompt, "off", n=64)
    res = _run(m, prompt, "auto", acceptance_hook(off.tokens, 1.0, vocab=d["vocab_size"]), n=64)
    assert res.tokens == off.tokens
    st = res.stats
    assert max(st.mtp_depths) == 5 and st.mtp_depths[5] >= 6 and 0 not in st.mtp_depths, st.mtp_depths
    assert st.mtp_acceptance == [1.0] * 5 and st.mtp_off is None


def phased_hook(reference, vocab: int, seed: int):
    """Drafts kept with probability 1 up to position 30, 0 up to 60, then 0.9: a text that turns
    unpredictable, then predictable again."""
    rng, right = random.Random(seed), {}

    def draft(pos: int) -> int:
        if pos not in right:
            right[pos] = rng.random() < (1.0 if pos < 30 else 0.0 if pos < 60 else 0.9)
        token = reference[pos] if pos < len(reference) else 0
        return token if right[pos] else (token + 1) % vocab
    return draft


@pytest.mark.parametrize("prenorm", [False, True])
def test_auto_switching_depths_is_exact(model, rng, stand_in, prenorm):
    """Greedy through deep drafting, plain segments with probes, and back: the MTP-off tokens (which
    every fixed depth gives: ``test_engine_mtp``)."""
    stand_in()
    m, d = model
    if prenorm:
        from qwen35_fast.engine import bind
        m = bind(m)
        m.mtp_hidden = "prenorm"
    prompt = torch.randn(7, d["hidden_size"], generator=rng)
    off = _run(m, prompt, "off", n=110)
    res = _run(m, prompt, "auto", phased_hook(off.tokens, d["vocab_size"], seed=3), n=110)
    assert res.tokens == off.tokens
    depths = res.stats.mtp_depths
    assert depths.get(0, 0) >= 16 and max(depths) >= 4 and len(depths) >= 4, depths


def test_auto_with_the_real_head_and_real_timings(model, rng):
    """No stand-ins: the head's own drafts and this machine's wall times; greedy stays exact, and
    the stats report what ran."""
    m, d = model
    prompt = torch.randn(4, d["hidden_size"], generator=rng)
    off = _run(m, prompt, "off", n=40)
    res = _run(m, prompt, "auto", n=40)
    assert res.tokens == off.tokens
    st = res.stats
    assert sum(st.mtp_depths.get(k, 0) * 1 for k in st.mtp_depths if k) >= 1
    assert len(st.mtp_acceptance) == 5 and st.mtp_acceptance[0] is not None


def test_next_generation_starts_at_the_last_depth(model, rng, monkeypatch):
    """The cost book remembers the depth a generation ended at; the next one of the same model
    starts there: drafting deep at once after a predictable text, plain at once after the opposite."""
    book = StandIn(0.2)
    monkeypatch.setattr(generation, "cycle_costs", lambda key, max_depth: book)
    m, d = model
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    off = _run(m, prompt, "off", n=48)
    right = acceptance_hook(off.tokens, 1.0, vocab=d["vocab_size"])
    first = _run(m, prompt, "auto", right, n=48)
    assert book.last_depth == 5 and set(first.stats.mtp_depths) > {5}, first.stats.mtp_depths
    again = _run(m, prompt, "auto", acceptance_hook(off.tokens, 1.0, vocab=d["vocab_size"]), n=48)
    shallow = sum(n for k, n in again.stats.mtp_depths.items() if k < 5)
    assert again.tokens == off.tokens and shallow <= 1, again.stats.mtp_depths  # at most the last, short cycle
    wrong = acceptance_hook(off.tokens, 0.0, vocab=d["vocab_size"])
    plain = _run(m, prompt, "auto", wrong, n=48)
    assert book.last_depth == 0
    later = _run(m, prompt, "auto", acceptance_hook(off.tokens, 0.0, vocab=d["vocab_size"]), n=48)
    assert later.tokens == off.tokens
    cycles = [sum(n for k, n in r.stats.mtp_depths.items() if k) for r in (plain, later)]
    assert cycles[1] < cycles[0] and later.stats.mtp_depths[0] >= 40, (cycles, later.stats.mtp_depths)
