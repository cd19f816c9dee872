"""Fused Gated DeltaNet step kernel against a float64 oracle written from the spec (CPU via the
Triton interpreter; bf16 at the 9B shape and CUDA-graph replay on the GPU)."""

import math

import pytest
import torch
from qwen35_fast.kernels.deltanet_step import gated_delta_step

from tests.oracles.kitchen import kitchen_rotate


def oracle(qkv, z, a, b, conv_state, conv_w, a_log, dt_bias, state, norm_w, eps, hk):
    """Row by row in float64: conv+SiLU, L2 norms, gates, delta rule, gated RMSNorm (no pack code)."""
    qkv, z, a, b = (t.double() for t in (qkv, z, a, b))
    conv_state, conv_w, state = conv_state.double(), conv_w.double(), state.double().clone()
    bsz, s, c = qkv.shape
    hv, dk, dv = state.shape[1:]
    kernel = conv_w.shape[1]
    key_dim = hk * dk
    window = torch.cat([conv_state, qkv.transpose(1, 2)], dim=-1)  # [B, C, K-1+S]
    out = torch.zeros(bsz, s, hv * dv, dtype=torch.float64)
    states = torch.zeros(s, bsz, hv, dk, dv, dtype=torch.float64)
    for bi in range(bsz):
        for t in range(s):
            conv = (window[bi, :, t:t + kernel] * conv_w).sum(-1)
            act = conv / (1 + torch.exp(-conv))
            for h in range(hv):
                kh = h // (hv // hk)
                q = act[kh * dk:(kh + 1) * dk]
                k = act[key_dim + kh * dk:key_dim + (kh + 1) * dk]
                v = act[2 * key_dim + h * dv:2 * key_dim + (h + 1) * dv]
                q = q / torch.sqrt((q * q).sum() + 1e-6) / math.sqrt(dk)
                k = k / torch.sqrt((k * k).sum() + 1e-6)
                x = a[bi, t, h] + dt_bias[h].double()
                sp = x if x > 20 else math.log1p(math.exp(x))
                decay = math.exp(-math.exp(float(a_log[h])) * sp)
                beta = 1 / (1 + math.exp(-float(b[bi, t, h])))
                st = state[bi, h] * decay
                u = beta * (v - st.T @ k)
                st = st + torch.outer(k, u)
                state[bi, h] = st
                states[t, bi, h] = st
                o = st.T @ q
                n = o / torch.sqrt((o * o).mean() + eps) * norm_w.double()
                zz = z[bi, t, h * dv:(h + 1) * dv]
                out[bi, t, h * dv:(h + 1) * dv] = n * zz / (1 + torch.exp(-zz))
    return out, states, window


def make(gen, bsz, s, hk, hv, dk, dv, kernel, dtype):
    dev = gen.device
    c = 2 * hk * dk + hv * dv

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=dev) * scale

    qkv = r(bsz, s, c).to(dtype)
    z = r(bsz, s, hv * dv).to(dtype)
    a = r(bsz, s, hv).to(dtype)
    b = r(bsz, s, hv).to(dtype)
    conv_state = r(bsz, c, kernel - 1).to(dtype)
    conv_w = r(c, kernel, scale=0.5).to(dtype)
    a_log = torch.rand(hv, generator=gen, device=dev) * math.log(16.0)
    dt_bias = r(hv, scale=0.3)
    state = r(bsz, hv, dk, dv, scale=0.2)
    norm_w = 1.0 + r(dv, scale=0.2)
    return qkv, z, a, b, conv_state, conv_w, a_log, dt_bias, state, norm_w


def run(inputs, eps, hk, **kw):
    qkv, z, a, b, conv_state, conv_w, a_log, dt_bias, state, norm_w = inputs
    return gated_delta_step(qkv, z, a, b, conv_state, conv_w, -a_log.exp(), dt_bias, state, norm_w, eps,
                            key_heads=hk, **kw)


def rel(x, ref):
    return ((x.double().cpu() - ref).norm() / ref.norm()).item()


SHAPES = [  # B, S, Hk, Hv, Dk, Dv, K
    (1, 1, 2, 4, 32, 32, 4),
    (1, 4, 2, 4, 32, 16, 4),
    (2, 3, 1, 3, 16, 32, 3),
    (1, 8, 2, 2, 16, 16, 4),
    (1, 3, 1, 2, 16, 16, 2),
]


