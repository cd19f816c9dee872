"""Decode-row matrix product (Triton, CPU interpreter) against float64."""

import pytest
import torch
from qwen35_fast.kernels.gemv import gemv

CONFIGS = [None, (16, 32, 4, 2), (32, 64, 4, 3)]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("shape", [(1, 48, 96), (4, 40, 80), (3, 16, 64), (16, 33, 100)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gemv_matches_float64(rng, shape, config):
    m, n, k = shape
    x = torch.randn(m, k, generator=rng).half()
    w = (torch.randn(n, k, generator=rng) * 0.1).half()
    bias = torch.randn(n, generator=rng).half()
    for b in (None, bias):
        out = gemv(x, w, b, config=config)
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        assert out.shape == (m, n) and out.dtype == torch.float16
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


def test_gemv_leading_dims_and_strided_x(rng):
    x = torch.randn(1, 3, 2 * 64, generator=rng).half()[..., :64]  # rows with a stride, last dim contiguous
    w = (torch.randn(40, 64, generator=rng) * 0.1).half()
    out = gemv(x, w)
    ref = x.double() @ w.double().T
    assert out.shape == (1, 3, 40)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


def test_gemv_rejects(rng):
    w = torch.randn(8, 16).half()
    with pytest.raises(ValueError, match="F.linear|functional.linear"):
        gemv(torch.randn(17, 16).half(), w)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemv(torch.randn(2, 16), w.float())
    with pytest.raises(ValueError, match="row-major"):
        gemv(torch.randn(2, 16).half(), torch.randn(16, 8).half().T)
