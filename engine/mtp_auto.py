"""``mtp="auto"``: the draft depth (0..5) chosen before every cycle from acceptance and step costs.

Model. A cycle at depth k (k drafts, one verify of k + 1 rows) yields on average
``E_k = 1 + sum_{j=1..k} prod_{i<=j} a_i`` tokens, where ``a_i`` is the probability that draft i
is accepted once drafts 1..i-1 were; it costs ``c_k`` seconds; depth 0 is a plain step (``E_0 =
1``, ``c_0``). The controller runs the depth with the largest ``E_k / c_k``.

* **Acceptance** ``a_i``: counts of drafts at position i reached and accepted, each multiplied by
  ``DECAY`` when position i is reached again (an average over its last ~12 drafts: the estimate
  follows the text), with a prior of weight ``PRIOR_WEIGHT``: 0.5 for position 1, the estimate of
  position i - 1 for the others (a position never reached is assumed as good as the one before
  it, so a head that keeps every draft is tried deeper).
* **Costs** ``c_k``: host wall time per cycle (draft, verify, catch-up and the host's own work,
  callbacks included: what a user waits for), the mean of the last ``COST_WINDOW`` cycles at each
  depth that took at most ``OUTLIER`` times their median (a capture or a pause is not a cost),
  kept per process and model shape (``cycle_costs``) so a later generation starts from the last
  one's (``engine/cycle_costs.py``). The mean: cycles that kept drafts take longer than those
  that kept none, and a median follows whichever group the last few fell in. A depth not yet
  timed is estimated from a line through the timed ones, or, with one timed depth, from
  ``PRIOR_SLOPE`` (each draft adding a fixed share of a plain step).
* **Start**: at depth 1, never plain: a depth-1 cycle whose draft is rejected costs little more
  than a plain step and observes the acceptance every cycle, where plain steps observe it once a
  segment (a start at depth 0 stayed plain where drafting paid). Drafts kept take it deeper within
  a few cycles (an unreached position is assumed as good as the one before it).
* **Capture cost**: the first cycle at a depth captures that depth's CUDA graphs unless the
  stack kept from the last generation has them (``ready``, ``engine/held.py``): tens of plain
  steps. ``CycleCosts.capture()`` is the smallest
  such overhead seen (a first cycle's wall time over the depth's estimate; ``CAPTURE_STEPS``
  plain steps before one is seen). A depth without graphs is switched to only when the time it
  saves over the expected rest of the generation exceeds that cost: ``HORIZON_MIN`` tokens, or
  more when the tokens made so far, or what the last generation of the same model made beyond
  them, say so; at most the room left.
* **Switching**: to the best depth when it is ``HYSTERESIS`` better than the current one (for a
  depth not yet run, also worth its capture). From drafting to plain steps only when plain steps
  beat every depth even at the acceptance's upper bound (``upper``, ``LEAVE_Z`` standard errors up):
  plain segments observe the acceptance once a probe, so leaving on a dip of the estimate lasts;
  drafts never kept still leave within a few cycles. At depth 0 the
  controller asks for a plain segment of ``segment_length()`` tokens; after it, ``shadow_depth()``
  drafts are made by the MTP head (no verify step, so no verify graph to capture) and compared with
  the next segment's first tokens: the verify keeps a draft exactly when it equals the model's token
  at its position (the argmax, or the keyed draw the segment made there), so each comparison is the
  decision the verify would have made. A shadow probe with no draft kept doubles the segment (up to
  ``MAX_SEGMENT``), a kept one resets it to the shortest segment, ``FIRST_SEGMENT`` tokens or as
  many as keep the probes' wall time (``CycleCosts.probe``, the median of the last ones) within
  ``PROBE_SHARE`` of the plain steps' (a probe after every short segment kept a generation plain
  while drafting paid). A probe whose drafts were all kept returns to depth 1, whose cycles
  observe the acceptance every time (the text may have become predictable). Every ``DEEPER_EVERY``
  cycles at depth k < max whose last drafts are mostly kept, one cycle runs at k + 1 when that is
  worth its capture (its cost is then timed, not guessed).

The choice depends on past acceptance and wall times only and never changes a token: each is the
model's own at its position (``speculative``), so the text is that of MTP off and of any fixed depth.
The measurements behind these rules are in ``benchmarks/CHANGELOG.md``.
"""

