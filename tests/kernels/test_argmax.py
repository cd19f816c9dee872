"""``kernels.argmax.argmax_rows`` against torch's argmax (CPU through the Triton interpreter; the
same tests on a GPU): random rows of every width class (one tile, several programs, programs that
walk several tiles), ties inside a tile, across tiles of one program and across programs, NaN,
infinities and signed zeros, each logits dtype, ``out=``, bad input; on the GPU the 248k
vocabulary in bf16 and inside a CUDA graph."""

import pytest
import torch
from qwen35_fast.kernels import argmax as am

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu  # skipped where conftest.gpu_reason() says the GPU kernels cannot run
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# one tile; several programs of one tile; programs of two tiles (> MAX_PARTS tiles); odd widths
WIDTHS = [1, 5, am.BLOCK + 3, 9 * am.BLOCK - 1, am.MAX_PARTS * am.BLOCK + 1000]


def _want(x):
    return x.cpu().float().argmax(dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", WIDTHS)
def test_random_rows(rng, dtype, v):
    rows = 3 if v < 20000 else 1
    x = torch.randn(rows, v, generator=rng).to(device=DEV, dtype=dtype)
    got = am.argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got.cpu(), _want(x))


def test_ties_take_the_first_index(rng):
    """Few distinct values, so every row's maximum repeats inside tiles, across the tiles one
    program walks and across programs: the first index wins, as torch's argmax."""
    v = am.MAX_PARTS * am.BLOCK + 1000  # programs of two tiles each
    x = torch.randint(0, 4, (4, v), generator=rng).float().to(DEV)
    # in one tile; in the two tiles of one program; in two programs; the last two columns
    for row, cols in enumerate(([5, 17], [7, am.BLOCK + 9], [3 * am.BLOCK + 1, 40 * am.BLOCK], [v - 2, v - 1])):
        x[row, cols] = 9.0  # the row's maximum, twice
    got = am.argmax_rows(x)
    assert got.tolist() == [5, 7, 3 * am.BLOCK + 1, v - 2]
    assert torch.equal(got.cpu(), _want(x))


def test_special_values():
    v = 3 * am.BLOCK
    x = torch.zeros(6, v)
    x[0, 4000], x[0, 10] = float("inf"), float("nan")  # a NaN beats everything, +inf included
    x[1, 5000], x[1, 7] = float("nan"), float("inf")
    x[1, 4999] = -torch.tensor(float("nan"))  # a NaN with its sign bit set is a NaN too
    x[2] = float("-inf")  # nothing but -inf: the first
    x[3] = -1.0
    x[3, 300], x[3, 200] = 0.0, -0.0  # -0.0 == +0.0: the first of the two
    x[4] = -5.0
    x[4, 6000] = -4.0
    x[5, 1] = torch.finfo(torch.float32).max
    x[5, 2] = float("inf")
    got = am.argmax_rows(x.to(DEV))
    assert got.tolist() == [10, 4999, 0, 200, 6000, 2]
    assert torch.equal(got.cpu(), _want(x))


def test_out_and_leading_dims(rng):
    x = torch.randn(2, 3, 700, generator=rng).to(DEV)
    out = torch.full((6,), -1, dtype=torch.int64, device=DEV)
    got = am.argmax_rows(x, out=out)
    assert got is out and torch.equal(out.cpu(), _want(x).view(6))
    assert am.argmax_rows(x).shape == (2, 3)


def test_bad_input_names_the_fix():
    x = torch.randn(2, 64, device=DEV)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        am.argmax_rows(x.double())
    strided = torch.randn(64, 2, device=DEV).t()
    assert "contiguous last dim" in am.argmax_reason(strided)  # so the engine takes torch's
    with pytest.raises(ValueError, match="contiguous"):
        am.argmax_rows(strided)
    with pytest.raises(ValueError, match="int64"):
        am.argmax_rows(x, out=torch.empty(2, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="2 elements"):
        am.argmax_rows(x, out=torch.empty(3, dtype=torch.int64, device=DEV))


@gpu
def test_gpu_vocabulary_rows_in_a_graph(rng):
    """Qwen3.5's 248320 logits in bf16, 1 and 4 rows, eager and replayed in a CUDA graph with new
    values each time (the graph reads its input buffer, writes the index into ``out``)."""
    v = 248320
    for rows in (1, 4):
        x = torch.randn(rows, v, generator=rng).to("cuda", torch.bfloat16)
        assert torch.equal(am.argmax_rows(x).cpu(), _want(x))
        out = torch.empty(rows, dtype=torch.int64, device="cuda")
        am.argmax_rows(x, out=out)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            am.argmax_rows(x, out=out)
        for _ in range(3):
            x.copy_(torch.randn(rows, v, generator=rng).to(torch.bfloat16))
            graph.replay()
            assert torch.equal(out.cpu(), _want(x))
