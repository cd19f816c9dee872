"""Weight-only fp8 decode-row products (Triton, CPU interpreter; bf16 on the GPU) against float64
references built from ComfyUI's own dequantization (comfy-kitchen's ``TensorCoreFP8Layout``)."""

import pytest
import torch
from qwen35_fast.kernels import capabilities
from qwen35_fast.kernels.gemv import gemv, gemv_group, gemv_reason

pytestmark = pytest.mark.interpreter  # Triton on CPU tensors: run with TRITON_INTERPRET=1 (tests/conftest.py)

ck_tensor = pytest.importorskip("comfy_kitchen.tensor", reason="comfy-kitchen (requirements-dev.txt) is the oracle")
gpu = pytest.mark.gpu

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def comfy_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 weight ComfyUI computes with for fp8 ``q`` and its per-tensor ``scale``."""
    params = ck_tensor.TensorCoreFP8Layout.Params(scale=scale, orig_dtype=torch.float32, orig_shape=tuple(q.shape))
    return ck_tensor.QuantizedTensor(q, "TensorCoreFP8Layout", params).dequantize().double()


def rand_fp8(gen, n, k, dtype, device="cpu"):
    """Random fp8 rows over the format's range: normals, subnormals and zeros, no NaN or inf (e5m2
    has infinities: values past its largest finite one are clamped)."""
    top = torch.finfo(dtype).max
    w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-12, 1, (n, k), generator=gen).float()) * (top / 4)
    w[torch.rand(n, k, generator=gen) < 0.05] = 0.0
    w = w.clamp(-top, top)
    return w.to(dtype).to(device)


def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-3


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_fp8_matches_comfy_dequantization(rng, fp8, dtype, rows):
    """Odd output widths, a K that is not a tile multiple; the stored bytes are the weight as is."""
    n, k = 37, 100
    q = rand_fp8(rng, n, k, fp8)
    scale = torch.tensor(3e-3)
    x = torch.randn(rows, k, generator=rng).to(dtype)
    out = gemv(x, q, scale, config=(16, 32, 4, 2))
    assert out.shape == (rows, n) and out.dtype == dtype
    ref = x.double() @ comfy_weight(q, scale).T
    assert rel(out, ref) < tol(dtype)
    # The bytes read as int8 (no fp8 widening) or another scale give another answer.
    assert rel(gemv(x, q.view(torch.int8), scale, config=(16, 32, 4, 2)), ref) > 0.3
    assert rel(gemv(x, q, scale * 0.5, config=(16, 32, 4, 2)), ref) > 0.3


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3fn", "e5m2"])
def test_fp8_group_strided_rows_and_split(rng, fp8):
    """Three fp8 weights in one launch on strided rows, and the split-K partials summed."""
    k = 192
    ws = [rand_fp8(rng, n, k, fp8) for n in (40, 8, 21)]
    scales = [torch.rand((), generator=rng) * 1e-2 + 1e-3 for _ in ws]
    base = torch.randn(5, 2 * k, generator=rng)
    x = base[:, ::2]  # rows with a stride that is not their width
    outs = gemv_group(x, ws, scales=scales, config=(16, 64, 4, 2))
    for out, w, s in zip(outs, ws, scales):
        assert rel(out, x.double() @ comfy_weight(w, s).T) < 1e-5
    parts = gemv_group(x, ws[:1], scales=scales[:1], config=(16, 64, 4, 2), split=3)[0]
    assert parts.shape[0] == 3 and parts.dtype == torch.float32
    assert rel(parts.sum(0), x.double() @ comfy_weight(ws[0], scales[0]).T) < 1e-5


def test_fp8_operand_checks(monkeypatch):
    x = torch.randn(2, 64)
    q = torch.zeros(8, 64, dtype=torch.float8_e4m3fn)
    assert "without a scale" in gemv_reason(x, q)
    assert "float32" in gemv_reason(x, q, torch.tensor(1.0, dtype=torch.float16))
    assert gemv_reason(x, q, torch.tensor(1.0)) is None  # the CPU interpreter reads fp8
    monkeypatch.setattr(capabilities, "interpreting", lambda: False)
    assert "CUDA" in capabilities.fp8_reason("cpu")


def test_fp8_needs_compute_capability_89(monkeypatch):
    """Where Triton's fp8 conversions do not exist (before Ada), the reason names the GPU."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert "8.9" in capabilities.fp8_reason("cuda") and "8.6" in capabilities.fp8_reason("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert capabilities.fp8_reason("cuda") is None
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert "NVIDIA" in capabilities.fp8_reason("cuda")


def test_e4m3_bit_placement_is_exact():
    """The integer rewrite ``_e4m3_bf16`` does on the GPU (bf16 bits (sign << 15) | (magnitude << 4),
    then times 2^120 in bf16), done here in torch for every byte: each finite e4m3 value exactly."""
    b = torch.arange(256, dtype=torch.int32)
    bf = (((b & 0x80) << 8) | ((b & 0x7F) << 4)).to(torch.int16).view(torch.bfloat16)
    got = (bf * torch.tensor(2.0 ** 120, dtype=torch.bfloat16)).double()
    want = b.to(torch.uint8).view(torch.float8_e4m3fn).double()
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite]) and torch.equal(got[~finite].abs(), torch.full((2,), 480.0,
                                                                                                  dtype=torch.float64))


@gpu
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_bf16_9b_shapes(fp8, rows, test_seed):
    """bf16 activations at 9B decode shapes (grouped inputs, the split-K output, a wide output)."""
    if capabilities.fp8_reason("cuda") is not None:
        pytest.skip(capabilities.fp8_reason("cuda"))
    gen = torch.Generator().manual_seed(test_seed)
    x = torch.randn(rows, 4096, generator=gen).to("cuda", torch.bfloat16)
    ws = [rand_fp8(gen, n, 4096, fp8, "cuda") for n in (8192, 1024, 1024)]
    scales = [torch.tensor(2e-3, device="cuda") for _ in ws]
    for out, w, s in zip(gemv_group(x, ws, scales=scales), ws, scales):
        err = rel(out, x.double() @ comfy_weight(w.cpu(), s.cpu()).cuda().T)
        assert err < 1e-2, f"{tuple(w.shape)}: relative error {err:.2e}"
    parts = gemv_group(x, ws[1:2], scales=scales[1:2], split=4)[0]
    err = rel(parts.sum(0), x.double() @ comfy_weight(ws[1].cpu(), scales[1].cpu()).cuda().T)
    assert err < 1e-2, f"split-K partials: relative error {err:.2e}"
