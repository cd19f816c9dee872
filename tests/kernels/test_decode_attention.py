"""decode_attention backends against an independent float64 reference (CPU; Triton via the interpreter)."""

import math

import pytest
import torch
from qwen35_fast.kernels import attention_triton as td
from qwen35_fast.kernels import decode_attention

LENGTH_AWARE = ("torch", "triton", "bucket")  # bucket without a span: it zeroes the unfilled slots first
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def reference_f64(q, k, v, lengths, causal, scale=None):
    """Row-by-row float64 attention written from the spec alone (no shared code with the pack)."""
    b_sz, hq, s, d = q.shape
    hkv, cap = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(b_sz, hq, s, d, dtype=torch.float64)
    for b in range(b_sz):
        length = min(max(int(lengths[b]), 0), cap)
        for h in range(hq):
            kh = h // (hq // hkv)
            for j in range(s):
                limit = length - s + 1 + j if causal else length
                if limit <= 0:
                    continue
                keys = k[b, kh, :limit].double()
                vals = v[b, kh, :limit].double()
                w = torch.softmax(keys @ q[b, h, j].double() * scale, dim=0)
                out[b, h, j] = w @ vals
    return out


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make(gen, b, hq, hkv, s, d, cap, dtype):
    """Random q ``[b,hq,s,d]`` and caches ``[b,hkv,cap,d]`` in dtype, on the generator's device."""
    q = torch.randn(b, hq, s, d, generator=gen, device=gen.device).to(dtype)
    k = torch.randn(b, hkv, cap, d, generator=gen, device=gen.device).to(dtype)
    v = torch.randn(b, hkv, cap, d, generator=gen, device=gen.device).to(dtype)
    return q, k, v


SHAPES = [  # B, Hq, Hkv, S, D, C
    (1, 16, 4, 1, 256, 150),
    (1, 16, 4, 6, 256, 97),
    (2, 8, 2, 4, 64, 200),
    (1, 4, 4, 8, 128, 75),
    (3, 6, 1, 3, 64, 130),
]


