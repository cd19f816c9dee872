"""Opt-in: the fused path reading ComfyUI's 4-bit layers in place, and the pack's 4-bit files loaded by
ComfyUI (in process, CPU under the Triton interpreter, tiny random weights): a file of its own so the
ComfyUI stage's two workers share the interpreted kernels' minutes (``scripts/test_comfyui.sh``).

Set ``QWEN35_FAST_COMFYUI=<ComfyUI checkout>`` and run with a Python that has ComfyUI's requirements.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from qwen35_fast.engine import bind, build_mtp_head, generate

from tests.comfyui import test_engine_comfyui as base
from tests.oracles.comfy_tree import comfy_qwen35, mixed_formats
from tests.oracles.tiny import add_mtp, make_tiny

# the same tree, marks, binding and ComfyUI modules (fixture) as test_engine_comfyui
pytestmark, BIND, comfy = base.pytestmark, base.BIND, base.comfy


def _mixed_4bit(key: str) -> str:
    """A file mixing formats layer by layer (and within one layer's MLP): layers 0 and 3 4-bit of both
    kinds, layer 1 nvfp4, layer 2 int8 + ConvRot, lm_head convrot_w4a4."""
    if "lm_head" in key or ".0.linear_attn" in key or ".3.self_attn" in key or key.endswith("gate_proj.weight"):
        return "convrot_w4a4"
    return "int8" if ".2." in key else "nvfp4"


@pytest.mark.one_tree
def test_fast_path_reads_4bit_files_in_place(comfy, rng, monkeypatch):
    """A file mixing ComfyUI's convrot_w4a4, nvfp4 and int8_convrot layers, loaded by ComfyUI's
    ``MixedPrecisionOps``: the fused plan reads every projection in place (the log line counts each
    format) and its greedy tokens, MTP off and depth 3, equal the module path's where ComfyUI
    dequantizes (``_full_precision_mm``; a convrot_w4a4 module's call is replaced by ``F.linear`` over
    ComfyUI's ``dequantize()``, since even with ``_full_precision_mm`` its ``F.linear`` goes to
    kitchen's W4A4 product, which quantizes the activations too: the 4-bit GEMV is weight-only). CPU,
    Triton interpreter, fp32, about 25 s: one tree (``one_tree``; the 4-bit loading is 0.29.0's
    ``comfy/ops.py`` on every tree)."""
    from qwen35_fast.engine.fused import FusedPlan

    ops, _ = comfy
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    sd, d = make_tiny(seed, strength=0.5, intermediate_size=128)  # every width a multiple of 64
    model = comfy_qwen35(comfy, sd, d, ops=ops.mixed_precision_ops({}, torch.float32),
                         layout=lambda sd: mixed_formats(sd, _mixed_4bit, group=16))
    for m in model.modules():
        m.comfy_force_cast_weights = True
        if hasattr(m, "comfy_cast_weights"):
            m.comfy_cast_weights = True
    sd = add_mtp(sd, d, seed + 1, noise=0.02, norm_spread=0.05)
    model.model.mtp = build_mtp_head({k: v for k, v in sd.items() if k.startswith("mtp.")}, bind(model).config)
    plan, why = FusedPlan.build(bind(model, **BIND), "cpu", torch.float32)
    if plan is None and "Triton" in why:
        pytest.skip(why)
    assert plan is not None and plan.unresolved == {}, why or plan.describe()
    assert {k: plan.formats.get(k) for k in ("convrot_w4a4", "nvfp4", "int8+ConvRot")} == \
        {"convrot_w4a4": 5 + 4 + 4 + 1, "nvfp4": 2 + 7 + 2, "int8+ConvRot": 7}, plan.formats
    assert "convrot_w4a4 14" in plan.describe() and "nvfp4 11" in plan.describe()
    for m in model.modules():
        if getattr(m, "quant_format", None) is not None:
            m._full_precision_mm = True  # the module path: ComfyUI dequantizes, then a float matmul
        if getattr(m, "quant_format", None) == "convrot_w4a4":  # whose F.linear would still quantize x
            monkeypatch.setattr(m, "forward", lambda x, m=m: F.linear(x, m.weight.dequantize().to(x.dtype), m.bias))
    emb = torch.randn(9, d["hidden_size"], generator=rng)
    for mtp in ("off", 3):
        kw = dict(do_sample=False, max_length=8, mtp=mtp, stop_tokens=[], execution_dtype=torch.float32,
                  attention="torch", cuda_graphs=False)
        fused = generate(model, emb, **BIND, fused=True, **kw)
        assert fused.tokens == generate(model, emb, **BIND, fused=False, **kw).tokens, mtp


@pytest.mark.one_tree
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt", ["convrot_w4a4", "nvfp4"])
def test_converted_file_loads_through_comfyui(comfy, tmp_path, monkeypatch, fmt, device):
    """The converter's file read by ComfyUI's own file path (``comfy.utils.load_torch_file`` +
    ``convert_old_quants``, as ``load_clip``) into ``MixedPrecisionOps`` modules: every converted layer
    is ComfyUI's 4-bit ``QuantizedTensor``, its ``dequantize()`` equals the converter's own
    dequantization, and the fused plan reads each in place. The embedding table is ComfyUI's int8
    (its lookup within int8 rounding of the source's rows), and greedy tokens of the fused path
    equal the module path's with it (fp32, ComfyUI dequantizing as in the mixed-format test), on
    the CPU (Triton interpreter) and on a GPU (the compiled 4-bit kernels, the model moved there by
    ``Module.to`` as ComfyUI's load moves it)."""
    import importlib

    from qwen35_fast.engine.fused import FusedPlan
    from qwen35_fast.kernels.packed4 import Packed4, dequantize
    from qwen35_fast.patches import convert_4bit

    from tests.comfyui.test_convert_4bit import source_file

    ops, _ = comfy
    src = source_file(tmp_path, "bf16")
    out = convert_4bit.convert(src, tmp_path, fmt, device="cpu")
    utils = importlib.import_module("comfy.utils")
    sd, meta = utils.load_torch_file(str(out), safe_load=True, return_metadata=True)
    sd, _ = utils.convert_old_quants(sd, model_prefix="", metadata=meta)
    sd = {("model.lm_head.weight" if k == "lm_head.weight" else k.replace("model.language_model.", "model.")):
          v.float() if v.dtype == torch.bfloat16 else v for k, v in sd.items()}
    tiny, d = make_tiny(3, hidden_size=256, intermediate_size=256)
    model = comfy_qwen35(comfy, tiny, d, ops=ops.mixed_precision_ops({}, torch.float32), layout=lambda _: sd)
    quantized = [(n, m) for n, m in model.named_modules() if getattr(m, "quant_format", None) == fmt]
    assert len(quantized) == sum(s.action == "quantize" for s in convert_4bit.plan(src, fmt)) > 0
    assert all(s.action == "keep" for s in convert_4bit.plan(out, fmt))  # converting it again changes nothing
    for name, m in quantized:
        w = m.weight
        p = Packed4(fmt, w._qdata, w._params.scale, getattr(w._params, "block_scale", None), *m._orig_shape,
                    256 if fmt == "convrot_w4a4" else 0)
        assert torch.allclose(w.dequantize(), dequantize(p), rtol=1e-6, atol=1e-7), name
    from safetensors import safe_open

    table = model.model.embed_tokens
    assert table.quant_format == "int8_tensorwise" and table.weight._qdata.dtype == torch.int8
    table.comfy_force_cast_weights = table.comfy_cast_weights = True
    ids = torch.arange(0, d["vocab_size"], 3)
    with safe_open(str(src), framework="pt") as f:
        rows = f.get_tensor(convert_4bit.EMBEDDING).float()[ids]
    got = table(ids).float()
    assert got.shape == rows.shape and ((got - rows).norm() / rows.norm()).item() < 0.01
    model.to(device)
    plan, why = FusedPlan.build(bind(model, **BIND), device, torch.float32)
    if plan is None and "Triton" in why:
        pytest.skip(why)
    assert plan is not None and plan.formats.get(fmt) == len(quantized), why or plan.describe()
    assert plan.embedding is None  # an int8 table is looked up by ComfyUI's module, never read as floats
    for _, m in quantized:
        m._full_precision_mm = True  # the module path: ComfyUI dequantizes (as the mixed-format test)
        if fmt == "convrot_w4a4":
            monkeypatch.setattr(m, "forward", lambda x, m=m: F.linear(x, m.weight.dequantize().to(x.dtype), m.bias))
    emb = torch.randn(7, d["hidden_size"], generator=torch.Generator().manual_seed(5)).to(device)
    kw = dict(do_sample=False, max_length=6, mtp="off", stop_tokens=[], execution_dtype=torch.float32,
              attention="torch", cuda_graphs=False)
    fused = generate(model, emb, **BIND, fused=True, **kw)
    assert fused.tokens == generate(model, emb, **BIND, fused=False, **kw).tokens
    # the pack's MTP head grafted beside these 4-bit weights is held as int8 rows, read in place, and
    # drafting through it leaves the tokens as they are (beside a 16-bit model, or without the Triton
    # kernels, it stays as the file holds it)
    from qwen35_fast.engine.modules import Int8Linear
    from qwen35_fast.patches import mtp_graft
    from qwen35_fast.patches.mtp_graft import four_bit, graft_mtp

    assert four_bit(model) and not four_bit(comfy_qwen35(comfy, tiny, d))
    clip = SimpleNamespace(cond_stage_model=SimpleNamespace(clip="qwen", qwen=SimpleNamespace(
        transformer=model, process_tokens=None)), patcher=None)
    head = {k: v for k, v in add_mtp(tiny, d, 4, noise=0.02, norm_spread=0.05).items() if k.startswith("mtp.")}
    real = mtp_graft.triton_module
    monkeypatch.setattr(mtp_graft, "triton_module", lambda name: (None, "no Triton here"))
    graft_mtp(clip, head)  # without the kernels that read int8 rows in place: as the file holds it
    assert not any(isinstance(m, Int8Linear) for m in model.model.mtp.modules())
    monkeypatch.setattr(mtp_graft, "triton_module", real)
    graft_mtp(clip, head)
    lins = [m for m in model.model.mtp.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    assert len(lins) == 8 and all(isinstance(m, Int8Linear) and m.weight.device.type == device for m in lins)
    plan, why = FusedPlan.build(bind(model, **BIND), device, torch.float32)
    assert all(plan.linears[id(m)].weight.dtype == torch.int8 for m in lins), why
    kw["mtp"] = 3
    assert generate(model, emb, **BIND, fused=True, **kw).tokens == fused.tokens
    assert generate(model, emb, **BIND, fused=False, **kw).tokens == fused.tokens
