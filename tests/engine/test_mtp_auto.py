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
import qwen35_fast.engine.cycle_costs as cycle_costs
import qwen35_fast.engine.generation as generation
import qwen35_fast.engine.mtp_auto as mtp_auto
import torch
from qwen35_fast.engine import generate
from qwen35_fast.engine.cycle_costs import CycleCosts
from qwen35_fast.engine.mtp_auto import DepthController

from benchmarks.draft_hook import acceptance_hook


class StandIn:
    """Costs of the controller's cost interface: ``1 + slope * depth`` per cycle and ``capture``
    per newly captured depth (0: free), never updated."""

    def __init__(self, slope: float, capture: float = 0.0):
        self.slope, self._capture = slope, capture
        self.last_tokens = 0

    def estimate(self, depth: int) -> float:
        return 1.0 + self.slope * depth

    def timed(self) -> dict[int, float]:
        return {}

    def capture(self) -> float:
        return self._capture

    def add(self, depth: int, seconds: float) -> None:
        pass

    def add_capture(self, seconds: float) -> None:
        pass

    def add_probe(self, seconds: float) -> None:
        pass

    def probe(self) -> None:  # untimed probes: segments start at FIRST_SEGMENT
        return None


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


def simulate(controller: DepthController, acceptance: list[float], cycles: int, seed: int, *,
             tokens: int | None = None, ran: list[int] | None = None) -> list[int]:
    """Run the controller on a simulated head that keeps draft j with probability acceptance[j-1]
    (given the ones before it were kept; a shadow probe's drafts likewise) for ``cycles`` cycles
    (a plain segment counts as one), or, with ``tokens``, until that many tokens (the controller
    told the room left, the last segment cut to it); returns the depth each token was made at (0:
    plain). ``ran``: each cycle's depth is appended to it, and 0 for each shadow probe."""
    rng = random.Random(seed)

    def kept(k: int) -> int:
        accepted = 0
        while accepted < k and rng.random() < acceptance[accepted]:
            accepted += 1
        return accepted

    depths = []
    ran = [] if ran is None else ran
    for _ in range(cycles):
        if tokens is not None:
            if len(depths) >= tokens:
                break
            controller.room = tokens - len(depths)
        k = controller.choose()
        if k == 0:
            n = controller.segment_length() if tokens is None else min(controller.segment_length(), controller.room)
            depths += [0] * n
            controller.plain(n, None)
            shadow = controller.shadow_depth()
            if shadow:
                controller.shadow(shadow, kept(shadow))
                ran.append(0)
            continue
        accepted = kept(k)
        depths += [k] * (accepted + 1)
        controller.cycle(k, accepted, None)
        ran.append(k)
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
    if want == 0:  # settled within the probe window: plain within 8 cycles (24 when 5% are kept: a kept
        # draft lifts the bound), then plain but for rare cycles (depth 1 costs 1.2 plain steps: plain
        # once the first draft's upper bound is under 0.2, which 7 rejected drafts reach from the prior
        # 0.5: 0.5 / 7.2 + 1.25 * sqrt(0.069 * 0.931 / 7.2) = 0.19)
        start = depths.index(0)
        first = depths[start:start + mtp_auto.FIRST_SEGMENT]
        assert start <= (8 if max(acceptance) == 0 else 24) and first == [0] * mtp_auto.FIRST_SEGMENT
        assert share > 0.95


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
    assert costs.estimate(3) == pytest.approx(1 + 3 * cycle_costs.PRIOR_SLOPE)
    for s in (2.0, 2.2, 2.1):
        costs.add(1, s)
    assert costs.estimate(1) == pytest.approx(2.1)  # the mean
    assert costs.estimate(0) == pytest.approx(2.1 / (1 + cycle_costs.PRIOR_SLOPE))
    costs.add(3, 3.1)
    assert costs.estimate(5) == pytest.approx(4.1)  # the line through (1, 2.1) and (3, 3.1)
    assert costs.estimate(0) == pytest.approx(1.6)


def test_cycle_costs_are_the_mean_of_two_groups_without_outliers():
    """A depth's cycles come in two groups (drafts kept: more tokens to report and catch up), most
    of the recent ones in the faster group: the cost is their mean (tokens per second need the
    mean time), which a median (4.2) misses; a capture or a pause (over ``OUTLIER`` times the
    median) is left out; only the last ``COST_WINDOW`` timings count."""
    costs = CycleCosts(5)
    costs.add(1, 9.0)  # older than the window: dropped
    times = [4.2, 4.2, 5.0] * 10 + [4.2, 5.0]
    for s in times[:16]:
        costs.add(1, s)
    costs.add(1, 80.0)  # a capture
    for s in times[16:]:
        costs.add(1, s)
    assert len(times) + 1 > cycle_costs.COST_WINDOW
    kept = (times + [80.0])[-cycle_costs.COST_WINDOW:]
    expected = sum(s for s in kept if s < 80.0) / (len(kept) - 1)
    assert costs.timed()[1] == pytest.approx(expected)
    assert costs.estimate(1) == pytest.approx(expected) and expected > 4.4


