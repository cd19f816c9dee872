"""Fused decode ops against independent float64 oracles (CPU; Triton via the interpreter).

The oracles below are written from the op definitions alone (no code shared with the pack). Where
the spec puts a rounding point ("round" = cast to the input dtype), the oracle rounds there too,
so what is left is float32-vs-float64 arithmetic and the final rounding. On a CUDA machine the
same tests run on the GPU; bfloat16 runs there only (the CPU interpreter truncates float32 to
bfloat16 instead of rounding to nearest).
"""

import math

import pytest
import torch
from qwen35_fast.kernels import fused_ops as fo
from qwen35_fast.kernels.row_norm import factor

from tests.oracles.kitchen import kitchen_rotate

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu  # skipped where conftest.gpu_reason() says the GPU kernels cannot run
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=gpu)]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # kernel vs float64 oracle
TORCH_TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # kernel vs *_torch
EPS = 1e-6


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEV, dtype=dtype)


def eff_weight(gen, n):
    """A randomised effective norm weight (float32), as the caller prepares it."""
    return (1 + 0.1 * torch.randn(n, generator=gen)).to(DEV)


def rnd(t, dtype):
    """The spec's rounding point: to dtype and back to float64."""
    return t.to(dtype).double()


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_matches(out, ref, tol, what=""):
    """Relative error of the whole tensor <= tol, and every element within tol of its own size
    plus the tensor's largest size (an intermediate rounding may flip by one ulp of the input)."""
    ref = ref.to(out.device, torch.float64)
    assert torch.isfinite(out).all(), what
    err = rel_err(out, ref)
    assert err <= tol, (what, err)
    bound = tol * (ref.abs() + ref.abs().max())
    worst = ((out.double() - ref).abs() - bound).max().item()
    assert worst <= 0, (what, "elementwise", worst)


# ---------------------------------------------------------------- float64 oracles (from the spec)
def oracle_add_rms_norm(x, residual, weight, eps):
    h = x.double() if residual is None else rnd(x.double() + residual.double(), x.dtype)
    ms = (h * h).sum(-1, keepdim=True) / h.shape[-1]
    return h / torch.sqrt(ms + eps) * weight.double(), h


def oracle_rms_norm_rope(x, weight, eps, cos, sin):
    b_sz, s, hn, d = x.shape
    r = cos.shape[1]
    half = r // 2
    v = x.double()
    n = rnd(v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * weight.double(), x.dtype)
    out = n.clone()
    c, sn = cos.double()[None, :, None, :], sin.double()[None, :, None, :]  # [1,S,1,R]
    for i in range(r):  # column by column: out_i = n_i cos_i + (-n_{i+h} or n_{i-h}) sin_i
        partner = -n[..., i + half] if i < half else n[..., i - half]
        out[..., i] = n[..., i] * c[..., i] + partner * sn[..., i]
    return out.permute(0, 2, 1, 3)  # [B,Hn,S,D]


def oracle_silu_mul(g, u):
    gd = g.double()
    return rnd(rnd(gd * (1 / (1 + torch.exp(-gd))), g.dtype) * u.double(), g.dtype)


def oracle_sigmoid_gate(o, gate):
    b_sz, hn, s, d = o.shape
    out = torch.empty(b_sz, s, hn * d, dtype=torch.float64, device=o.device)
    sig = rnd(1 / (1 + torch.exp(-gate.double())), o.dtype)
    for h in range(hn):
        out[:, :, h * d:(h + 1) * d] = o[:, h].double() * sig[:, :, h * d:(h + 1) * d]
    return rnd(out, o.dtype)


def rope_tables(gen, s, r):
    """cos/sin float32 [S, R] of random angles, a different angle in every column (so a wrong
    pairing of the two halves shows)."""
    a = torch.rand(s, r, generator=gen, dtype=torch.float64) * 2 * math.pi
    return a.cos().float().to(DEV), a.sin().float().to(DEV)


# ---------------------------------------------------------------- add_rms_norm
NORM_SHAPES = [(96,), (1, 1, 96), (2, 5, 96), (1, 4, 4096), (3, 200)]


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_add_rms_norm(rng, shape, dtype, with_residual):
    hid = shape[-1]
    x = randn(rng, *shape, dtype=dtype)
    res = randn(rng, *shape, dtype=dtype) if with_residual else None
    w = eff_weight(rng, hid)
    y, h = fo.add_rms_norm(x, res, w, EPS)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert h.shape == x.shape and h.dtype == dtype and h.is_contiguous()
    if res is None:
        assert h is x
    y_ref, h_ref = oracle_add_rms_norm(x, res, w, EPS)
    assert_matches(h, h_ref, TOL[dtype], "h")
    assert_matches(y, y_ref, TOL[dtype], "y")
    y_t, h_t = fo.add_rms_norm_torch(x, res, w, EPS)
    assert_matches(y, y_t.double(), TORCH_TOL[dtype], "y vs torch")
    assert torch.equal(h, h_t)  # one rounding of the exact sum (fp32 adds fp16/bf16 values exactly enough)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_strided(rng, dtype):
    """Row-strided x and residual (slices of wider tensors) and a strided weight."""
    b_sz, s, hid = 2, 3, 96
    x = randn(rng, b_sz, s, hid + 24, dtype=dtype)[..., 8:8 + hid]
    res = randn(rng, b_sz, 2 * s, hid, dtype=dtype)[:, ::2]
    w = torch.stack([eff_weight(rng, hid), eff_weight(rng, hid)], -1)[:, 1]
    assert not x.is_contiguous() and not res.is_contiguous() and w.stride(0) == 2
    y, h = fo.add_rms_norm(x, res, w, EPS)
    y_ref, h_ref = oracle_add_rms_norm(x, res, w, EPS)
    assert_matches(h, h_ref, TOL[dtype], "h")
    assert_matches(y, y_ref, TOL[dtype], "y")
    assert_matches(y, fo.add_rms_norm_torch(x, res, w, EPS)[0].double(), TORCH_TOL[dtype], "y vs torch")