from __future__ import annotations

import math

from .cycle_costs import CycleCosts

DECAY = 0.92
PRIOR_WEIGHT = 1.0
PRIOR_FIRST = 0.5
HYSTERESIS = 1.02
LEAVE_Z = 1.25
FIRST_SEGMENT = 32
MAX_SEGMENT = 256
DEEPER_EVERY = 24
SHADOW_DEPTH = 2
PROBE_SHARE = 0.02
HORIZON_MIN = 256


class DepthController:
    """Chooses each cycle's draft depth for ``mtp="auto"`` (see the module docstring).

    Use: set ``room`` (tokens the generation may still make), ``choose()`` -> depth for the next
    cycle (0: run ``segment_length()`` plain steps); after it, ``cycle(depth, accepted, seconds,
    first_seconds=)`` or ``plain(tokens, seconds_per_token)`` (``seconds`` None: not timed, e.g. a
    cycle that captured a graph); after a plain segment ``shadow_depth()`` drafts, scored by
    ``shadow(depth, matched)`` once the next segment's tokens are known. ``summary()`` for the stats.
    """

    def __init__(self, max_depth: int, costs: CycleCosts, ready: set[int] = frozenset()):
        self.max_depth = max_depth
        self.ready = set(ready)  # depths whose graphs exist before this generation (a kept stack's)
        self.costs = costs
        self.depth = 1
        self._reached = [0.0] * (max_depth + 1)  # decayed counts, index = draft position (1-based)
        self._kept = [0.0] * (max_depth + 1)
        self.histogram = [0] * (max_depth + 1)  # cycles (plain: tokens) run at each depth
        self.drafted = [0] * (max_depth + 1)  # undecayed, for the report
        self.accepted = [0] * (max_depth + 1)
        self._segment = FIRST_SEGMENT
        self._since_deeper = 0
        self._next: int | None = None
        self._shadow_due = False
        #: tokens made so far in this generation; the room left (set by the caller, None: unknown)
        self.tokens, self.room = 0, None
        self.off_reason = None
        self._wall = [0.0] * (max_depth + 1)  # wall seconds spent at each depth (plain: segments)
        self._probes = [0, 0.0]  # shadow probes run, their wall seconds
        self._switches: list[dict] = []  # each change of depth, with what the controller saw

    # ------------------------------------------------------------------ estimates
    def acceptance(self) -> list[float]:
        """``a_1..a_max`` (index 0 unused, 1.0): the decayed estimate per draft position."""
        out = [1.0]
        prior = PRIOR_FIRST
        for j in range(1, self.max_depth + 1):
            a = (self._kept[j] + PRIOR_WEIGHT * prior) / (self._reached[j] + PRIOR_WEIGHT)
            out.append(a)
            prior = a
        return out

    def upper(self) -> list[float]:
        """``acceptance()`` with each position raised by ``LEAVE_Z`` standard errors, ``sqrt(a (1 - a)
        / n)`` with ``n`` its decayed count of drafts reached plus the prior's weight; at most 1."""
        a, n = self.acceptance(), [r + PRIOR_WEIGHT for r in self._reached]
        return [1.0] + [min(1.0, a[j] + LEAVE_Z * math.sqrt(a[j] * (1.0 - a[j]) / n[j])) for j in range(1, len(a))]

    def expected_tokens(self, depth: int, acceptance: list[float] | None = None) -> float:
        """``E_depth``: tokens a cycle at ``depth`` yields on average."""
        a = self.acceptance() if acceptance is None else acceptance
        total, run = 1.0, 1.0
        for j in range(1, depth + 1):
            run *= a[j]
            total += run
        return total

    def rate(self, depth: int, acceptance: list[float] | None = None) -> float:
        """Expected tokens per second (per cost unit before anything is timed) at ``depth``."""
        return self.expected_tokens(depth, acceptance) / self.costs.estimate(depth)

    def best(self) -> int:
        """The depth with the highest expected rate now (ties: the shallower)."""
        a = self.acceptance()
        rates = [self.rate(k, a) for k in range(self.max_depth + 1)]
        return max(range(self.max_depth + 1), key=lambda k: (rates[k], -k))

    # ------------------------------------------------------------------ decisions
    def choose(self) -> int:
        """The depth to run next (0 = a plain segment of ``segment_length()`` tokens)."""
        if self._next is not None:
            depth, self._next = self._next, None
            return depth
        return self.depth

    def segment_length(self) -> int:
        """Plain steps to run before the next shadow probe."""
        return self._segment

    def horizon(self) -> float:
        """Tokens the rest of the generation is expected to make: ``HORIZON_MIN``, or as many as so
        far, or what the last generation made beyond that, whichever is most; at most the room left."""
        h = max(HORIZON_MIN, self.tokens, self.costs.last_tokens - self.tokens)
        return h if self.room is None else min(h, self.room)

    def captured(self, depth: int) -> bool:
        """Whether ``depth``'s graphs exist: it ran there, runs there now, or a kept stack has them."""
        return depth == self.depth or self.histogram[depth] > 0 or depth in self.ready

    def worth(self, depth: int, a: list[float]) -> bool:
        """Whether running ``depth`` instead of the current depth pays: by ``HYSTERESIS``, and for a
        depth without graphs by more than its capture over ``horizon()`` tokens; plain steps instead
        of drafting only when they beat every depth at the acceptance's upper bound (``upper``)."""
        if depth == 0 < self.depth:
            u = self.upper()
            return self.rate(0, u) > max(self.rate(k, u) for k in range(1, self.max_depth + 1))
        now, then = self.rate(self.depth, a), self.rate(depth, a)
        if then <= HYSTERESIS * now:
            return False
        if self.captured(depth):
            return True
        h = self.horizon()
        return h / now - h / then > self.costs.capture()

    def _decide(self) -> None:
        a = self.acceptance()
        best = self.best()
        if best != self.depth and self.worth(best, a):
            self._switch(best, a)
        if self.depth == 0:
            self.off_reason = (f"drafts were rarely accepted (estimated {100 * a[1]:.0f}% at the first position): "
                               f"plain steps, probing every {self._segment} tokens")
        elif (self.depth < self.max_depth and self._since_deeper >= DEEPER_EVERY
              and a[self.depth] >= 0.5):
            self._since_deeper = 0
            deeper = self.depth + 1
            if self.captured(deeper) or self.horizon() * (1 / self.rate(self.depth, a) - 1 / self.rate(deeper, a)) \
                    > self.costs.capture():
                self._next = deeper

    def _switch(self, depth: int, a: list[float]) -> None:
        if len(self._switches) < 64:
            self._switches.append({"at": self.tokens, "from": self.depth, "to": depth, **self._estimates(a)})
        self.depth = depth

    # ------------------------------------------------------------------ observations
    def _observe(self, depth: int, accepted: int) -> None:
        for j in range(1, min(accepted + 1, depth) + 1):  # the positions this draft run decided
            kept = j <= accepted
            self._reached[j] = DECAY * self._reached[j] + 1.0
            self._kept[j] = DECAY * self._kept[j] + kept
            self.drafted[j] += 1
            self.accepted[j] += kept

    def cycle(self, depth: int, accepted: int, seconds: float | None, *, first_seconds: float | None = None,
              wall: float = 0.0) -> None:
        """A cycle of ``depth`` drafts kept ``accepted`` of them and took ``seconds`` (None: untimed).
        ``first_seconds``: the wall time of the generation's first cycle at this depth (it captured
        the depth's graphs; not a cost sample). ``wall``: its wall seconds, timed or not (``trace``)."""
        self._wall[depth] += wall
        self._observe(depth, accepted)
        self.histogram[depth] += 1
        self.tokens += accepted + 1
        self._since_deeper += 1
        if seconds is not None:
            self.costs.add(depth, seconds)
        if first_seconds is not None and depth in self.costs.timed():
            self.costs.add_capture(first_seconds - self.costs.estimate(depth))
        self._decide()

    def plain(self, tokens: int, seconds_per_token: float | None, wall: float = 0.0) -> None:
        """A plain segment produced ``tokens`` tokens at ``seconds_per_token`` (None: untimed) in
        ``wall`` seconds; a shadow probe is due after it (``shadow_depth``)."""
        self._wall[0] += wall
        self.histogram[0] += tokens
        self.tokens += tokens
        if seconds_per_token is not None:
            self.costs.add(0, seconds_per_token)
        self._shadow_due = True

    def shadow_depth(self) -> int:
        """Drafts to make now for a shadow probe (0: none due): after a plain segment, at depth 0."""
        due, self._shadow_due = self._shadow_due, False
        return min(SHADOW_DEPTH, self.max_depth) if due and self.depth == 0 else 0

    def probed(self, seconds: float) -> None:
        """A shadow probe (the head's catch-up and its drafts) took ``seconds``."""
        self._probes[0] += 1
        self._probes[1] += seconds
        self.costs.add_probe(seconds)

    def shadow(self, depth: int, matched: int) -> None:
        """A shadow probe's ``depth`` drafts: the first ``matched`` equal the tokens the model then
        drew. Observed as a cycle's acceptance (untimed); sets the next segment's length; all of them
        kept: back to depth 1."""
        self._observe(depth, matched)
        self._segment = self.shortest_segment() if matched else min(2 * self._segment, MAX_SEGMENT)
        self._decide()
        if matched == depth and self.depth == 0 and self.captured(1):
            self._switch(1, self.acceptance())

    def shortest_segment(self) -> int:
        """``FIRST_SEGMENT``, or the plain tokens whose time a probe's is ``PROBE_SHARE`` of when
        both are timed; at most ``MAX_SEGMENT``."""
        probe, timed = self.costs.probe(), self.costs.timed()
        if probe is None or 0 not in timed:
            return FIRST_SEGMENT
        return min(MAX_SEGMENT, max(FIRST_SEGMENT, math.ceil(probe / (PROBE_SHARE * timed[0]))))

    def trace(self) -> dict:
        """Where the generation's wall time went and why the depth changed (benchmarks, the debug
        log): ``wall_s`` {depth: seconds}, ``probes`` / ``probe_s``, ``switches`` (the first 64: at
        how many tokens, from and to which depth, the acceptance estimate ``a`` per position and
        the cost estimate per depth in ms), the same estimates at the end, the timed depths and the
        depths whose graphs existed before the generation."""
        return {"wall_s": {k: round(w, 4) for k, w in enumerate(self._wall) if w},
                "probes": self._probes[0], "probe_s": round(self._probes[1], 4), "switches": self._switches,
                **self._estimates(self.acceptance()), "timed": sorted(self.costs.timed()), "ready": sorted(self.ready)}

    def _estimates(self, a: list[float]) -> dict:
        """``a``: the acceptance estimate per draft position (``acceptance()``'s, rounded); ``cost_ms``:
        the cost estimate per depth 0..max in milliseconds."""
        return {"a": [round(x, 3) for x in a[1:]],
                "cost_ms": [round(1e3 * self.costs.estimate(k), 3) for k in range(self.max_depth + 1)]}

    def summary(self) -> dict:
        """``depths``: {depth: cycles run (depth 0: plain tokens)}; ``acceptance``: per draft
        position, accepted / reached over the whole generation; ``off``: why plain steps ran, or
        None; ``trace``: ``trace()`` (None for a fixed depth)."""
        return {"depths": {k: n for k, n in enumerate(self.histogram) if n},
                "acceptance": [self.accepted[j] / self.drafted[j] if self.drafted[j] else None
                               for j in range(1, self.max_depth + 1)],
                "off": self.off_reason if self.histogram[0] else None,
                "trace": self.trace()}


class FixedDepth:
    """The controller of a fixed ``mtp`` depth: always ``depth``; keeps the same report."""

    def __init__(self, depth: int):
        self.depth = self.max_depth = depth
        self.histogram = [0] * (depth + 1)
        self.drafted = [0] * (depth + 1)
        self.accepted = [0] * (depth + 1)
        self.off_reason = None
        self.room = None

    def choose(self) -> int:
        return self.depth

    def shadow_depth(self) -> int:
        return 0

    def cycle(self, depth: int, accepted: int, seconds: float | None, *, first_seconds: float | None = None,
              wall: float = 0.0) -> None:
        self.histogram[depth] += 1
        for j in range(1, min(accepted + 1, depth) + 1):
            self.drafted[j] += 1
        for j in range(1, accepted + 1):
            self.accepted[j] += 1

    def trace(self) -> None:
        """A fixed depth keeps no trace."""
        return None

    summary = DepthController.summary
