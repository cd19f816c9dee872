"""Fixtures of the engine tests."""

import pytest
import torch

from tests.oracles.tiny import add_mtp, engine_model, make_tiny


@pytest.fixture
def model(tmp_path, rng):
    """A tiny random Qwen3.5 with an MTP head whose drafts are often but not always right, as the
    engine loads it: ``(model, dims)``."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    sd, d = make_tiny(seed, strength=0.2)
    sd = add_mtp(sd, d, seed + 1, noise=0.02, norm_spread=0.05)
    return engine_model(sd, tmp_path), d