def test_norm_eps_is_used(rng):
    """Tiny inputs, where eps dominates the mean square: a kernel that drops eps is caught."""
    x = randn(rng, 3, 96, scale=1e-3)
    w = eff_weight(rng, 96)
    y, _ = fo.add_rms_norm(x, None, w, 1e-4)
    assert_matches(y, oracle_add_rms_norm(x, None, w, 1e-4)[0], TOL[torch.float32])
    q = randn(rng, 1, 2, 3, 80, scale=1e-3)
    cos, sin = rope_tables(rng, 2, 64)
    wq = eff_weight(rng, 80)
    out = fo.rms_norm_rope(q, wq, 1e-4, cos, sin)
    assert out.pow(2).mean().sqrt() < 0.2  # rms ~0.1; without eps each head would come out at rms ~1
    assert_matches(out, oracle_rms_norm_rope(q, wq, 1e-4, cos, sin), TOL[torch.float32])


# ---------------------------------------------------------------- rms_norm_rope
ROPE_SHAPES = [  # B, S, Hn, D, R
    (1, 1, 4, 80, 64),
    (2, 5, 3, 80, 64),
    (1, 5, 2, 256, 64),
    (2, 1, 16, 256, 64),
    (1, 3, 2, 64, 64),
    (1, 2, 3, 96, 32),
]


