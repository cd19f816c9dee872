"""Keyed exponential noise: ``E(seed, position, token id) ~ Exp(1)``, independent over the three keys.

A sampled token is the winner of an exponential race, ``argmax_i p_i / E_i`` over the candidates
(``draw.keyed_draw``); with noise keyed by the token's position instead of read from a random
stream, the token at a position depends on the seed, the position and that row's distribution
only, never on how many draws came before (so MTP's draft depth cannot change the text).

The hash (bit-exact on every device: int64 tensors holding 32-bit values, every product below
2**63, shifts of non-negative values; the same expressions on Python ints give the same bits):

* ``mix(x)`` for ``x`` in ``[0, 2**32)``: ``x ^= x >> 16; x = x * 0x7FEB352D mod 2**32;
  x ^= x >> 15; x = x * 0x5BD1E995 mod 2**32; x ^= x >> 16`` (a bijection of 32-bit values);
* ``row_key(seed, position) = mix(mix(mix((seed mod 2**32) ^ 0x9E3779B9) ^ (seed >> 32)) ^ position)``
  for a seed in ``[0, 2**64)`` and a position in ``[0, 2**32)``;
* ``bits = mix(id ^ row_key)`` for a token id in ``[0, 2**32)``;
* ``E = -log(1 - v)`` with ``v = (bits + 0.5) / 2**32`` (exact in float64), computed as
  ``-log1p(-v)`` in float64: finite, positive, accurate at both ends.

The position is the token's index in the sequence (the prompt's rows first), which the decode loop
knows on the host; a row key is a Python int, and several rows' keys go to the device as one
int64 ``[N,1]`` tensor (a pinned, non-blocking copy on CUDA: no host sync).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_MUL1, _MUL2 = 0x7FEB352D, 0x5BD1E995  # odd and below 2**31: a product of a 32-bit value stays below 2**63
_SEED_SALT = 0x9E3779B9


def mix(x):
    """The 32-bit mixer on a Python int or an int64 tensor of values in ``[0, 2**32)`` (same bits)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & MASK32
    return x ^ (x >> 16)


def row_key(seed: int, position: int) -> int:
    """The key of one sequence position under ``seed``: a Python int in ``[0, 2**32)``.
    seed in ``[0, 2**64)``, position in ``[0, 2**32)``; anything else raises ValueError."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"keyed noise: seed must be an integer in [0, 2**64), got {seed!r}")
    if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= MASK32:
        raise ValueError(f"keyed noise: position must be an integer in [0, 2**32), got {position!r}")
    return mix(mix(mix((seed & MASK32) ^ _SEED_SALT) ^ (seed >> 32)) ^ position)


def row_keys(seed: int, first_position: int, rows: int, device) -> int | torch.Tensor:
    """Keys of ``rows`` consecutive positions from ``first_position``: a Python int for one row,
    else int64 ``[rows, 1]`` on ``device`` (to CUDA through pinned memory, without a host sync)."""
    keys = [row_key(seed, first_position + i) for i in range(rows)]
    if rows == 1:
        return keys[0]
    t = torch.tensor(keys, dtype=torch.int64).view(rows, 1)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def exponentials(ids: torch.Tensor, keys: int | torch.Tensor) -> torch.Tensor:
    """``E`` for token ids int64 ``[N,K]`` (values in ``[0, 2**32)``) at rows keyed by ``keys`` (an int
    for every row, or int64 ``[N,1]`` on ids' device) -> float64 ``[N,K]``, every value in
    ``[2**-33, 33 log 2]`` (up to float64 rounding)."""
    bits = mix(ids ^ keys)
    neg_v = bits.to(torch.float64).add_(0.5).mul_(-(2.0 ** -32))
    return torch.log1p(neg_v).neg_()
