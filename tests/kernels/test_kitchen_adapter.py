"""comfy-kitchen adapter: both ``flash_attention_decode_gqa`` signatures are detected and called right.

Fake ``comfy_kitchen`` modules stand in for 0.2.38/0.2.39 (``(q, k, v, kv_lengths)``, causal staircase)
and 0.2.40 (``causal=``); their bodies restate kitchen's torch fallback. Calls go through the
adapter's own dispatch (the native kernel itself needs CUDA and is covered by the GPU tests).
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from qwen35_fast.kernels import attention_kitchen as ak
from qwen35_fast.kernels.attention_torch import torch_decode_attention


def _kitchen_torch(q, k, v, kv_lengths, causal=True):
    """kitchen's torch path: [B,Hq,S,D] over [B,Hkv,C,D] -> [B,S,Hq*D]."""
    b, hq, s, d = q.shape
    cap = k.shape[2]
    g = hq // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1).float(), v.repeat_interleave(g, 1).float()
    scores = q.float() @ kk.transpose(-1, -2) * d ** -0.5
    lim = kv_lengths.long().clamp(0, cap).view(b, 1, 1, 1)
    if causal:
        lim = lim - s + 1 + torch.arange(s).view(1, 1, s, 1)
    scores = scores.masked_fill(torch.arange(cap) >= lim, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return (probs @ vv).to(q.dtype).transpose(1, 2).reshape(b, s, hq * d)


def _positional(q, k, v, kv_lengths):  # 0.2.38 / 0.2.39
    return _kitchen_torch(q, k, v, kv_lengths)


def _with_causal(q, k, v, kv_lengths, causal=True):  # 0.2.40
    return _kitchen_torch(q, k, v, kv_lengths, causal)


def _three(q, k, v):
    raise AssertionError("never called")


@pytest.fixture
def fake_kitchen(monkeypatch):
    def install(fn, version):
        mod = types.ModuleType("comfy_kitchen")
        mod.__version__ = version
        if fn is not None:
            mod.flash_attention_decode_gqa = fn
        monkeypatch.setitem(sys.modules, "comfy_kitchen", mod)
        ak.detect.cache_clear()
        return mod
    yield install
    ak.detect.cache_clear()


@pytest.mark.parametrize("fn,version,form", [(_positional, "0.2.39", ak.POSITIONAL),
                                             (_with_causal, "0.2.40", ak.CAUSAL)])
def test_both_signatures_detected_with_one_log_line(fake_kitchen, caplog, fn, version, form):
    fake_kitchen(fn, version)
    caplog.set_level(logging.INFO, logger=ak.__name__)
    q = torch.zeros(1, 8, 1, 256, dtype=torch.bfloat16)
    for _ in range(3):
        why = ak.kitchen_reason(q, 256 ** -0.5)
    assert ak.detect().form == form
    assert why == "kitchen decode runs on CUDA/HIP devices only"  # found; refused only for the CPU tensor
    lines = [r.getMessage() for r in caplog.records if r.name == ak.__name__]
    assert len(lines) == 1 and version in lines[0] and "unavailable" not in lines[0], lines


@pytest.mark.parametrize("fn,version", [(None, "0.2.24"), (_three, "9.9")])
def test_kitchen_without_a_usable_decode_says_why_once(fake_kitchen, caplog, fn, version):
    fake_kitchen(fn, version)
    caplog.set_level(logging.INFO, logger=ak.__name__)
    q = torch.zeros(1, 8, 1, 256, dtype=torch.bfloat16)
    whys = {ak.kitchen_reason(q, 256 ** -0.5) for _ in range(3)}
    assert ak.detect().module is None and len(whys) == 1 and version in whys.pop()
    lines = [r.getMessage() for r in caplog.records if r.name == ak.__name__]
    assert len(lines) == 1 and "unavailable" in lines[0], lines


def test_kitchen_version_from_the_distribution_when_the_module_has_none(fake_kitchen, monkeypatch):
    """comfy-kitchen 0.2.24 (ComfyUI 0.29.0's pin) has no ``__version__``: the installed
    distribution's version is named, never "?"."""
    from importlib import metadata

    mod = fake_kitchen(None, "unused")
    del mod.__version__
    monkeypatch.setattr(metadata, "version", lambda name: "0.2.24" if name == "comfy-kitchen" else "")
    why = ak.detect().note
    assert "comfy-kitchen 0.2.24 has no flash_attention_decode_gqa" in why, why


@pytest.mark.parametrize("form,fn", [(ak.POSITIONAL, _positional), (ak.CAUSAL, _with_causal)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s", [1, 4])
def test_call_matches_the_torch_path(rng, form, fn, causal, s):
    b, hq, hkv, d, cap = 2, 8, 2, 64, 40
    q = torch.randn(b, hq, s, d, generator=rng)
    k = torch.randn(b, hkv, cap, d, generator=rng)
    v = torch.randn(b, hkv, cap, d, generator=rng)
    lengths = torch.tensor([17, cap], dtype=torch.int32)
    out = ak.call_decode(fn, form, q, k, v, lengths, causal)
    ref = torch_decode_attention(q, k, v, lengths, causal, d ** -0.5)
    assert out.shape == (b, hq, s, d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
