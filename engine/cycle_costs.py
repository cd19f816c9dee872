"""Wall seconds per draft + verify cycle at each ``mtp`` depth, kept per process and model shape
(``cycle_costs``), for ``mtp="auto"``'s controller (``engine/mtp_auto.py``, whose docstring gives
the model these costs feed)."""

from __future__ import annotations

from collections import deque
from statistics import median

#: each draft adds about a fifth of a plain step (measured: benchmarks/CHANGELOG.md)
PRIOR_SLOPE = 0.2
#: shadow probes and first-cycle overheads kept
WINDOW = 9
#: cycle timings kept per depth
COST_WINDOW = 32
#: a timing over this many times its depth's median (a capture, a pause) is not a cost
OUTLIER = 2.0
#: plain steps a graph capture is assumed to cost before one is seen
CAPTURE_STEPS = 20.0


class CycleCosts:
    """Wall seconds per cycle at each depth (0 = one plain step): the mean of the last
    ``COST_WINDOW`` timings, those over ``OUTLIER`` times their median left out; ``estimate(k)``
    fills untimed depths (``engine/mtp_auto.py``'s docstring says how)."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self._seen: dict[int, deque] = {}
        self._timed: dict[int, float] | None = None  # ``timed()`` until the next ``add``
        self._captures: deque = deque(maxlen=WINDOW)
        self._probes: deque = deque(maxlen=WINDOW)
        #: the tokens the last generation made (0 before one ran)
        self.last_tokens = 0

    def add(self, depth: int, seconds: float) -> None:
        """One cycle (depth >= 1) or one plain step (depth 0) took ``seconds``."""
        if seconds > 0:
            self._seen.setdefault(depth, deque(maxlen=COST_WINDOW)).append(seconds)
            self._timed = None

    def add_capture(self, seconds: float) -> None:
        """A first cycle at a depth took ``seconds`` more than the depth's estimate (its graphs were
        captured; a first generation's Triton compiles inflate it, hence ``capture`` takes the least)."""
        if seconds > 0:
            self._captures.append(seconds)

    def add_probe(self, seconds: float) -> None:
        """A shadow probe (the head's catch-up over a plain segment and its drafts) took ``seconds``."""
        if seconds > 0:
            self._probes.append(seconds)

    def probe(self) -> float | None:
        """Seconds per shadow probe (the median of the last ones), None before one is timed."""
        return median(self._probes) if self._probes else None

    def capture(self) -> float:
        """What capturing one more depth's graphs costs, in ``estimate``'s units."""
        if self._captures and self.timed():
            return min(self._captures)
        return CAPTURE_STEPS * self.estimate(0)

    def timed(self) -> dict[int, float]:
        """The timed depths and their seconds per cycle (the mean of the recent timings that took at
        most ``OUTLIER`` times their median)."""
        if self._timed is None:
            self._timed = {}
            for k, v in self._seen.items():
                bound = OUTLIER * median(v)
                kept = [s for s in v if s <= bound]
                self._timed[k] = sum(kept) / len(kept)
        return dict(self._timed)

    def estimate(self, depth: int) -> float:
        """Seconds per cycle at ``depth``: ``timed()``'s when timed, else from the line through the
        timed depths (never below half the cheapest timed one); with none timed, relative units
        (a plain step = 1)."""
        timed = self.timed()
        if depth in timed:
            return timed[depth]
        if not timed:
            return 1.0 + PRIOR_SLOPE * depth
        if len(timed) == 1:
            (k0, c0), = timed.items()
            base = c0 / (1.0 + PRIOR_SLOPE * k0)
            return base * (1.0 + PRIOR_SLOPE * depth)
        ks, cs = list(timed), list(timed.values())
        mk, mc = sum(ks) / len(ks), sum(cs) / len(cs)
        var = sum((k - mk) ** 2 for k in ks)
        slope = sum((k - mk) * (c - mc) for k, c in zip(ks, cs)) / var
        slope = max(slope, 0.0)  # a deeper cycle never costs less than a shallower one
        return max(mc + slope * (depth - mk), 0.5 * min(cs))


_BOOK: dict[tuple, CycleCosts] = {}


def cycle_costs(key: tuple, max_depth: int) -> CycleCosts:
    """The process-wide ``CycleCosts`` of one model shape (``key``: the model, dtype, device and
    sampling mode a generation runs with)."""
    if key not in _BOOK:
        _BOOK[key] = CycleCosts(max_depth)
    return _BOOK[key]
