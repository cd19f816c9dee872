"""Decode-row matrix products (Triton, CPU interpreter) against float64."""

import pytest
import torch
from qwen35_fast.kernels.gemv import gemv, gemv_group

pytestmark = pytest.mark.interpreter  # Triton on CPU tensors: run with TRITON_INTERPRET=1 (tests/conftest.py)

CONFIGS = [None, (16, 32, 4, 2), (32, 64, 4, 3)]


def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("shape", [(1, 48, 96), (4, 40, 80), (3, 16, 64), (16, 33, 100)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gemv_matches_float64(rng, shape, config):
    m, n, k = shape
    x = torch.randn(m, k, generator=rng).half()
    w = (torch.randn(n, k, generator=rng) * 0.1).half()
    out = gemv(x, w, config=config)
    assert out.shape == (m, n) and out.dtype == torch.float16
    assert rel(out, x.double() @ w.double().T) < 2e-3


@pytest.mark.parametrize("count", [2, 3, 4])
def test_group_matches_separate_products(rng, count):
    """Several weights (small ones among large ones) in one launch; each output as its own product."""
    m, k = 3, 64
    x = torch.randn(1, m, k, generator=rng).half()
    ns = [5, 70, 2, 33][:count]
    ws = [(torch.randn(n, k, generator=rng) * 0.1).half() for n in ns]
    outs = gemv_group(x, ws, config=(16, 32, 4, 2))
    for out, w, n in zip(outs, ws, ns):
        assert out.shape == (1, m, n)
        assert rel(out, x.double() @ w.double().T) < 2e-3


def test_gemv_leading_dims_and_strided_x(rng):
    x = torch.randn(1, 3, 2 * 64, generator=rng).half()[..., :64]  # rows with a stride, last dim contiguous
    w = (torch.randn(40, 64, generator=rng) * 0.1).half()
    out = gemv(x, w)
    assert out.shape == (1, 3, 40)
    assert rel(out, x.double() @ w.double().T) < 2e-3


def test_gemv_rejects():
    w = torch.randn(8, 16).half()
    with pytest.raises(ValueError, match="functional.linear"):
        gemv(torch.randn(17, 16).half(), w)
    with pytest.raises(ValueError, match="x's dtype"):
        gemv(torch.randn(2, 16), w)
    with pytest.raises(ValueError, match="row-major"):
        gemv(torch.randn(2, 16).half(), torch.randn(16, 8).half().T)
    with pytest.raises(ValueError, match="1..4 weights"):
        gemv_group(torch.randn(2, 16).half(), [w] * 5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_gpu_bf16_9b_shapes_and_graph(rows):
    """bf16 at the 9B shapes (grouped DeltaNet inputs, the down projection) against float64, and a
    captured graph replayed on new inputs equals eager."""
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    x = r(1, rows, 4096)
    ws = [r(32, 4096, scale=0.02), r(32, 4096, scale=0.02), r(8192, 4096, scale=0.02), r(4096, 4096, scale=0.02)]
    for out, w in zip(gemv_group(x, ws), ws):
        assert rel(out, x.double() @ w.double().T) < 1e-2
    a, wd = r(1, rows, 12288), r(4096, 12288, scale=0.02)
    assert rel(gemv(a, wd), a.double() @ wd.double().T) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = gemv_group(x, ws)
    x.copy_(r(1, rows, 4096))
    graph.replay()
    for got, want in zip(outs, gemv_group(x, ws)):
        assert torch.equal(got, want)