def test_capture_cost_is_the_least_first_cycle_overhead():
    costs = CycleCosts(5)
    assert costs.capture() == pytest.approx(cycle_costs.CAPTURE_STEPS)  # plain steps, before any timing
    costs.add(0, 0.004)
    assert costs.capture() == pytest.approx(cycle_costs.CAPTURE_STEPS * 0.004)
    for s in (2.4, 0.07, 0.09):  # a first generation's compile, then captures alone
        costs.add_capture(s)
    assert costs.capture() == pytest.approx(0.07)


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


def _auto_against_off(model, rng, p: float, n: int):
    """MTP off, then ``mtp="auto"`` with each draft right with probability ``p``, greedy on one random
    prompt; auto's tokens must be off's. Returns ``(prompt, off, auto)``."""
    m, d = model
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    off = _run(m, prompt, "off", n=n)
    res = _run(m, prompt, "auto", acceptance_hook(off.tokens, p, vocab=d["vocab_size"]), n=n)
    assert res.tokens == off.tokens
    return prompt, off, res


def test_auto_at_p0_settles_on_plain_steps(model, rng, stand_in):
    stand_in()
    _, _, res = _auto_against_off(model, rng, 0.0, 64)
    st = res.stats
    assert st.accepted == 0 and st.mtp_auto and st.mtp_depth == 5
    cycles = sum(n for k, n in st.mtp_depths.items() if k)
    # cycles until plain steps are ahead even at the acceptance's upper bound (7-8 rejected drafts)
    assert st.mtp_depths[0] >= 54 and cycles <= 8, st.mtp_depths
    assert st.mtp_off and "rarely accepted" in st.mtp_off


def test_auto_at_p1_goes_deep(model, rng, stand_in):
    stand_in()
    _, _, res = _auto_against_off(model, rng, 1.0, 64)
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
    # the trace accounts for the decode's wall time, at the depths that ran, and for every switch
    trace = res.stats.mtp_trace
    assert set(trace["wall_s"]) == set(depths) and trace["probes"] >= 1, trace
    spent = sum(trace["wall_s"].values()) + trace["probe_s"]
    assert 0.8 * res.stats.decode_s <= spent <= 1.001 * res.stats.decode_s, (spent, res.stats.decode_s)
    moves = trace["switches"]
    assert moves and all(m["to"] in depths and m["from"] != m["to"] for m in moves), moves
    assert [m["from"] for m in moves[1:]] == [m["to"] for m in moves[:-1]], moves


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


def test_every_generation_starts_at_depth_1(model, rng, monkeypatch):
    """Whatever the last generation of the same model did, the next starts at depth 1: after a
    predictable text (every draft kept) it is back at depth 5 within a few cycles; after one whose
    drafts were never kept, it drafts until plain steps are ahead (never starting plain: a plain
    segment observes the acceptance once), then runs plain."""
    book = StandIn(0.2)
    monkeypatch.setattr(generation, "cycle_costs", lambda key, max_depth: book)
    m, d = model
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    off = _run(m, prompt, "off", n=48)
    first = _run(m, prompt, "auto", acceptance_hook(off.tokens, 1.0, vocab=d["vocab_size"]), n=48)
    assert set(first.stats.mtp_depths) > {5}, first.stats.mtp_depths
    again = _run(m, prompt, "auto", acceptance_hook(off.tokens, 1.0, vocab=d["vocab_size"]), n=48)
    moves = again.stats.mtp_trace["switches"]
    assert again.tokens == off.tokens and moves[0]["from"] == 1, moves
    shallow = sum(n for k, n in again.stats.mtp_depths.items() if k < 5)
    assert again.stats.mtp_depths[1] >= 1 and shallow <= 6, again.stats.mtp_depths
    _run(m, prompt, "auto", acceptance_hook(off.tokens, 0.0, vocab=d["vocab_size"]), n=48)
    later = _run(m, prompt, "auto", acceptance_hook(off.tokens, 0.0, vocab=d["vocab_size"]), n=48)
    assert later.tokens == off.tokens
    assert set(later.stats.mtp_depths) == {0, 1} and later.stats.mtp_depths[1] <= 8, later.stats.mtp_depths
    assert later.stats.mtp_depths[0] >= 38, later.stats.mtp_depths


