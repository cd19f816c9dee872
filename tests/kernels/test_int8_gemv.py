"""Weight-only INT8 decode-row products (Triton, CPU interpreter) against float64 references built
from ComfyUI's own dequantization (comfy-kitchen's ``TensorWiseINT8Layout``, ConvRot included)."""

import pytest
import torch
from qwen35_fast.kernels.convrot import hadamard, hadamard_rotate_torch
from qwen35_fast.kernels.convrot_triton import hadamard_rotate
from qwen35_fast.kernels.gemv import gemv, gemv_group

pytestmark = pytest.mark.interpreter  # Triton on CPU tensors: run with TRITON_INTERPRET=1 (tests/conftest.py)

ck_tensor = pytest.importorskip("comfy_kitchen.tensor", reason="comfy-kitchen (requirements-dev.txt) is the oracle")


def comfy_weight(q: torch.Tensor, scale: torch.Tensor, group: int = 0) -> torch.Tensor:
    """The float64 weight ComfyUI computes with for int8 ``q`` and ``scale`` (ConvRot when group > 0)."""
    params = ck_tensor.TensorWiseINT8Layout.Params(
        scale=scale, orig_dtype=torch.float32, orig_shape=tuple(q.shape), convrot=group > 0,
        convrot_groupsize=group or 256)
    return ck_tensor.QuantizedTensor(q, "TensorWiseINT8Layout", params).dequantize().double()


def rand_int8(gen, n, k):
    return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)


def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("per_row", [True, False], ids=["row-scale", "tensor-scale"])
def test_int8_matches_comfy_dequantization(rng, dtype, rows, per_row):
    """Odd output widths, a K that is not a tile multiple, both scale kinds."""
    n, k = 37, 100
    q = rand_int8(rng, n, k)
    scale = torch.rand(n, 1, generator=rng) * 1e-3 + 1e-4 if per_row else torch.tensor(2e-3)
    x = torch.randn(rows, k, generator=rng).to(dtype)
    out = gemv(x, q, scale, config=(16, 32, 4, 2))
    assert out.shape == (rows, n) and out.dtype == dtype
    ref = x.double() @ comfy_weight(q, scale).T
    assert rel(out, ref) < tol(dtype)