@pytest.mark.parametrize("strided", [True, False], ids=["qg_slice", "contiguous"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_rope(rng, shape, dtype, strided):
    b_sz, s, hn, d, r = shape
    if strided:  # q = qg[..., :D] of the fused q/gate projection [B,S,Hn,2D]
        x = randn(rng, b_sz, s, hn, 2 * d, dtype=dtype)[..., :d]
    else:
        x = randn(rng, b_sz, s, hn, d, dtype=dtype)
    w = eff_weight(rng, d)
    cos, sin = rope_tables(rng, s, r)
    out = fo.rms_norm_rope(x, w, EPS, cos, sin)
    assert out.shape == (b_sz, hn, s, d) and out.dtype == dtype and out.is_contiguous()
    assert_matches(out, oracle_rms_norm_rope(x, w, EPS, cos, sin), TOL[dtype])
    assert_matches(out, fo.rms_norm_rope_torch(x, w, EPS, cos, sin).double(), TORCH_TOL[dtype], "vs torch")


def test_rope_identity_tables_give_the_norm(rng):
    """cos=1, sin=0 leaves the normed vector; a quarter turn maps (a, b) to (-b, a)."""
    x = randn(rng, 1, 2, 3, 80)
    w = eff_weight(rng, 80)
    normed = fo.rms_norm_rope(x, w, EPS, torch.ones(2, 64, device=DEV), torch.zeros(2, 64, device=DEV))
    n = fo.add_rms_norm(x, None, w, EPS)[0].transpose(1, 2)
    assert torch.allclose(normed, n, rtol=1e-6, atol=1e-6)
    quarter = fo.rms_norm_rope(x, w, EPS, torch.zeros(2, 64, device=DEV), torch.ones(2, 64, device=DEV))
    assert torch.allclose(quarter[..., :32], -n[..., 32:64], rtol=1e-6, atol=1e-6)
    assert torch.allclose(quarter[..., 32:64], n[..., :32], rtol=1e-6, atol=1e-6)
    assert torch.allclose(quarter[..., 64:], n[..., 64:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_rope_to_cache(rng, dtype):
    """k normed and rotated into slots length[b]..length[b]+S-1 of a NaN-filled cache, v copied
    beside it (strided: the GEMV outputs' views), every other slot untouched."""
    b_sz, s, hn, d, r, cap = 2, 3, 2, 128, 64, 11
    k = randn(rng, b_sz, s, hn, 2 * d, dtype=dtype)[..., :d]
    v = randn(rng, b_sz, s, hn, d, dtype=dtype)
    w = eff_weight(rng, d)
    cos, sin = rope_tables(rng, s, r)
    kc = torch.full((b_sz, hn, cap, d), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    length = torch.tensor([4, 7], dtype=torch.int32, device=DEV)
    fo.rms_norm_rope_to_cache(k, v, w, EPS, cos, sin, kc, vc, length)
    want_k = oracle_rms_norm_rope(k, w, EPS, cos, sin)  # [B,Hn,S,D]
    for b, start in enumerate(length.tolist()):
        assert_matches(kc[b:b + 1, :, start:start + s], want_k[b:b + 1], TOL[dtype])
        assert torch.equal(vc[b, :, start:start + s], v[b].transpose(0, 1))
        rest = [c for c in range(cap) if not start <= c < start + s]
        assert torch.isnan(kc[b, :, rest]).all() and torch.isnan(vc[b, :, rest]).all()
    kt, vt = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    fo.rms_norm_rope_to_cache_torch(k, v, w, EPS, cos, sin, kt, vt, length)  # each batch at its own length
    for b, start in enumerate(length.tolist()):
        assert_matches(kt[b:b + 1, :, start:start + s], want_k[b:b + 1], TORCH_TOL[dtype], "the torch twin")
    filled = ~kc.isnan()
    assert torch.equal(kt.isnan(), kc.isnan()) and torch.equal(vt.isnan(), vc.isnan()), "the twin's slots"
    assert torch.equal(vt[filled], vc[filled])
    with pytest.raises(ValueError, match="cache"):
        fo.rms_norm_rope_to_cache(k, v, w, EPS, cos, sin, kc.float() if dtype != torch.float32 else kc.half(), vc,
                                  length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=gpu)])
def test_rms_norm_rope_qk(rng, dtype):
    """q and k in one launch: q as the float64 oracle with q's weight, k and v in the cache at
    length[b] with k's weight (different weights and head counts, so a swapped pointer shows),
    equal to the two separate launches, every other slot untouched."""
    b_sz, s, hq, hk, d, r, cap = 2, 3, 4, 2, 128, 64, 9
    qg = randn(rng, b_sz, s, hq, 2 * d, dtype=dtype)
    q = qg[..., :d]  # the q half of a gated q projection, as the fused path passes it
    k = randn(rng, b_sz, s, hk, d, dtype=dtype, scale=3.0)
    v = randn(rng, b_sz, s, hk, d, dtype=dtype)
    wq, wk = eff_weight(rng, d), 2 * eff_weight(rng, d)
    cos, sin = rope_tables(rng, s, r)
    kc = torch.full((b_sz, hk, cap, d), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    length = torch.tensor([1, 5], dtype=torch.int32, device=DEV)
    out = fo.rms_norm_rope_qk(q, k, v, wq, wk, EPS, cos, sin, kc, vc, length)
    assert out.shape == (b_sz, hq, s, d) and out.is_contiguous()
    assert_matches(out, oracle_rms_norm_rope(q, wq, EPS, cos, sin), TOL[dtype], "q")
    want_k = oracle_rms_norm_rope(k, wk, EPS, cos, sin)
    for b, start in enumerate(length.tolist()):
        assert_matches(kc[b:b + 1, :, start:start + s], want_k[b:b + 1], TOL[dtype], "k")
        assert torch.equal(vc[b, :, start:start + s], v[b].transpose(0, 1))
        rest = [c for c in range(cap) if not start <= c < start + s]
        assert torch.isnan(kc[b, :, rest]).all() and torch.isnan(vc[b, :, rest]).all()
    k2, v2 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    fo.rms_norm_rope_to_cache(k, v, wk, EPS, cos, sin, k2, v2, length)
    assert torch.equal(out, fo.rms_norm_rope(q, wq, EPS, cos, sin))
    assert torch.equal(k2.nan_to_num(7.0), kc.nan_to_num(7.0)) and torch.equal(v2.nan_to_num(7.0), vc.nan_to_num(7.0))
    with pytest.raises(ValueError, match="share B, S, D"):
        fo.rms_norm_rope_qk(q[..., :64], k, v, wq[:64].contiguous(), wk, EPS, cos, sin, kc, vc, length)


def test_rope_tables_match_float64_and_the_rope(rng):
    """cos/sin of float32(pos[axis[j]]) * inv_freq[j mod R/2]: against float64 math on the same
    float32 angles, and against the engine's Rope.tables, for multimodal positions (three
    different rows, large positions) read through a strided view."""
    from qwen35_fast.engine.rope import Rope

    rope = Rope(64, 10_000_000.0, (11, 11, 10), True, DEV)
    table = torch.randint(0, 300_000, (3, 40), generator=rng).to(DEV)
    pos = table[:, 7:12]  # a view, as RowPositions.rows returns
    cos, sin = fo.rope_tables(pos, rope.inv_freq, rope.axis)
    assert cos.shape == sin.shape == (5, 64) and cos.is_contiguous()
    j = torch.arange(64, device=DEV)
    f = pos[rope.axis, :].T.to(torch.float32) * rope.inv_freq[j % 32]  # [S, R] float32 angles
    assert torch.allclose(cos.double(), f.double().cos(), rtol=0, atol=2e-7)
    assert torch.allclose(sin.double(), f.double().sin(), rtol=0, atol=2e-7)
    want_cos, want_sin = rope.tables(pos)
    assert torch.allclose(cos, want_cos, rtol=0, atol=2e-7) and torch.allclose(sin, want_sin, rtol=0, atol=2e-7)
    assert not torch.equal(pos[0], pos[1]), "the test needs distinct axes"
    with pytest.raises(ValueError, match="int64 \\[3, S\\]"):
        fo.rope_tables(pos.float(), rope.inv_freq, rope.axis)
    with pytest.raises(ValueError, match="axis int64"):
        fo.rope_tables(pos, rope.inv_freq, rope.axis[:10])


# ---------------------------------------------------------------- silu_mul
SILU_SHAPES = [(1, 1, 96), (2, 5, 300), (3, 3000), (1, 1, 12288)]


@pytest.mark.parametrize("strided", [True, False], ids=["gate_up_slices", "contiguous"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_silu_mul(rng, shape, dtype, strided):
    n = shape[-1]
    if strided:  # the halves of a fused gate/up projection [..., 2N]
        gu = randn(rng, *shape[:-1], 2 * n, dtype=dtype, scale=3.0)
        g, u = gu[..., :n], gu[..., n:]
    else:
        g, u = randn(rng, *shape, dtype=dtype, scale=3.0), randn(rng, *shape, dtype=dtype)
    out = fo.silu_mul(g, u)
    assert out.shape == g.shape and out.dtype == dtype and out.is_contiguous()
    assert_matches(out, oracle_silu_mul(g, u), TOL[dtype])
    assert_matches(out, fo.silu_mul_torch(g, u).double(), TORCH_TOL[dtype], "vs torch")


def test_silu_mul_extremes():
    """Large |g| saturates without inf/NaN: silu(-80) ~ 0, silu(80) = 80."""
    g = torch.tensor([[-80.0, -20.0, 0.0, 20.0, 80.0]], device=DEV)
    u = torch.full_like(g, 2.0)
    for dtype in (torch.float32, torch.float16):
        out = fo.silu_mul(g.to(dtype), u.to(dtype)).double()
        assert torch.isfinite(out).all()
        assert torch.allclose(out, oracle_silu_mul(g.to(dtype), u.to(dtype)).to(out.device), rtol=1e-3, atol=1e-6)


# ---------------------------------------------------------------- sigmoid_gate
GATE_SHAPES = [  # B, Hn, S, D
    (1, 4, 1, 80),
    (2, 3, 5, 80),
    (1, 16, 1, 256),
    (2, 2, 4, 96),
]


@pytest.mark.parametrize("strided", [True, False], ids=["strided", "contiguous"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GATE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sigmoid_gate(rng, shape, dtype, strided):
    b_sz, hn, s, d = shape
    if strided:  # o a transposed view of padded [B,S,Hn,D+8] rows; gate a slice of a wider row
        o = randn(rng, b_sz, s, hn, d + 8, dtype=dtype)[..., :d].transpose(1, 2)
        gate = randn(rng, b_sz, s, hn * d + 16, dtype=dtype, scale=3.0)[..., 16:]
        assert not o.is_contiguous() and gate.storage_offset() == 16
    else:
        o = randn(rng, b_sz, hn, s, d, dtype=dtype)
        gate = randn(rng, b_sz, s, hn * d, dtype=dtype, scale=3.0)
    out = fo.sigmoid_gate(o, gate)
    assert out.shape == (b_sz, s, hn * d) and out.dtype == dtype and out.is_contiguous()
    assert_matches(out, oracle_sigmoid_gate(o, gate), TOL[dtype])
    assert_matches(out, fo.sigmoid_gate_torch(o, gate).double(), TORCH_TOL[dtype], "vs torch")


def test_sigmoid_gate_from_qg_view(rng):
    """The engine's real gate: the per-head view ``qg[..., D:]`` ``[B,S,Hn,D]`` of the q projection
    (head stride 2D, no copy), and its flattened copy."""
    b_sz, s, hn, d = 1, 3, 4, 80
    qg = randn(rng, b_sz, s, hn, 2 * d)
    o = randn(rng, b_sz, hn, s, d)
    flat = qg[..., d:].reshape(b_sz, s, hn * d)
    want = oracle_sigmoid_gate(o, flat)
    assert_matches(fo.sigmoid_gate(o, qg[..., d:]), want, TOL[torch.float32])
    assert_matches(fo.sigmoid_gate(o, flat), want, TOL[torch.float32])


# ---------------------------------------------------------------- ConvRot-rotated outputs, split-K partials
ROT_DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=gpu)]


@pytest.mark.parametrize("group", [16, 64, 256])  # 16 and 256 in the kernels' tiles, 64 by a launch after
@pytest.mark.parametrize("dtype", ROT_DTYPES)
def test_rotated_outputs_match_kitchen(rng, group, dtype):
    """``rotate=G``: the op's own output, then ConvRot-rotated as comfy-kitchen rotates it, one rounding;
    the unrotated output is unchanged. Widths leave a partial silu tile and take several heads."""
    tol = 2 * TOL[dtype]
    x, res, w = randn(rng, 1, 3, 1536, dtype=dtype), randn(rng, 1, 3, 1536, dtype=dtype), eff_weight(rng, 1536)
    y, h, y_rot = fo.add_rms_norm(x, res, w, EPS, rotate=group)  # 3 slices of 512 columns and an empty one
    assert y_rot.shape == y.shape and y_rot.dtype == dtype
    assert_matches(y, oracle_add_rms_norm(x, res, w, EPS)[0], TOL[dtype], "y")
    assert_matches(y_rot, kitchen_rotate(y, group), tol, "y_rot")
    assert_matches(fo.add_rms_norm_torch(x, res, w, EPS, rotate=group)[2], kitchen_rotate(y, group), tol, "twin")
    g, u = randn(rng, 2, 1536, dtype=dtype, scale=3.0), randn(rng, 2, 1536, dtype=dtype)
    out, out_rot = fo.silu_mul(g, u, rotate=group)
    assert_matches(out, oracle_silu_mul(g, u), TOL[dtype], "silu")
    assert_matches(out_rot, kitchen_rotate(out, group), tol, "silu rot")
    o, gate = randn(rng, 1, 2, 3, 256, dtype=dtype), randn(rng, 1, 3, 512, dtype=dtype, scale=3.0)
    out, out_rot = fo.sigmoid_gate(o, gate, rotate=group)
    assert_matches(out, oracle_sigmoid_gate(o, gate), TOL[dtype], "gate")
    assert_matches(out_rot, kitchen_rotate(out, group), tol, "gate rot")
    assert_matches(fo.sigmoid_gate_torch(o, gate, rotate=group)[1], kitchen_rotate(out, group), tol, "gate twin")


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("dtype", ROT_DTYPES)
def test_add_rms_norm_sums_partials(rng, dtype, count):
    """float32 partial products ``[P, ..., H]`` as the residual: summed, rounded to x's dtype once
    (as the unsplit product is), then added; the torch twin does the same."""
    x, w = randn(rng, 1, 2, 384, dtype=dtype), eff_weight(rng, 384)
    parts = randn(rng, count, 1, 2, 384)
    y, h = fo.add_rms_norm(x, parts, w, EPS)
    prod = rnd(parts.double().sum(0), dtype).to(dtype)
    y_ref, h_ref = oracle_add_rms_norm(x, prod, w, EPS)
    assert_matches(h, h_ref, TOL[dtype], "h")
    assert_matches(y, y_ref, TOL[dtype], "y")
    assert_matches(y, fo.add_rms_norm_torch(x, parts, w, EPS)[0].double(), TORCH_TOL[dtype], "twin")
    with pytest.raises(ValueError, match="float32 partials"):
        fo.add_rms_norm(x, parts.to(dtype) if dtype != torch.float32 else parts[:, :, :1], w, EPS)


@pytest.mark.parametrize("residual", ["partials", "none"])
@pytest.mark.parametrize("rotate", [0, 256])
@pytest.mark.parametrize("dtype", ROT_DTYPES)
def test_add_rms_norm_deferred(rng, dtype, rotate, residual):
    """``defer=True``: y is h * weight rounded, without the row's factor; ``RowNorm.sq`` holds one
    sum of squares of h per 512-column program, whose sum is the row's; y times the factor is the
    norm (float64 oracle); h is the undeferred call's bit for bit; y_rot is y's rotation; the torch
    twin agrees."""
    x, w = randn(rng, 1, 3, 1536, dtype=dtype), eff_weight(rng, 1536)
    parts = randn(rng, 4, 1, 3, 1536) if residual == "partials" else None
    out = fo.add_rms_norm(x, parts, w, EPS, rotate=rotate, defer=True, config=(512, 4))
    assert len(out) == (4 if rotate else 3)
    y, h, norm = out[0], out[1], out[-1]
    prod = None if parts is None else rnd(parts.double().sum(0), dtype).to(dtype)
    y_ref, h_ref = oracle_add_rms_norm(x, prod, w, EPS)
    assert torch.equal(h, fo.add_rms_norm(x, parts, w, EPS)[1])
    assert norm.sq.shape == (1, 3, 3) and norm.sq.dtype == torch.float32 and norm.n == 1536 and norm.eps == EPS
    for j in range(3):
        assert_matches(norm.sq[..., j], h_ref[..., 512 * j:512 * (j + 1)].square().sum(-1), 1e-5, f"sq {j}")
    assert_matches(y, rnd(h_ref * w.double(), dtype), TOL[dtype], "y")
    assert_matches(y.double() * factor(norm).double(), y_ref, TOL[dtype], "y * factor")
    if rotate:
        assert_matches(out[2], kitchen_rotate(y, 256), 2 * TOL[dtype], "y_rot")
    twin = fo.add_rms_norm_torch(x, parts, w, EPS, rotate=rotate, defer=True)
    assert_matches(y, twin[0].double(), TORCH_TOL[dtype], "twin y")
    assert_matches(factor(norm), factor(twin[-1]).double(), 1e-5, "twin factor")


@pytest.mark.parametrize("config", [(2048, 8), (256, 4)], ids=["one-program", "256-columns"])
def test_add_rms_norm_configs(rng, config):
    """Every launch config computes the same norm: one program per row (the row kept in registers)
    or many slices, with partials summed and the output rotated."""
    x, w = randn(rng, 1, 3, 1536), eff_weight(rng, 1536)
    parts = randn(rng, 4, 1, 3, 1536)
    y, h, y_rot = fo.add_rms_norm(x, parts, w, EPS, rotate=256, config=config)
    y_ref, h_ref = oracle_add_rms_norm(x, rnd(parts.double().sum(0), x.dtype).to(x.dtype), w, EPS)
    assert_matches(h, h_ref, TOL[torch.float32], "h")
    assert_matches(y, y_ref, TOL[torch.float32], "y")
    assert_matches(y_rot, kitchen_rotate(y, 256), 2 * TOL[torch.float32], "y_rot")
    with pytest.raises(ValueError, match="power of two dividing"):
        fo.add_rms_norm(x, parts, w, EPS, config=(768, 4))


# ---------------------------------------------------------------- rounding points
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=gpu)])
def test_rounding_points_match_torch(rng, dtype):
    """Kernels round where the *_torch twins do, so in half precision they agree bit for bit on
    almost every element (float32-level differences flip a rounding very rarely). A kernel that
    skips a rounding point (norm before RoPE, silu, sigmoid) differs on ~20% of the elements,
    which the ulp-sized tolerances above cannot see."""
    def frac_differs(a, b):
        return (a != b).float().mean().item()

    x, res, w = randn(rng, 2, 5, 96, dtype=dtype), randn(rng, 2, 5, 96, dtype=dtype), eff_weight(rng, 96)
    assert frac_differs(fo.add_rms_norm(x, res, w, EPS)[0], fo.add_rms_norm_torch(x, res, w, EPS)[0]) < 0.01
    q, wd = randn(rng, 2, 5, 3, 160, dtype=dtype)[..., :80], eff_weight(rng, 80)
    cos, sin = rope_tables(rng, 5, 64)
    assert frac_differs(fo.rms_norm_rope(q, wd, EPS, cos, sin), fo.rms_norm_rope_torch(q, wd, EPS, cos, sin)) < 0.01
    g, u = randn(rng, 5, 3000, dtype=dtype, scale=3.0), randn(rng, 5, 3000, dtype=dtype)
    assert frac_differs(fo.silu_mul(g, u), fo.silu_mul_torch(g, u)) < 0.01
    o, gate = randn(rng, 2, 3, 5, 80, dtype=dtype), randn(rng, 2, 5, 240, dtype=dtype, scale=3.0)
    assert frac_differs(fo.sigmoid_gate(o, gate), fo.sigmoid_gate_torch(o, gate)) < 0.01


# ---------------------------------------------------------------- dispatch, edge cases and errors
def test_empty_inputs():
    w = torch.ones(96, device=DEV)
    y, h = fo.add_rms_norm(torch.empty(0, 96, device=DEV), torch.empty(0, 96, device=DEV), w, EPS)
    assert y.shape == h.shape == (0, 96)
    assert fo.silu_mul(torch.empty(2, 0, 8, device=DEV), torch.empty(2, 0, 8, device=DEV)).shape == (2, 0, 8)
    assert fo.sigmoid_gate(torch.empty(1, 2, 0, 8, device=DEV), torch.empty(1, 0, 16, device=DEV)).shape == (1, 0, 16)
    cos = torch.empty(0, 8, device=DEV)
    assert fo.rms_norm_rope(torch.empty(1, 0, 2, 8, device=DEV), torch.ones(8, device=DEV), EPS, cos,
                            cos).shape == (1, 2, 0, 8)


def test_fused_ops_reason(monkeypatch):
    x = torch.randn(2, 96)
    w = torch.ones(96)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    why = fo.fused_ops_reason(x)
    assert why is not None and "TRITON_INTERPRET" in why and "\n" not in why
    assert fo.fused_ops_reason(torch.empty(1, device="meta")) is not None
    calls = [
        ("add_rms_norm_torch", lambda: fo.add_rms_norm(x, None, w, EPS)),
        ("rms_norm_rope_torch", lambda: fo.rms_norm_rope(x.view(1, 1, 2, 96), w, EPS, torch.ones(1, 64),
                                                         torch.zeros(1, 64))),
        ("silu_mul_torch", lambda: fo.silu_mul(x, x)),
        ("sigmoid_gate_torch", lambda: fo.sigmoid_gate(x.view(1, 2, 1, 96), x.view(1, 1, 192))),
    ]
    for fallback, call in calls:
        with pytest.raises(ValueError, match=fallback):
            call()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fo.fused_ops_reason(x) is None
    if HAS_CUDA:
        assert fo.fused_ops_reason(x.cuda()) is None


def test_bad_inputs_raise_clear_errors(rng):
    x = randn(rng, 1, 2, 96)
    w = torch.ones(96, device=DEV)
    q = randn(rng, 1, 3, 2, 80)
    w80 = torch.ones(80, device=DEV)
    cos = sin = torch.ones(3, 64, device=DEV)
    o = randn(rng, 1, 2, 3, 80)
    gate = randn(rng, 1, 3, 160)
    cases = [
        (fo.add_rms_norm, (x, None, torch.ones(95, device=DEV), EPS), r"shape \[96\]"),
        (fo.add_rms_norm, (x, None, w.half(), EPS), "float32"),
        (fo.add_rms_norm, (x, x[:, :1], w, EPS), "residual must match"),
        (fo.add_rms_norm, (x, x.half(), w, EPS), "residual must match"),
        (fo.add_rms_norm, (x.double(), None, w.double(), EPS), "bfloat16, float16 or float32"),
        (fo.add_rms_norm, (randn(rng, 2, 96, 3).transpose(1, 2), None, w, EPS), "contiguous last dim"),
        (fo.add_rms_norm, (randn(rng, 2, 3, 96).transpose(0, 1), None, w, EPS), r"x.contiguous\(\)"),
        (fo.rms_norm_rope, (q, torch.ones(64, device=DEV), EPS, cos, sin), r"shape \[80\]"),
        (fo.rms_norm_rope, (q[0], w80, EPS, cos, sin), r"expected x \[B,S,Hn,D\]"),
        (fo.rms_norm_rope, (q, w80, EPS, cos[:2], sin[:2]), "S=3"),
        (fo.rms_norm_rope, (q, w80, EPS, cos[:, :63], sin[:, :63]), "R=63"),
        (fo.rms_norm_rope, (q[..., :48], torch.ones(48, device=DEV), EPS, cos, sin), "R=64"),
        (fo.rms_norm_rope, (q, w80, EPS, cos, sin[:, :32]), "same shape"),
        (fo.rms_norm_rope, (q, w80, EPS, cos.half(), sin), "float32"),
        (fo.silu_mul, (x, x[..., :95]), "same shape and dtype"),
        (fo.silu_mul, (x, x.half()), "same shape and dtype"),
        (fo.sigmoid_gate, (o, gate[..., :159]), r"\[B,S,Hn\*D\]"),
        (fo.sigmoid_gate, (o, gate.half()), "float32"),
        (fo.sigmoid_gate, (o[0], gate), r"expected o \[B,Hn,S,D\]"),
    ]
    for fn, args, needle in cases:
        with pytest.raises(ValueError, match=needle):
            fn(*args)
    if HAS_CUDA:
        with pytest.raises(ValueError, match="one device"):
            fo.add_rms_norm(x, None, w.cpu(), EPS)


def test_oracles_are_real(rng):
    """The float64 oracles agree with closed forms on hand-made inputs."""
    x = torch.tensor([[3.0, 4.0]])
    y, _ = oracle_add_rms_norm(x, None, torch.tensor([1.0, 2.0]), 0.0)
    assert torch.allclose(y, torch.tensor([[3.0, 8.0]], dtype=torch.float64) / math.sqrt(12.5))
    q = torch.tensor([[[[1.0, 0.0, 0.0, 0.0, 5.0]]]])  # D=5, R=4: n = q / rms, rms = sqrt(26/5)
    a = 0.3
    cos = torch.full((1, 4), math.cos(a))
    sin = torch.full((1, 4), math.sin(a))
    out = oracle_rms_norm_rope(q, torch.ones(5), 0.0, cos, sin)[0, 0, 0] * math.sqrt(26 / 5)
    # pairs (0, 2) and (1, 3) rotate: (1, 0) -> (cos a, sin a); the pass-through dim stays
    assert torch.allclose(out, torch.tensor([math.cos(a), 0, math.sin(a), 0, 5.0], dtype=torch.float64), atol=1e-6)
    assert math.isclose(oracle_silu_mul(torch.tensor([2.0]), torch.tensor([3.0])).item(),
                        3 * 2 / (1 + math.exp(-2)), rel_tol=1e-6)
    assert math.isclose(oracle_sigmoid_gate(torch.full((1, 1, 1, 1), 2.0), torch.zeros(1, 1, 1)).item(), 1.0)


# ---------------------------------------------------------------- GPU (skipped without CUDA)
def _gpu_gen():
    return torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)


def _cuda_randn(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()


@gpu
@pytest.mark.parametrize("s", [1, 4])
def test_gpu_bf16_9b_shapes(s):
    gen = _gpu_gen()
    tol, ttol = TOL[torch.bfloat16], TORCH_TOL[torch.bfloat16]
    hid = 4096
    x, res = _cuda_randn(gen, 1, s, hid), _cuda_randn(gen, 1, s, hid)
    w = 1 + 0.1 * torch.randn(hid, generator=gen, device="cuda")
    y, h = fo.add_rms_norm(x, res, w, EPS)
    y_ref, h_ref = oracle_add_rms_norm(x, res, w, EPS)
    assert_matches(h, h_ref, tol, "h")
    assert_matches(y, y_ref, tol, "y")
    assert_matches(y, fo.add_rms_norm_torch(x, res, w, EPS)[0].double(), ttol, "y vs torch")

    d, r = 256, 64
    wd = 1 + 0.1 * torch.randn(d, generator=gen, device="cuda")
    a = torch.rand(s, r, generator=gen, device="cuda", dtype=torch.float64) * 2 * math.pi
    cos, sin = a.cos().float(), a.sin().float()
    for hn in (16, 4):
        qg = _cuda_randn(gen, 1, s, hn, 2 * d)
        q = qg[..., :d]
        out = fo.rms_norm_rope(q, wd, EPS, cos, sin)
        assert_matches(out, oracle_rms_norm_rope(q, wd, EPS, cos, sin), tol, f"rope Hn={hn}")
        assert_matches(out, fo.rms_norm_rope_torch(q, wd, EPS, cos, sin).double(), ttol, f"rope Hn={hn} torch")

    n = 12288
    gu = _cuda_randn(gen, 1, s, 2 * n, scale=3.0)
    g, u = gu[..., :n], gu[..., n:]
    out = fo.silu_mul(g, u)
    assert_matches(out, oracle_silu_mul(g, u), tol, "silu_mul")
    assert_matches(out, fo.silu_mul_torch(g, u).double(), ttol, "silu_mul vs torch")

    hn = 16
    qg = _cuda_randn(gen, 1, s, hn, 2 * d, scale=3.0)
    gate = qg[..., d:].reshape(1, s, hn * d)
    o = _cuda_randn(gen, 1, hn, s, d)
    out = fo.sigmoid_gate(o, gate)
    assert_matches(out, oracle_sigmoid_gate(o, gate), tol, "sigmoid_gate")
    assert_matches(out, fo.sigmoid_gate_torch(o, gate).double(), ttol, "sigmoid_gate vs torch")


@gpu
@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("config", [(512, 4), (4096, 8), (4096, 16)])
def test_gpu_rotated_norm_every_config(config, defer):
    """bf16 at the 9B width, column counts per program the benchmark tries: the tiles up to
    512 columns rotate in the kernel, wider ones (whose in-kernel rotation needs more shared memory
    than an H200 has) through a rotation launch after it, with the same result."""
    gen = _gpu_gen()
    x, parts = _cuda_randn(gen, 1, 2, 4096), torch.randn(4, 1, 2, 4096, generator=gen, device="cuda")
    w = 1 + 0.1 * torch.randn(4096, generator=gen, device="cuda")
    out = fo.add_rms_norm(x, parts, w, EPS, rotate=256, config=config, defer=defer)
    y, y_rot = out[0], out[2]
    assert_matches(y_rot, kitchen_rotate(y, 256), 2 * TOL[torch.bfloat16], "y_rot")
    y_ref, h_ref = oracle_add_rms_norm(x, rnd(parts.double().sum(0), x.dtype).to(x.dtype), w, EPS)
    assert_matches(out[1], h_ref, TOL[torch.bfloat16], "h")
    assert_matches(y, rnd(h_ref * w.double(), x.dtype) if defer else y_ref, TOL[torch.bfloat16], "y")


@gpu
def test_gpu_graph_capture_replay():
    """All four ops captured in one CUDA graph; new input contents replay to the eager result."""
    gen = _gpu_gen()
    s, hid, hn, d, r, n = 4, 4096, 16, 256, 64, 12288
    x, res = _cuda_randn(gen, 1, s, hid), _cuda_randn(gen, 1, s, hid)
    w = 1 + 0.1 * torch.randn(hid, generator=gen, device="cuda")
    qg = _cuda_randn(gen, 1, s, hn, 2 * d)
    wd = 1 + 0.1 * torch.randn(d, generator=gen, device="cuda")
    cos, sin = torch.empty(s, r, device="cuda"), torch.empty(s, r, device="cuda")
    gu = _cuda_randn(gen, 1, s, 2 * n)
    o = _cuda_randn(gen, 1, hn, s, d)
    gate = torch.empty(1, s, hn * d, device="cuda", dtype=torch.bfloat16)

    def step():
        return (*fo.add_rms_norm(x, res, w, EPS), fo.add_rms_norm(x, None, w, EPS)[0],
                fo.rms_norm_rope(qg[..., :d], wd, EPS, cos, sin),
                fo.silu_mul(gu[..., :n], gu[..., n:]), fo.sigmoid_gate(o, gate))

    def refill():
        for t in (x, res, qg, gu, o):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
        gate.copy_(qg[..., d:].reshape(1, s, hn * d))
        a = torch.rand(s, r, generator=gen, device="cuda") * 2 * math.pi
        cos.copy_(a.cos())
        sin.copy_(a.sin())

    refill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        refill()
        graph.replay()
        eager = step()
        for i, (c, e) in enumerate(zip(captured, eager)):
            assert torch.equal(c, e), i
        assert_matches(captured[3], oracle_rms_norm_rope(qg[..., :d], wd, EPS, cos, sin), TOL[torch.bfloat16])
        assert_matches(captured[5], oracle_sigmoid_gate(o, gate), TOL[torch.bfloat16])
