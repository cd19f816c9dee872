"""4-bit decode-row products (``kernels/gemv4.py``, Triton, CPU interpreter) against float64 products
with the weight as ComfyUI itself dequantizes the same stored tensors (comfy-kitchen's
``TensorCoreConvRotW4A4Layout`` / ``TensorCoreNVFP4Layout`` ``QuantizedTensor.dequantize``)."""

import pytest
import torch
import triton
import triton.language as tl
from qwen35_fast.kernels.gemv4 import X_KIND, _e2m1_16, _nibbles16, gemv4, gemv4_group, gemv4_reason
from qwen35_fast.kernels.packed4 import Packed4, dequantize

from .ptx_warp import run_warp

pytestmark = pytest.mark.interpreter  # Triton on CPU tensors: run with TRITON_INTERPRET=1 (tests/conftest.py)

ck_tensor = pytest.importorskip("comfy_kitchen.tensor", reason="comfy-kitchen (requirements-dev.txt) is the oracle")

LAYOUTS = {"convrot_w4a4": "TensorCoreConvRotW4A4Layout", "nvfp4": "TensorCoreNVFP4Layout"}
CFG = (16, 64, 4, 2)  # small tiles: several K tiles and a ragged last one at these widths


def stored(rng, fmt: str, n: int, k: int, group: int = 256):
    """(Packed4 over the stored tensors, ComfyUI's float64 dequantization of them) for a random weight
    quantized by comfy-kitchen as ComfyUI's layouts quantize."""
    w = torch.randn(n, k, generator=rng) * 0.05
    kw = {"convrot_groupsize": group} if fmt == "convrot_w4a4" else {}
    qt = ck_tensor.QuantizedTensor.from_float(w, LAYOUTS[fmt], **kw)
    params = qt._params
    block = getattr(params, "block_scale", None)
    p = Packed4(fmt, qt._qdata, params.scale, block, n, k, group if fmt == "convrot_w4a4" else 0)
    return p, qt.dequantize().double()


def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def tol(dtype):
    # fp32: the order of the sums; bf16 / fp16: x's rotation and the output each rounded once
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16: the GPU test below
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("fmt, n, k, group", [("convrot_w4a4", 37, 320, 64), ("convrot_w4a4", 21, 256, 256),
                                              ("convrot_w4a4", 32, 512, 256), ("nvfp4", 37, 100, 0),
                                              ("nvfp4", 130, 64, 0)])
def test_4bit_matches_comfy_dequantization(rng, fmt, n, k, group, dtype, rows):
    """Odd output widths (nvfp4: rows and columns padded in storage, 130 rows over two swizzle tiles),
    K no tile multiple, x rows strided inside a wider tensor; 32 x 512: whole tiles (convrot_w4a4's
    word tile without masks)."""
    p, w = stored(rng, fmt, n, k, group)
    wide = torch.randn(rows, k + 7, generator=rng).to(dtype)
    x = wide[:, 3:3 + k]  # row stride k + 7
    out = gemv4(x, p, config=CFG)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert rel(out, x.double() @ w.T) < tol(dtype)


@pytest.mark.parametrize("fmt", ["convrot_w4a4", "nvfp4"])
def test_group_split_and_row_norm(rng, fmt):
    """Two weights in one launch, split over K ranges (float32 partials summing to the product), and
    a deferred RMSNorm factor applied to the accumulator."""
    from qwen35_fast.kernels.row_norm import RowNorm

    k, rows, eps = 256, 5, 1e-5
    group = 64 if fmt == "convrot_w4a4" else 0
    (p1, w1), (p2, w2) = stored(rng, fmt, 45, k, group), stored(rng, fmt, 7, k, group)
    x = torch.randn(1, rows, k, generator=rng)
    outs = gemv4_group(x, [p1, p2], config=CFG, split=4)
    for out, w in zip(outs, (w1, w2)):
        assert out.shape == (4, 1, rows, w.shape[0]) and out.dtype == torch.float32
        assert rel(out.sum(0), x.double() @ w.T) < 1e-5
    sq = torch.rand(1, rows, 4, generator=rng) * 1e-3
    fac = 1 / torch.sqrt(sq.double().sum(-1, keepdim=True) / k + eps)
    (y,) = gemv4_group(x, [p1], config=CFG, row_norm=RowNorm(sq, k, eps))
    assert rel(y, (x.double() @ w1.T) * fac) < 1e-5


