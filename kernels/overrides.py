"""Launch overrides for measuring decode kernels in the step itself: settings a module parses from
an environment variable, read again each time a fused plan is built (``FusedPlan.build``, once
per generation), so one process can compare launch settings (``benchmarks/comfy_e2e.py
--variants``). Each kernel module holds one ``EnvOverrides`` and its own ``parse``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator


def entries(text: str) -> Iterator[str]:
    """The ``;``-separated entries of a variable's value, stripped, empty ones skipped."""
    for raw in text.split(";"):
        entry = raw.strip()
        if entry:
            yield entry


def pow2_between(v: int, lo: int, hi: int) -> bool:
    """``lo <= v <= hi`` and ``v`` a power of two (``lo`` >= 1)."""
    return lo <= v <= hi and v & (v - 1) == 0


class EnvOverrides:
    """``parse(os.environ[env])`` (``{}`` while ``env`` is unset), in ``values``; ``parse`` raises
    ValueError naming ``env`` and its form for a malformed value."""

    def __init__(self, env: str, parse: Callable[[str], dict]):
        self.env, self.parse, self.values = env, parse, {}

    def load(self) -> dict:
        """Read ``env`` again; returns a copy of the settings now in force. A ValueError from
        ``parse`` leaves the previous ones in force."""
        self.values = self.parse(os.environ.get(self.env, ""))
        return dict(self.values)