@pytest.mark.parametrize("config", [None, (2, 4)], ids=["tuned", "split2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_step_matches_float64(rng, dtype, shape, config):
    bsz, s, hk, hv, dk, dv, kernel = shape
    inputs = make(rng, bsz, s, hk, hv, dk, dv, kernel, dtype)
    state_before = inputs[8].clone()
    out, states, window = run(inputs, 1e-6, hk, config=config)
    ref_out, ref_states, ref_window = oracle(*inputs, 1e-6, hk)
    tol = 2e-5 if dtype == torch.float32 else 5e-3
    assert out.dtype == dtype and states.dtype == torch.float32 and window.dtype == dtype
    assert torch.equal(inputs[8], state_before), "the input state must not be modified"
    assert torch.equal(window.double(), ref_window), "conv window: old state then the new rows"
    assert rel(states, ref_states) < tol
    assert rel(out, ref_out) < (tol if dtype == torch.float32 else 2e-2)
    for t in range(s):  # every row's state, not only the last
        assert rel(states[t], ref_states[t]) < tol, t


@pytest.mark.parametrize("config", [None, (2, 4)], ids=["tuned", "split2"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_last_state_in_place(rng, shape, config):
    """``last_in_place``: the state after the last row is written over the input state (each
    program reads its own tile before it writes it), the rows before it into ``states``; the
    output and the window are unchanged."""
    bsz, s, hk, hv, dk, dv, kernel = shape
    inputs = make(rng, bsz, s, hk, hv, dk, dv, kernel, torch.float32)
    ref_out, ref_states, ref_window = oracle(*inputs, 1e-6, hk)
    out, states, window = run(inputs, 1e-6, hk, config=config, last_in_place=True)
    assert states.shape == (s - 1, bsz, hv, dk, dv)
    assert rel(inputs[8], ref_states[-1]) < 2e-5, "the last row's state over the input state"
    if s > 1:
        assert rel(states, ref_states[:-1]) < 2e-5
    assert rel(out, ref_out) < 2e-5 and torch.equal(window.double(), ref_window)


@pytest.mark.parametrize("group", [256, 16, 4], ids=["g256", "g16", "g4-launch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3])
def test_rotated_output(rng, dtype, rows, group):
    """``rotate=G``: the gated norm's output ConvRot-rotated (the gated-norm kernel for G 16/256 over
    2 heads of 128 columns, a rotation launch for G 4), against comfy-kitchen's float64 rotation of
    the kernel's own rounded output and of the float64 oracle's."""
    bsz, hk, hv, dk, dv, kernel = 1, 2, 4, 32, 128, 4
    inputs = make(rng, bsz, rows, hk, hv, dk, dv, kernel, dtype)
    out, states, window, out_rot = run(inputs, 1e-6, hk, rotate=group)
    ref_out, ref_states, ref_window = oracle(*inputs, 1e-6, hk)
    tol = 2e-5 if dtype == torch.float32 else 5e-3
    assert out_rot.shape == out.shape and out_rot.dtype == dtype
    assert rel(out, ref_out) < (tol if dtype == torch.float32 else 2e-2)
    assert rel(states, ref_states) < tol and torch.equal(window.double(), ref_window)
    one_rounding = 1e-6 if dtype == torch.float32 else 1e-3
    assert rel(out_rot, kitchen_rotate(out, group)) < one_rounding
    assert rel(out_rot, kitchen_rotate(ref_out, group)) < (tol if dtype == torch.float32 else 2e-2)


def test_rotate_must_divide_the_width(rng):
    inputs = make(rng, 1, 1, 2, 4, 16, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="ConvRot group size"):
        run(inputs, 1e-6, 2, rotate=256)  # the output is 64 wide
    with pytest.raises(ValueError, match="ConvRot group size"):
        run(inputs, 1e-6, 2, rotate=8)


def test_strided_inputs_and_given_outputs(rng):
    """a/b/z as column slices of one projection output, outputs written into given buffers."""
    bsz, s, hk, hv, dk, dv, kernel = 1, 3, 2, 4, 16, 16, 4
    qkv, z, a, b, conv_state, conv_w, a_log, dt_bias, state, norm_w = make(rng, bsz, s, hk, hv, dk, dv, kernel,
                                                                         torch.float32)
    packed = torch.cat([z, a, b], dim=-1)
    zs, as_, bs = packed.split([hv * dv, hv, hv], dim=-1)
    states_out = torch.full((s, bsz, hv, dk, dv), float("nan"))
    window_out = torch.full((bsz, qkv.shape[-1], kernel - 1 + s), float("nan"))
    out, st, win = gated_delta_step(qkv, zs, as_, bs, conv_state, conv_w, -a_log.exp(), dt_bias, state, norm_w,
                                    1e-6, key_heads=hk, states_out=states_out, window_out=window_out)
    assert st is states_out and win is window_out
    assert torch.isfinite(st).all() and torch.isfinite(win).all(), "every output element written"
    ref_out, ref_states, _ = oracle(qkv, z, a, b, conv_state, conv_w, a_log, dt_bias, state, norm_w, 1e-6, hk)
    assert rel(out, ref_out) < 2e-5 and rel(st, ref_states) < 2e-5


def test_bad_inputs(rng):
    inputs = list(make(rng, 1, 2, 2, 4, 16, 16, 4, torch.float32))
    with pytest.raises(ValueError, match="qkv width"):
        run(inputs, 1e-6, 3)
    bad = list(inputs)
    bad[8] = inputs[8].transpose(-1, -2)
    with pytest.raises(ValueError, match="contiguous float32"):
        run(bad, 1e-6, 2)
    bad = list(inputs)
    bad[1] = inputs[1][..., :-1]
    with pytest.raises(ValueError, match="do not match"):
        run(bad, 1e-6, 2)
    bad = list(inputs)
    bad[0] = torch.zeros(1, 2, 2 * 2 * 12 + 4 * 12)
    bad[8] = torch.zeros(1, 4, 12, 12)
    with pytest.raises(ValueError, match="powers of two"):
        run(bad, 1e-6, 2)
    wide = list(make(rng, 1, 2, 2, 4, 16, 16, 5, torch.float32))
    with pytest.raises(ValueError, match="conv kernel of 5 taps"):
        run(wide, 1e-6, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, (1, 4), (1, 16), (2, 8), (4, 4)])
@pytest.mark.parametrize("s", [1, 4, 8])
def test_gpu_bf16_9b_shape(s, config):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    inputs = make(gen, 1, s, 16, 32, 128, 128, 4, torch.bfloat16)
    out, states, window = run(inputs, 1e-6, 16, config=config)
    ref_out, ref_states, ref_window = oracle(*(t.cpu() for t in inputs), 1e-6, 16)
    assert torch.equal(window.double().cpu(), ref_window)
    assert rel(states, ref_states) < 1e-2
    assert rel(out, ref_out) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("s", [1, 4])
def test_gpu_bf16_9b_shape_last_state_in_place(s):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    inputs = make(gen, 1, s, 16, 32, 128, 128, 4, torch.bfloat16)
    ref_out, ref_states, _ = oracle(*(t.cpu() for t in inputs), 1e-6, 16)
    out, states, window = run(inputs, 1e-6, 16, last_in_place=True)
    assert rel(inputs[8], ref_states[-1]) < 1e-2 and rel(out, ref_out) < 2e-2
    if s > 1:
        assert rel(states, ref_states[:-1]) < 1e-2


@pytest.mark.gpu
def test_gpu_graph_replay_matches_eager():
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    inputs = make(gen, 1, 4, 16, 32, 128, 128, 4, torch.bfloat16)
    run(inputs, 1e-6, 16)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(inputs, 1e-6, 16)
    fresh = make(gen, 1, 4, 16, 32, 128, 128, 4, torch.bfloat16)
    for dst, src in zip(inputs, fresh):
        dst.copy_(src)
    graph.replay()
    eager = run(inputs, 1e-6, 16)
    for g, e in zip(outs, eager):
        assert torch.equal(g, e)


@pytest.mark.gpu
@pytest.mark.parametrize("s", [1, 4])
def test_gpu_bf16_9b_shape_rotated(s):
    """The 9B shape in bf16 with the output rotated for an int8_convrot out_proj (groups of 256)."""
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    inputs = make(gen, 1, s, 16, 32, 128, 128, 4, torch.bfloat16)
    out, states, window, out_rot = run(inputs, 1e-6, 16, rotate=256)
    ref_out, ref_states, _ = oracle(*(t.cpu() for t in inputs), 1e-6, 16)
    assert rel(out, ref_out) < 2e-2 and rel(states, ref_states) < 1e-2
    assert rel(out_rot, kitchen_rotate(out, 256)) < 5e-3
