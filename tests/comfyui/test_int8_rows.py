"""``engine/int8_rows.py``: several rows times ComfyUI's int8 weight (comfy-kitchen's own
``QuantizedTensor``, int8_tensorwise per-row scales, with and without ConvRot) read in place, against a
float64 oracle of the W8A8 math and against comfy-kitchen's own product (ComfyUI's module call)."""

import pytest
import torch
from qwen35_fast.engine.int8_rows import PAD_ROWS, int8_rows, int8_rows_ok
from qwen35_fast.engine.plain_weights import PlainLinear
from qwen35_fast.kernels.convrot import hadamard

ck = pytest.importorskip("comfy_kitchen.tensor", reason="comfy-kitchen (requirements-dev.txt): ComfyUI's int8 type")


def quantized(gen, n, k, convrot):
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    return ck.QuantizedTensor.from_float(w, "TensorWiseINT8Layout", is_weight=True, per_channel=True,
                                         convrot=convrot, convrot_groupsize=256)


def oracle(x, q, scale, group):
    """float64: rotate, quantize each row (amax / 127, round half to even), integer product, scales."""
    rows = x.reshape(-1, x.shape[-1]).double()
    if group:
        h = hadamard(group, dtype=torch.float64)
        rows = (rows.reshape(-1, group) @ h).reshape(rows.shape)
    s = rows.abs().amax(dim=1, keepdim=True) / 127
    xq = torch.round(rows / s).clamp(-127, 127)
    return (xq @ q.double().t()) * s * scale.double().view(1, -1)


@pytest.mark.parametrize("convrot", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [2, 4, 8])
def test_int8_rows_is_the_w8a8_product(rng, convrot, dtype, rows):
    qt = quantized(rng, 96, 512, convrot)
    q, scale = qt._qdata, qt._params.scale.reshape(-1).float()
    plain = PlainLinear(q, scale=scale, convrot=256 if convrot else 0)
    assert int8_rows_ok(plain)
    x = torch.randn(1, rows, 512, generator=rng).to(dtype)
    got = int8_rows(x, plain)
    assert got.shape == (1, rows, 96) and got.dtype == dtype
    want = oracle(x, q, scale, 256 if convrot else 0).view(1, rows, 96)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-3  # bf16 output rounding; a rare quantization tie
    assert ((got.double() - want).abs().amax() / want.abs().amax()).item() < tol
    kitchen = torch.nn.functional.linear(x.to(torch.bfloat16), qt).double()  # ComfyUI's own call
    assert ((got.double() - kitchen).abs().amax() / kitchen.abs().amax()).item() < 2e-2


def test_int8_rows_refuses_what_it_cannot_read(rng):
    qt = quantized(rng, 8, 256, True)
    plain = PlainLinear(qt._qdata, scale=qt._params.scale.reshape(-1).float(), convrot=256)
    assert not int8_rows_ok(None)
    assert not int8_rows_ok(PlainLinear(torch.zeros(8, 256, dtype=torch.bfloat16)))
    assert not int8_rows_ok(PlainLinear(qt._qdata, scale=torch.ones(1), convrot=256))  # one scale: not this layout
    with pytest.raises(ValueError, match=f"at most {PAD_ROWS} rows"):
        int8_rows(torch.randn(PAD_ROWS + 1, 256), plain)