@pytest.mark.parametrize("backend", ["torch", "triton", "masked", "bucket"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backend_matches_float64(rng, backend, dtype, shape):
    b, hq, hkv, s, d, cap = shape
    q, k, v = make(rng, b, hq, hkv, s, d, cap, dtype)
    lengths = torch.randint(s, cap + 1, (b,), generator=rng, dtype=torch.int32)
    for causal in (True, False):
        out = decode_attention(q, k, v, lengths, causal=causal, backend=backend)
        assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
        err = rel_err(out, reference_f64(q, k, v, lengths, causal))
        assert err < TOL[dtype], (backend, causal, lengths.tolist(), err)


@pytest.mark.parametrize("backend", ["torch", "triton", "masked", "bucket"])
def test_edge_lengths(rng, backend):
    """Lengths 0, 1, S, C-1, C, past C and negative (clamped), odd values, in one batch."""
    s, cap = 4, 131
    lens = [0, 1, s, cap - 1, cap, cap + 50, -3, 37, 65]
    q, k, v = make(rng, len(lens), 8, 2, s, 64, cap, torch.float32)
    lengths = torch.tensor(lens, dtype=torch.int32)
    for causal in (True, False):
        out = decode_attention(q, k, v, lengths, causal=causal, backend=backend)
        ref = reference_f64(q, k, v, lengths, causal)
        assert torch.isfinite(out).all()
        assert (out[0] == 0).all() and (out[6] == 0).all()  # L=0 and L<0: every row sees nothing
        if causal:
            assert (out[1, :, : s - 1] == 0).all()  # L=1 < S: only the last row sees a slot
        assert rel_err(out, ref) < 2e-5, (backend, causal)


@pytest.mark.parametrize("backend", LENGTH_AWARE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_poisoned_tail_never_read(rng, backend, dtype):
    """NaN in every unfilled slot leaves the length-aware outputs bit-identical."""
    s, cap = 3, 190
    q, k, v = make(rng, 3, 8, 2, s, 128, cap, dtype)
    lengths = torch.tensor([57, cap, 1], dtype=torch.int32)
    clean = decode_attention(q, k, v, lengths, backend=backend)
    for b, length in enumerate(lengths.tolist()):
        k[b, :, length:] = float("nan")
        v[b, :, length:] = float("nan")
    poisoned = decode_attention(q, k, v, lengths, backend=backend)
    assert torch.equal(clean, poisoned)
    assert torch.isfinite(poisoned).all()


def test_bucket_end_rounds_up_to_a_bucket(monkeypatch):
    from qwen35_fast.kernels import attention_torch, bucket_end

    monkeypatch.setattr(attention_torch, "BUCKET", 16)
    cases = {(0, 100): 16, (1, 100): 16, (16, 100): 16, (17, 100): 32, (95, 100): 96, (97, 100): 100,
             (100, 100): 100, (5, 8): 8}
    assert {key: bucket_end(*key) for key in cases} == cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bucket_reads_its_span_only(rng, monkeypatch, dtype):
    """With a span from ``bucket_end``, the bucketed backend equals the float64 reference whatever
    the unfilled slots hold (NaN before and past the span's end); it never touches a slot past the
    span nor a filled one, and zeroes the unfilled ones of its last bucket."""
    from qwen35_fast.kernels import attention_torch, bucket_end

    monkeypatch.setattr(attention_torch, "BUCKET", 16)
    s, cap = 3, 120
    q, k, v = make(rng, 3, 8, 2, s, 64, cap, dtype)
    lengths = torch.tensor([40, 33, 45], dtype=torch.int32)
    ref = reference_f64(q, k, v, lengths, True)
    for b, length in enumerate(lengths.tolist()):
        k[b, :, length:] = float("nan")
        v[b, :, length:] = float("nan")
    before_k, before_v = k.clone(), v.clone()
    span = bucket_end(45, cap)
    assert span == 48
    out = decode_attention(q, k, v, lengths, backend="bucket", span=span)
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL[dtype]
    for b, length in enumerate(lengths.tolist()):
        for cache, before in ((k, before_k), (v, before_v)):
            assert torch.equal(cache[b, :, :length], before[b, :, :length])  # filled slots untouched
            assert (cache[b, :, length:span] == 0).all()  # its unfilled slots, zeroed
            assert torch.isnan(cache[b, :, span:]).all()  # past the span: never touched


def test_poison_catches_masked(rng):
    """The capacity-bound baseline reads the whole cache, so the poison test must catch it."""
    q, k, v = make(rng, 1, 8, 2, 1, 64, 100, torch.float32)
    lengths = torch.tensor([40], dtype=torch.int32)
    k[:, :, 40:] = float("nan")
    out = decode_attention(q, k, v, lengths, backend="masked")
    assert torch.isnan(out).any()


@pytest.mark.parametrize("n_split", [1, 3, 7, 16])
def test_triton_split_combine(rng, n_split):
    """Any fixed split count gives the same answer, including splits with no work."""
    q, k, v = make(rng, 2, 8, 2, 5, 64, 300, torch.float32)
    lengths = torch.tensor([299, 70], dtype=torch.int32)
    out = td.triton_decode_attention(q, k, v, lengths, True, 64 ** -0.5, n_split=n_split,
                                     config={"BLOCK_N": 16})
    assert rel_err(out, reference_f64(q, k, v, lengths, True)) < 2e-5


def test_triton_many_row_blocks(rng):
    """G*S above 64 rows runs in several row blocks."""
    q, k, v = make(rng, 1, 24, 2, 8, 64, 90, torch.float32)
    lengths = torch.tensor([83], dtype=torch.int32)
    out = decode_attention(q, k, v, lengths, backend="triton")
    assert rel_err(out, reference_f64(q, k, v, lengths, True)) < 2e-5


def test_custom_scale_and_strided_inputs(rng):
    q, k, v = make(rng, 1, 4, 2, 2, 64, 80, torch.float32)
    lengths = torch.tensor([50], dtype=torch.int32)
    big_k = torch.randn(1, 2, 80, 128, generator=rng)[..., :64]  # last dim strided by 128
    big_k.copy_(k)
    for backend in ("torch", "triton", "masked"):
        out = decode_attention(q, big_k, v, lengths, scale=0.3, backend=backend)
        assert rel_err(out, reference_f64(q, k, v, lengths, True, scale=0.3)) < 2e-5


def test_auto_on_cpu_is_torch(rng, caplog):
    q, k, v = make(rng, 1, 4, 2, 1, 64, 40, torch.float32)
    from qwen35_fast.kernels import resolve_backend

    assert resolve_backend(q, 0.125) == "torch"
    out = decode_attention(q, k, v, torch.tensor([9], dtype=torch.int32))
    assert rel_err(out, reference_f64(q, k, v, [9], True)) < 2e-5


def test_bad_inputs_raise_clear_errors(rng, monkeypatch):
    q, k, v = make(rng, 1, 8, 2, 2, 64, 32, torch.float32)
    lens = torch.tensor([10], dtype=torch.int32)
    cases = [
        ((q[:, :, :1].expand(1, 8, 9, 64), k, v, lens), {}, "S=9"),
        ((q[..., :48], k[..., :48], v[..., :48], lens), {}, "head_dim 48"),
        ((q[:, :7], k, v, lens), {}, "multiple of kv heads"),
        ((q.half(), k, v, lens), {}, "dtypes"),
        ((q.double(), k.double(), v.double(), lens), {}, "dtypes"),
        ((q, k, v, lens.long()), {}, "int32"),
        ((q, k, v, torch.tensor([1, 2], dtype=torch.int32)), {}, "shape"),
        ((q, k, v[:, :, :16], lens), {}, "same shape"),
        ((q[0], k, v, lens), {}, "expected q"),
        ((q, k, v, lens), {"backend": "cuda"}, "unknown backend"),
        ((q, k, v, lens), {"backend": "kitchen"}, "kitchen"),
    ]
    for args, kw, needle in cases:
        with pytest.raises(ValueError, match=needle):
            decode_attention(*args, **kw)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        decode_attention(q, k, v, lens, backend="triton")


def test_reference_is_a_real_oracle(rng):
    """The float64 oracle itself agrees with a closed form: one visible slot returns that value."""
    q, k, v = make(rng, 1, 2, 1, 1, 64, 10, torch.float32)
    ref = reference_f64(q, k, v, [1], True)
    assert torch.allclose(ref[0, :, 0], v[0, 0, 0].double().expand(2, 64))
    ref2 = reference_f64(q, k, v, [2], True)
    w = torch.softmax(torch.stack([k[0, 0, 0] @ q[0, 0, 0], k[0, 0, 1] @ q[0, 0, 0]]).double() / 8, 0)
    assert math.isclose(ref2[0, 0, 0, 0].item(), (w[0] * v[0, 0, 0, 0] + w[1] * v[0, 0, 1, 0]).item(),
                        rel_tol=1e-6)


# ---------------------------------------------------------------- GPU (skipped without CUDA)
gpu = pytest.mark.gpu  # skipped where conftest.gpu_reason() says the GPU kernels cannot run


def reference_f64_gpu(q, k, v, lengths, causal):
    """Vectorised float64 oracle for GPU-sized inputs (same spec as reference_f64)."""
    b_sz, hq, s, d = q.shape
    hkv, cap = k.shape[1], k.shape[2]
    out = torch.zeros(b_sz, hq, s, d, dtype=torch.float64, device=q.device)
    for b in range(b_sz):
        length = min(max(int(lengths[b]), 0), cap)
        if length == 0:
            continue
        kk = k[b, :, :length].double().repeat_interleave(hq // hkv, 0)
        vv = v[b, :, :length].double().repeat_interleave(hq // hkv, 0)
        sc = q[b].double() @ kk.transpose(-1, -2) * d ** -0.5  # [Hq, S, L]
        lim = (length - s + 1 + torch.arange(s, device=q.device)) if causal else torch.full(
            (s,), length, device=q.device)
        sc = sc.masked_fill(torch.arange(length, device=q.device)[None, None] >= lim[None, :, None],
                            float("-inf"))
        w = torch.softmax(sc, -1).nan_to_num(0.0)
        out[b] = w @ vv
    return out


def _gpu_backends(q):
    from qwen35_fast.kernels.attention_kitchen import kitchen_reason

    return ["triton", "torch", "masked"] + (["kitchen"] if kitchen_reason(q, q.shape[-1] ** -0.5) is None
                                            else []) + ["bucket"]  # last: it zeroes unfilled slots


@gpu
@pytest.mark.parametrize("s", [1, 4, 6, 8])
def test_gpu_bf16_accuracy_9b_shape(s):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    cap = 8192
    q, k, v = make(gen, 2, 16, 4, s, 256, cap, torch.bfloat16)
    for lens in ([3000, 17], [cap, s], [1, 4097]):
        lengths = torch.tensor(lens, dtype=torch.int32, device="cuda")
        ref = reference_f64_gpu(q, k, v, lengths, True)
        for backend in _gpu_backends(q):
            err = rel_err(decode_attention(q, k, v, lengths, backend=backend), ref)
            assert err <= 1e-2, (backend, lens, err)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_other_dtypes_and_dims(dtype, d):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    q, k, v = make(gen, 1, 8, 2, 3, d, 5000, dtype)
    lengths = torch.tensor([4321], dtype=torch.int32, device="cuda")
    out = decode_attention(q, k, v, lengths, backend="triton")
    err = rel_err(out, reference_f64_gpu(q, k, v, lengths, True))
    assert err <= (1e-4 if dtype == torch.float32 else 2e-3), err


@gpu
def test_gpu_graph_replay_with_new_lengths():
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    cap, s = 40000, 4
    q, k, v = make(gen, 1, 16, 4, s, 256, cap, torch.bfloat16)
    lengths = torch.tensor([100], dtype=torch.int32, device="cuda")
    for backend in ("triton", "kitchen"):
        if backend not in _gpu_backends(q):
            continue
        decode_attention(q, k, v, lengths, backend=backend)  # compile / warm up outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_attention(q, k, v, lengths, backend=backend)
        for length in (5, 100, 3001, 39999, cap, 777):
            lengths.fill_(length)
            q.normal_(generator=gen)
            graph.replay()
            eager = decode_attention(q, k, v, lengths, backend=backend)
            assert torch.equal(out, eager), (backend, length)
            assert rel_err(out, reference_f64_gpu(q, k, v, [length], True)) <= 1e-2


@gpu
def test_gpu_bucket_graph_replays_inside_its_span():
    """One graph of the bucketed backend, captured for a span, serves every length inside it (a
    9B-shaped bf16 cache holding NaN in its unfilled slots)."""
    from qwen35_fast.kernels import attention_torch, bucket_end

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    cap, s = 9000, 4
    q, k, v = make(gen, 1, 16, 4, s, 256, cap, torch.bfloat16)
    span = bucket_end(5000, cap)
    lengths = torch.tensor([span - attention_torch.BUCKET + 1], dtype=torch.int32, device="cuda")
    decode_attention(q, k, v, lengths, backend="bucket", span=span)  # warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, lengths, backend="bucket", span=span)
    for length in (span - attention_torch.BUCKET + 1, 5000, span - 1, span):
        lengths.fill_(length)
        k[:, :, length:] = float("nan")
        v[:, :, length:] = float("nan")
        q.normal_(generator=gen)
        graph.replay()
        ref = reference_f64_gpu(q, k, v, [length], True)
        assert torch.isfinite(out).all() and rel_err(out, ref) <= 1e-2, length


@gpu
def test_gpu_poison_and_agreement():
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    cap, s = 20000, 6
    q, k, v = make(gen, 1, 16, 4, s, 256, cap, torch.bfloat16)
    lengths = torch.tensor([12345], dtype=torch.int32, device="cuda")
    outs = {b: decode_attention(q, k, v, lengths, backend=b) for b in _gpu_backends(q)}
    for b, o in outs.items():
        assert rel_err(o, outs["torch"].double()) <= 1e-2, b
    k[:, :, 12345:] = float("nan")
    v[:, :, 12345:] = float("nan")
    for b in outs:
        o = decode_attention(q, k, v, lengths, backend=b)
        if b == "masked":
            assert torch.isnan(o).any()
        else:
            assert torch.equal(o, outs[b]), b


def test_tile_fits_shared_memory():
    """H200-class GPUs get the tuned tile; smaller shared memory gets a smaller tile, never a failure."""
    from qwen35_fast.kernels.capabilities import DeviceRecord
    from qwen35_fast.kernels.fallback import attention_tile

    def gpu(shared):
        return DeviceRecord("test GPU", 90, 132, shared, 50 << 20)

    big = attention_tile(256, 2, 16, gpu(232448))
    assert (big["BLOCK_N"], big["num_stages"]) == (64, 3)
    assert attention_tile(256, 2, 32, gpu(232448))["num_warps"] == 8
    a100 = attention_tile(256, 2, 16, gpu(166912))
    assert (a100["BLOCK_N"], a100["num_stages"]) == (64, 2)
    rtx = attention_tile(256, 2, 16, gpu(101376))
    assert (rtx["BLOCK_N"], rtx["num_stages"]) == (32, 2)
    fp32 = attention_tile(256, 4, 32, gpu(101376))
    assert 2 * fp32["num_stages"] * fp32["BLOCK_N"] * 256 * 4 <= 101376
    assert attention_tile(256, 2, 16, gpu(232448), start=1)["num_stages"] == 2  # shrink step after a failure


def gated_reference(q, k, v, lengths, gate):
    """float64 spec of attention then the output gate: ``round(round(attn) * round(sigmoid(gate)))``
    per (b, s, h), flattened to ``[B,S,Hq*D]`` (round = to q's dtype)."""
    dt = q.dtype
    att = reference_f64(q, k, v, lengths, True).to(dt).double().transpose(1, 2)  # [B,S,Hq,D]
    sig = torch.sigmoid(gate.double()).to(dt).double()
    return (att * sig).to(dt).double().reshape(q.shape[0], q.shape[2], -1)


@pytest.mark.parametrize("n_split", [3, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_gated_merge(rng, dtype, n_split):
    """The merge that also gates: against the float64 spec, and bit for bit against the two
    launches it replaces (the same merge, the same rounding points)."""
    from qwen35_fast.kernels import fused_ops

    b, hq, hkv, s, d, cap = 2, 4, 2, 3, 256, 640
    q, k, v = make(rng, b, hq, hkv, s, d, cap, dtype)
    qg = torch.randn(b, s, hq, 2 * d, generator=rng).to(dtype) * 3
    gate = qg[..., d:]  # the gate half of the q projection, as the fused path passes it
    lengths = torch.tensor([630, 41], dtype=torch.int32)  # 630: 16-slot chunks keep all 40 splits busy
    out = td.triton_decode_attention_gated(q, k, v, lengths, True, d ** -0.5, gate, n_split=n_split,
                                           config={"BLOCK_N": 16})
    assert out.shape == (b, s, hq * d) and out.dtype == dtype and out.is_contiguous()
    want = gated_reference(q, k, v, lengths, gate)
    tol = TOL[dtype] if dtype == torch.float32 else 2e-3
    assert rel_err(out, want) < tol
    assert (out.double() - want).abs().max() <= 2 * tol * want.abs().max()
    unfused = fused_ops.sigmoid_gate(td.triton_decode_attention(q, k, v, lengths, True, d ** -0.5, n_split=n_split,
                                                                config={"BLOCK_N": 16}), gate)
    assert torch.equal(out, unfused)
    with pytest.raises(ValueError, match=r"\[B,S,Hq,D\]"):
        td.triton_decode_attention_gated(q, k, v, lengths, True, d ** -0.5, gate[:, :2])


@pytest.mark.parametrize("gated", [False, True])
def test_triton_merge_counts_pending_rows(rng, gated):
    """``pending=P``: the cache holds ``lengths + P`` rows; the split pass attends over all of them
    (the float64 reference at ``lengths + P``) and the merge adds P to ``lengths``, per batch row."""
    b, hq, hkv, s, d, cap = 2, 4, 2, 3, 64, 200
    q, k, v = make(rng, b, hq, hkv, s, d, cap, torch.float32)
    gate = torch.randn(b, s, hq, d, generator=rng)
    lengths = torch.tensor([120, 7], dtype=torch.int32)
    full = lengths + s
    if gated:
        out = td.triton_decode_attention_gated(q, k, v, lengths, True, d ** -0.5, gate, pending=s)
        want = gated_reference(q, k, v, full, gate)
    else:
        out = td.triton_decode_attention(q, k, v, lengths, True, d ** -0.5, pending=s)
        want = reference_f64(q, k, v, full, True)
    assert torch.equal(lengths, full)
    assert rel_err(out, want) < TOL[torch.float32]
    with pytest.raises(ValueError, match="int32"):
        td.triton_decode_attention(q, k, v, lengths.long(), True, d ** -0.5, pending=s)