def test_a_new_depth_must_be_worth_its_capture():
    """Every draft kept, drafting at depth 1: deeper is better (depth 5: 6 tokens for 2 plain steps
    against depth 1's 2 for 1.2), but a depth's graphs cost 100 plain steps. Early in the generation
    (horizon ``HORIZON_MIN`` = 256 tokens: about 67 steps saved) the controller stays at depth 1;
    once the generation has made enough tokens that the rest is expected to repay the capture it
    leaves; with only 300 tokens of room it never does; a capture of 20 steps is worth it at once."""
    def tokens_at_depth_1(capture: float, room: int | None = None) -> int:
        controller = DepthController(5, StandIn(0.2, capture=capture))
        controller.room = room
        depths = simulate(controller, [1.0] * 5, 300, seed=0)
        return next((i for i, k in enumerate(depths) if k != 1), len(depths))

    assert tokens_at_depth_1(20.0) <= 2
    left = tokens_at_depth_1(100.0)
    # saved over h tokens: h / (2 / 1.2) - h / (6 / 2) = 0.267 h > 100 once h = tokens so far > 375
    assert 375 <= left <= 420, left  # the estimates reach ~0.99 a few cycles in
    assert tokens_at_depth_1(100.0, room=300) == 600  # never: 300 cycles of 2 tokens at depth 1


def test_probes_stay_a_small_share_of_plain_time():
    """Half the first drafts kept (the shadow probes keep matching) but drafting never worth its
    capture: the controller stays plain, and once a probe is timed at 3 plain steps the segments
    after a matched probe are long enough that probes cost PROBE_SHARE of the plain time (150
    tokens), not FIRST_SEGMENT (probing every 32 tokens would cost 9%)."""
    costs = CycleCosts(5)
    for _ in range(3):
        costs.add(0, 0.004)
        costs.add(1, 0.0052)
    costs.add_capture(10.0)  # a capture no horizon repays: plain steps throughout
    controller = DepthController(5, costs)
    controller.depth = 0  # as after drafts rarely kept (a generation starts at depth 1 at least)
    assert controller.shortest_segment() == mtp_auto.FIRST_SEGMENT  # no probe timed yet
    costs.add_probe(0.012)
    assert controller.shortest_segment() == 150  # 0.012 / (0.02 * 0.004)
    depths = simulate(controller, [0.5] * 5, 40, seed=3)
    assert set(depths) == {0}
    probes = 40  # one per plain segment
    assert len(depths) / probes >= 150 * 0.9, len(depths) / probes


def test_the_last_generation_length_sets_the_horizon():
    """After a generation of 1000 tokens the next expects as many: a capture of 100 plain steps
    pays at once (0.267 * 1000 > 100)."""
    costs = StandIn(0.2, capture=100.0)
    costs.last_tokens = 1000
    controller = DepthController(5, costs)
    depths = simulate(controller, [1.0] * 5, 100, seed=0)
    assert next(i for i, k in enumerate(depths) if k != 1) <= 12, depths[:20]


def test_shadow_probes_bring_drafting_back(model, rng, monkeypatch):
    """A text whose drafts are wrong for its first 12 tokens and right after: the generation leaves
    depth 1 for plain steps, the shadow drafts after the first segment match the next segment's
    tokens, and drafting resumes after it at depth 1 (then deeper), with no probe cycle; greedy stays
    exact. A generation after one that ended plain starts at depth 1 and leaves it within a few cycles."""
    book = StandIn(0.2)
    monkeypatch.setattr(generation, "cycle_costs", lambda key, max_depth: book)
    m, d = model
    prompt = torch.randn(5, d["hidden_size"], generator=rng)
    off = _run(m, prompt, "off", n=120)
    right = acceptance_hook(off.tokens, 1.0, vocab=d["vocab_size"])
    wrong = acceptance_hook(off.tokens, 0.0, vocab=d["vocab_size"])
    res = _run(m, prompt, "auto", lambda pos: wrong(pos) if pos < 12 else right(pos), n=120)
    st = res.stats
    assert res.tokens == off.tokens
    # the first probe is scored by the segment after it: two segments, then depth 1 and deeper
    assert st.mtp_depths[0] == 2 * mtp_auto.FIRST_SEGMENT and st.mtp_depths.get(5, 0) >= 4, st.mtp_depths
    assert res.stats.mtp_trace["switches"][1]["to"] == 1, res.stats.mtp_trace["switches"]
    never = _run(m, prompt, "auto", acceptance_hook(off.tokens, 0.0, vocab=d["vocab_size"]), n=120)
    cycles = sum(n for k, n in never.stats.mtp_depths.items() if k)
    assert never.tokens == off.tokens and cycles <= 8, never.stats.mtp_depths


