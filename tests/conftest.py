import os
import sys
from pathlib import Path

import pytest

# pytest-xdist workers share the CPUs: one torch / OpenMP pool per worker sized to its share (two
# workers each spinning a pool of every core ran the suite 2.1x slower on 2 cores). Before torch loads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()

import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton kernels run on the CPU through the interpreter; it must be set before triton.jit runs.
    os.environ.setdefault("TRITON_INTERPRET", "1")


#: Seed of every test's random inputs: fixed, so a red run is reproducible; set QWEN35_TEST_SEED to
#: explore other draws (the seed is printed with a failing test's output).
TEST_SEED = int(os.environ.get("QWEN35_TEST_SEED", "20260501"))


def gpu_reason() -> str | None:
    """Why tests marked ``gpu`` cannot run here (the pack's own capability check), or None."""
    if not HAS_CUDA:
        return "needs a CUDA device"
    from qwen35_fast.kernels import triton_reason

    return triton_reason(torch.device("cuda"))


def pytest_collection_modifyitems(config, items):
    why = None
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if "gpu" in item.keywords:
            why = why or gpu_reason() or ""
            if why:
                item.add_marker(pytest.mark.skip(reason=why))
        elif "interpreter" in item.keywords and HAS_CUDA and not interpreting:
            item.add_marker(pytest.mark.skip(
                reason="runs Triton on CPU tensors: run it with TRITON_INTERPRET=1 (the GPU tests without it)"))


@pytest.fixture
def test_seed() -> int:
    """``TEST_SEED`` (printed on failure)."""
    print(f"seed={TEST_SEED} (QWEN35_TEST_SEED overrides)")
    return TEST_SEED


@pytest.fixture
def rng(test_seed):
    """A torch generator seeded with the test seed."""
    return torch.Generator().manual_seed(test_seed)


@pytest.fixture(autouse=True)
def _no_kept_stacks():
    """Each test starts and ends without a decode stack kept from another (``engine/held.py``)."""
    from qwen35_fast.engine import held

    held.release_all()
    yield
    held.release_all()
