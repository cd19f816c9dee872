import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()

import os  # noqa: E402

import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton kernels run on the CPU through the interpreter; it must be set before triton.jit runs.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def rng():
    """A fresh, differently seeded generator per test (seed printed on failure)."""
    import random

    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)