def test_prerotated_input_and_mutations(rng):
    """The broken versions this test is there to catch, each measured against the same reference:
    the rotation left out, a scale dropped, the nibble order swapped: all far off."""
    from qwen35_fast.kernels.convrot import hadamard
    from qwen35_fast.kernels.convrot_triton import hadamard_rotate

    k, rows = 256, 2
    p, w = stored(rng, "convrot_w4a4", 19, k, 64)
    x = torch.randn(rows, k, generator=rng)
    ref = x.double() @ w.T
    assert rel(gemv4(hadamard_rotate(x, hadamard(64)), p, rotate=False, config=CFG), ref) < 1e-5
    assert rel(gemv4(x, p, rotate=False, config=CFG), ref) > 0.3  # rotation off
    ones = Packed4(p.fmt, p.qdata, torch.ones_like(p.scale), None, p.n, p.k, p.convrot)
    assert rel(gemv4(x, ones, config=CFG) * p.scale.double(), ref) < 1e-5
    assert rel(gemv4(x, ones, config=CFG), ref) > 0.3  # scale dropped
    u = p.qdata.view(torch.uint8)
    swapped = ((u << 4) | (u >> 4)).view(torch.int8)
    assert rel(gemv4(x, Packed4(p.fmt, swapped, p.scale, None, p.n, p.k, 64), config=CFG), ref) > 0.3
    q, wq = stored(rng, "nvfp4", 19, k)
    ref = x.double() @ wq.T
    u = q.qdata
    assert rel(gemv4(x, Packed4("nvfp4", (u << 4) | (u >> 4), q.scale, q.block_scale, 19, k), config=CFG), ref) > 0.3
    flat = torch.ones_like(q.block_scale.float()).to(torch.float8_e4m3fn)  # block scales dropped
    assert rel(gemv4(x, Packed4("nvfp4", u, q.scale, flat, 19, k), config=CFG), ref) > 0.3


class _Spy:
    """Stands in for a kernel object: counts its launches and runs it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("fmt", ["convrot_w4a4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_word_tile_and_tensor_core_tile(rng, monkeypatch, dtype, fmt):
    """Both formats run the word tile (``gemv4w.py``) for 1..8 rows of 4-byte aligned storage and the
    tensor-core tile for more rows or storage no word can be read from: both equal the reference."""
    from qwen35_fast.kernels import gemv4 as mod

    spy = _Spy(mod.gemv4w_kernel)
    monkeypatch.setattr(mod, "gemv4w_kernel", spy)
    p, w = stored(rng, fmt, 48, 512, 256)
    raw = torch.zeros(p.qdata.numel() + 1, dtype=p.qdata.dtype)
    shifted = raw[1:].view(p.qdata.shape)  # one byte off a word boundary
    shifted.copy_(p.qdata)
    odd = Packed4(p.fmt, shifted, p.scale, p.block_scale, p.n, p.k, p.convrot)
    for rows, packed, words in ((1, p, 1), (8, p, 1), (9, p, 0), (16, p, 0), (2, odd, 0)):
        x = torch.randn(rows, 512, generator=rng).to(dtype)
        before = spy.launches
        out = gemv4(x, packed, config=CFG)
        assert spy.launches - before == words, (rows, words)
        assert rel(out, x.double() @ w.T) < tol(dtype), (rows, words)


def _run_ptx(asm: str, word: int) -> list[int]:
    """The 8 outputs of ``asm`` (``$8`` the input word), one lane of ``ptx_warp``'s model of the PTX."""
    return run_warp(asm, [[0] * 8 + [word]])[0][:8]