def test_a_segment_catch_up_in_chunks_equals_one_forward(model, rng, monkeypatch):
    """The head's catch-up over a plain segment's 33 rows, run as decode-row pieces (6-row ones,
    single rows, then the last row with its logits; float32, the module path), leaves the MTP
    cache and the drafts as one forward over all rows does, after rows already in the cache."""
    from qwen35_fast.engine import bind, speculative
    from qwen35_fast.engine.rope import RowPositions
    from qwen35_fast.engine.sampling import Sampler
    from qwen35_fast.engine.sampling_params import SamplingParams
    from qwen35_fast.engine.stack import build_runner

    m, d = model
    binding = bind(m)
    h, start, rows = d["hidden_size"], 4, 33
    hid = torch.randn(1, start + rows, h, generator=rng)
    emb = torch.randn(1, start + rows, h, generator=rng)
    params = SamplingParams(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    seen = []
    for limit in (speculative.CHUNKED_MAX, 0):  # chunked, then one forward
        monkeypatch.setattr(speculative, "CHUNKED_MAX", limit)
        runner = build_runner(binding, capacity=64, dtype=torch.float32, device="cpu", fused=False,
                              cuda_graphs=False)
        positions = RowPositions(torch.arange(start).expand(3, start))
        sampler = Sampler(params, seed=0, first_position=start, stop_tokens=[], min_tokens=0, initial_tokens=[],
                          device="cpu", mtp_draft="argmax")
        with torch.no_grad():
            speculative.draft(binding, runner, sampler, positions, hid[:, :start], emb[:, :start], 0, start, 1)
            drafts = speculative.draft(binding, runner, sampler, positions, hid[:, start:], emb[:, start:],
                                       start, start + rows, 2, chunk=6)
        mtp = runner.cache.mtp
        seen.append((drafts.tolist(), mtp.host_length, mtp.k[:, :, :start + rows].clone(),
                     mtp.v[:, :, :start + rows].clone()))
    (d1, n1, k1, v1), (d2, n2, k2, v2) = seen
    assert d1 == d2 and n1 == n2 == start + rows
    torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)


def test_a_small_gain_keeps_drafting():
    """The H100's costs (a cycle at depth k: 1 + 0.256 k plain steps, the 9B int8 file's fixed-depth
    rows) and a first draft kept 35% of the time: depth 1 makes 7.5% more tokens a second than plain
    steps. The estimate of a few kept drafts is noisy, and a controller that leaves for plain steps
    at the first dip stays there (a plain segment observes the acceptance once); with
    ``HYSTERESIS_PLAIN`` most of the tokens are drafted at depth 1 (over 10 seeds)."""
    shares = []
    for seed in range(10):
        controller = DepthController(5, StandIn(0.256))
        depths = simulate(controller, [0.35] * 5, 300, seed=seed)[:400]
        shares.append(sum(k == 1 for k in depths) / len(depths))
    assert sum(shares) / len(shares) > 0.6, shares


class Measured(StandIn):
    """The H100's wall times per cycle (9B int8 file, sampled, ``comfy_e2e.py --accept``): a plain
    step 3.72 ms, depth 1..5 4.82, 5.40, 6.05, 6.72, 7.52 ms."""

    COSTS = (3.72, 4.82, 5.40, 6.05, 6.72, 7.52)

    def __init__(self):
        super().__init__(0.0)

    def estimate(self, depth: int) -> float:
        return self.COSTS[depth]


def rate_against_best(kept: float, seed: int, tokens: int = 300, probe_ms: float = 5.0) -> float:
    """Tokens per ms of ``mtp="auto"`` over ``tokens`` tokens on ``Measured`` costs, each draft kept
    with probability ``kept`` (a shadow probe costing ``probe_ms``), over the best fixed choice's
    expected rate (plain steps or depth k: ``sum_j kept**j, j = 0..k`` tokens per cycle)."""
    costs, ran = Measured(), []
    depths = simulate(DepthController(5, costs), [kept] * 5, 10**6, seed, tokens=tokens, ran=ran)
    ms = depths.count(0) * costs.COSTS[0] + sum(costs.COSTS[k] if k else probe_ms for k in ran)
    best = max(sum(kept ** j for j in range(k + 1)) / costs.COSTS[k] for k in range(6))
    return len(depths) / ms / best


@pytest.mark.parametrize("kept", [0.0, 0.2, 0.3, 0.35, 0.5, 0.9])
def test_auto_is_near_the_best_choice_on_the_h100_costs(kept):
    """The issue's target (auto >= 0.97x the best of off and depths 1..5) on the H100's measured
    costs, over 40 simulated generations of 300 tokens (the median). At 35% kept (the sampled
    ``--accept 0.3`` run's true acceptance) depth 1 is 4% ahead of plain steps; a controller that
    left drafting whenever its decayed estimate dipped below the break-even stayed plain (0.95x,
    measured and simulated alike)."""
    ratios = sorted(rate_against_best(kept, seed) for seed in range(40))
    assert ratios[len(ratios) // 2] >= 0.97, ratios
