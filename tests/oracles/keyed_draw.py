"""The keyed draw restated on the host from its specification (pure Python integers and float64;
test-only, sharing no code with ``engine/keyed_noise.py`` or ``engine/draw.py``).

Specification: 32-bit words; ``h(x)``: xor-shift right 16, times 0x7FEB352D, xor-shift right 15,
times 0x5BD1E995, xor-shift right 16 (products mod 2**32). The key of (seed, position) is
``h(h(h(seed_low ^ 0x9E3779B9) ^ seed_high) ^ position)``; a token's 32 bits are ``h(id ^ key)``;
with ``v = (bits + 0.5) / 2**32`` the noise is ``E = -log(1 - v)``; the token drawn from a
distribution ``p`` at that position is ``argmax_id p[id] / E(id)`` (first id on a tie).
"""

from __future__ import annotations

import math

import torch

_WORD = 1 << 32


def _h(x: int) -> int:
    x = (x ^ (x >> 16)) % _WORD
    x = (x * 0x7FEB352D) % _WORD
    x ^= x >> 15
    x = (x * 0x5BD1E995) % _WORD
    return x ^ (x >> 16)


def position_key(seed: int, position: int) -> int:
    low, high = seed % _WORD, seed // _WORD
    return _h(_h(_h(low ^ 0x9E3779B9) ^ high) ^ position)


def token_bits(seed: int, position: int, token: int) -> int:
    """The 32 bits behind ``E(seed, position, token)``."""
    return _h(token ^ position_key(seed, position))


def noise(seed: int, position: int, token: int) -> float:
    """``E(seed, position, token)``, float64."""
    v = (token_bits(seed, position, token) + 0.5) / _WORD
    return -math.log1p(-v)


def draw(probs: torch.Tensor, seed: int, position: int) -> tuple[int, float]:
    """The token the keyed race picks from ``probs [V]`` (any row sum) at ``position``, and its margin:
    the relative gap between the winner's ``p / E`` and the runner-up's (0 when they tie)."""
    p = probs.to(torch.float64).tolist()
    scores = [(p[t] / noise(seed, position, t) if p[t] > 0 else 0.0) for t in range(len(p))]
    order = sorted(range(len(p)), key=lambda t: (-scores[t], t))
    best = order[0]
    second = scores[order[1]] if len(order) > 1 else 0.0
    return best, (scores[best] - second) / scores[best] if scores[best] > 0 else 0.0