def test_e2m1_ptx_makes_every_code_by_column(rng):
    """``gemv4w.E2M1_ASM`` (the nvfp4 word tile's unpack on NVIDIA GPUs), run by a model of its PTX
    over words of random codes and over every code in every column: output j is the float32
    140 + 2v of column j's code (kitchen's order: the even column in a byte's high nibble)."""
    import struct

    from qwen35_fast.kernels import gemv4w

    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    value = e2m1 + [-v for v in e2m1]
    words = torch.randint(0, 2**32, (200,), generator=rng, dtype=torch.int64).tolist()
    words += [sum(c << (4 * j) for j in range(8)) for c in range(16)]
    for word in words:
        out = [struct.unpack("<f", struct.pack("<I", r))[0] for r in _run_ptx(gemv4w.E2M1_ASM.value, word)]
        byte = [(word >> (8 * b)) & 255 for b in range(4)]
        codes = [byte[j // 2] >> 4 if j % 2 == 0 else byte[j // 2] & 15 for j in range(8)]
        assert out == [140 + 2 * value[c] for c in codes], hex(word)


@triton.jit
def _bits(OUT_I, OUT_F, HALF16: tl.constexpr):
    nib = tl.arange(0, 16)
    tl.store(OUT_I + nib, _nibbles16(nib, HALF16))
    tl.store(OUT_F + nib, _e2m1_16(nib, HALF16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nibble_bit_patterns(dtype):
    """Every 4-bit code made into fp16 / bf16 by integer operations alone (``_nibbles16``,
    ``_e2m1_16``): a signed nibble q becomes OFFSET + q, an E2M1 code its value (the OCP table)."""
    out_i, out_f = torch.zeros(16, dtype=torch.int16), torch.zeros(16, dtype=torch.int16)
    _bits[(1,)](out_i, out_f, HALF16=X_KIND[dtype])
    signed = torch.tensor([n - 16 if n >= 8 else n for n in range(16)], dtype=torch.float64)
    offset = {torch.float16: 1032, torch.bfloat16: 136}[dtype]
    assert torch.equal(out_i.view(dtype).double(), offset + signed)
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert torch.equal(out_f.view(dtype).double(), torch.tensor(e2m1 + [-v for v in e2m1], dtype=torch.float64))


@pytest.mark.parametrize("fmt, n, k", [("convrot_w4a4", 21, 512), ("nvfp4", 130, 100)])
def test_torch_twin_is_comfy_dequantization(rng, fmt, n, k):
    """``packed4.dequantize`` (the converter's and the fallback's) equals ComfyUI's, bit for bit in float32."""
    p, w = stored(rng, fmt, n, k, 256)
    assert torch.allclose(dequantize(p).double(), w, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["convrot_w4a4", "nvfp4"])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_gpu_bf16_matches_comfy_dequantization(fmt, rows):
    """Compiled, bf16 (the interpreter has no bf16 dot), the launch table's config, 9B-like width."""
    gen = torch.Generator().manual_seed(7)
    p, w = stored(gen, fmt, 1000, 4096)
    p = Packed4(p.fmt, p.qdata.cuda(), p.scale.cuda(), None if p.block_scale is None else p.block_scale.cuda(),
                p.n, p.k, p.convrot)
    x = torch.randn(1, rows, 4096, generator=gen).to(torch.bfloat16).cuda()
    assert rel(gemv4(x, p).cpu(), x.double().cpu() @ w.T) < tol(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_word_tile_x_loads(dtype, rows):
    """The word tile compiled, fp16 / fp32 x: rows starting on 16 bytes (one PTX vector load per word)
    and rows 3 elements off (a tile split into columns), both ComfyUI's dequantization's product."""
    gen = torch.Generator().manual_seed(11)
    p, w = stored(gen, "convrot_w4a4", 1000, 4096)
    p = Packed4(p.fmt, p.qdata.cuda(), p.scale.cuda(), None, p.n, p.k, p.convrot)
    wide = torch.randn(rows, 4096 + 8, generator=gen).to(dtype).cuda()
    for x in (wide[:, :4096], wide[:, 3:3 + 4096]):
        assert rel(gemv4(x, p).cpu(), x.double().cpu() @ w.T) < tol(dtype)


def test_bad_operands_say_why(rng):
    p, _ = stored(rng, "nvfp4", 16, 64)
    assert "width 64" in gemv4_reason(torch.randn(2, 48), p)
    assert "swizzled" in gemv4_reason(torch.randn(2, 64), Packed4("nvfp4", p.qdata, p.scale, None, 16, 64))
    c, _ = stored(rng, "convrot_w4a4", 16, 256, 64)
    bad = Packed4("convrot_w4a4", c.qdata, torch.ones(16, 4), None, 16, 256, 64)
    assert "per output row" in gemv4_reason(torch.randn(1, 256), bad)
    with pytest.raises(ValueError, match="different formats"):
        gemv4_group(torch.randn(1, 256), [c, Packed4("convrot_w4a4", c.qdata, c.scale, None, 16, 256, 256)])