@pytest.mark.parametrize("group", [16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_convrot_rotated_input_matches_comfy(rng, group, dtype):
    """ConvRot: rotating x once and reading the stored (rotated) int8 rows gives x @ W.T with W as
    ComfyUI dequantizes and un-rotates it; without the rotation the answer is wrong."""
    n, k, rows = 45, 2 * max(group, 64), 4
    q = rand_int8(rng, n, k)
    scale = torch.rand(n, 1, generator=rng) * 1e-3 + 1e-4
    x = torch.randn(1, rows, k, generator=rng).to(dtype)
    h = hadamard(group)
    out = gemv(hadamard_rotate(x, h), q, scale, config=(16, 64, 4, 2))
    ref = x.double() @ comfy_weight(q, scale, group).T
    assert out.shape == (1, rows, n)
    assert rel(out, ref) < tol(dtype)
    assert rel(gemv(x, q, scale, config=(16, 64, 4, 2)), ref) > 0.3  # the rotation is what makes it right


@pytest.mark.parametrize("group", [16, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_convrot_argument_matches_comfy(rng, group, dtype):
    """``gemv_group(convrot=G)`` rotates x itself: two ConvRot weights in one launch equal x @ W.T
    with W as ComfyUI dequantizes them."""
    k, rows = 2 * group, 3
    x = torch.randn(rows, k, generator=rng).to(dtype)
    qs = [rand_int8(rng, n, k) for n in (45, 7)]
    scales = [torch.rand(q.shape[0], 1, generator=rng) * 1e-3 + 1e-4 for q in qs]
    for out, q, s in zip(gemv_group(x, qs, scales=scales, convrot=group, config=(16, 64, 4, 2)), qs, scales):
        assert rel(out, x.double() @ comfy_weight(q, s, group).T) < tol(dtype)


@pytest.mark.parametrize("slices", [2, 4])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_k_slices_match_comfy_dequantization(rng, slices, rows, dtype):
    """A launch whose warps own K slices of each tile (a config's fifth value): a group of odd
    widths over a K that is no tile multiple, both scale kinds, split over K ranges too, equals x @
    W.T with W as ComfyUI dequantizes it; so do dense weights."""
    k = 328  # tiles of 64: five whole, the last 8 wide (slices of 16 or 32, some empty)
    x = torch.randn(1, rows, k, generator=rng).to(dtype)
    qs = [rand_int8(rng, n, k) for n in (37, 16, 5)]
    scales = [torch.rand(37, 1, generator=rng) * 1e-3 + 1e-4, torch.tensor(2e-3), torch.rand(5, generator=rng) * 1e-3]
    for out, q, s in zip(gemv_group(x, qs, scales=scales, config=(16, 64, 4, 2, slices)), qs, scales):
        assert out.shape == (1, rows, q.shape[0]) and out.dtype == dtype
        assert rel(out, x.double() @ comfy_weight(q, s.reshape(-1, 1) if s.dim() else s).T) < tol(dtype)
    (parts,) = gemv_group(x, qs[:1], scales=scales[:1], config=(16, 64, 2, 2, slices), split=3)
    assert parts.shape == (3, 1, rows, 37)
    assert rel(parts.sum(0), x.double() @ comfy_weight(qs[0], scales[0]).T) < tol(dtype)
    dense = torch.randn(24, k, generator=rng).to(dtype)
    out = gemv(x, dense, config=(16, 64, 4, 2, slices))
    assert rel(out, x.double() @ dense.double().T) < tol(dtype)


@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_k_partials_sum_to_the_product(rng, split, dtype):
    """``split=P``: float32 partials over K ranges (a K that is no tile multiple; P larger than the
    tiles there are gives fewer partials) whose sum is x @ W.T with W as ComfyUI dequantizes it;
    each partial alone is not, and dense weights split the same way."""
    k, rows = 200, 3
    x = torch.randn(rows, k, generator=rng).to(dtype)
    qs = [rand_int8(rng, n, k) for n in (37, 16)]
    scales = [torch.rand(q.shape[0], 1, generator=rng) * 1e-3 + 1e-4 for q in qs]
    outs = gemv_group(x, qs, scales=scales, config=(16, 32, 4, 2), split=split)
    for out, q, s in zip(outs, qs, scales):
        assert out.dtype == torch.float32 and out.shape == (min(split, 7), rows, q.shape[0])
        ref = x.double() @ comfy_weight(q, s).T
        assert rel(out.sum(0), ref) < tol(dtype)
        assert rel(out[0], ref) > 0.2
    dense = torch.randn(24, k, generator=rng).to(dtype)
    (parts,) = gemv_group(x, [dense], config=(16, 64, 4, 2), split=split)
    assert rel(parts.sum(0), x.double() @ dense.double().T) < tol(dtype)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_norm_factor_is_applied(rng, split, dtype):
    """``row_norm``: each row's product (each partial's, split over K) times rsqrt(sum(sq) / n +
    eps), an RMSNorm's factor (float64 reference; sums of squares small enough that eps counts),
    for int8 and dense weights; without it the answer is wrong."""
    from qwen35_fast.kernels.row_norm import RowNorm

    k, rows, eps = 200, 3, 1e-5
    z = torch.randn(1, rows, k, generator=rng).to(dtype)
    sq = torch.rand(1, rows, 5, generator=rng) * 1e-3
    fac = 1 / torch.sqrt(sq.double().sum(-1, keepdim=True) / k + eps)
    q = rand_int8(rng, 37, k)
    s = torch.rand(37, 1, generator=rng) * 1e-3 + 1e-4
    dense = torch.randn(24, k, generator=rng).to(dtype)
    norm = RowNorm(sq, k, eps)
    (yq,) = gemv_group(z, [q], scales=[s], config=(16, 32, 4, 2), split=split, row_norm=norm)
    (yd,) = gemv_group(z, [dense], config=(16, 32, 4, 2), split=split, row_norm=norm)
    if split > 1:
        yq, yd = yq.sum(0), yd.sum(0)
    assert rel(yq, (z.double() * fac) @ comfy_weight(q, s).T) < tol(dtype)
    assert rel(yd, (z.double() * fac) @ dense.double().T) < tol(dtype)
    assert rel(gemv(z, q, s, config=(16, 32, 4, 2)), (z.double() * fac) @ comfy_weight(q, s).T) > 0.3
    with pytest.raises(ValueError, match="row_norm.sq must be float32"):
        gemv(z, q, s, row_norm=RowNorm(sq[:, :2], k, eps))


def test_linear_group_applies_row_norm_to_every_format(rng):
    """``linear_group(row_norm=)``: the factor reaches products of every format, the int8 ConvRot
    one reading a rotated input, the one ``F.linear`` computes (a column-major weight the GEMV does
    not take), before the bias."""
    from qwen35_fast.engine.plain_weights import PlainLinear, linear_group
    from qwen35_fast.kernels.row_norm import RowNorm

    k = 256
    z = torch.randn(1, 2, k, generator=rng)
    norm = RowNorm(torch.rand(1, 2, 2, generator=rng) * k, k, 1e-6)
    fac = 1 / torch.sqrt(norm.sq.double().sum(-1, keepdim=True) / k + 1e-6)
    column_major = (torch.randn(k, 9, generator=rng) * 0.1).T
    q1, q2 = rand_int8(rng, 20, k), rand_int8(rng, 5, k)
    s1, s2 = (torch.rand(q.shape[0], generator=rng) * 1e-3 + 1e-4 for q in (q1, q2))
    bias = torch.randn(9, generator=rng)
    plains = [PlainLinear(column_major, bias=bias), PlainLinear(q1, scale=s1, convrot=16),
              PlainLinear(q2, scale=s2)]
    zn = z.double() * fac
    refs = [zn @ column_major.double().T + bias.double(), zn @ comfy_weight(q1, s1[:, None], 16).T,
            zn @ comfy_weight(q2, s2[:, None]).T]
    rotated = (16, hadamard_rotate(z, hadamard(16)))
    for out, ref in zip(linear_group(z, plains, rotated=rotated, row_norm=norm), refs):
        assert rel(out, ref) < 1e-5


def test_linear_group_mixes_formats(rng):
    """The fused path's product of one input with projections of several formats (dense in x's
    dtype, int8 with a bias, int8 with ConvRot) equals each one's own reference."""
    from qwen35_fast.engine.plain_weights import PlainLinear, linear_group

    k = 256
    x = torch.randn(1, 2, k, generator=rng)
    dense = torch.randn(9, k, generator=rng) * 0.1
    q1, q2, q3 = rand_int8(rng, 20, k), rand_int8(rng, 5, k), rand_int8(rng, 11, k)
    s1, s2, s3 = (torch.rand(q.shape[0], generator=rng) * 1e-3 + 1e-4 for q in (q1, q2, q3))
    bias = torch.randn(5, generator=rng)
    plains = [PlainLinear(dense), PlainLinear(q1, scale=s1, convrot=16), PlainLinear(q2, scale=s2, bias=bias),
              PlainLinear(q3, scale=s3, convrot=16)]
    refs = [x.double() @ dense.double().T, x.double() @ comfy_weight(q1, s1[:, None], 16).T,
            x.double() @ comfy_weight(q2, s2[:, None]).T + bias.double(),
            x.double() @ comfy_weight(q3, s3[:, None], 16).T]
    outs = linear_group(x, plains)
    for out, ref in zip(outs, refs):
        assert out.shape == (1, 2, ref.shape[-1])
        assert rel(out, ref) < 1e-5


def test_hadamard_is_convrots_matrix():
    """Our matrix equals comfy-kitchen's ConvRot matrix and is orthogonal."""
    utils = pytest.importorskip("comfy_kitchen.tensor.int8_utils")
    for size in (4, 16, 64, 256):
        h = hadamard(size, dtype=torch.float64)
        assert torch.allclose(h, utils._build_hadamard(size, dtype=torch.float64), atol=0, rtol=0)
        assert torch.allclose(h @ h.T, torch.eye(size, dtype=torch.float64), atol=1e-12)
    with pytest.raises(ValueError, match="power of 4"):
        hadamard(32)


@pytest.mark.parametrize("group", [16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotation_kernel_matches_kitchen_rotation(rng, group, dtype):
    """The Triton rotation (3 rows, a width that leaves a partial tile of groups) equals comfy-kitchen's
    activation rotation in float64, and its torch twin."""
    from comfy_kitchen.tensor.int8_utils import _build_hadamard, _rotate_activation

    k = group * 19
    x = torch.randn(3, k, generator=rng).to(dtype)
    ref = _rotate_activation(x.double(), _build_hadamard(group, dtype=torch.float64), group)
    h = hadamard(group)
    out = hadamard_rotate(x, h)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel(out, ref) < tol(dtype)
    assert rel(hadamard_rotate_torch(x, h), ref) < tol(dtype)


def test_int8_group_strided_rows_and_scalar_scales(rng):
    """Four int8 weights (tiny ones among larger ones) in one launch, x rows with a stride."""
    k, rows = 64, 3
    x = torch.randn(1, rows, 2 * k, generator=rng)[..., :k]
    ns = [5, 70, 2, 33]
    qs = [rand_int8(rng, n, k) for n in ns]
    scales = [torch.rand(n, generator=rng) * 1e-3 + 1e-4 for n in ns[:2]] + [torch.tensor([3e-3]), torch.tensor(1e-3)]
    outs = gemv_group(x, qs, scales=scales, config=(16, 32, 4, 2))
    for out, q, s, n in zip(outs, qs, scales, ns):
        assert out.shape == (1, rows, n)
        assert rel(out, x.double() @ comfy_weight(q, s.reshape(-1, 1) if s.numel() > 1 else s).T) < 1e-5


def test_int8_rejects():
    q = torch.zeros(8, 16, dtype=torch.int8)
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="without a scale"):
        gemv(x, q)
    with pytest.raises(ValueError, match="per output row"):
        gemv(x, q, torch.ones(3))
    with pytest.raises(ValueError, match="per output row"):
        gemv(x, q, torch.ones(8, dtype=torch.float16))
    with pytest.raises(ValueError, match="x's dtype"):
        gemv(x, torch.zeros(8, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of the group"):
        hadamard_rotate(torch.randn(2, 20), hadamard(16))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_gpu_int8_bf16_9b_shapes_and_graph(rows):
    """bf16 activations at the 9B shapes, ConvRot 256, against ComfyUI's dequantization; a captured
    graph replayed on a new x equals eager."""
    gen = torch.Generator(device="cuda").manual_seed(1234 + rows)
    h = hadamard(256, device="cuda")
    x = torch.randn(1, rows, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    qs = [torch.randint(-127, 128, (n, 4096), generator=gen, device="cuda", dtype=torch.int8)
          for n in (8192, 4096, 32, 32)]
    scales = [torch.rand(q.shape[0], 1, generator=gen, device="cuda") * 1e-3 + 1e-4 for q in qs]
    xr = hadamard_rotate(x, h)
    for out, q, s in zip(gemv_group(xr, qs, scales=scales), qs, scales):
        ref = x.double() @ comfy_weight(q, s, 256).T
        assert rel(out, ref) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = gemv_group(xr, qs, scales=scales)
    xr.copy_(hadamard_rotate(torch.randn(1, rows, 4096, generator=gen, device="cuda").to(torch.bfloat16), h))
    graph.replay()
    for got, want in zip(outs, gemv_group(xr, qs, scales=scales)):
        assert torch.equal(got, want)


#: The 9B decode products (output widths of one launch, K), each under the launch config and K
#: split ``kernels.gemv`` picks for it: DeltaNet inputs, attention q/k/v, gate/up, the outputs that
#: feed a norm (DeltaNet out / attention o, MLP down).
NINE_B_PRODUCTS = [((8192, 4096, 32, 32), 4096), ((8192, 1024, 1024), 4096), ((12288, 12288), 4096),
                   ((4096,), 4096), ((4096,), 12288)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("ns,k", NINE_B_PRODUCTS, ids=[f"{sum(ns)}x{k}" for ns, k in NINE_B_PRODUCTS])
def test_gpu_int8_9b_products_under_their_picked_configs(ns, k, rows):
    """Every 9B decode product, bf16 rows, under the config and split the kernel picks for it, equals
    x @ W.T in float64 with W as ComfyUI dequantizes it (ConvRot 256)."""
    from qwen35_fast.kernels.launch import split_k

    gen = torch.Generator(device="cuda").manual_seed(97 + rows + len(ns) + k)
    h = hadamard(256, device="cuda")
    x = torch.randn(1, rows, k, generator=gen, device="cuda").to(torch.bfloat16)
    qs = [torch.randint(-127, 128, (n, k), generator=gen, device="cuda", dtype=torch.int8) for n in ns]
    scales = [torch.rand(n, 1, generator=gen, device="cuda") * 1e-3 + 1e-4 for n in ns]
    split = split_k(ns[0], k, True, rows, x.device) if len(ns) == 1 else 1
    outs = gemv_group(hadamard_rotate(x, h), qs, scales=scales, split=split)
    for out, q, s in zip(outs, qs, scales):
        got = out.sum(0) if split > 1 else out
        assert got.shape == (1, rows, q.shape[0])
        assert rel(got, x.double() @ comfy_weight(q, s, 256).T) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_row_norm_bf16_9b(rows, split):
    """bf16 at the 9B shapes: the deferred norm (``fused_ops.add_rms_norm(defer=True)``) feeding the
    int8 ConvRot GEMV with ``row_norm`` equals the float64 norm, rotated, times the weight as ComfyUI
    dequantizes it (split over K as a norm-feeding product is)."""
    from qwen35_fast.kernels.fused_ops import add_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(4321 + rows)
    x = (3 * torch.randn(1, rows, 4096, generator=gen, device="cuda")).to(torch.bfloat16)  # factor ~1/3
    w = 1 + 0.1 * torch.randn(4096, generator=gen, device="cuda")
    q = torch.randint(-127, 128, (4096, 4096), generator=gen, device="cuda", dtype=torch.int8)
    s = torch.rand(4096, 1, generator=gen, device="cuda") * 1e-3 + 1e-4
    z, _, z_rot, norm = add_rms_norm(x, None, w, 1e-6, rotate=256, defer=True)
    (out,) = gemv_group(z_rot, [q], scales=[s], split=split, row_norm=norm)
    if split > 1:
        out = out.sum(0)
    xd = x.double()
    ref = (xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6) * w.double()) @ comfy_weight(q, s, 256).T
    assert rel(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_prefetching_the_next_weight_changes_nothing(rows, split):
    """``prefetch=`` (the next product's weight into L2 after each program's own) is on where
    overlapped launches are, and the product equals the same launch without it bit for bit; in a
    graph too."""
    from qwen35_fast.kernels import gemv as gemv_mod
    from qwen35_fast.kernels import launch
    from qwen35_fast.kernels.capabilities import pdl_reason

    w = torch.zeros(8, 128, dtype=torch.int8, device="cuda")
    args = gemv_mod._prefetch_args(w, w.device)
    if pdl_reason(w.device) is None and launch.prefetch(w.device)[0] > 0:
        assert args is not None and args[0].data_ptr() == w.data_ptr() and args[1] == w.numel() // 128
        assert gemv_mod._prefetch_args(w, w.device, 256)[1] == 2  # a length of its own: 2 lines of 128 bytes
        assert gemv_mod._prefetch_args(w, w.device, 0) is None
    else:
        assert args is None
    gen = torch.Generator(device="cuda").manual_seed(5678 + 10 * rows + split)
    qs = [torch.randint(-127, 128, (n, 4096), generator=gen, dtype=torch.int8, device="cuda") for n in (4096, 1024)]
    scales = [torch.rand(q.shape[0], generator=gen, device="cuda") * 1e-3 + 1e-4 for q in qs]
    nxt = torch.randint(-127, 128, (12288, 4096), generator=gen, dtype=torch.int8, device="cuda")
    x = torch.randn(1, rows, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    plain = gemv_group(x, qs if split == 1 else qs[:1], scales=scales if split == 1 else scales[:1], split=split)
    fetched = gemv_group(x, qs if split == 1 else qs[:1], scales=scales if split == 1 else scales[:1], split=split,
                         prefetch=nxt)
    for a, b in zip(plain, fetched):
        assert torch.equal(a, b)
    one = gemv_group(x, qs[:1], scales=scales[:1], split=split)
    gemv_group(x, qs[:1], scales=scales[:1], split=split, prefetch=nxt)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv_group(x, qs[:1], scales=scales[:1], split=split, prefetch=nxt)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], one[0])
