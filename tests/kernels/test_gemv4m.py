"""The 4-bit tensor-core register tile (``kernels/gemv4m.py``: convrot_w4a4, nvfp4) against float64 products
with the weight as ComfyUI dequantizes the same stored tensors (comfy-kitchen's quantizers and layouts).

No CPU runs its PTX, so on the CPU the tile's PTX block (``gemv4m.mma_asm``, the loads, the unpack
and the MMAs) runs lane by lane on a model of the PTX ISA (``ptx_warp.py``, whose MMA fragment
layout is PTX's); the lanes' operands are computed here from the layout the module docstring
states. Compiled on the GPU (``-m gpu``): the same products through ``gemv4_group``."""

import pytest
import torch
import triton
from qwen35_fast.kernels import gemv4m, ptx
from qwen35_fast.kernels.convrot import hadamard
from qwen35_fast.kernels.convrot_triton import hadamard_rotate_torch
from qwen35_fast.kernels.packed4 import Packed4

from .ptx_warp import Memory, run_warp
from .test_gemv4 import rel, stored, tol

pytestmark = pytest.mark.interpreter


def _block_scales(p) -> torch.Tensor:
    """nvfp4's E4M3 block scales as bytes (uint8) ``[rows, K / 16 blocks]``, unswizzled from cuBLAS's 128x4
    tiles (``packed4``'s layout: tile-row r at ``(r % 32) * 16 + (r // 32 % 4) * 4``)."""
    n_rb, n_cb = p.block_scale.shape[0] // 128, p.block_scale.shape[1] // 4
    tiles = p.block_scale.view(torch.uint8).reshape(n_rb, n_cb, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(n_rb * 128, n_cb * 4)


def emulate(p, xr: torch.Tensor, chunks: int, warps: int, asm: str | None = None) -> torch.Tensor:
    """``xr @ W.T`` (float64 ``[M, N]``, W as stored: convrot_w4a4 in its rotated basis) by the tile's PTX
    on the warp model: per program 16 weight rows, its warps taking steps of ``128 * chunks`` columns in
    turn, lane (g, t) reading rows g and g + 8 and x row g from column ``32 t`` of each chunk (nvfp4:
    with the E4M3 bytes of its two 16-column blocks' scales); D times the row scales (nvfp4: the
    tensor scale times 2^7)."""
    fp4 = p.fmt == "nvfp4"
    asm = asm or gemv4m.mma_asm(2 if xr.dtype == torch.bfloat16 else 1, 2 if fp4 else 1)
    m, k, n = xr.shape[0], p.k, p.n
    mem = Memory()
    wbase, xbase = mem.add(p.qdata), mem.add(xr)
    sw, step = p.qdata.stride(0), 128 * chunks
    blocks = _block_scales(p) if fp4 else None
    y = torch.zeros(m, n, dtype=torch.float64)
    for pid in range(triton.cdiv(n, 16)):
        for warp in range(warps):
            acc = [[0.0] * 4 for _ in range(32)]
            for kc in range(warp * step, k, step * warps):
                for c in range(chunks):
                    ops = []
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        row, col = pid * 16 + g, kc + 128 * c + 32 * t
                        pa = wbase + row * sw + col // 2
                        ops.append(acc[lane] + [pa, pa + 8 * sw, xbase + 2 * (g * xr.stride(0) + col), int(row < n),
                                                int(row + 8 < n), int(g < m), k - col] + acc[lane])
                        if fp4:
                            b = col // 16
                            ops[-1] += [int(blocks[r, b + j]) if col < k else 0 for r in (row, row + 8) for j in (0, 1)]
                    acc = [out[:4] for out in run_warp(asm, ops, mem)]
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for value, row, xrow in zip(acc[lane], (g, g, g + 8, g + 8), (2 * t, 2 * t + 1) * 2):
                    r = pid * 16 + row
                    if r < n and xrow < m:
                        y[xrow, r] += value * (128 * p.scale.item() if fp4 else p.scale[r].item())
    return y


@pytest.mark.parametrize("fmt", ["convrot_w4a4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, chunks, warps", [(1, 1, 1), (3, 2, 1), (8, 1, 2)])
def test_mma_ptx_matches_comfy_dequantization(rng, fmt, dtype, rows, chunks, warps):
    """21 weight rows (the second program's rows 5..15 absent), K = 384 (a step of 256 columns half
    past the end), 1 / 3 / 8 rows of x: the PTX's product is ComfyUI's within bf16 / fp16 rounding
    (convrot_w4a4: x rotated as ComfyUI rotates it)."""
    p, w = stored(rng, fmt, 21, 384, 64)
    x = torch.randn(rows, 384, generator=rng).to(dtype)
    xr = hadamard_rotate_torch(x, hadamard(64)) if fmt == "convrot_w4a4" else x
    assert rel(emulate(p, xr, chunks, warps), x.double() @ w.T) < tol(dtype)


def test_mma_ptx_mutations(rng):
    """The broken versions this test is there to catch: the offset not taken off, x's columns paired
    as the weights' are not (even with odd), the nibbles of one row read as the other's; nvfp4: one
    block's scale for both of a lane's blocks, a pair's two columns swapped, one x register twice."""
    p, w = stored(rng, "convrot_w4a4", 16, 128, 64)
    x = torch.randn(2, 128, generator=rng).to(torch.bfloat16)
    xr = hadamard_rotate_torch(x, hadamard(64))
    ref = x.double() @ w.T
    good = gemv4m.mma_asm(2, 1)
    assert rel(emulate(p, xr, 1, 1, good), ref) < tol(torch.bfloat16)
    for broken in (good.replace("off, 0xc308c308", "off, 0x00000000"),
                   good.replace("0x7632;", "0x7610;"),
                   good.replace("prmt.b32 a1, lb, m, 0x4140;", "prmt.b32 a1, la, m, 0x4140;")):
        assert broken != good
        assert rel(emulate(p, xr, 1, 1, broken), ref) > 0.05
    q, wq = stored(rng, "nvfp4", 16, 128)
    ref = x.double() @ wq.T
    good = gemv4m.mma_asm(2, 2)
    assert rel(emulate(q, x, 1, 1, good), ref) < tol(torch.bfloat16)
    for broken in (good.replace("sc1, ez;", "sc0, ez;"),  # one block's scale for both
                   good.replace("b0, xr0, xr2, 0x5410;", "b0, xr2, xr0, 0x5410;"),  # x's pair swapped
                   good.replace("b1, xr1, xr3, 0x5410;", "b1, xr0, xr3, 0x5410;"),  # one x register twice
                   good.replace("0x80008000, 0xEC;", "0x80008000, 0xCC;")):  # signs dropped
        assert broken != good
        assert rel(emulate(q, x, 1, 1, broken), ref) > 0.05


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the OCP MX spec's E2M1 magnitudes, codes 0..7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nvfp4_codes_and_scales_as_half_bits(dtype):
    """Every E2M1 code (both signs) times every finite E4M3 scale byte, subnormals included, through the
    tile's conversion (``ptx.e4m3_half2``, ``ptx.e2m1_halves``, the packed FMA) on the PTX model: each
    16-bit result is exactly code x scale x 2^-7 (torch's float8_e4m3fn for the scale), code i of the
    word in register i's low half and code i + 4 in its high half."""
    kind = "bf16" if dtype == torch.bfloat16 else "f16"
    regs = [f"r{j}" for j in range(4)]
    asm = "{\n" + "\n".join([".reg .b32 r0, r1, r2, r3, sc;", ptx.HALF_BITS_REGS, *ptx.e4m3_consts(kind),
                               *ptx.e4m3_half2("$5", "sc", kind), *ptx.e2m1_halves("$4", regs, kind),
                               *(f"fma.rn.{kind}x2 r{j}, r{j}, sc, ez;" for j in range(4)),
                               *(f"mov.b32 ${j}, r{j};" for j in range(4))]) + "\n}"
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    scales = finite.view(torch.float8_e4m3fn).double()
    for word in (0x76543210, 0xFEDCBA98, 0x8F9E1C2B):
        codes = [(word >> (4 * i)) & 15 for i in range(8)]
        value = torch.tensor([(-1 if c & 8 else 1) * E2M1[c & 7] for c in codes], dtype=torch.float64)
        out = run_warp(asm, [[0, 0, 0, 0, word, int(b)] for b in finite])
        halves = torch.tensor([[(o[i] >> (16 * h)) & 0xFFFF for h in (0, 1) for i in range(4)] for o in out])
        got = (halves - (halves >> 15) * 65536).to(torch.int16).view(dtype).double()  # columns: codes 0..3, then 4..7
        assert torch.equal(got, scales[:, None] * value[None, :] / 128), (word, kind)

def test_register_tile_config_where_it_cannot_run(rng, monkeypatch):
    """A config asking for the register tile where it cannot run (here: Triton interpreting, no PTX)
    runs the word tile instead, with the same product."""
    from qwen35_fast.kernels import gemv4 as mod

    launched = []
    monkeypatch.setattr(mod, "gemv4m_kernel", type("Spy", (), {"__getitem__": lambda s, g: launched.append(g)})())
    p, w = stored(rng, "convrot_w4a4", 21, 256, 64)
    x = torch.randn(3, 256, generator=rng).to(torch.float16)
    assert rel(mod.gemv4(x, p, config=(16, 128, 4, 1, 2)), x.double() @ w.T) < tol(torch.float16)
    assert not launched


def cuda(p: Packed4) -> Packed4:
    return Packed4(p.fmt, p.qdata.cuda(), p.scale.cuda(), None if p.block_scale is None else p.block_scale.cuda(),
                   p.n, p.k, p.convrot)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["convrot_w4a4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("config", [(16, 128, 4, 1, 2), (16, 256, 8, 1, 2), (16, 128, 1, 1, 2)])
def test_gpu_mma_tile_matches_comfy_dequantization(monkeypatch, fmt, dtype, rows, config):
    """Compiled: the tile launches (counted) and its product is ComfyUI's at a 9B-like width, with
    1000 weight rows (the last program's rows 8..15 absent)."""
    from qwen35_fast.kernels import gemv4 as mod

    launched = []
    real = mod.gemv4m_kernel
    monkeypatch.setattr(mod, "gemv4m_kernel", type("Spy", (), {"__getitem__": lambda s, g: (launched.append(g),
                                                                                          real[g])[1]})())
    gen = torch.Generator().manual_seed(5)
    p, w = stored(gen, fmt, 1000, 4096)
    p = cuda(p)
    x = torch.randn(rows, 4096, generator=gen).to(dtype).cuda()
    out = mod.gemv4(x, p, config=config)
    assert launched, "the tensor-core register tile did not launch"
    assert rel(out.cpu(), x.double().cpu() @ w.T) < tol(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["convrot_w4a4", "nvfp4"])
def test_gpu_mma_tile_group_split_and_row_norm(fmt):
    """Two weights in one launch, split over K ranges, and a deferred RMSNorm factor, compiled."""
    from qwen35_fast.kernels import gemv4 as mod
    from qwen35_fast.kernels.row_norm import RowNorm

    gen = torch.Generator().manual_seed(6)
    k, rows, eps = 4096, 5, 1e-5
    (p1, w1), (p2, w2) = stored(gen, fmt, 300, k), stored(gen, fmt, 40, k)
    p1, p2 = cuda(p1), cuda(p2)
    x = torch.randn(1, rows, k, generator=gen).to(torch.bfloat16).cuda()
    cfg = (16, 128, 4, 1, 2)
    outs = mod.gemv4_group(x, [p1, p2], config=cfg, split=4)
    for out, w in zip(outs, (w1, w2)):
        assert out.shape == (4, 1, rows, w.shape[0]) and out.dtype == torch.float32
        assert rel(out.sum(0).cpu(), x.double().cpu() @ w.T) < tol(torch.bfloat16)
    sq = torch.rand(1, rows, 4, generator=gen).cuda() * 1e-3
    fac = 1 / torch.sqrt(sq.double().sum(-1, keepdim=True) / k + eps)
    (y,) = mod.gemv4_group(x, [p1], config=cfg, row_norm=RowNorm(sq, k, eps))
    assert rel(y.cpu(), ((x.double() @ w1.cuda().T.double()) * fac).cpu()) < tol(torch.bfloat16)


def test_why_the_register_tile_cannot_run(rng, monkeypatch):
    """``_mma_reason`` names what keeps a launch off the register tile (the log says it once, on a
    GPU): no PTX compiler, a GPU below compute capability 8.0, float32 activations, rows off 16
    bytes; None where it runs."""
    from qwen35_fast.kernels import capabilities
    from qwen35_fast.kernels import gemv4 as mod

    p, _ = stored(rng, "convrot_w4a4", 32, 256, 64)
    x = torch.randn(4, 256, generator=rng).to(torch.bfloat16)
    assert "no Triton compiling PTX" in mod._mma_reason(x, [p])
    monkeypatch.setattr(mod, "compiled", lambda device: True)
    try:
        capabilities.simulate(capabilities.DeviceRecord("GPU", 90, 132, 227 * 1024, 50 << 20))
        assert mod._mma_reason(x, [p]) is None
        assert "float32" in mod._mma_reason(x.float(), [p])
        assert "16 bytes" in mod._mma_reason(torch.randn(4, 264, generator=rng).to(torch.bfloat16)[:, 4:260], [p])
        capabilities.simulate(capabilities.DeviceRecord("GPU", 75, 40, 64 * 1024, 4 << 20))
        assert "compute capability 7.5" in mod._mma_reason(x, [p])
    finally:
        capabilities.simulate(None)
