"""Programmatic dependent launch (``kernels/pdl.py``): where it is on, and that the decode kernels
launched with it compute bit for bit what plain launches compute (GPU), inside a CUDA graph whose
inputs change between replays, where a kernel that read before its wait would see stale rows."""

import pytest
import torch
import triton
from qwen35_fast.engine import generate
from qwen35_fast.kernels import capabilities
from qwen35_fast.kernels.capabilities import PDL_ENV, pdl_reason
from qwen35_fast.kernels.pdl import launch_args

from tests.oracles.tiny import add_mtp, engine_model, make_tiny

gpu = pytest.mark.gpu


def test_pdl_off_where_it_cannot_run(monkeypatch):
    assert "CUDA device" in pdl_reason(torch.device("cpu"))
    assert launch_args(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv(PDL_ENV, "0")
    assert pdl_reason(torch.device("cpu")) == f"{PDL_ENV}=0"


@gpu
def test_pdl_on_where_the_gpu_and_triton_have_it(monkeypatch):
    major, _ = torch.cuda.get_device_capability()
    why = pdl_reason(torch.device("cuda"))
    if major < 9:
        assert "9.0+" in why
    elif tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 4) and torch.version.hip is None:
        assert why is None
        assert launch_args(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv(PDL_ENV, "0")
    assert launch_args(torch.device("cuda")) == {"PDL": False}


def _int8(n, k, gen):
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8, device="cuda")
    return q, torch.rand(n, generator=gen, device="cuda") * 1e-3 + 1e-4


def _chain(x, layers, eps=1e-6):
    """Layers of add_rms_norm (rotated twin) -> int8 gate/up -> silu_mul (rotated) -> split-K
    down -> the next norm: the launches of a decode step's MLP half, as the fused plan chains them."""
    from qwen35_fast.kernels import fused_ops
    from qwen35_fast.kernels.gemv import gemv_group

    res = None
    for w, (qg, sg), (qu, su), (qd, sd) in layers:
        y, x, y_rot = fused_ops.add_rms_norm(x, res, w, eps, rotate=256)
        g, u = gemv_group(y_rot, [qg, qu], scales=[sg, su])
        _, a_rot = fused_ops.silu_mul(g, u, rotate=256)
        res = gemv_group(a_rot, [qd], scales=[sd], split=4)[0]
    return fused_ops.add_rms_norm(x, res, layers[0][0], eps)


@gpu
def test_pdl_chain_in_a_graph_equals_plain_launches(monkeypatch, test_seed):
    if pdl_reason(torch.device("cuda")) is not None:
        pytest.skip(f"no programmatic dependent launch here: {pdl_reason(torch.device('cuda'))}")
    gen = torch.Generator("cuda").manual_seed(test_seed)
    h, f = 4096, 8192
    layers = [(torch.rand(h, generator=gen, device="cuda") + 0.5, _int8(f, h, gen), _int8(f, h, gen), _int8(h, f, gen))
              for _ in range(4)]
    inputs = [torch.randn(1, 1, h, generator=gen, device="cuda").bfloat16() for _ in range(5)]
    monkeypatch.setenv(PDL_ENV, "0")
    plain = [[t.clone() for t in _chain(x, layers)] for x in inputs]
    monkeypatch.delenv(PDL_ENV)
    static = inputs[0].clone()
    _chain(static, layers)  # compiled outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        outs = _chain(static, layers)
    torch.cuda.current_stream().wait_stream(stream)
    for x, want in zip(inputs, plain):
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        for got, ref in zip(outs, want):
            assert torch.equal(got, ref)


@gpu
def test_pdl_decode_tokens_equal_plain(monkeypatch, tmp_path, test_seed):
    """The whole fused decode (norms, GEMVs, DeltaNet step, attention, gates) in CUDA graphs,
    MTP off and at depth 3, with and without programmatic dependent launch."""
    if pdl_reason(torch.device("cuda")) is not None:
        pytest.skip(f"no programmatic dependent launch here: {pdl_reason(torch.device('cuda'))}")
    seed = test_seed % 1000
    sd, d = make_tiny(seed, strength=0.3, vocab_size=64, hidden_size=256, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    model = engine_model(add_mtp(sd, d, seed + 1), tmp_path, dtype=torch.bfloat16, device="cuda")
    prompt = torch.randn(1, 19, d["hidden_size"], device="cuda",
                         generator=torch.Generator("cuda").manual_seed(seed)).bfloat16()
    kw = dict(do_sample=False, max_length=40, stop_tokens=[], cuda_graphs=True)
    with_pdl = [generate(model, prompt, mtp=m, **kw).tokens for m in ("off", 3)]
    monkeypatch.setenv(PDL_ENV, "0")
    assert capabilities.pdl_reason(torch.device("cuda")) is not None
    assert [generate(model, prompt, mtp=m, **kw).tokens for m in ("off", 3)] == with_pdl
